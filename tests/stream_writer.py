"""A process that feeds a stream as a logging pipeline would: each part written under a
hidden name, then renamed into the watched folder, or pushed to the oracle
(``POST /v1/ingest``), at random times.

``python -m tests.stream_writer FOLDER SEED STARTED [--push HOST:PORT] PART...``: the first
part at once, the next ones once the file STARTED exists (the trainers' first records: they
are training), each after a pause of 0 to `MAX_PAUSE_S` seconds (seeded), so that trainers
sometimes train on rows already there and sometimes wait for the next part. With --push
(token: $BAGPIPE_TOKEN), every second part is pushed instead of landed, each after a malformed
body the oracle must refuse naming its line (the writer fails otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import time
from pathlib import Path

from common.errors import BadRequest
from common.spec import TOKEN_ENV, Endpoint
from oracle.coordinator_client import CoordinatorClient

MAX_PAUSE_S = 0.8


def land(part: Path, folder: Path) -> None:
    hidden = folder / f".{part.name}.tmp"
    shutil.copyfile(part, hidden)
    os.replace(hidden, folder / part.name)


async def push(part: Path, oracle: Endpoint) -> None:
    """Push `part`, after a malformed body the oracle must refuse naming its line."""
    client = CoordinatorClient(oracle, token=os.environ[TOKEN_ENV])
    try:
        try:
            await client.ingest(b"1\tnot a row\n")
        except BadRequest as exc:
            assert exc.message.startswith("line 1: "), exc.message
        else:
            raise AssertionError("a malformed body was accepted")
        await client.ingest(part.read_bytes())
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("started", type=Path)
    parser.add_argument("--push", help="HOST:PORT of the oracle: every second part is pushed to it")
    parser.add_argument("parts", nargs="+", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    oracle = Endpoint.parse(args.push, "--push") if args.push else None
    for k, part in enumerate(args.parts):
        if k == 1:
            while not args.started.exists():
                time.sleep(0.05)
        if k:
            time.sleep(rng.uniform(0, MAX_PAUSE_S))
        if oracle is not None and k % 2:
            asyncio.run(push(part, oracle))
        else:
            land(part, args.folder)


if __name__ == "__main__":
    main()
