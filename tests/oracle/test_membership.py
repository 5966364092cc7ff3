"""`oracle.membership`: when an elastic job regroups, how long it waits, and the terms it
forms (the real-process run is tests/test_elastic.py)."""

from __future__ import annotations

import time

import pytest

from common.spec import Endpoint
from oracle.coordinator_service import HeldTrainers
from oracle.membership import MAX_REGROUPS_WITHOUT_PROGRESS, Candidate, Membership, RegroupFailed
from oracle.protocol import Registration


def _membership(trainers: int = 2, min_count: int = 1, max_count: int = 3, batch: int = 12) -> Membership:
    return Membership(trainers=trainers, min_count=min_count, max_count=max_count, batch_size=batch,
                      rejoin_timeout_s=2.0)


def test_a_trainer_unheard_of_for_the_rejoin_timeout_is_silent_unless_it_finished() -> None:
    m = _membership()
    m.heard(0, 0.0)
    m.heard(1, 0.0)
    m.heard(0, 1.5)
    assert m.silent(1.9) == []
    assert m.silent(2.0) == [1]
    m.finished(1)
    assert m.silent(10.0) == [0]


def test_a_regroup_waits_for_the_trainers_that_were_there_then_goes_on_without_the_gone() -> None:
    m = _membership()
    m.heard(0, 0.0)
    m.heard(1, 0.0)
    m.begin("trainer 1 could not go on", resume_from=11, now=0.0)
    m.add(Candidate(key=0, last_term=0, last_index=0))
    assert m.decide(1.0) is None  # trainer 1 may still come back
    decision = m.decide(2.0)
    assert decision is not None
    assert (decision.term.number, decision.term.trainers, decision.term.resumed_from) == (1, 1, 11)
    assert decision.indices == {0: 0}
    assert decision.change.first_iteration == 12 and decision.change.seconds == 2.0


def test_a_regroup_ends_as_soon_as_every_trainer_not_known_gone_is_back() -> None:
    m = _membership()
    m.begin("trainer 0 unheard of", resume_from=5, now=0.0, gone=(0,))
    m.add(Candidate(key=3, last_term=0, last_index=1))
    decision = m.decide(0.1)
    assert decision is not None and decision.term.trainers == 1 and decision.indices == {3: 0}


def test_trainers_of_the_old_term_keep_their_order_and_newcomers_follow_up_to_max_count() -> None:
    m = _membership(trainers=2, max_count=3)
    m.add(Candidate(key=0))  # a spare, registered while the term ran
    m.add(Candidate(key=1))
    assert m.wants_to_grow()
    m.begin("2 trainer(s) wait to join", resume_from=17, now=0.0)
    m.add(Candidate(key=2, last_term=0, last_index=1))
    m.add(Candidate(key=3, last_term=0, last_index=0))
    decision = m.decide(0.2)
    assert decision is not None and decision.term.trainers == 3
    assert decision.indices == {3: 0, 2: 1, 0: 2}
    assert [c.key for c in m.waiting] == [1]  # a spare for a later regroup
    assert not m.wants_to_grow()  # at max_count


@pytest.mark.parametrize(("available", "want"), [(5, 4), (4, 4), (3, 3), (2, 2), (1, 1)])
def test_the_count_is_the_most_trainers_that_divide_the_batch(available: int, want: int) -> None:
    assert _membership(max_count=4, batch=12).count_for(available) == want


def test_with_fewer_than_min_count_back_it_waits_for_newcomers_then_fails() -> None:
    m = _membership(trainers=3, min_count=2, max_count=3)
    m.give_up_s = 10.0
    m.begin("trainer 2 unheard of", resume_from=None, now=0.0, gone=(2,))
    m.add(Candidate(key=0, last_term=0, last_index=0))
    assert m.decide(5.0) is None  # trainer 1 is gone by now: one trainer, below min_count
    m.add(Candidate(key=1))  # a newcomer makes two
    decision = m.decide(6.0)
    assert decision is not None and decision.term.trainers == 2 and decision.indices == {0: 0, 1: 1}
    m.begin("trainer 1 could not go on", resume_from=None, now=20.0)
    m.add(Candidate(key=2, last_term=1, last_index=0))
    assert m.decide(29.0) is None
    with pytest.raises(RegroupFailed, match="1 trainer\\(s\\) registered within 10 s .* fewer than trainers.min_count = 2"):
        m.decide(30.0)


def test_a_trainer_is_gone_once_unheard_of_for_the_rejoin_timeout_from_its_last_word() -> None:
    m = _membership()
    m.heard(0, 0.0)
    m.heard(1, 0.0)
    m.begin("trainer 0 could not go on", resume_from=3, now=1.0)
    m.heard(1, 1.5)  # still alive, told to start again
    m.add(Candidate(key=0, last_term=0, last_index=0))
    assert m.decide(3.0) is None  # trainer 1 may be starting again
    decision = m.decide(3.5)  # unheard of for 2 s: gone
    assert decision is not None and decision.term.trainers == 1


def test_terms_that_end_again_and_again_before_their_next_checkpoint_stop_the_job() -> None:
    m = _membership()
    for round_ in range(MAX_REGROUPS_WITHOUT_PROGRESS):
        m.begin("a collective failed", resume_from=11, now=float(round_))
        m.add(Candidate(key=round_, last_term=m.term.number, last_index=0))
        m.add(Candidate(key=100 + round_, last_term=m.term.number, last_index=1))
        assert m.decide(float(round_)) is not None
    with pytest.raises(RegroupFailed, match="in a row ended before the checkpoint after 11"):
        m.begin("a collective failed", resume_from=11, now=9.0)


async def test_a_held_trainer_that_asks_again_is_the_same_candidate_and_gets_the_index_it_was_given() -> None:
    held = HeldTrainers()
    reg = Registration(role="trainer", address=Endpoint(host="10.0.0.3", port=0), nonce="n1")
    key, placed, fresh = held.ask(reg)
    assert fresh
    held.asked(key)  # its hold ran out before the decision...
    held.place({key: 1})  # ...which took it
    again, placed_again, fresh_again = held.ask(reg)
    assert (again, fresh_again, await placed_again) == (key, False, 1)
    other, _, _ = held.ask(Registration(role="trainer", address=Endpoint(host="10.0.0.4", port=0), nonce="n2"))
    assert other != key
    held.asked(other)
    assert held.stale(time.monotonic() + HeldTrainers.STALE_S) == [other]  # it stopped asking: gone


def test_a_trainer_told_to_start_again_is_waited_for_longer_than_the_rejoin_timeout() -> None:
    m = _membership()
    m.give_up_s = 30.0
    m.heard(0, 0.0)
    m.heard(1, 0.0)
    m.begin("trainer 1 could not go on", resume_from=5, now=0.0)
    m.told(1)  # its new process takes a while to register
    assert m.decide(10.0) is None  # trainer 0, never heard since, is gone; trainer 1 is not
    m.add(Candidate(key=0, last_term=0, last_index=1))
    decision = m.decide(12.0)
    assert decision is not None and decision.term.trainers == 1 and decision.indices == {0: 0}
