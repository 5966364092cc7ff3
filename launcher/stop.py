"""``python launch.py stop``: end a running stream (`data.watch`) at its next checkpoint.

    python launch.py stop SPEC.toml            the oracle the spec names (its token too)
    python launch.py stop --coordinator HOST:PORT
                                              any oracle ($BAGPIPE_TOKEN)

The oracle plans the batches up to its next checkpoint as they arrive; the trainers train
them, take the checkpoint and write the final model, and every role exits, as at the end of
any run. The same as SIGTERM to the oracle (docs/design.md#online-training).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.errors import ConfigError
from common.spec import TOKEN_ENV, Endpoint, load_spec
from common.transport import load_tls, run
from oracle.coordinator_client import CoordinatorClient


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="launch.py stop", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", type=Path, help="the job's spec: its oracle address and token")
    parser.add_argument("--coordinator", help="HOST:PORT of the oracle (token: $BAGPIPE_TOKEN)")
    args = parser.parse_args(argv)
    if (args.spec is None) == (args.coordinator is None):
        raise ConfigError("stop", "give the spec or --coordinator HOST:PORT (one of them)")
    if args.spec is not None:
        spec = load_spec(args.spec)
        endpoint, token, tls = spec.oracle.address, spec.token(), load_tls(spec.cluster.tls)
        transport = spec.cluster.transport
    else:
        endpoint, token, tls, transport = Endpoint.parse(args.coordinator, "--coordinator"), os.environ.get(
            TOKEN_ENV, ""), None, "h2"
    client = CoordinatorClient(endpoint, token=token, transport=transport, tls=tls)

    async def stop() -> None:
        try:
            await client.stop_stream()
        finally:
            await client.close()

    run(stop())
    print(f"launch.py stop: the stream at {endpoint} ends at its next checkpoint", file=sys.stderr)
    return 0
