from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.runtime import connection_limits
from common.spec import parse_spec
from common.transport import ConnectionLimits

ROOT = Path(__file__).resolve().parents[2]


def test_file_limit_is_raised_to_the_hard_limit() -> None:
    # In a child whose soft limit starts low (`ulimit -Sn 256`), as on many machines.
    script = (
        "import resource\n"
        "from common.runtime import raise_file_limit\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "assert raise_file_limit() == hard\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60)


def test_connection_limits_come_from_the_spec() -> None:
    spec = parse_spec({"cluster": {"idle_timeout_s": 5, "max_connections": 9,
                                   "max_concurrent_streams": 7, "max_resets": 50,
                                   "reset_window_s": 2.5, "unauthenticated_rate": 30,
                                   "unauthenticated_burst": 4}}, Path("/tmp/specs/x.toml"))
    assert connection_limits(spec.cluster) == ConnectionLimits(
        idle_timeout_s=5.0, max_connections=9, max_concurrent_streams=7, max_resets=50,
        reset_window_s=2.5, unauthenticated_rate=30.0, unauthenticated_burst=4,
    )
    assert connection_limits(parse_spec({}, Path("/tmp/specs/x.toml")).cluster) == ConnectionLimits()
