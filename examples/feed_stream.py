#!/usr/bin/env python3
"""Feed `examples/online.toml`'s stream: the shipped Criteo sample in parts of `--rows` lines,
each written under a hidden name and renamed into the watched folder, one every `--every`
seconds (as a logging pipeline lands hourly parts, faster).

    python examples/feed_stream.py [--every 2] [--rows 1000] [--to runs/online/incoming]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "criteo_kaggle_head8000.tsv"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between parts (default %(default)s)")
    parser.add_argument("--rows", type=int, default=1000, help="lines per part (default %(default)s)")
    parser.add_argument("--to", type=Path, default=ROOT / "runs" / "online" / "incoming",
                        help="the watched folder (default runs/online/incoming of the checkout)")
    args = parser.parse_args()
    args.to.mkdir(parents=True, exist_ok=True)
    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    for k, first in enumerate(range(0, len(lines), args.rows)):
        if k:
            time.sleep(args.every)
        name = f"part-{k:05d}.tsv"
        hidden = args.to / f".{name}.tmp"
        hidden.write_bytes(b"".join(lines[first : first + args.rows]))
        os.replace(hidden, args.to / name)  # complete, all at once
        print(f"landed {args.to / name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
