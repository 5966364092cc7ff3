"""Who trains in an elastic job, and when it regroups (docs/design.md#elastic-trainers).

An elastic job (``[trainers] min_count < count`` or ``max_count > count``) runs in *terms*.
Within a term the number of trainers T is fixed and every role runs as in any other job. A
term ends when the job regroups:

* a trainer is gone: unheard of for ``[cluster] rejoin_timeout_s`` (dead, or cut off), or
  another trainer could not go on with it (a failed collective, reported in its `Presence`);
* trainers wait to join, T is below ``max_count``, and a checkpoint completes.

Every role of the ending term then starts again as a fresh process and registers
(`common.runtime.restart_process`). The regroup waits for each trainer that was there until
it is back or gone: unheard of for ``rejoin_timeout_s``, or, for one known to be starting
again (it was told, or said it failed), not back within ``[cluster] reconnect_s`` (a fresh
process takes seconds to register). If fewer than ``min_count`` are back, it waits for
newcomers up to ``reconnect_s``, then the job fails. The next term resumes from the checkpoint that was
the latest complete one when the regroup began. It has T' trainers: as many of those
registered as divide the batch, up to ``max_count`` and at least ``min_count``. A trainer of
the old term keeps its index where it can. Trainers beyond T' wait as spares for a later
regroup.

A term is exactly a run resumed by hand from that checkpoint with T' trainers, so a job that
shrank and grew ends bit-identical to one resumed by hand at the same checkpoints.

`Membership` is the sans-IO bookkeeping; `oracle.coordinator_service` holds the registrations
and runs the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import BagpipeError

#: Regroups in a row that resume from the same checkpoint before the job gives up: a failure
#: that comes back whatever the trainers are is not a change of membership.
MAX_REGROUPS_WITHOUT_PROGRESS = 3


class RegroupFailed(BagpipeError):
    """The job cannot form a next term (too few trainers, or no progress between regroups)."""


@dataclass(frozen=True, kw_only=True)
class Term:
    number: int  # 0 for the job as started, + 1 at each regroup
    trainers: int
    resumed_from: int | None  # the checkpoint it resumed from; None: from iteration 0


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A trainer registered while the job regroups, or waiting to join it."""

    key: int  # its registration, in arrival order
    last_term: int | None = None  # the term it left, if it trained before
    last_index: int | None = None


@dataclass(frozen=True, kw_only=True)
class Regroup:
    reason: str
    began: float
    resume_from: int | None  # the latest complete checkpoint when it began
    awaited: frozenset[int]  # indices of the ending term expected back (not known to be gone)


@dataclass(frozen=True, kw_only=True)
class Change:
    """One regroup, as the logs, metrics and the report show it."""

    term: int
    trainers: int
    first_iteration: int
    reason: str
    seconds: float  # from the regroup's start to the next term's


@dataclass(frozen=True, kw_only=True)
class Decision:
    term: Term
    indices: dict[int, int]  # candidate key -> its index in the new term
    change: Change


@dataclass
class Membership:
    trainers: int
    min_count: int
    max_count: int
    batch_size: int
    rejoin_timeout_s: float
    give_up_s: float = 30.0  # how long a regroup waits for min_count trainers (cluster.reconnect_s)
    resumed_from: int | None = None
    term: Term = field(init=False)
    regroup: Regroup | None = None
    waiting: list[Candidate] = field(default_factory=list)
    _heard: dict[int, float] = field(default_factory=dict)
    _told: set[int] = field(default_factory=set)  # trainers of the ending term known to start again
    _finished: set[int] = field(default_factory=set)
    _stalled: int = 0  # regroups in a row from the same checkpoint

    def __post_init__(self) -> None:
        self.term = Term(number=0, trainers=self.trainers, resumed_from=self.resumed_from)

    # -- a term running ----------------------------------------------------------------
    def heard(self, index: int, now: float) -> None:
        """Trainer `index` of the term is alive (also while the job regroups: it starts again)."""
        if 0 <= index < self.term.trainers:
            self._heard[index] = now

    def told(self, index: int) -> None:
        """Trainer `index` of the ending term knows it must start again: it is waited for
        up to `give_up_s`, however long its new process takes to register."""
        if self.regroup is not None:
            self._told.add(index)

    def finished(self, index: int) -> None:
        self._finished.add(index)

    def silent(self, now: float) -> list[int]:
        """The term's trainers (heard of once, not finished) unheard of for rejoin_timeout_s."""
        return sorted(j for j, t in self._heard.items()
                      if j not in self._finished and now - t >= self.rejoin_timeout_s)

    def wants_to_grow(self) -> bool:
        """Whether trainers wait that the job could take in at its next checkpoint."""
        return self.regroup is None and bool(self.waiting) and self.term.trainers < self.max_count

    # -- regrouping --------------------------------------------------------------------
    def begin(self, reason: str, resume_from: int | None, now: float, gone: tuple[int, ...] = ()) -> Regroup:
        """Start a regroup (RegroupFailed after MAX_REGROUPS_WITHOUT_PROGRESS from one checkpoint)."""
        assert self.regroup is None
        if resume_from == self.term.resumed_from and self.term.number > 0:
            self._stalled += 1
            if self._stalled >= MAX_REGROUPS_WITHOUT_PROGRESS:
                raise RegroupFailed(f"{self._stalled + 1} terms in a row ended before the checkpoint after "
                                    f"{resume_from}; the last because {reason}: the job stops")
        else:
            self._stalled = 0
        awaited = frozenset(range(self.term.trainers)) - set(gone) - self._finished
        self.regroup = Regroup(reason=reason, began=now, resume_from=resume_from, awaited=awaited)
        return self.regroup

    def add(self, candidate: Candidate) -> None:
        self.waiting.append(candidate)

    def remove(self, key: int) -> None:
        self.waiting = [c for c in self.waiting if c.key != key]

    def count_for(self, available: int) -> int | None:
        """T' for `available` trainers: the most, up to max_count, that divide the batch; None
        below min_count."""
        for count in range(min(available, self.max_count), self.min_count - 1, -1):
            if self.batch_size % count == 0:
                return count
        return None

    def decide(self, now: float) -> Decision | None:
        """The next term once the regroup may end: each trainer of the ending term is back
        (registered again) or gone: unheard of for rejoin_timeout_s, or, if it was told to
        start again, not back within give_up_s; None while it waits. With fewer than
        min_count trainers it waits for more up to `give_up_s` after the regroup began, then
        raises RegroupFailed."""
        regroup = self.regroup
        assert regroup is not None
        back = {c.last_index for c in self.waiting if c.last_term == self.term.number}
        pending = [j for j in regroup.awaited - back
                   if (j in self._told and now - regroup.began < self.give_up_s)
                   or now - self._heard.get(j, regroup.began) < self.rejoin_timeout_s]
        if pending:
            return None
        count = self.count_for(len(self.waiting))
        if count is None:
            if now - regroup.began < max(self.give_up_s, self.rejoin_timeout_s):
                return None
            raise RegroupFailed(f"{len(self.waiting)} trainer(s) registered within {self.give_up_s:g} s of the "
                                f"regroup (because {regroup.reason}), fewer than trainers.min_count = "
                                f"{self.min_count} that divide the batch of {self.batch_size}")
        old = self.term.number
        order = sorted(self.waiting, key=lambda c: (0, c.last_index, c.key) if c.last_term == old else (1, 0, c.key))
        chosen = order[:count]
        self.waiting = order[count:]
        term = Term(number=old + 1, trainers=count, resumed_from=regroup.resume_from)
        first = 0 if regroup.resume_from is None else regroup.resume_from + 1
        change = Change(term=term.number, trainers=count, first_iteration=first, reason=regroup.reason,
                        seconds=now - regroup.began)
        self.term, self.regroup = term, None
        self._heard = {j: now for j in range(count)}
        self._told, self._finished = set(), set()
        return Decision(term=term, indices={c.key: j for j, c in enumerate(chosen)}, change=change)
