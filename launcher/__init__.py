"""What `launch.py` runs on top of the roles: a local cluster of subprocesses and the run report."""
