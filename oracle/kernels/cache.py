"""Where the planner's kernels are cached (`common.jit`): in the user's folder
``oracle-kernels/<digest>``, the digest of every ``.py`` file of this package and of
`common.cpu_prefetch`, the only sources their code is compiled from (they import nothing
else of the project: tests/oracle/test_compiled.py checks)."""

from __future__ import annotations

from pathlib import Path

from common.jit import CPU_PREFETCH, KernelCache, is_cached

PACKAGE = Path(__file__).resolve().parent

KERNELS = KernelCache("oracle-kernels", lambda: [*PACKAGE.glob("*.py"), CPU_PREFETCH])
kernel = KERNELS.kernel
inlined = KERNELS.inlined

__all__ = ["KERNELS", "inlined", "is_cached", "kernel"]
