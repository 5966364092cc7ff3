"""The cluster spec: one TOML file, parsed once into frozen, validated dataclasses.

Every role reads the same file. A bad value raises `ConfigError` naming the field
(``oracle.lookahead: must be >= 0``); unknown keys are refused too, so a typo never silently
falls back to a default. The data, model and optimizer sections have parsers of their own
(`common/data/spec.py`, `common/model_spec.py`, `common/optimizer_spec.py`); `common/job.py`
puts them together with this one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from common.errors import ConfigError, quoted

T = TypeVar("T")
Transport = Literal["h2", "http1"]
Mode = Literal["bagpipe", "no-cache", "static-cache", "local"]
#: The modes in the order docs/design.md#modes describes them (tables and charts list them so too).
MODES: tuple[str, ...] = get_args(Mode)
TOKEN_ENV = "BAGPIPE_TOKEN"


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """A service address; port 0 means "any free port" (local clusters only)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: Any, field: str) -> Endpoint:
        if not isinstance(text, str) or ":" not in text:
            raise ConfigError(field, f"must be 'host:port', got {quoted(text)}")
        host, _, port = text.rpartition(":")
        # isascii: str.isdigit accepts digits int() refuses; 253: the longest DNS name.
        digits = port.isascii() and port.isdigit() and len(port) <= 5
        if not host or len(host) > 253 or not digits or not 0 <= int(port) <= 65535:
            raise ConfigError(field, f"must be 'host:port', a host name of at most 253 characters and "
                                     f"a port in 0..65535, got {quoted(text)}")
        return cls(host=host.strip("[]"), port=int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class TlsSection:
    """`[cluster.tls]`: every server of every role speaks TLS with `cert` and `key`, and every
    client checks the server's certificate against `ca` (and presents its own). With `mutual`,
    servers accept only clients whose certificate `ca` signed. The files are read at start-up
    (`common.transport.tls.Tls.load`), not here: a role joined through the coordinator gets the
    oracle's spec, whose paths name files on the oracle's machine, and uses its own instead.

    `origin` says how errors name the fields: `cluster.tls.cert`, or `--tls-cert` for files
    given on the command line."""

    cert: Path
    key: Path
    ca: Path
    mutual: bool = False
    origin: str = field(default="cluster.tls", compare=False)

    def field_name(self, name: str) -> str:
        """How an error names field `name` (cert, key, ca) where it was given."""
        return f"{self.origin}-{name}" if self.origin.startswith("--") else f"{self.origin}.{name}"


@dataclass(frozen=True, kw_only=True)
class ClusterSection:
    transport: Transport = "h2"
    token: str = ""
    max_body_bytes: int = 256 << 20
    request_timeout_s: float = 30.0
    fetch_timeout_s: float = 120.0
    retries: int = 5
    reconnect_s: float = 30.0
    #: An elastic job ([trainers] min_count < max_count) goes on without a trainer unheard of
    #: for this long, and a regroup waits this long for the trainers that were there.
    rejoin_timeout_s: float = 30.0
    # Connection hygiene of every server (`common/transport/limits.py` says why each).
    idle_timeout_s: float = 300.0
    max_connections: int = 1024
    max_concurrent_streams: int = 256
    max_resets: int = 200
    reset_window_s: float = 10.0
    unauthenticated_rate: float = 200.0
    unauthenticated_burst: int = 200
    auth_timeout_s: float = 10.0
    max_unauthenticated_connections: int = 256
    # A finished role serves until a scrape has read its final metrics, at most this long.
    metrics_linger_s: float = 0.0
    tls: TlsSection | None = None

    def __post_init__(self) -> None:
        if not self.metrics_linger_s >= 0:
            raise ConfigError("cluster.metrics_linger_s", f"must be >= 0, got {self.metrics_linger_s}")
        counts = ("max_connections", "max_concurrent_streams", "max_resets", "unauthenticated_burst",
                  "max_unauthenticated_connections")
        for name in counts:
            if getattr(self, name) < 1:
                raise ConfigError(f"cluster.{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "reset_window_s", "unauthenticated_rate", "auth_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cluster.{name}", f"must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class OracleSection:
    address: Endpoint
    mode: Mode = "bagpipe"
    lookahead: int = 200
    prefetch_lead: int = 8
    cache_rows: int = 65536
    max_ahead: int = 64
    #: Planner worker processes, each planning one key partition (bagpipe mode).
    planner_workers: int = 1


@dataclass(frozen=True, kw_only=True)
class PsSection:
    addresses: tuple[Endpoint, ...]

    @property
    def num_shards(self) -> int:
        return len(self.addresses)


@dataclass(frozen=True, kw_only=True)
class TrainersSection:
    count: int = 2
    #: An elastic job: it goes on with as few as `min_count` trainers when some are gone and
    #: takes in trainers that register while it runs, up to `max_count` (docs/design.md#elastic-trainers).
    min_count: int | None = None  # None: `count`
    max_count: int | None = None  # None: `count`
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    rendezvous: Endpoint
    threads: int = 1
    #: A local cluster gives each trainer its own share of this machine's cores
    #: (`common.runtime.trainer_cpus`); false lets the OS move them at will.
    pin_cpus: bool = True
    metrics_address: Endpoint = Endpoint(host="127.0.0.1", port=0)
    #: Where a trainer's PS client runs: on its I/O thread, or in a helper process of its own
    #: that takes the HTTP/2 work off the training process's GIL (`trainer.ps_process`).
    ps_client: Literal["thread", "process"] = "thread"

    def __post_init__(self) -> None:
        if self.min_count is None:
            object.__setattr__(self, "min_count", self.count)
        if self.max_count is None:
            object.__setattr__(self, "max_count", self.count)
        if not 1 <= self.min_count <= self.count:
            raise ConfigError("trainers.min_count", f"must be in 1..count = {self.count}, got {self.min_count}")
        if self.max_count < self.count:
            raise ConfigError("trainers.max_count", f"must be >= count = {self.count}, got {self.max_count}")
        # Trainer j serves its metrics on port + j, so trainers sharing a host never clash.
        last = self.metrics_address.port + self.max_count - 1
        if self.metrics_address.port and last > 65535:
            raise ConfigError("trainers.metrics_address", f"port + max_count - 1 = {last} is above 65535")

    @property
    def elastic(self) -> bool:
        """Whether the number of trainers may change while the job runs."""
        return self.min_count != self.count or self.max_count != self.count

    def metrics_endpoint(self, rank: int) -> Endpoint:
        """Where trainer `rank` serves its metrics: port + rank, or any free port for 0."""
        address = self.metrics_address
        return Endpoint(host=address.host, port=address.port + rank if address.port else 0)


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    batch_size: int = 512
    epochs: int = 1
    max_iterations: int = 0
    eval_every: int = 0


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    dir: Path
    every: int = 0
    restart: bool = False
    restart_alone: bool = True
    journal_bytes: int = 1 << 30
    keep: int = 2


@dataclass(frozen=True, kw_only=True)
class ExportSection:
    """Exports while the job runs (`serving.chain`): at the first complete checkpoint at
    least `every_iterations` iterations, or `every_s` seconds, after the last export (0: not
    by that measure); a base, then deltas, in `dir`."""

    dir: Path
    every_iterations: int = 0
    every_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.every_iterations or self.every_s)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str
    seed: int
    source: Path
    cluster: ClusterSection
    oracle: OracleSection
    ps: PsSection
    trainers: TrainersSection
    train: TrainSection
    checkpoint: CheckpointSection
    sections: dict[str, dict[str, Any]]
    export: ExportSection = field(default_factory=lambda: ExportSection(dir=Path("runs/exports").resolve()))
    """Raw data, model and optimizer sections, each parsed by its own module (`common/job.py`)."""
    document: dict[str, Any] = field(default_factory=dict, compare=False)
    """The whole TOML document as read: the coordinator sends it to roles that have no spec
    file, and a role that has one must agree with it (`oracle.coordinator_client`)."""

    def token(self) -> str:
        """The bearer token: the spec's, else $BAGPIPE_TOKEN; ConfigError if neither is set."""
        token = self.cluster.token or os.environ.get(TOKEN_ENV, "")
        if not token:
            raise ConfigError("cluster.token", f"empty: set it in the spec or in ${TOKEN_ENV}")
        return token


class _Section:
    """Typed reads from one TOML table that remember the field path and refuse leftovers."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(path, "must be a table")
        self.raw = dict(raw)
        self.path = path

    def get(self, key: str, kind: type[T] | tuple[type, ...], default: T) -> T:
        value = self.raw.pop(key, default)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and type(value) is int:
            value = float(value)
        if type(value) not in kinds:
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.path}.{key}", f"must be {names}, got {value!r}")
        return value  # type: ignore[return-value]

    def int(self, key: str, default: int, *, low: int | None = None) -> int:
        value = self.get(key, int, default)
        if low is not None and value < low:
            raise ConfigError(f"{self.path}.{key}", f"must be >= {low}, got {value}")
        return value

    def float(self, key: str, default: float, *, positive: bool = True) -> float:
        value = self.get(key, float, default)
        if positive and not value > 0:
            raise ConfigError(f"{self.path}.{key}", f"must be > 0, got {value}")
        return value

    def choice(self, key: str, options: tuple[str, ...], default: str) -> Any:
        value = self.get(key, str, default)
        if value not in options:
            raise ConfigError(f"{self.path}.{key}", f"must be one of {', '.join(options)}; got {value!r}")
        return value

    def endpoint(self, key: str, default: str) -> Endpoint:
        return Endpoint.parse(self.get(key, str, default), f"{self.path}.{key}")

    def done(self) -> None:
        if self.raw:
            unknown = sorted(self.raw)[0]
            raise ConfigError(f"{self.path}.{unknown}", "unknown field")


def _parse(raw: dict[str, Any], key: str, build: Callable[[_Section], T], path: str | None = None) -> T:
    section = _Section(raw.pop(key, {}), path or key)
    value = build(section)
    section.done()
    return value


def _cluster(s: _Section, folder: Path) -> ClusterSection:
    tls = s.raw.pop("tls", None)
    return ClusterSection(
        transport=s.choice("transport", ("h2", "http1"), "h2"),
        token=s.get("token", str, ""),
        max_body_bytes=s.int("max_body_mib", 256, low=1) << 20,
        request_timeout_s=s.float("request_timeout_s", 30.0),
        fetch_timeout_s=s.float("fetch_timeout_s", 120.0),
        retries=s.int("retries", 5, low=0),
        reconnect_s=s.float("reconnect_s", 30.0),
        rejoin_timeout_s=s.float("rejoin_timeout_s", 30.0),
        idle_timeout_s=s.get("idle_timeout_s", float, 300.0),
        max_connections=s.get("max_connections", int, 1024),
        max_concurrent_streams=s.get("max_concurrent_streams", int, 256),
        max_resets=s.get("max_resets", int, 200),
        reset_window_s=s.get("reset_window_s", float, 10.0),
        unauthenticated_rate=s.get("unauthenticated_rate", float, 200.0),
        unauthenticated_burst=s.get("unauthenticated_burst", int, 200),
        auth_timeout_s=s.get("auth_timeout_s", float, 10.0),
        max_unauthenticated_connections=s.get("max_unauthenticated_connections", int, 256),
        metrics_linger_s=s.float("metrics_linger_s", 0.0, positive=False),
        tls=None if tls is None else _parse({"tls": tls}, "tls", lambda t: _tls(t, folder), "cluster.tls"),
    )


def _tls(s: _Section, folder: Path) -> TlsSection:
    """`[cluster.tls]`: the three files are required, relative to the spec's folder."""
    paths = {}
    for name in ("cert", "key", "ca"):
        if name not in s.raw:
            raise ConfigError(f"{s.path}.{name}", "required: a PEM file (relative to the spec's folder)")
        value = s.get(name, str, "")
        if not value:
            raise ConfigError(f"{s.path}.{name}", "must name a file, got an empty string")
        paths[name] = folder / Path(value).expanduser()
    return TlsSection(**paths, mutual=s.get("mutual", bool, False))


def _oracle(s: _Section) -> OracleSection:
    return OracleSection(
        address=s.endpoint("address", "127.0.0.1:0"),
        mode=s.choice("mode", MODES, "bagpipe"),
        lookahead=s.int("lookahead", 200, low=0),
        prefetch_lead=s.int("prefetch_lead", 8, low=0),
        cache_rows=s.int("cache_rows", 65536, low=1),
        max_ahead=s.int("max_ahead", 64, low=1),
        planner_workers=s.int("planner_workers", 1, low=1),
    )


def _ps(s: _Section) -> PsSection:
    shards = s.int("shards", 2, low=1)
    addresses = s.get("addresses", list, [])
    if addresses and len(addresses) != shards:
        raise ConfigError("ps.addresses", f"lists {len(addresses)} addresses for {shards} shards")
    parsed = tuple(Endpoint.parse(a, f"ps.addresses[{i}]") for i, a in enumerate(addresses))
    return PsSection(addresses=parsed or tuple(Endpoint(host="127.0.0.1", port=0) for _ in range(shards)))


def _trainers(s: _Section) -> TrainersSection:
    return TrainersSection(
        count=(count := s.int("count", 2, low=1)),
        min_count=s.int("min_count", count, low=1),
        max_count=s.int("max_count", count, low=1),
        device=s.choice("device", ("auto", "cpu", "cuda"), "auto"),
        backend=s.choice("backend", ("auto", "gloo", "nccl"), "auto"),
        rendezvous=s.endpoint("rendezvous", "127.0.0.1:0"),
        threads=s.int("threads", 1, low=1),
        pin_cpus=s.get("pin_cpus", bool, True),
        metrics_address=s.endpoint("metrics_address", "127.0.0.1:0"),
        ps_client=s.choice("ps_client", ("thread", "process"), "thread"),
    )


def _train(s: _Section) -> TrainSection:
    return TrainSection(
        batch_size=s.int("batch_size", 512, low=1),
        epochs=s.int("epochs", 1, low=1),
        max_iterations=s.int("max_iterations", 0, low=0),
        eval_every=s.int("eval_every", 0, low=0),
    )


def _checkpoint(s: _Section, name: str) -> CheckpointSection:
    directory = Path(s.get("dir", str, f"runs/{name}/checkpoints"))
    return CheckpointSection(
        dir=directory.resolve(),  # relative to the working directory, like runs/
        every=s.int("every", 0, low=0),
        restart=s.get("restart", bool, False),
        restart_alone=s.get("restart_alone", bool, True),
        journal_bytes=s.int("journal_mib", 1024, low=0) << 20,
        keep=s.int("keep", 2, low=0),
    )


def _export(s: _Section, name: str) -> ExportSection:
    every_s = s.get("every_s", float, 0.0)
    if every_s < 0 or every_s != every_s or every_s == float("inf"):
        raise ConfigError("export.every_s", f"must be a finite number >= 0, got {every_s}")
    return ExportSection(
        dir=Path(s.get("dir", str, f"runs/{name}/exports")).resolve(),  # relative to the working directory
        every_iterations=s.int("every_iterations", 0, low=0),
        every_s=every_s,
    )


ROLE_SECTIONS = ("data", "model", "optimizer")


def parse_spec(raw: dict[str, Any], source: Path) -> ClusterSpec:
    """Build a ClusterSpec from a parsed TOML document; `source` anchors relative paths."""
    document = copy.deepcopy(raw)
    raw = dict(raw)
    top = _Section({k: raw.pop(k) for k in ("name", "seed") if k in raw}, "spec")
    name = top.get("name", str, source.stem)
    seed = top.int("seed", 0, low=0)
    spec = ClusterSpec(
        name=name,
        seed=seed,
        source=source,
        cluster=_parse(raw, "cluster", lambda s: _cluster(s, source.parent)),
        oracle=_parse(raw, "oracle", _oracle),
        ps=_parse(raw, "ps", _ps),
        trainers=_parse(raw, "trainers", _trainers),
        train=_parse(raw, "train", _train),
        checkpoint=_parse(raw, "checkpoint", lambda s: _checkpoint(s, name)),
        export=_parse(raw, "export", lambda s: _export(s, name)),
        sections={key: _Section(raw.pop(key, {}), key).raw for key in ROLE_SECTIONS},
        document=document,
    )
    if raw:
        raise ConfigError(sorted(raw)[0], "unknown section")
    if spec.trainers.elastic and not spec.checkpoint.every:
        raise ConfigError("trainers.min_count", "an elastic job (min_count or max_count other than count) "
                                                "needs checkpoints: a change of trainers goes back to the "
                                                "latest complete one; set [checkpoint] every")
    if spec.export.enabled and not spec.checkpoint.every:
        raise ConfigError("export.every_iterations" if spec.export.every_iterations else "export.every_s",
                          "exports are taken at checkpoints: set [checkpoint] every")
    _check_batch_divides(spec.train.batch_size, spec.trainers.count)
    return spec


def _check_batch_divides(batch_size: int, trainers: int) -> None:
    """Each trainer takes an equal slice of the global batch."""
    if batch_size % trainers:
        raise ConfigError("train.batch_size", f"{batch_size} is not divisible by trainers.count = {trainers}")


def with_trainer_count(spec: ClusterSpec, count: int) -> ClusterSpec:
    """`spec` with `count` trainers (its document too, which joined roles are sent): the job
    an elastic regroup goes on with. ConfigError when `count` does not divide the batch."""
    _check_batch_divides(spec.train.batch_size, count)
    document = copy.deepcopy(spec.document)
    trainers_table = document.setdefault("trainers", {})
    trainers_table.update(count=count, min_count=spec.trainers.min_count, max_count=spec.trainers.max_count)
    trainers = dataclasses.replace(spec.trainers, count=count)
    return dataclasses.replace(spec, trainers=trainers, document=document)


def spec_toml(name: str, seed: int, sections: dict[str, dict[str, Any]]) -> str:
    """A spec file's text from plain values (for generated specs: benchmarks, tests)."""
    lines = [f"name = {_toml_value(name)}", f"seed = {seed}"]
    for section, values in sections.items():
        lines.append(f"\n[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: [cluster] tls = {cert = "...", ...}
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (int, float)):
        return repr(value)
    raise TypeError(f"cannot write {value!r} to TOML")


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a spec file; ConfigError names the file on a TOML syntax error."""
    path = Path(path).resolve()
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("spec", f"no such file: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("spec", f"{path}: {exc}") from None
    return parse_spec(raw, path)
