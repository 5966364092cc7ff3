from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from common.transport import ConnectionLimits
from common.transport.limits import EventWindow, TokenBucket


def test_trips_on_the_event_past_the_limit_within_the_window() -> None:
    window = EventWindow(limit=3, window_s=10.0)
    assert [window.hit(t) for t in (0.0, 1.0, 2.0)] == [False, False, False]
    assert window.hit(9.0)


def test_events_spread_wider_than_the_window_never_trip() -> None:
    window = EventWindow(limit=3, window_s=10.0)
    assert not any(window.hit(t * 4.0) for t in range(1_000))


@given(st.lists(st.floats(0.0, 100.0), max_size=60), st.integers(1, 8), st.floats(0.1, 20.0))
def test_agrees_with_counting_the_window(times: list[float], limit: int, window_s: float) -> None:
    window = EventWindow(limit, window_s)
    seen: list[float] = []
    for now in sorted(times):
        seen.append(now)
        inside = [t for t in seen if now - t <= window_s]
        assert window.hit(now) == (len(inside) > limit)


def test_production_defaults() -> None:
    assert ConnectionLimits() == ConnectionLimits(
        idle_timeout_s=300.0, max_connections=1024, max_concurrent_streams=256,
        max_resets=200, reset_window_s=10.0, unauthenticated_rate=200.0, unauthenticated_burst=200,
    )


def test_bucket_lets_a_burst_through_then_paces_to_the_rate() -> None:
    bucket = TokenBucket(rate=10.0, burst=3)
    assert [bucket.take(0.0) for _ in range(5)] == [0.0, 0.0, 0.0, 0.1, 0.2]
    assert bucket.take(0.3) == 0.0  # the debt of 2 is paid by 0.2 s, one token more by 0.3
    assert bucket.take(100.0) == 0.0 and bucket.take(100.0) == 0.0  # refilled to the burst only


@given(st.floats(0.5, 100.0), st.integers(1, 20), st.lists(st.floats(0.0, 0.5), max_size=80))
def test_a_sender_that_waits_as_told_keeps_to_the_rate(
    rate: float, burst: int, extra: list[float]
) -> None:
    """However late it sends, a sender that always waits as told never has more than burst +
    rate * T events in any window of T seconds, plus the one that overdrew the budget (it is
    answered; its sender waits after it)."""
    bucket, now, times = TokenBucket(rate, burst), 0.0, []
    for late in extra:
        now += late
        times.append(now)
        now += bucket.take(now)
    for i, start in enumerate(times):
        for j in range(i, len(times)):
            assert j - i + 1 <= burst + 1 + rate * (times[j] - start) + 1e-6
