"""The planner's numba kernels (oracle/engine.py for now) and how they are compiled and cached
(`jit`)."""
