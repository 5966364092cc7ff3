"""Synthetic Criteo-like click data of any length, skewed like the real set, from a seed.

Popularity: in table t, rank r (0 = hottest) is drawn from a continuous power law on
``[1, n_t + 1)`` floored to an integer, density ∝ x^-α_t. The exponents are calibrated
numerically: every table gets the α_t that gives its own top 1% of rows a common share c,
and c is solved for so that the top 1% of *all* rows (across tables) receives `top1_share`
of all accesses (0.92 by default, the published Criteo figure). Ranks become rows through a
seeded affine permutation of each table, so hot rows are spread over the key space.

Drift: the hot set slides through the ranks; `drift` is the fraction of each table's top-1%
set replaced per million samples. Labels: Bernoulli(sigmoid(z)), z = a few stable per-row
effects + a linear function of the dense features + a bias calibrated to `click_rate`.

Rows come in chunks of `CHUNK_ROWS`; chunk i is a function of (seed, i) alone, so any range
is produced without generating what precedes it. `write_synthetic` stores them as a
preprocessed directory, which trains on the same rows without generating them again.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from common.data.hashing import mix64
from common.data.preprocessed import Manifest, Writer
from common.data.spec import DataSpec
from common.errors import ConfigError
from common.numba_cache import cache_root

CHUNK_ROWS = 1 << 16
GENERATOR_VERSION = 1
TOP_FRACTION = 0.01
_EFFECT_TABLES = 6  # tables that carry a per-row effect on the click probability


def _mass(x: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """∫_1^x t^-α dt with β = 1 - α (log x where β is 0)."""
    lx = np.log(x)
    safe = np.where(beta == 0, 1.0, beta)
    return np.where(beta == 0, lx, np.expm1(beta * lx) / safe)


def top_share_table(size: np.ndarray, alpha: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Share of a table's accesses that go to its `k` hottest rows."""
    beta = 1.0 - alpha
    return _mass(k + 1.0, beta) / _mass(size + 1.0, beta)


def _exponents_for_share(sizes: np.ndarray, share: float) -> np.ndarray:
    """Per table, the α >= 0 whose top 1% of rows (at least one row) gets `share`."""
    k = np.maximum(1.0, np.round(TOP_FRACTION * sizes))
    lo, hi = np.zeros(len(sizes)), np.full(len(sizes), 30.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        low = top_share_table(sizes, mid, k) < share
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return hi


def overall_top_share(sizes: np.ndarray, alphas: np.ndarray, fraction: float = TOP_FRACTION) -> float:
    """Expected share of all accesses received by the hottest `fraction` of all rows.

    Every sample reads one row per table. The hottest rows overall are found by lowering a
    probability threshold until `fraction` of all rows are above it (water-filling).
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    beta = 1.0 - alphas
    z = _mass(sizes + 1.0, beta)
    target = max(1.0, round(fraction * sizes.sum()))
    steps = int(math.log2(sizes.max() + 1)) + 2

    def count_above(tau: float) -> np.ndarray:
        lo, hi = np.zeros(len(sizes)), sizes.copy()  # count in [lo, hi]
        for _ in range(steps):
            mid = np.floor((lo + hi) / 2)
            p = (_mass(mid + 2.0, beta) - _mass(mid + 1.0, beta)) / z  # rank `mid`
            above = p >= tau
            active = lo < hi
            lo = np.where(active & above, mid + 1, lo)
            hi = np.where(active & ~above, mid, hi)
        return lo

    lo_log, hi_log = -745.0, 0.0
    for _ in range(50):
        mid = (lo_log + hi_log) / 2
        if count_above(math.exp(mid)).sum() > target:
            lo_log = mid
        else:
            hi_log = mid
    counts = count_above(math.exp(hi_log))
    # Rows tied at the threshold fill the remainder (matters for uniform tables).
    next_p = np.where(counts < sizes, (_mass(counts + 2.0, beta) - _mass(counts + 1.0, beta)) / z, 0.0)
    share = top_share_table(sizes, alphas, counts).sum() + (target - counts.sum()) * next_p.max()
    return float(share / len(sizes))


@functools.lru_cache(maxsize=16)
def calibrate_exponents(sizes: tuple[int, ...], target: float) -> np.ndarray:
    """Per-table exponents whose overall top-1% share is `target` (bisection on the common
    per-table share). Cached, also on disk (`_calibration_file`): it takes about 0.3
    CPU-seconds, and every role of every run on the same data would repeat it."""
    path = _calibration_file(sizes, target)
    try:
        alphas = np.load(path, allow_pickle=False)
        if alphas.shape != (len(sizes),) or alphas.dtype != np.float64:
            raise ValueError(f"{path} holds {alphas.dtype} {alphas.shape}")
    except (OSError, ValueError):
        alphas = _calibrate(sizes, target)
        _save_whole(path, alphas)
    alphas.flags.writeable = False
    return alphas


def _calibration_file(sizes: tuple[int, ...], target: float) -> Path:
    """Where the exponents of (`sizes`, `target`) are kept: named by a hash of them and of
    this module's source, so that a file is only ever read by the code that wrote it."""
    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(repr((tuple(int(s) for s in sizes), float(target))).encode())
    return cache_root(os.environ) / "synthetic" / f"exponents-{key.hexdigest()[:32]}.npy"


def _save_whole(path: Path, alphas: np.ndarray) -> None:
    """Best effort (a read-only home computes them again): written aside, then renamed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{os.getpid()}")
        with open(aside, "wb") as out:
            np.save(out, alphas, allow_pickle=False)
        os.replace(aside, path)
    except OSError:
        pass


def _calibrate(sizes: tuple[int, ...], target: float) -> np.ndarray:
    n = np.asarray(sizes, dtype=np.float64)
    floor = overall_top_share(n, np.zeros(len(n)))
    if target <= floor:
        raise ConfigError("data.top1_share", f"must be above {floor:.3f}, the share of uniform "
                          "popularity with these table sizes")  # fmt: skip
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(24):
        mid = (lo + hi) / 2
        if overall_top_share(n, _exponents_for_share(n, mid)) < target:
            lo = mid
        else:
            hi = mid
    return _exponents_for_share(n, (lo + hi) / 2)


def _sample_ranks(u: np.ndarray, size: int, alpha: float) -> np.ndarray:
    """Inverse CDF of the floored power law: uniform [0, 1) → rank in [0, size)."""
    beta = 1.0 - alpha
    z = float(_mass(np.array(size + 1.0), np.array(beta)))
    x = np.exp(u * z) if beta == 0 else np.exp(np.log1p(beta * u * z) / beta)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, size - 1)


@dataclass(frozen=True, kw_only=True)
class _Table:
    size: int
    alpha: float
    mult: int  # rank → row permutation: (mult * rank + add) % size, gcd(mult, size) = 1
    add: int
    hot: int  # rows in the top 1%, the unit of drift


def _tables(spec: DataSpec) -> tuple[_Table, ...]:
    alphas = calibrate_exponents(spec.table_sizes, spec.top1_share)
    rng = np.random.default_rng([spec.seed, GENERATOR_VERSION, 1])
    tables = []
    for size, alpha in zip(spec.table_sizes, alphas, strict=True):
        mult = int(rng.integers(1, max(size, 2)))
        while math.gcd(mult, size) != 1:
            mult += 1
        hot = max(1, round(TOP_FRACTION * size))
        tables.append(_Table(size=size, alpha=float(alpha), mult=mult, add=int(rng.integers(0, size)), hot=hot))
    return tuple(tables)


@dataclass(frozen=True, kw_only=True)
class Rows:
    """A range of rows: labels float32 [n], dense float32 [n, D], sparse int64 [n, F]."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray


@dataclass(frozen=True)
class SyntheticGenerator:
    """Deterministic generator for one synthetic `DataSpec` (format "synthetic")."""

    spec: DataSpec
    tables: tuple[_Table, ...] = field(init=False, repr=False)
    _dense_mu: np.ndarray = field(init=False, repr=False)
    _dense_sigma: np.ndarray = field(init=False, repr=False)
    _dense_weight: np.ndarray = field(init=False, repr=False)
    _bias: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", _tables(self.spec))
        rng = np.random.default_rng([self.spec.seed, GENERATOR_VERSION, 2])
        d = self.spec.num_dense
        object.__setattr__(self, "_dense_mu", rng.uniform(0.0, 4.0, d))
        object.__setattr__(self, "_dense_sigma", rng.uniform(0.5, 1.5, d))
        object.__setattr__(self, "_dense_weight", rng.normal(0.0, 0.3, d))
        object.__setattr__(self, "_bias", 0.0)
        object.__setattr__(self, "_bias", self._calibrate_bias())

    @property
    def num_rows(self) -> int:
        return self.spec.rows

    def chunk(self, i: int) -> Rows:
        """Rows ``[i * CHUNK_ROWS, min((i + 1) * CHUNK_ROWS, rows))``."""
        return self._generate(i, max(0, min(CHUNK_ROWS, self.spec.rows - i * CHUNK_ROWS)))

    def _generate(self, i: int, n: int) -> Rows:
        start = i * CHUNK_ROWS
        rng = np.random.default_rng([self.spec.seed, GENERATOR_VERSION, 3, i])
        sparse = np.empty((n, len(self.tables)), dtype=np.int64)
        for t, table in enumerate(self.tables):
            rank = _sample_ranks(rng.random(n), table.size, table.alpha)
            shift = int(self.spec.drift * table.hot * start / 1e6) % table.size
            sparse[:, t] = (table.mult * ((rank + shift) % table.size) + table.add) % table.size
        raw = np.floor(np.exp(self._dense_mu + self._dense_sigma * rng.standard_normal((n, self.spec.num_dense))))
        missing = rng.random(raw.shape) < 0.1
        dense = np.log1p(np.where(missing, 0.0, raw - 1.0).clip(0.0)).astype(np.float32)
        logits = self.logits(dense, sparse)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return Rows(labels=labels, dense=dense, sparse=sparse)

    def rows(self, start: int, stop: int) -> Rows:
        """Rows ``[start, stop)`` (clipped to the data set), generating only the chunks needed."""
        stop = min(stop, self.spec.rows)
        parts = [self.chunk(i) for i in range(start // CHUNK_ROWS, -(-stop // CHUNK_ROWS))]
        if not parts:
            return Rows(labels=np.empty(0, np.float32), dense=np.empty((0, self.spec.num_dense), np.float32),
                        sparse=np.empty((0, len(self.tables)), np.int64))  # fmt: skip
        first = (start // CHUNK_ROWS) * CHUNK_ROWS
        cut = slice(start - first, stop - first)
        return Rows(**{k: np.concatenate([getattr(p, k) for p in parts])[cut] for k in ("labels", "dense", "sparse")})

    def logits(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """The click log-odds the labels are drawn from (what a perfect model would learn)."""
        z = np.full(len(sparse), self._bias)
        for t in range(0, len(self.tables), max(1, len(self.tables) // _EFFECT_TABLES)):
            salt = np.uint64(((self.spec.seed << 8) + t + 1) % 2**64)
            unit = (mix64(sparse[:, t].astype(np.uint64) ^ mix64(np.array([salt]))) >> np.uint64(11)) * 2.0**-53
            z += 0.6 * math.sqrt(3.0) * (2.0 * unit - 1.0)  # uniform, standard deviation 0.6
        centred = (dense - np.log1p(np.exp(self._dense_mu))) / (self._dense_sigma + 1.0)
        return z + centred @ self._dense_weight

    def _calibrate_bias(self) -> float:
        """Bias that makes the mean click probability `click_rate` on chunk 0 (deterministic)."""
        sample = self._generate(0, CHUNK_ROWS)
        z = self.logits(sample.dense, sample.sparse)
        lo, hi = -20.0, 20.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(z + mid)))) < self.spec.click_rate:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


def synthetic_config(spec: DataSpec) -> dict[str, Any]:
    """What decides a synthetic data set's rows: a preprocessed copy's manifest records it."""
    keys = ("seed", "rows", "top1_share", "drift", "click_rate", "num_dense")
    return {"format": "synthetic", "table_sizes": list(spec.table_sizes), **{k: getattr(spec, k) for k in keys}}


def write_synthetic(spec: DataSpec, out: Path, *, progress: bool = False) -> Manifest:
    """Write every row of synthetic `spec` to the preprocessed directory `out`."""
    gen = SyntheticGenerator(spec)
    chunks: Iterable[int] = range(-(-spec.rows // CHUNK_ROWS))
    if progress:
        chunks = tqdm(chunks, desc="synth", unit="chunk")
    with Writer(out, num_dense=spec.num_dense, table_sizes=spec.table_sizes) as writer:
        for i in chunks:
            rows = gen.chunk(i)
            writer.append(rows.labels, rows.dense, rows.sparse)
        return writer.commit(config=synthetic_config(spec), source={"generator": GENERATOR_VERSION})
