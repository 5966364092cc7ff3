from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from common.transport import ConnectionLimits
from common.transport.limits import EventWindow, Newcomers, TokenBucket


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
        auth_timeout_s=10.0, max_unauthenticated_connections=256,
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


# -- newcomers: connections that have not shown the token ----------------------------------
@given(
    st.lists(st.sampled_from(["arrive", "token", "leave"]), max_size=60),
    st.integers(1, 6), st.integers(1, 6),
)
def test_newcomers_never_keep_out_a_peer_while_one_without_the_token_holds_a_slot(
    steps: list[str], max_connections: int, budget: int
) -> None:
    """Against a model: a newcomer is refused only when every slot is a token holder's; past
    either bound the oldest newcomer goes; newcomers never exceed their budget."""
    limits = ConnectionLimits(max_connections=max_connections, max_unauthenticated_connections=budget)
    newcomers: Newcomers[int] = Newcomers(limits)
    waiting: list[int] = []  # oldest first
    trusted: set[int] = set()
    for n, step in enumerate(steps):
        if step == "arrive":
            keep, evicted = newcomers.arrive(n, len(waiting) + len(trusted))
            full = len(waiting) + len(trusted) >= max_connections or len(waiting) >= budget
            assert keep == (not full or bool(waiting))
            assert evicted == (waiting.pop(0) if full and waiting else None)
            if keep:
                waiting.append(n)
        elif waiting and step == "token":
            assert newcomers.showed_token(waiting[0]) and not newcomers.showed_token(waiting[0])
            trusted.add(waiting.pop(0))
        elif waiting:
            newcomers.left(waiting.pop())
        assert len(newcomers) == len(waiting) <= budget
        assert all(c in newcomers for c in waiting) and not any(c in newcomers for c in trusted)
