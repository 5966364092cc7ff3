"""What a trainer wrote to one PS shard since that shard's latest snapshot (sans-IO).

A shard restarted alone comes back with its latest snapshot; every trainer then replays its
journal for that shard, and the shard is as it was (`ShardStore` accepts replays in any
order). Entries are dropped once the shard reports a snapshot that holds them, so a journal
holds at most the writes of one checkpoint interval plus those in flight. Past its byte
limit (checkpoints failing, or none scheduled) it drops everything and is incomplete until
a snapshot covers what it dropped: a restart of that shard then needs the whole cluster.

Entries are the write-backs as first sent (`ps.protocol.WriteBack`, this shard's keys only);
the client resends them as replays.
"""

from __future__ import annotations

from ps.protocol import WriteBack


class WriteJournal:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: list[WriteBack] = []
        self._lost_through = -1  # the newest version dropped over the limit
        self.nbytes = 0
        self.peak_nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def complete(self) -> bool:
        return self._lost_through < 0

    def record(self, entry: WriteBack) -> None:
        self._entries.append(entry)
        self.nbytes += entry.nbytes
        if self.nbytes > self.limit_bytes:
            self._lost_through = max(self._lost_through, *(e.version for e in self._entries))
            self._entries, self.nbytes = [], 0
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def forget_through(self, checkpoint: int) -> None:
        """The shard has a snapshot of `checkpoint`: it holds every write of versions <= it."""
        self._entries = [e for e in self._entries if e.version > checkpoint]
        self.nbytes = sum(e.nbytes for e in self._entries)
        if checkpoint >= self._lost_through:
            self._lost_through = -1

    def entries(self) -> list[WriteBack]:
        """The entries in the order they were sent (a copy: recording may go on meanwhile)."""
        return list(self._entries)
