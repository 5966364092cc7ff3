"""What a trainer wrote to one PS shard since that shard's latest snapshot (sans-IO).

A shard restarted alone comes back with its latest snapshot; every trainer then replays its
journal for that shard, and the shard is as it was (`ShardStore` accepts replays in any
order). Each trainer then reports its replay done (`ps.protocol.Rejoined`), and the shard
serves no fetch until all have: a fetch asking for any version could otherwise get the
snapshot's copy of a row whose newest write-back is still in some trainer's journal.

Entries are dropped once the shard reports a snapshot that holds them, so a journal holds
at most the writes of one checkpoint interval plus those in flight. Past its byte
limit (checkpoints failing, or none scheduled) it drops everything and is incomplete until
a snapshot covers what it dropped: a restart of that shard then needs the whole cluster.

Entries are the write-backs as first sent (`ps.protocol.WriteBack`, this shard's keys only);
the client resends them as replays.

A replay makes a restarted shard whole only if what the shard loaded already holds every
write the journal no longer has: a shard process that holds checkpoint r (-1: nothing) can
be replayed into exactly when r >= `needs`, the newest checkpoint the journal was trimmed
to (or started after: a resumed trainer's checkpoint) and the newest version it dropped
over its limit. A shard that came back empty, or with an older snapshot, would silently
lose rows; the client refuses it instead (`ps.client`).
"""

from __future__ import annotations

from ps.protocol import WriteBack


class WriteJournal:
    def __init__(self, limit_bytes: int, *, base: int = -1) -> None:
        """`base`: the checkpoint the shard held when this journal started (a trainer that
        resumed from checkpoint c writes nothing of versions <= c)."""
        self.limit_bytes = limit_bytes
        self.base = base  # every write of a version <= base is in a snapshot, not here
        self._entries: list[WriteBack] = []
        self._lost_through = -1  # the newest version dropped over the limit
        self.nbytes = 0
        self.peak_nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def complete(self) -> bool:
        return self._lost_through < 0

    @property
    def needs(self) -> int:
        """The oldest checkpoint a restarted shard must hold for a replay of this journal to
        make it whole."""
        return max(self.base, self._lost_through)

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
        self.base = max(self.base, checkpoint)
        if checkpoint >= self._lost_through:
            self._lost_through = -1

    def entries(self) -> list[WriteBack]:
        """The entries in the order they were sent (a copy: recording may go on meanwhile)."""
        return list(self._entries)
