"""The executable specification of docs/design.md#the-planner and #modes: a plain, per-key planner.

Slow on purpose (Python dicts and sets, next uses found by scanning the window) and written to
be read next to the design. The production planner (oracle/planner.py) must emit byte-identical
directives on every workload. Mutation tests subclass `ReferencePlanner` and override one rule.

Order inside one iteration x (the numbered rules of §4 are rules, not steps; this is the one
order they allow):

a. classify the keys used at x (rules 1, 2): admitted (no copy at end of x-1) or resident;
b. per trainer, capacity (rule 4): evict Belady victims until the mandatory new copies (its
   fetches and joins) fit, then hand out the smallest free slots to them in key order (rule 5);
c. admission prefetches of trainers that use an admitted key later in the window (rule 1);
d. residencies whose last copies were victims end after x-1 (rule 4), checkpoint flushes of
   x-1 are settled;
e. G_x (rule 6) from the copies present during x;
f. residency after the use (rule 3): which copies leave after x; residencies that end.

Iterations count from 0 here; `directive` numbers them from `cfg.first_iteration` (a run
resumed from a checkpoint), and checkpoints follow the global number.

Parallel planning (P = `cfg.workers` > 1): one planner per key partition, each planning the
keys of its partition only (`cfg.for_partition`: its share of C) exactly as above, and
their directives merged per iteration and trainer (`merged_directive`): every list is the
union of the partitions' lists, each partition's slots moved into its share of the cache,
in the canonical order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from common.directive import Directive
from common.errors import ConfigError
from oracle.config import PlannerConfig, check_batch_size, infeasible_capacity
from oracle.kernels.batch import key_partitions

NEVER = 1 << 62


@dataclass
class _Acc:
    """What one trainer's directive of one iteration collects while iterations are planned."""

    input_slots: np.ndarray | None = None
    prefetch: list[tuple[int, int, int, int]] = field(default_factory=list)  # target, key, slot, min_v
    join_send: dict[int, int] = field(default_factory=dict)  # key -> slot
    join_recv: dict[int, int] = field(default_factory=dict)
    leave: list[tuple[int, int]] = field(default_factory=list)  # key, slot
    write: list[tuple[int, int, int]] = field(default_factory=list)  # key, slot, 1 if a flush


class ReferencePlanner:
    """Plans a whole stream of global batches ``int64 [B, F]`` at once; see `plan()`."""

    def __init__(self, config: PlannerConfig, batches: list[np.ndarray]) -> None:
        self.cfg = config
        self.T = config.num_trainers
        self.L = config.effective_lookahead
        self.D = config.effective_lead
        self.C = config.capacity
        self.batches = [np.asarray(b, dtype=np.int64) for b in batches]
        self.N = len(self.batches)
        self.per = check_batch_size(config, self.batches[0].shape[0]) if self.batches else 1
        self.uses: list[list[set[int]]] = [
            [set(int(k) for k in self.planned(np.unique(b[j * self.per : (j + 1) * self.per]))) for j in range(self.T)]
            for b in self.batches
        ]
        self.acc = [[_Acc() for _ in range(self.T)] for _ in range(self.N)]
        self.groups: list[list[tuple[int, list[int]]]] = [[] for _ in range(self.N)]  # G_x
        self.copies: dict[int, dict[int, int]] = {}  # key -> trainer -> slot
        self.free: list[set[int]] = [set(range(self.C)) for _ in range(self.T)]
        self.last_wb: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        self.dropped: dict[int, list[tuple[int, int]]] = {}  # rule-3 leavers after x-1

    # ----------------------------------------------------------------- public
    def plan(self) -> list[list[Directive]]:
        """Directives of every iteration, per trainer."""
        for x in range(self.N):
            if self.cfg.mode in ("bagpipe", "no-cache"):
                self.plan_iteration(x)
            elif self.cfg.mode == "static-cache":
                self.plan_static(x)
        return [[self.directive(x, j) for j in range(self.T)] for x in range(self.N)]

    # ----------------------------------------------------------------- helpers
    def planned(self, keys: np.ndarray) -> np.ndarray:
        """The keys this planner plans: all, or those of its key partition."""
        part = self.cfg.partition
        if part is None:
            return keys
        return keys[key_partitions(np.asarray(keys, dtype=np.int64).reshape(-1), part.count) == part.index]

    def next_use(self, key: int, trainer: int, x: int) -> int:
        """First y in (x, x+L] (within the stream) where `trainer` uses `key`, else NEVER."""
        for y in range(x + 1, min(x + self.L, self.N - 1) + 1):
            if key in self.uses[y][trainer]:
                return y
        return NEVER

    def used_next(self, x: int) -> set[int]:
        """Keys any trainer uses at x+1: rule 6 puts these keys of G_x in sync_now(x)."""
        return set().union(*self.uses[x + 1]) if x + 1 < self.N else set()

    def min_version(self, key: int, directive: int) -> int:
        """The version of the key's last planned write-back, or -1 if there is none or it
        has landed before the fetches of `directive` are issued."""
        version = self.last_wb.get(key, -1)
        return version if version > self.cfg.landed_through(directive) else -1

    def infeasible(self, x: int, j: int, need: int) -> ConfigError:
        return infeasible_capacity(x, j, need, self.C)

    def fetch(self, x: int, j: int, key: int, slot: int) -> None:
        d = max(0, x - self.D)
        self.acc[d][j].prefetch.append((x, key, slot, self.min_version(key, d)))

    def take_slot(self, j: int) -> int:
        slot = min(self.free[j])
        self.free[j].remove(slot)
        return slot

    # ----------------------------------------------------------------- bagpipe (§4)
    def plan_iteration(self, x: int) -> None:
        used_by = self.uses[x]
        used = sorted(set().union(*used_by))
        # a. (rules 1, 2) who holds what at the end of x-1
        admitted = [k for k in used if k not in self.copies]
        source = {k: min(self.copies[k]) for k in used if k in self.copies}
        source_slot = {k: self.copies[k][source[k]] for k in source}
        flush = self.flush_candidates(x - 1) if x > 0 and self.cfg.is_local_checkpoint(x - 1) else {}
        victims_of: dict[int, list[tuple[int, int]]] = defaultdict(list)
        candidates: list[list[int]] = []
        # b. (rules 4, 5) capacity and slots of the mandatory new copies
        for j in range(self.T):
            if len(used_by[j]) > self.C:
                raise self.infeasible(x, j, len(used_by[j]))
            held = [k for k, c in self.copies.items() if j in c]
            new = sorted(k for k in used_by[j] if j not in self.copies.get(k, {}))
            cands = sorted(
                (k for k in held if k not in used_by[j]),
                key=lambda k: (self.next_use(k, j, x), k),
                reverse=True,
            )
            excess = len(held) + len(new) - self.C
            for k in cands[: max(0, excess)]:
                self.evict(x, j, k, victims_of)
            candidates.append(cands[max(0, excess) :])
            for k in new:
                slot = self.take_slot(j)
                self.copies.setdefault(k, {})[j] = slot
                if k in source:
                    self.acc[x][j].join_recv[k] = slot
                else:
                    self.fetch(x, j, k, slot)
        for k in source:
            if any(k in self.acc[x][j].join_recv for j in range(self.T)):
                self.acc[x][source[k]].join_send[k] = source_slot[k]
        # c. (rule 1) admission prefetch by trainers that use the key later in the window
        for k in admitted:
            for j in range(self.T):
                if k in used_by[j]:
                    continue
                u = self.next_use(k, j, x)
                if u == NEVER:
                    continue
                if not self.free[j]:
                    if not candidates[j] or self.next_use(candidates[j][0], j, x) <= u:
                        continue
                    self.evict(x, j, candidates[j].pop(0), victims_of)
                slot = self.take_slot(j)
                self.copies[k][j] = slot
                self.fetch(x, j, k, slot)
        # d. (rule 4) residencies whose last copies were victims end after x-1
        ended = set()
        for k in sorted(victims_of):
            if not self.copies.get(k):
                self.copies.pop(k, None)
                self.end_residency(x - 1, k, self.dropped.get(k, []) + victims_of[k])
                ended.add(k)
        for k, (j, slot) in flush.items():
            if k not in ended:
                self.acc[x - 1][j].write.append((k, slot, 1))
        # e. (rule 6) G_x and the input slots
        for k in used:
            if self.synchronised(x, k):
                self.groups[x].append((k, [self.copies[k].get(j, -1) for j in range(self.T)]))
        self.record_inputs(x)
        # f. (rule 3) residency after the use
        self.dropped = {}
        for k in used:
            self.after_use(x, k)
            self.last_use[k] = x

    def synchronised(self, x: int, key: int) -> bool:
        """Rule 6: a key used at x is in G_x if it has two copies or more during x."""
        return len(self.copies[key]) >= 2

    def evict(self, x: int, j: int, key: int, victims_of: dict[int, list[tuple[int, int]]]) -> None:
        """Capacity victim: the copy leaves after x-1; its slot is free for x."""
        slot = self.copies[key].pop(j)
        self.free[j].add(slot)
        self.acc[x - 1][j].leave.append((key, slot))
        victims_of[key].append((j, slot))

    def keeper(self, x: int, key: int, copies: dict[int, int], stay: list[int]) -> list[int]:
        """Rule 3: the lowest-index copy stays if no copy stays but another trainer uses the key."""
        if not stay and any(self.next_use(key, j, x) != NEVER for j in range(self.T)):
            return [min(copies)]
        return stay

    def after_use(self, x: int, key: int) -> None:
        copies = self.copies[key]
        stay = [j for j in sorted(copies) if self.next_use(key, j, x) != NEVER]
        stay = self.keeper(x, key, copies, stay)
        leavers = [(j, copies[j]) for j in sorted(copies) if j not in stay]
        for j, slot in leavers:
            del copies[j]
            self.free[j].add(slot)
            self.acc[x][j].leave.append((key, slot))
        if not copies:
            del self.copies[key]
            self.end_residency(x, key, leavers)
        elif leavers:
            self.dropped[key] = leavers

    def end_residency(self, e: int, key: int, leavers: list[tuple[int, int]]) -> None:
        """The residency of `key` ends after e: the lowest-index leaver writes version e."""
        writer, slot = min(leavers)
        self.acc[e][writer].write.append((key, slot, 0))
        self.last_wb[key] = e

    def flush_candidates(self, c: int) -> dict[int, tuple[int, int]]:
        """Residencies at the end of checkpoint c used since the previous checkpoint: writer."""
        previous = c - self.cfg.checkpoint_every
        return {
            k: (min(cs), cs[min(cs)])
            for k, cs in sorted(self.copies.items())
            if self.last_use[k] > previous
        }

    def record_inputs(self, x: int) -> None:
        """Each input's slot; -1 for another partition's key."""
        for j in range(self.T):
            part = self.batches[x][j * self.per : (j + 1) * self.per]
            alone = self.cfg.partition is None  # plans every key: each has a copy
            slots = [[self.copies[int(k)][j] if alone or int(k) in self.copies else -1 for k in row] for row in part]
            self.acc[x][j].input_slots = np.array(slots, dtype=np.int32).reshape(part.shape)

    # ----------------------------------------------------------------- static cache (§8)
    def plan_static(self, x: int) -> None:
        hot = [int(k) for k in self.cfg.hot_keys]
        hot_slot = {k: i for i, k in enumerate(hot)}
        used_by = self.uses[x]
        cold_slot: list[dict[int, int]] = []
        for j in range(self.T):
            cold = sorted(k for k in used_by[j] if k not in hot_slot)
            if len(hot) + len(cold) > self.C:
                raise self.infeasible(x, j, len(hot) + len(cold))
            cold_slot.append({k: len(hot) + i for i, k in enumerate(cold)})
            if x == 0:
                for k in hot:
                    self.fetch(0, j, k, hot_slot[k])
            for k, slot in cold_slot[j].items():
                self.fetch(x, j, k, slot)
                self.acc[x][j].leave.append((k, slot))
        for k in sorted(set().union(*used_by)):
            holders = [j for j in range(self.T) if k in hot_slot or k in cold_slot[j]]
            slots = [hot_slot[k] if k in hot_slot else cold_slot[j].get(k, -1) for j in range(self.T)]
            if len(holders) >= 2:
                self.groups[x].append((k, slots))
            if k not in hot_slot:
                self.acc[x][holders[0]].write.append((k, slots[holders[0]], 0))
                self.last_wb[k] = x
            self.last_use[k] = x
        self.static_hot_writes(x, hot)
        for j in range(self.T):
            part = self.batches[x][j * self.per : (j + 1) * self.per]
            slots = [[hot_slot.get(int(k), cold_slot[j].get(int(k), -1)) for k in row] for row in part]
            self.acc[x][j].input_slots = np.array(slots, dtype=np.int32).reshape(part.shape)

    def static_hot_writes(self, x: int, hot: list[int]) -> None:
        """Pinned rows: written by trainer 0 when they leave after the last iteration, or when
        used since the previous checkpoint (flush)."""
        if x == self.N - 1:
            for j in range(self.T):
                self.acc[x][j].leave.extend((k, i) for i, k in enumerate(hot))
            self.acc[x][0].write.extend((k, i, 0) for i, k in enumerate(hot))
        elif self.cfg.is_local_checkpoint(x):
            previous = x - self.cfg.checkpoint_every
            self.acc[x][0].write.extend(
                (k, i, 1) for i, k in enumerate(hot) if self.last_use.get(k, -1) > previous
            )

    # ----------------------------------------------------------------- directives
    def directive(self, x: int, j: int) -> Directive:
        """Trainer j's directive of iteration x, numbered globally from cfg.first_iteration."""
        acc = self.acc[x][j]
        first = self.cfg.first_iteration
        if self.cfg.mode == "local":
            acc.input_slots = self.batches[x][j * self.per : (j + 1) * self.per].astype(np.int32)
            groups = [(k, [k] * self.T) for k in sorted(set().union(*self.uses[x]))] if self.T > 1 else []
        else:
            groups = self.groups[x]
        nxt = self.used_next(x)
        now = [(k, s[j]) for k, s in groups if k in nxt]
        later = [(k, s[j]) for k, s in groups if k not in nxt]
        prefetch = sorted(acc.prefetch)
        join_keys = sorted(set().union(*(set(self.acc[x][i].join_recv) for i in range(self.T))))
        leave = sorted(acc.leave)
        write = sorted(acc.write)
        return lists_to_directive(
            first, x, j, np.asarray(acc.input_slots, dtype=np.int32), prefetch, join_keys, acc.join_send,
            acc.join_recv, now, later, leave, write, checkpoint=self.cfg.is_checkpoint(first + x),
        )


def reference_plan(config: PlannerConfig, batches: list[np.ndarray]) -> list[list[Directive]]:
    """Directives of the whole stream, per iteration and trainer, by the specification."""
    if config.workers == 1:
        return ReferencePlanner(config, batches).plan()
    planners = [ReferencePlanner(config.for_partition(p), batches) for p in range(config.workers)]
    for planner in planners:
        planner.plan()
    n, t = len(batches), config.num_trainers
    return [[merged_directive(planners, x, j) for j in range(t)] for x in range(n)]


def merged_directive(planners: list[ReferencePlanner], x: int, j: int) -> Directive:
    """Trainer j's directive of iteration x from the planners of every key partition."""
    first = planners[0].cfg.first_iteration
    offsets = [p.cfg.partition.offset if p.cfg.partition else 0 for p in planners]

    def moved(slot: int, off: int) -> int:
        return slot + off if slot >= 0 else slot

    inputs = np.full(planners[0].acc[x][j].input_slots.shape, -1, np.int32)
    for p, off in zip(planners, offsets):
        own = p.acc[x][j].input_slots
        inputs = np.where(own >= 0, own + off, inputs).astype(np.int32)
    pairs = list(zip(planners, offsets))
    prefetch = sorted((t, k, moved(s, off), v) for p, off in pairs for t, k, s, v in p.acc[x][j].prefetch)
    join_keys = sorted({k for p in planners for i in range(p.T) for k in p.acc[x][i].join_recv})
    send = {k: moved(s, off) for p, off in pairs for k, s in p.acc[x][j].join_send.items()}
    recv = {k: moved(s, off) for p, off in pairs for k, s in p.acc[x][j].join_recv.items()}
    groups = sorted((k, moved(slots[j], off)) for p, off in pairs for k, slots in p.groups[x])
    nxt = set().union(*(p.used_next(x) for p in planners))
    now = [(k, s) for k, s in groups if k in nxt]
    later = [(k, s) for k, s in groups if k not in nxt]
    leave = sorted((k, moved(s, off)) for p, off in pairs for k, s in p.acc[x][j].leave)
    write = sorted((k, moved(s, off), f) for p, off in pairs for k, s, f in p.acc[x][j].write)
    return lists_to_directive(first, x, j, inputs, prefetch, join_keys, send, recv, now, later, leave, write,
                              checkpoint=planners[0].cfg.is_checkpoint(first + x))


def lists_to_directive(
    first: int, x: int, trainer: int, input_slots: np.ndarray, prefetch: list, join_keys: list, join_send: dict,
    join_recv: dict, now: list, later: list, leave: list, write: list, *, checkpoint: bool,
) -> Directive:
    """A directive from the specification's sorted lists: prefetch (target, key, slot,
    min version), joins by key with each key's send and receive slot (-1: none), sync
    (key, slot) pairs, leave (key, slot), write (key, slot, flush). Iteration x, prefetch
    targets and min versions count from this planner's 0; the directive's from `first`."""
    i32, i64 = np.int32, np.int64
    return Directive(
        iteration=first + x,
        trainer=trainer,
        input_slots=input_slots,
        prefetch_keys=np.array([p[1] for p in prefetch], dtype=i64),
        prefetch_slots=np.array([p[2] for p in prefetch], dtype=i32),
        prefetch_min_versions=np.array([v + first if v >= 0 else v for _, _, _, v in prefetch], dtype=i64),
        prefetch_targets=np.array([first + p[0] for p in prefetch], dtype=i32),
        join_keys=np.array(join_keys, dtype=i64),
        join_send_slots=np.array([join_send.get(k, -1) for k in join_keys], dtype=i32),
        join_recv_slots=np.array([join_recv.get(k, -1) for k in join_keys], dtype=i32),
        sync_now_keys=np.array([k for k, _ in now], dtype=i64),
        sync_now_slots=np.array([s for _, s in now], dtype=i32),
        sync_later_keys=np.array([k for k, _ in later], dtype=i64),
        sync_later_slots=np.array([s for _, s in later], dtype=i32),
        leave_slots=np.array([s for _, s in leave], dtype=i32),
        write_keys=np.array([k for k, _, _ in write], dtype=i64),
        write_slots=np.array([s for _, s, _ in write], dtype=i32),
        write_flush=np.array([f for _, _, f in write], dtype=np.uint8),
        checkpoint=checkpoint,
    )
