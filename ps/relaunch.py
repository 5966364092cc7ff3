"""The command that starts a PS shard again the way it was started, for the messages that
tell an operator how to recover one (the shard's own at start-up, a trainer's when a shard
came back without its rows)."""

from __future__ import annotations

from common.spec import Endpoint


def shard_command(index: int, coordinator: Endpoint | None, address: Endpoint | None) -> str:
    """Shard `index`'s launch command: from the spec, or through the coordinator at
    `coordinator` (on `address`, where the trainers look for it)."""
    if coordinator is None:
        return f"python launch.py SPEC --role ps --index {index}"
    bind = "" if address is None else f" --bind {address}"
    return f"python launch.py --role ps --coordinator {coordinator} --index {index}{bind}"
