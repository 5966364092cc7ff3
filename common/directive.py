"""The directive: what the oracle tells trainer j to do around iteration x (docs/design.md#the-directive).

One `Directive` per (iteration, trainer). Every array is ordered canonically so two planners
that agree on the plan emit the same bytes: lists of keys ascend by key, `prefetch_*` ascends by
(target, key). Slots are indices into the trainer's ``[C, d]`` cache; -1 means "no slot here".

Timing, in the words of docs/design.md#the-boundary (steps 0-7). A trainer runs, for each
directive x in order: the boundary into x, then forward/backward on x, then end of x. After the
last directive N-1 it drains: it runs the boundary into N (steps 1 and 3) and the boundary
into N+1 (step 1) without receiving a directive, so every held-back write-back is sent.

Sparse inputs are single-hot (one id per feature per sample), so `input_slots` needs no bag
offsets: row i, column f is the slot holding sample i's id for feature f.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from common.errors import WireError
from common.wire import decode, encode, require

_KIND = "directive"

#: A trainer's write-back lag W: at the boundary into x it waits until the PS has
#: acknowledged its write-backs of versions <= x - W (`trainer.boundary.WaitWrites`).
WRITE_LAG = 32


def landed_through(iteration: int, write_lag: int = WRITE_LAG) -> int:
    """The newest version v such that every write-back of a version <= v has reached the PS
    before any trainer issues the fetches of directive `iteration`: such a fetch may ask for
    version -1, and the oracle may forget those versions (docs/design.md#write-lag-and-forgetting-versions).

    A write-back of version v is sent by the boundary into v + 2 at the latest (step 1 there
    sends the rows held back for sync_later(v)), so the first WaitWrites to cover it is the
    one at the boundary into v + max(W, 3). A trainer issues directive y's fetches after
    Train(y - 1), whose dense-gradient all-reduce no trainer leaves before every trainer has
    passed its boundary into y - 1: y - 1 >= v + max(W, 3) suffices. (On a GPU "leaves" means
    on the CPU: `trainer.engine.Engine._train` reads the loss, which waits for the stream.)
    """
    return iteration - 1 - max(write_lag, 3)


@dataclass(frozen=True, kw_only=True, eq=False)
class Directive:
    """The plan of trainer `trainer` for iteration `iteration`.

    Compare directives with `to_wire()`; arrays make `==` meaningless, so it is disabled.
    """

    iteration: int
    trainer: int
    #: int32 [B/T, F]: cache slot of each sparse input of this trainer's slice during x.
    input_slots: np.ndarray
    #: int64 [P]: keys to fetch from the PS. Issued at boundary into x, step 0.
    prefetch_keys: np.ndarray
    #: int32 [P]: slot each fetched row (value + optimizer state) is written into, at the
    #: boundary into its target, step 5. Until then the row is staged outside the cache.
    prefetch_slots: np.ndarray
    #: int64 [P]: the PS serves the row only once its version is >= this (-1: any version,
    #: also for a write-back known to have landed: see `landed_through`).
    prefetch_min_versions: np.ndarray
    #: int32 [P]: iteration whose boundary (step 5) waits for and inserts the row; >= x.
    prefetch_targets: np.ndarray
    #: int64 [J]: keys joined at the boundary into x (identical on every trainer).
    join_keys: np.ndarray
    #: int32 [J]: slot this trainer reads and sends (value + state) at step 2, or -1.
    #: Exactly one trainer has a slot per position: the collective sums the others' zeros.
    join_send_slots: np.ndarray
    #: int32 [J]: slot this trainer writes the received row into at step 4, or -1.
    join_recv_slots: np.ndarray
    #: int64 [N]: keys whose gradients are all-reduced at the end of x and applied at once
    #: in every copy's slot (step 7), copies leaving after x included. Same on every trainer.
    sync_now_keys: np.ndarray
    #: int32 [N]: this trainer's slot for each `sync_now_keys` position during x, or -1.
    sync_now_slots: np.ndarray
    #: int64 [M]: keys all-reduced asynchronously from the end of x; the result is applied at
    #: the boundary into x+2, step 1, to copies that stay and to rows held for write-back.
    sync_later_keys: np.ndarray
    #: int32 [M]: this trainer's slot for each `sync_later_keys` position during x, or -1.
    sync_later_slots: np.ndarray
    #: int32 [V]: slots whose copies leave after x: freed at the boundary into x+1, step 3
    #: (after join sources read at step 2). Ordered by the key they held.
    leave_slots: np.ndarray
    #: int64 [W]: rows this trainer writes to the PS after x. At boundary into x+1, step 3, it
    #: copies each `write_slots` row out; if the key is in `sync_later_keys` of x it applies
    #: that update to the copy at boundary into x+2, step 1, and sends then, else sends at
    #: once.
    write_keys: np.ndarray
    #: int32 [W]: slot each written row is copied from (its slot during x). The PS stores
    #: every written row at version x.
    write_slots: np.ndarray
    #: uint8 [W]: 1 where the write is checkpoint x's flush of a residency that goes on (the
    #: copy written may itself be leaving after x while another trainer keeps the row), 0
    #: where it ends the residency. Only a flush may reach the PS after a newer version of
    #: its row, so only a flush is sent as one (docs/design.md, "Checkpoints").
    write_flush: np.ndarray
    #: True if x is a checkpoint: after sending this directive's writes (flushes included) the
    #: trainer saves its dense model and optimizer as checkpoint x (docs/design.md#checkpoints).
    checkpoint: bool

    _INT32: ClassVar[tuple[str, ...]] = (
        "prefetch_slots",
        "prefetch_targets",
        "join_send_slots",
        "join_recv_slots",
        "sync_now_slots",
        "sync_later_slots",
        "leave_slots",
        "write_slots",
    )
    _INT64: ClassVar[tuple[str, ...]] = (
        "prefetch_keys",
        "prefetch_min_versions",
        "join_keys",
        "sync_now_keys",
        "sync_later_keys",
        "write_keys",
    )

    @classmethod
    def array_names(cls) -> tuple[str, ...]:
        """Names of the array fields, in wire order."""
        return tuple(f.name for f in fields(cls) if f.name not in ("iteration", "trainer", "checkpoint"))

    def to_wire(self) -> bytes:
        """Binary body (common/wire.py): meta {kind, iteration, trainer, checkpoint} + arrays."""
        meta = {
            "kind": _KIND,
            "iteration": self.iteration,
            "trainer": self.trainer,
            "checkpoint": self.checkpoint,
        }
        return encode(meta, {name: getattr(self, name) for name in self.array_names()})

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Directive:
        """Decode and validate a body; WireError naming the first problem found."""
        meta, arrays = decode(body)
        if meta.get("kind") != _KIND:
            raise WireError(f"not a directive (kind {meta.get('kind')!r})")
        scalars = {}
        for name in ("iteration", "trainer"):
            value = meta.get(name)
            if type(value) is not int or value < 0:
                raise WireError(f"meta {name!r} must be a non-negative integer, got {value!r}")
            scalars[name] = value
        if type(meta.get("checkpoint")) is not bool:
            raise WireError("meta 'checkpoint' must be a boolean")
        extra = set(arrays) - set(cls.array_names())
        if extra:
            raise WireError(f"unexpected arrays {sorted(extra)}")
        values = {"input_slots": require(arrays, "input_slots", "<i4", 2)}
        values.update({n: require(arrays, n, "<i4", 1) for n in cls._INT32})
        values.update({n: require(arrays, n, "<i8", 1) for n in cls._INT64})
        values["write_flush"] = require(arrays, "write_flush", "|u1", 1)
        directive = cls(**scalars, checkpoint=meta["checkpoint"], **values)
        directive.validate()
        return directive

    def validate(self) -> None:
        """WireError unless the arrays are mutually consistent (lengths, ranges, order)."""
        _same_length(self, "prefetch_", ("keys", "slots", "min_versions", "targets"))
        _same_length(self, "join_", ("keys", "send_slots", "recv_slots"))
        _same_length(self, "sync_now_", ("keys", "slots"))
        _same_length(self, "sync_later_", ("keys", "slots"))
        _same_length(self, "write_", ("keys", "slots", "flush"))
        _check(bool(np.all(self.write_flush <= 1)), "write_flush not 0 or 1")
        for name in ("input_slots", "prefetch_slots", "leave_slots", "write_slots"):
            _check(getattr(self, name).size == 0 or getattr(self, name).min() >= 0, f"{name} < 0")
        for name in ("join_send_slots", "join_recv_slots", "sync_now_slots", "sync_later_slots"):
            _check(getattr(self, name).size == 0 or getattr(self, name).min() >= -1, f"{name} < -1")
        for name in ("prefetch_keys", "join_keys", "sync_now_keys", "sync_later_keys", "write_keys"):
            _check(getattr(self, name).size == 0 or getattr(self, name).min() >= 0, f"{name} < 0")
        for name in ("join_keys", "sync_now_keys", "sync_later_keys", "write_keys"):
            keys = getattr(self, name)
            # compared in place: np.diff would allocate the differences first (twice the time)
            _check(bool((keys[1:] > keys[:-1]).all()), f"{name} not strictly ascending")
        _check(
            self.prefetch_targets.size == 0 or self.prefetch_targets.min() >= self.iteration,
            "prefetch_targets before the directive's iteration",
        )
        _check(bool(np.all(self.prefetch_min_versions >= -1)), "prefetch_min_versions < -1")


def _same_length(d: Directive, prefix: str, names: tuple[str, ...]) -> None:
    lengths = {getattr(d, prefix + n).shape[0] for n in names}
    _check(len(lengths) == 1, f"{prefix}* arrays differ in length")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise WireError(f"invalid directive: {message}")
