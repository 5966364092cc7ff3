"""The PS protocol: every message a PS client and a shard exchange, and `ROUTES`, the one
table of which message goes where (docs/design.md#parameter-server,
#wire-format-and-transport, #checkpoints).

Messages are frozen keyword-only dataclasses, checked when they are built (on either side)
and carrying their codec: `to_wire()` / `from_wire()`, and `to_parts()` for sending without
joining large arrays. Data-plane bodies (fetch, write-back) use the binary codec of
`common.wire`, decoded into zero-copy array views; control bodies (checkpoint, rejoin,
restore, health, status) are one JSON object, so that curl can drive and probe a shard. A
message that does not follow its definition raises `WireError` (400) naming the first
problem. What only the shard can judge (key ranges and ownership, row width, versions
against stored ones) is checked by `ps.store.ShardStore`.

A shard process has a random *incarnation*. Requests name, in `INCARNATION_HEADER`, the one
their client last spoke with; on routes marked `incarnation` a restarted shard refuses
them (409 ``restarted``, `common.errors.Restarted`), so that the client replays its journal
to it first (docs/design.md#a-ps-shard-restarted-alone) and then says so (`Rejoined`): a shard restarted alone serves no
fetch until every trainer has.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, Protocol, Self

import numpy as np
import orjson

from common.errors import WireError, clipped, quoted
from common.wire import DTYPES, decode, encode_parts, peer_json, require

INCARNATION_HEADER = "bagpipe-incarnation"
BINARY = "application/octet-stream"
JSON = "application/json"

#: An array field: its wire dtype and rank.
ArraySpec = tuple[str, int]


class Message(Protocol):
    """What every PS message offers."""

    CONTENT_TYPE: ClassVar[str]

    def to_parts(self) -> list[bytes | memoryview]: ...

    def to_wire(self) -> bytes: ...

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self: ...


# --------------------------------------------------------------------------- data plane
class WriteKind(enum.Enum):
    """Why a trainer writes rows back (docs/design.md#rule-3-residency-and-the-keeper, #checkpoints)."""

    #: The residency ended: the row leaves every cache, with the version of its last use.
    EVICT = "evict"
    #: Checkpoint c's copy of a row that stays cached; version c, which may be older than
    #: what the shard holds by the time it lands.
    FLUSH = "flush"


@dataclass(frozen=True, kw_only=True, eq=False)
class _BinaryMessage:
    """A data-plane message: `_meta()` and the arrays named in `_ARRAYS`, by `common.wire`.

    Arrays make `==` meaningless, so it is disabled.
    """

    NAME: ClassVar[str]
    CONTENT_TYPE: ClassVar[str] = BINARY
    _ARRAYS: ClassVar[dict[str, ArraySpec]]

    def __post_init__(self) -> None:
        for name, (dtype, ndim) in self._ARRAYS.items():
            value = getattr(self, name)
            if isinstance(value, np.ndarray) and value.ndim == ndim and value.dtype == DTYPES[dtype]:
                continue  # the usual case, in one test; the checks below name what is wrong
            kind = type(value).__name__
            _check(self, isinstance(value, np.ndarray), "%s must be a numpy array, got %s", name, kind)
            require({name: value}, name, dtype, ndim)

    def _meta(self) -> dict[str, Any]:
        return {}

    def to_parts(self) -> list[bytes | memoryview]:
        """The body as buffers, so that large arrays are sent without being copied."""
        return encode_parts(self._meta(), {name: getattr(self, name) for name in self._ARRAYS})

    def to_wire(self) -> bytes:
        return b"".join(self.to_parts())

    @classmethod
    def _decode(
        cls,
        body: bytes | bytearray | memoryview,
        meta_fields: set[str],
        optional: set[str] | None = None,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Meta (`meta_fields` at most) and the arrays of `_ARRAYS`, all required but those in
        `optional` (the constructor checks their dtype and rank)."""
        meta, arrays = decode(body)
        _only(meta, meta_fields, "meta fields")
        for name in cls._ARRAYS:
            if name not in arrays and name not in (optional or ()):
                raise WireError(f"missing array {name!r}", array=name)
        _only(arrays, set(cls._ARRAYS), "arrays")
        return meta, arrays


@dataclass(frozen=True, kw_only=True, eq=False)
class FetchRequest(_BinaryMessage):
    """Rows of `keys` (all on the shard asked), each once it has reached its min_version.

    The shard waits without polling; past `wait_s` (None: the shard's default, which is also
    the most it accepts) it answers 504 rather than serve stale data. On the wire
    `min_versions` may be left out (any version) and so may `wait_s`.
    """

    NAME: ClassVar[str] = "fetch request"
    _ARRAYS: ClassVar[dict[str, ArraySpec]] = {"keys": ("<i8", 1), "min_versions": ("<i8", 1)}

    keys: np.ndarray  # int64 [n]
    min_versions: np.ndarray  # int64 [n]; -1: any version
    wait_s: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        one_each = self.min_versions.shape == self.keys.shape
        _check(self, one_each, "min_versions must have one entry per key")
        wait = self.wait_s
        positive = wait is None or (type(wait) in (int, float) and wait > 0)
        _check(self, positive, "wait_s must be a positive number, got %r", wait)

    def _meta(self) -> dict[str, Any]:
        return {} if self.wait_s is None else {"wait_s": self.wait_s}

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        meta, arrays = cls._decode(body, {"wait_s"}, optional={"min_versions"})
        if "min_versions" not in arrays:
            arrays["min_versions"] = np.full(arrays["keys"].shape, -1, dtype=np.int64)
        return cls(**arrays, wait_s=meta.get("wait_s"))


@dataclass(frozen=True, kw_only=True, eq=False)
class Rows(_BinaryMessage):
    """Rows in the order of the keys asked for: the answer to a `FetchRequest`."""

    NAME: ClassVar[str] = "rows"
    _ARRAYS: ClassVar[dict[str, ArraySpec]] = {
        "rows": ("<f4", 2),
        "state": ("<f4", 2),
        "versions": ("<i8", 1),
    }

    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_width]
    versions: np.ndarray  # int64 [n]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_same_length(self, ("versions", "rows", "state"))

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        _, arrays = cls._decode(body, set())
        return cls(**arrays)


@dataclass(frozen=True, kw_only=True, eq=False)
class WriteBack(_BinaryMessage):
    """Store `rows` and `state` of `keys` with `version`, all or nothing.

    Refused (409) if a key already has this version or a newer one, except for a flush,
    which may be older than the stored row (`ps.store.ShardStore.check_write`). A `replay`
    is a write the shard may have seen already or may meet out of order: a trainer resends
    its journal to a shard restarted alone, and a write retried after a broken connection
    may have landed. The shard applies a replayed row only where it is newer than what it
    holds, so repeats and reordering change nothing; a replayed flush is still a flush (its
    version must be a checkpoint's).
    """

    NAME: ClassVar[str] = "write-back"
    _ARRAYS: ClassVar[dict[str, ArraySpec]] = {
        "keys": ("<i8", 1),
        "rows": ("<f4", 2),
        "state": ("<f4", 2),
    }

    kind: WriteKind
    version: int
    keys: np.ndarray  # int64 [n]
    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_width]
    replay: bool = False

    def __post_init__(self) -> None:
        kind = self.kind
        _check(self, isinstance(kind, WriteKind), "kind must be a WriteKind, got %r", kind)
        _check_types(self, version=int, replay=bool)
        super().__post_init__()
        _check_same_length(self, ("keys", "rows", "state"))

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (what a journal entry costs)."""
        return self.keys.nbytes + self.rows.nbytes + self.state.nbytes

    def _meta(self) -> dict[str, Any]:
        """``write`` is "evict" or "flush" (``kind`` tells a stream's messages apart)."""
        return {"write": self.kind.value, "version": self.version, "replay": self.replay}

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        meta, arrays = cls._decode(body, {"write", "version", "replay"})
        _present(meta, ("write", "version", "replay"), "write-back meta")
        kinds = {k.value: k for k in WriteKind}
        write = meta["write"]
        # A str first: a list or an object (JSON gives both) cannot even be looked up.
        if not isinstance(write, str) or write not in kinds:
            raise WireError(f"invalid write-back: write must be one of {sorted(kinds)}, not "
                            f"{quoted(write)}", field="write")
        return cls(kind=kinds[write], version=meta["version"], replay=meta["replay"], **arrays)


# --------------------------------------------------------------------------- control
@dataclass(frozen=True, kw_only=True)
class _JsonMessage:
    """A control message: one JSON object whose fields are the dataclass's, in order."""

    NAME: ClassVar[str]
    CONTENT_TYPE: ClassVar[str] = JSON

    def to_parts(self) -> list[bytes | memoryview]:
        return [self.to_wire()]

    def to_wire(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        payload: Any = peer_json(body)
        if not isinstance(payload, dict):
            raise WireError("body must be a JSON object")
        names = [f.name for f in fields(cls)]
        _only(payload, set(names), "fields")
        _present(payload, [f.name for f in fields(cls) if f.default is MISSING], "body")
        return cls(**payload)


@dataclass(frozen=True, kw_only=True)
class WriteAck(_JsonMessage):
    """A write-back was accepted: `written` of its rows now hold `version` in the table. The
    others were already there at that version or a newer one (a replay that had landed, a
    late flush): they changed at most the pending checkpoints they belong to."""

    NAME: ClassVar[str] = "write acknowledgement"

    written: int
    version: int

    def __post_init__(self) -> None:
        _check_non_negative(self, "written")
        _check_types(self, version=int)


@dataclass(frozen=True, kw_only=True)
class CheckpointReport(_JsonMessage):
    """Trainer `trainer` (of `trainers`) says that all its writes of versions <= `checkpoint`,
    flushes included, were acknowledged (docs/design.md#a-ps-shard-restarted-alone).

    The shard snapshots checkpoint `checkpoint` once all `trainers` reported and answers
    every report with the snapshot once it is on disk (507 if it could not be written); a
    report of a checkpoint already on disk is answered at once.
    """

    NAME: ClassVar[str] = "checkpoint report"

    checkpoint: int
    trainer: int
    trainers: int
    prune_before: int = -1  # the oldest complete checkpoint still kept: older snapshots may go

    def __post_init__(self) -> None:
        _check_non_negative(self, "checkpoint")
        _check_types(self, prune_before=int)
        _check_trainer(self)


@dataclass(frozen=True, kw_only=True)
class Rejoined(_JsonMessage):
    """Trainer `trainer` (of `trainers`) has replayed to this shard process every write-back
    of its journal for the shard (docs/design.md#a-ps-shard-restarted-alone), or had none to replay.

    A shard restarted alone (``--rejoin``) answers no fetch until all `trainers` said so:
    until then its snapshot may lack a row whose newest write-back sits in a journal not yet
    replayed, and a fetch that asks for any version (min_version -1) would get the older
    row. Sending it again changes nothing; a shard not restarted alone waits for nobody.
    """

    NAME: ClassVar[str] = "rejoin report"

    trainer: int
    trainers: int

    def __post_init__(self) -> None:
        _check_trainer(self)


@dataclass(frozen=True, kw_only=True)
class RejoinProgress(_JsonMessage):
    """The answer to a `Rejoined`: `reported` trainers have replayed to this shard process,
    and it holds fetches until the `waiting` others have (0: it serves them; both are 0 at a
    shard that was not restarted alone)."""

    NAME: ClassVar[str] = "rejoin progress"

    reported: int
    waiting: int

    def __post_init__(self) -> None:
        _check_non_negative(self, "reported", "waiting")


@dataclass(frozen=True, kw_only=True)
class SnapshotRequest(_JsonMessage):
    """Persist the shard now, as of iteration `checkpoint`, without waiting for reports
    (the final tables, tools)."""

    NAME: ClassVar[str] = "snapshot request"

    checkpoint: int

    def __post_init__(self) -> None:
        _check_non_negative(self, "checkpoint")


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(_JsonMessage):
    """A snapshot on disk: the answer to a `CheckpointReport` or a `SnapshotRequest`."""

    NAME: ClassVar[str] = "saved checkpoint"

    checkpoint: int
    path: str
    nbytes: int
    seconds: float

    def __post_init__(self) -> None:
        _check_non_negative(self, "checkpoint", "nbytes")
        _check_types(self, path=str)
        seconds = self.seconds
        ok = type(seconds) in (int, float) and seconds >= 0
        _check(self, ok, "seconds must be a number >= 0, got %r", seconds)


@dataclass(frozen=True, kw_only=True)
class RestoreRequest(_JsonMessage):
    """Replace the shard's contents with its snapshot of `checkpoint` (404 if it has none)."""

    NAME: ClassVar[str] = "restore request"

    checkpoint: int

    def __post_init__(self) -> None:
        _check_non_negative(self, "checkpoint")


@dataclass(frozen=True, kw_only=True)
class Restored(_JsonMessage):
    """The shard holds checkpoint `checkpoint`: `rows` rows that had been touched."""

    NAME: ClassVar[str] = "restore answer"

    checkpoint: int
    rows: int

    def __post_init__(self) -> None:
        _check_non_negative(self, "checkpoint", "rows")


@dataclass(frozen=True, kw_only=True)
class Health(_JsonMessage):
    """That the shard process answers: public (probes, curl), so it tells nothing else and
    costs nothing, however often it is asked."""

    NAME: ClassVar[str] = "health"

    role: str
    ok: bool

    def __post_init__(self) -> None:
        _check_types(self, role=str, ok=bool)


@dataclass(frozen=True, kw_only=True)
class ShardStatus(_JsonMessage):
    """What a shard says about itself to its clients (the bearer token is required):
    `incarnation` names the process, `max_version` is the newest version it holds."""

    NAME: ClassVar[str] = "shard status"

    shard: int
    num_shards: int
    rows: int
    dim: int
    incarnation: str
    restored: int
    max_version: int
    last_checkpoint: int  # the newest checkpoint taken or restored; -1: none
    checkpoints: tuple[int, ...]  # the snapshots on the shard's disk, oldest first
    # Restarted alone: the trainers whose `Rejoined` it still waits for before serving fetches.
    rejoin_waits_for: tuple[int, ...] = ()
    term: int = 0  # an elastic job's term this shard serves (`oracle.membership`)

    def __post_init__(self) -> None:
        _check_non_negative(self, "shard", "num_shards", "rows", "dim", "term")
        _check_types(self, incarnation=str, restored=int, max_version=int, last_checkpoint=int)
        _check(self, self.restored >= -1, "restored must be >= -1, got %s", self.restored)
        _check_int_list(self, "checkpoints")
        _check_int_list(self, "rejoin_waits_for")


# --------------------------------------------------------------------------- routes
@dataclass(frozen=True, kw_only=True)
class Route:
    """One (method, path) of a shard and the messages it takes and answers."""

    method: str
    path: str
    request: type[Message] | None  # None: no body
    response: type[Message] | None  # None: not a protocol message (Prometheus text)
    public: bool = False  # served without the bearer token (probes, Prometheus)
    incarnation: bool = False  # refused (409) when meant for an earlier process of the shard


FETCH = Route(
    method="POST", path="/v1/fetch", request=FetchRequest, response=Rows, incarnation=True
)
WRITE_BACK = Route(
    method="POST", path="/v1/write_back", request=WriteBack, response=WriteAck, incarnation=True
)
REPORT_CHECKPOINT = Route(
    method="POST",
    path="/v1/checkpoint/report",
    request=CheckpointReport,
    response=CheckpointSaved,
    incarnation=True,
)
SNAPSHOT = Route(
    method="POST",
    path="/v1/checkpoint/snapshot",
    request=SnapshotRequest,
    response=CheckpointSaved,
    incarnation=True,
)
REJOINED = Route(
    method="POST", path="/v1/rejoined", request=Rejoined, response=RejoinProgress, incarnation=True
)
# Not tied to an incarnation: a whole-cluster restore is an operator's act, not a trainer's.
RESTORE = Route(method="POST", path="/v1/restore", request=RestoreRequest, response=Restored)
HEALTH = Route(method="GET", path="/v1/health", request=None, response=Health, public=True)
STATUS = Route(method="GET", path="/v1/status", request=None, response=ShardStatus)
METRICS = Route(method="GET", path="/metrics", request=None, response=None, public=True)

ROUTES: tuple[Route, ...] = (
    FETCH,
    WRITE_BACK,
    REPORT_CHECKPOINT,
    SNAPSHOT,
    REJOINED,
    RESTORE,
    HEALTH,
    STATUS,
    METRICS,
)


# --------------------------------------------------------------------------- checks
def _check(message: _BinaryMessage | _JsonMessage, ok: bool, problem: str, *args: object) -> None:
    """WireError naming `message` unless `ok`; `problem % args` is formatted only then (the
    checks run on every message built, the formatting would cost more than they do)."""
    if not ok:
        shown = tuple(a if type(a) in (int, float) else _Quoted(a) for a in args)
        raise WireError(f"invalid {message.NAME}: {problem % shown if args else problem}")


class _Quoted:
    """A value in a `_check` message: at most a few hundred characters of it (`quoted`)."""

    def __init__(self, value: object) -> None:
        self._value = value

    def __repr__(self) -> str:
        return quoted(self._value)

    def __str__(self) -> str:
        return clipped(self._value) if isinstance(self._value, str) else str(self._value)


_TYPE_NAMES = {int: "an integer", bool: "a boolean", str: "a string"}


def _check_types(message: _BinaryMessage | _JsonMessage, **types: type) -> None:
    """Each named field has exactly its type (a bool is not an int here)."""
    for name, kind in types.items():
        value = getattr(message, name)
        _check(message, type(value) is kind, "%s must be %s, got %r", name, _TYPE_NAMES[kind], value)


def _check_non_negative(message: _JsonMessage, *names: str) -> None:
    for name in names:
        value = getattr(message, name)
        ok = type(value) is int and value >= 0
        _check(message, ok, "%s must be a non-negative integer, got %r", name, value)


def _check_trainer(message: CheckpointReport | Rejoined) -> None:
    """`trainer` is one of `trainers`: both non-negative integers, trainer below trainers."""
    _check_non_negative(message, "trainer", "trainers")
    below = message.trainer < message.trainers
    _check(message, below, "trainer %s is not below trainers = %s", message.trainer, message.trainers)


def _check_int_list(message: _JsonMessage, name: str) -> None:
    """A list of integers, kept as a tuple (JSON gives a list; a frozen message wants a tuple)."""
    listed = getattr(message, name)
    ints = isinstance(listed, list | tuple) and all(type(c) is int for c in listed)
    _check(message, ints, "%s must be a list of integers, got %r", name, listed)
    object.__setattr__(message, name, tuple(listed))


def _check_same_length(message: _BinaryMessage, names: tuple[str, ...]) -> None:
    """Every array has one row per entry of the first."""
    n = len(getattr(message, names[0]))
    for name in names[1:]:
        rows = len(getattr(message, name))
        _check(message, rows == n, "%s has %d rows for %d %s", name, rows, n, names[0])


def _only(given: Mapping[str, Any], allowed: set[str], what: str) -> None:
    extra = set(given) - allowed
    if extra:
        raise WireError(f"unexpected {what} {quoted(sorted(extra))}")


def _present(given: Mapping[str, Any], names: Sequence[str], what: str) -> None:
    missing = [name for name in names if name not in given]
    if missing:
        raise WireError(f"{what} lacks {missing}")
