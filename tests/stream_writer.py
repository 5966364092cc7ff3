"""A process that feeds a stream as a logging pipeline would: each part written under a
hidden name, then renamed into the watched folder, or pushed to the oracle
(``POST /v1/ingest``), at random times.

``python -m tests.stream_writer FOLDER SEED STARTED BATCH [--push HOST:PORT] PART...``: the
first part at once, the next ones once STARTED (trainer 0's records) exists, each after a
pause of 0 to `MAX_PAUSE_S` seconds (seeded); every second one only once trainer 0 has
trained every full batch of BATCH rows the parts before hold but one: the trainers have
caught up with the stream and wait for it, whatever the machine's load. With --push (token:
$BAGPIPE_TOKEN), every second part is pushed instead of landed, each after a malformed body
the oracle must refuse naming its line (the writer fails otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import time
from pathlib import Path

import orjson

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


def wait_for_iteration(records: Path, iteration: int) -> None:
    """Until trainer 0's records (JSON lines) hold iteration `iteration`."""
    while True:
        done = [orjson.loads(line) for line in records.read_bytes().split(b"\n")[:-1]]  # whole lines only
        if any(r.get("kind") == "iter" and r["iteration"] >= iteration for r in done):
            return
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("started", type=Path)
    parser.add_argument("batch", type=int)
    parser.add_argument("--push", help="HOST:PORT of the oracle: every second part is pushed to it")
    parser.add_argument("parts", nargs="+", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    oracle = Endpoint.parse(args.push, "--push") if args.push else None
    lines = 0
    for k, part in enumerate(args.parts):
        if k == 1:
            while not args.started.exists():
                time.sleep(0.05)
        if k % 2 == 0 and k:
            # one batch short of all there is: the part with a bad line has a row fewer
            wait_for_iteration(args.started, lines // args.batch - 2)
        if k:
            time.sleep(rng.uniform(0, MAX_PAUSE_S))
        lines += part.read_bytes().count(b"\n")
        if oracle is not None and k % 2:
            asyncio.run(push(part, oracle))
        else:
            land(part, args.folder)


if __name__ == "__main__":
    main()
