"""A process that lands the parts of a stream as a logging pipeline would: each one written
under a hidden name, then renamed into the watched folder, at random times.

``python -m tests.stream_writer FOLDER SEED STARTED PART...``: the first part at once, the
next ones once the file STARTED exists (the trainers' first records: they are training),
each after a pause of 0 to `MAX_PAUSE_S` seconds (seeded), so that trainers sometimes train
on rows already there and sometimes wait for the next part.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from pathlib import Path

MAX_PAUSE_S = 0.8


def land(part: Path, folder: Path) -> None:
    hidden = folder / f".{part.name}.tmp"
    shutil.copyfile(part, hidden)
    os.replace(hidden, folder / part.name)


def main(folder: str, seed: str, started: str, *parts: str) -> None:
    rng = random.Random(int(seed))
    for k, part in enumerate(parts):
        if k == 1:
            while not Path(started).exists():
                time.sleep(0.05)
        if k:
            time.sleep(rng.uniform(0, MAX_PAUSE_S))
        land(Path(part), Path(folder))


if __name__ == "__main__":
    main(*sys.argv[1:])
