"""Fetches waiting for rows to reach a version, indexed by row (sans-IO).

A fetch asks for rows at least at given versions; rows still behind wait for the
write-backs that bring them there. The index keeps only the (row, version needed) entries
still behind, all waiting fetches together in flat arrays, and a per-row mask of the rows
any of them watch. A write-back that touches no watched row costs one gather over its own
rows; one that does re-checks the entries still behind and returns exactly the fetches it
completed. The cost never depends on how many rows the waiting fetches asked for in all,
and no Python loop runs per waiting fetch.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class WaitingFetches:
    """The waiting fetches of one shard, each known by the ticket `wait` gave it."""

    def __init__(self, num_rows: int) -> None:
        self._watched = np.zeros(num_rows, dtype=bool)
        self._rows = _EMPTY
        self._needed = _EMPTY
        self._tickets = _EMPTY
        self._behind: dict[int, int] = {}  # ticket → entries still behind
        self._next_ticket = 0

    def __len__(self) -> int:
        return len(self._behind)

    def wait(self, local: np.ndarray, min_versions: np.ndarray, versions: np.ndarray) -> int | None:
        """Register a fetch of `local` rows needing `min_versions`, given the shard's current
        `versions`; its ticket, or None when every row is there already."""
        behind = versions[local] < min_versions
        count = int(behind.sum())
        if count == 0:
            return None
        ticket = self._next_ticket
        self._next_ticket += 1
        rows = local[behind]
        self._rows = np.concatenate([self._rows, rows])
        self._needed = np.concatenate([self._needed, min_versions[behind]])
        self._tickets = np.concatenate([self._tickets, np.full(count, ticket, dtype=np.int64)])
        self._watched[rows] = True
        self._behind[ticket] = count
        return ticket

    def written(self, local: np.ndarray, versions: np.ndarray) -> list[int]:
        """The tickets whose last rows behind this write-back of `local` rows brought up to
        their version (`versions`: the shard's, after the write)."""
        if not self._watched[local].any():
            return []
        return self.recheck(versions)

    def recheck(self, versions: np.ndarray) -> list[int]:
        """The tickets complete under `versions`, whatever changed them (a write-back, a
        restored snapshot); they leave the index."""
        reached = versions[self._rows] >= self._needed
        if not reached.any():
            return []
        tickets, counts = np.unique(self._tickets[reached], return_counts=True)
        done = []
        for ticket, count in zip(tickets.tolist(), counts.tolist(), strict=True):
            left = self._behind[ticket] - count
            self._behind[ticket] = left
            if left == 0:
                del self._behind[ticket]
                done.append(ticket)
        self._keep(~reached)
        return done

    def cancel(self, ticket: int) -> None:
        """Forget a fetch that stopped waiting (timed out, cancelled); a no-op once complete."""
        if self._behind.pop(ticket, None) is not None:
            self._keep(self._tickets != ticket)

    def _keep(self, keep: np.ndarray) -> None:
        self._watched[self._rows[~keep]] = False
        self._rows, self._needed, self._tickets = (
            self._rows[keep], self._needed[keep], self._tickets[keep]
        )
        self._watched[self._rows] = True  # rows another fetch still watches
