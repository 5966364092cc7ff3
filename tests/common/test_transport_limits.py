from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from common.transport import ConnectionLimits
from common.transport.limits import EventWindow


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
        max_resets=200, reset_window_s=10.0,
    )
