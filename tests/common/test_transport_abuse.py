"""A real PS shard under each abuse of the hardening issue, both protocols: an authenticated
fetch loop running meanwhile must stay fast and the server's memory flat. The scenarios are
bench/abuse.py's (server and attacker in processes of their own)."""

from __future__ import annotations

import pytest

from bench.abuse import ABUSES, measure
from common.transport import ConnectionLimits

HELD_EXTRA = 8


@pytest.mark.slow
def test_fetches_stay_fast_and_memory_flat_under_abuse() -> None:
    rows = measure(seconds=1.5, limits=ConnectionLimits(max_connections=64),
                   held_extra=HELD_EXTRA)
    assert {(r.protocol, r.abuse) for r in rows} == {
        (p, a) for p in ("h2", "http1") for a in ABUSES if (p, a) != ("http1", "rapid_reset")
    }
    for r in rows:
        what = f"{r.protocol} {r.abuse}: {r}"
        assert r.fetches > 0, what
        assert r.p99_ms < 250, what  # generous: idle p99 is a few ms
        assert r.rss_peak_mb - r.rss_before_mb < 100, what
        if r.abuse == "rapid_reset":
            assert r.attack["goaway"] >= 1, what
        if r.abuse == "held_connections":
            # The cap holds the fetch client's connection and the attacker's up to it.
            assert r.attack["closed_by_server"] == HELD_EXTRA + 1, what
        if r.abuse == "unauth_bodies":
            assert r.attack["uploads_refused"] >= 1, what
