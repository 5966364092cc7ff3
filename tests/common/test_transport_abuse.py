"""A real PS shard under each abuse of the hardening issues, both protocols, in clear and over
TLS: an authenticated fetch loop running meanwhile must stay fast, the server's memory flat,
and a newcomer with the token must always get in. The scenarios are bench/abuse.py's (server
and attacker in processes of their own; over TLS every peer speaks inside TLS sessions)."""

from __future__ import annotations

import pytest

from bench.abuse import ABUSES, H2_ONLY, measure
from common.transport import ConnectionLimits
from tests.tls_fixtures import TlsFiles

HELD_EXTRA = 8


@pytest.mark.slow
# Plaintext is nightly: in CI the TLS case runs the same servers' limits under the same abuse, and
# tests/bench/test_smoke.py runs bench/abuse.py in plaintext.
@pytest.mark.parametrize("security", [pytest.param("plain", marks=pytest.mark.nightly), "tls"])
def test_fetches_stay_fast_and_memory_flat_under_abuse(security: str, tls_files: TlsFiles) -> None:
    rows = measure(seconds=1.5, limits=ConnectionLimits(max_connections=64),
                   held_extra=HELD_EXTRA, tls_files=tls_files.section if security == "tls" else None)
    assert {(r.protocol, r.abuse) for r in rows} == {
        (p, a) for p in ("h2", "http1") for a in ABUSES if p == "h2" or a not in H2_ONLY
    }
    for r in rows:
        what = f"{r.protocol} {r.abuse}: {r}"
        assert r.fetches > 0, what
        assert r.p99_ms < 250, what  # generous: idle p99 is a few ms
        assert r.rss_peak_mb - r.rss_before_mb < 100, what
        assert r.newcomers > 0 and r.newcomers_refused == 0, what
        if r.abuse in ("rapid_reset", "continuation"):
            assert r.attack["goaway"] >= 1, what
        if r.abuse in ("held_connections", "idle_connections"):
            # Past the cap, the oldest connections without the token make room.
            assert r.attack["closed_by_server"] >= HELD_EXTRA, what
        if r.abuse == "unauth_bodies":
            assert r.attack["uploads_refused"] >= 1, what
