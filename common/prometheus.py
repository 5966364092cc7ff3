"""A small metrics registry rendered as Prometheus text (exposition format 0.0.4).

Counters and gauges keyed by name and label set; summaries keep sum and count. A service
owns one `Registry` and passes it to what it instruments: no module-level globals.

A registry is not thread-safe: one thread (a service's event loop) records into it and
renders it. What another thread counts (the oracle's planner, a trainer's training loop)
it keeps in its own plain fields, and the scrape handler copies them in (`set_total`,
`set`) just before `render`.
"""

from __future__ import annotations

import asyncio

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]


def _labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


def _fmt_labels(labels: Labels, extra: Iterable[tuple[str, str]] = ()) -> str:
    items = [*labels, *extra]
    if not items:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in items)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(items, escaped)) + "}"


class Counter:
    """One counter of a `Registry` (a name and a label set)."""

    __slots__ = ("_cell",)

    def __init__(self, cell: list[float]) -> None:
        self._cell = cell

    def inc(self, amount: float = 1.0) -> None:
        self._cell[0] += amount


@dataclass
class _Family:
    name: str
    kind: str  # "counter" | "gauge" | "summary"
    help: str
    values: dict[Labels, list[float]] = field(default_factory=dict)


class Registry:
    """Named metric families; `render()` gives the Prometheus text page."""

    def __init__(self, prefix: str = "bagpipe") -> None:
        self._prefix = prefix
        self._families: dict[str, _Family] = {}

    def _family(self, name: str, kind: str, help: str) -> _Family:
        full = f"{self._prefix}_{name}"
        fam = self._families.get(full)
        if fam is None:
            fam = self._families[full] = _Family(full, kind, help)
        elif fam.kind != kind:
            raise ValueError(f"metric {full} is a {fam.kind}, not a {kind}")
        return fam

    def _counter_cell(self, name: str, labels: dict[str, str] | None, help: str) -> list[float]:
        return self._family(name, "counter", help).values.setdefault(_labels(labels), [0.0])

    def inc(self, name: str, amount: float = 1.0, labels: dict[str, str] | None = None, help: str = "") -> None:
        self._counter_cell(name, labels, help)[0] += amount

    def counter(self, name: str, labels: dict[str, str] | None = None, help: str = "") -> Counter:
        """The counter `name` with `labels`, to count into without looking it up each time
        (a request path counting per request)."""
        return Counter(self._counter_cell(name, labels, help))

    def set_total(self, name: str, total: float, labels: dict[str, str] | None = None, help: str = "") -> None:
        """A counter whose running total is kept elsewhere: set it to `total`."""
        self._counter_cell(name, labels, help)[0] = float(total)

    def set(self, name: str, value: float, labels: dict[str, str] | None = None, help: str = "") -> None:
        self._family(name, "gauge", help).values[_labels(labels)] = [float(value)]

    def observe(self, name: str, value: float, labels: dict[str, str] | None = None, help: str = "") -> None:
        cell = self._family(name, "summary", help).values.setdefault(_labels(labels), [0.0, 0.0])
        cell[0] += value
        cell[1] += 1

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value (a summary's sum); 0 if never recorded."""
        fam = self._families.get(f"{self._prefix}_{name}")
        cell = fam.values.get(_labels(labels)) if fam else None
        return cell[0] if cell else 0.0

    def render(self) -> str:
        lines: list[str] = []
        for fam in self._families.values():
            if fam.help:
                lines.append(f"# HELP {fam.name} {fam.help}")
            lines.append(f"# TYPE {fam.name} {fam.kind}")
            for labels, cell in fam.values.items():
                if fam.kind == "summary":
                    lines.append(f"{fam.name}_sum{_fmt_labels(labels)} {cell[0]:.9g}")
                    lines.append(f"{fam.name}_count{_fmt_labels(labels)} {int(cell[1])}")
                else:
                    lines.append(f"{fam.name}{_fmt_labels(labels)} {_fmt_value(cell[0])}")
        return "\n".join(lines) + "\n"


def _fmt_value(value: float) -> str:
    # The exposition format spells the special values NaN, +Inf and -Inf.
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.17g}"


class FinalScrape:
    """A service's last metrics page: once its work is `finish`ed, the next scrape `read`s
    the final figures, and a role that lingers for it (`[cluster] metrics_linger_s`) can
    `wait` for that scrape before it exits (a batch job otherwise ends between two)."""

    def __init__(self) -> None:
        self._finished = False
        self._read = asyncio.Event()

    def finish(self) -> None:
        self._finished = True

    def scraped(self) -> None:
        """Call after rendering a page."""
        if self._finished:
            self._read.set()

    async def wait(self, timeout_s: float) -> bool:
        """Whether a scrape read the final page within `timeout_s`."""
        try:
            await asyncio.wait_for(self._read.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
