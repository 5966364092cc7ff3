"""A strict reader of the Prometheus text exposition format (0.0.4), for tests: every
sample must belong to a family declared by a TYPE line before it, and parse as a float."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_KINDS = {"counter", "gauge", "summary", "histogram", "untyped"}

Key = tuple[str, frozenset[tuple[str, str]]]


@dataclass(frozen=True)
class Scrape:
    kinds: dict[str, str]  # family -> TYPE
    samples: dict[Key, float]

    def value(self, name: str, **labels: str) -> float:
        """The sample `name` with exactly these labels; KeyError naming it if absent."""
        key = (name, frozenset(labels.items()))
        if key not in self.samples:
            raise KeyError(f"no sample {name}{labels or ''} in the scrape")
        return self.samples[key]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Every sample of `name`, keyed by its value of `label`."""
        return {dict(labels)[label]: v for (n, labels), v in self.samples.items() if n == name}


def parse(text: str) -> Scrape:
    kinds: dict[str, str] = {}
    samples: dict[Key, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or not line:
            continue
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            assert kind in _KINDS and family not in kinds, line
            kinds[family] = kind
            continue
        sample = _SAMPLE.fullmatch(line)
        assert sample is not None, f"not a sample line: {line!r}"
        name = sample["name"]
        family = re.sub(r"_(sum|count)$", "", name) if name not in kinds else name
        assert family in kinds, f"{name} has no TYPE line before it"
        labels = frozenset(_LABEL.findall(sample["labels"] or ""))
        key = (name, labels)
        assert key not in samples, f"{line!r} repeats a sample"
        samples[key] = float(sample["value"])
    return Scrape(kinds, samples)
