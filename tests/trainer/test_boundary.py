"""The boundary protocol object on its own: hand-made directives in, actions out.

The planner simulator (tests/oracle/simulator.py) executes these actions on thousands of
generated plans; these cases pin the bookkeeping one rule at a time.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.directive import Directive
from trainer import boundary
from trainer.boundary import (
    ApplySyncLater,
    Boundary,
    CheckpointsWritten,
    InsertFetched,
    IssueFetches,
    LaunchSyncLater,
    Leave,
    ReadJoinSources,
    SyncNow,
    Train,
    UpdateAlone,
    WaitWrites,
    WriteJoins,
)

I32, I64 = np.int32, np.int64


@pytest.fixture(autouse=True, params=["table", "sorted"])
def slot_lookup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every case twice: with the slots an iteration reads found through a table over the
    cache's slots (a cache much smaller than the tables) and by sorting (`local` mode, where
    the cache is every row); both must give the same actions."""
    per_input = 1 << 30 if request.param == "table" else 0
    monkeypatch.setattr(boundary, "_TABLE_PER_INPUT", per_input)
    return request.param


def directive(x: int, *, inputs: list[list[int]], checkpoint: bool = False, **arrays: list[int]) -> Directive:
    """A directive of trainer 0 at iteration x; arrays not given are empty."""
    dtypes = {**dict.fromkeys(Directive._INT32, I32), **dict.fromkeys(Directive._INT64, I64), "write_flush": np.uint8}
    values = {name: np.zeros(0, dtype) for name, dtype in dtypes.items()}
    for name, value in arrays.items():
        values[name] = np.asarray(value, dtypes[name])
    if "write_keys" in arrays and "write_flush" not in arrays:
        values["write_flush"] = np.zeros(len(arrays["write_keys"]), np.uint8)
    return Directive(iteration=x, trainer=0, input_slots=np.asarray(inputs, I32), checkpoint=checkpoint, **values)


def of(actions: list, kind: type) -> object:
    (found,) = [a for a in actions if isinstance(a, kind)]
    return found


def test_every_plan_is_the_same_sequence_of_steps_in_design_order() -> None:
    b = Boundary()
    first = b.plan(directive(0, inputs=[[0, 1]]))
    second = b.plan(directive(1, inputs=[[1, 0]]))
    order = [IssueFetches, WaitWrites, ApplySyncLater, CheckpointsWritten, ReadJoinSources, Leave,
             WriteJoins, InsertFetched, Train, SyncNow, UpdateAlone, LaunchSyncLater]
    assert [type(a) for a in first] == [type(a) for a in second] == order


def test_fetches_are_grouped_by_target_and_inserted_at_their_target() -> None:
    b = Boundary()
    d0 = directive(0, inputs=[[0]], prefetch_keys=[5, 9, 7], prefetch_slots=[0, 2, 1],
                   prefetch_min_versions=[-1, 3, -1], prefetch_targets=[0, 2, 2])
    actions = b.plan(d0)
    groups = of(actions, IssueFetches).groups
    assert [(g.target, g.keys.tolist(), g.slots.tolist()) for g in groups] == [(0, [5], [0]), (2, [9, 7], [2, 1])]
    assert of(actions, InsertFetched).slots.tolist() == [0]
    assert of(b.plan(directive(1, inputs=[[0]])), InsertFetched).slots.tolist() == []
    assert of(b.plan(directive(2, inputs=[[1, 2]])), InsertFetched).slots.tolist() == [2, 1]


def test_hits_count_used_rows_resident_before_the_boundary() -> None:
    b = Boundary()
    b.plan(directive(0, inputs=[[0]], prefetch_keys=[5], prefetch_slots=[0], prefetch_min_versions=[-1], prefetch_targets=[0]))
    d1 = directive(1, inputs=[[0, 1], [2, 0]], prefetch_keys=[6], prefetch_slots=[1], prefetch_min_versions=[-1],
                   prefetch_targets=[1], join_keys=[8], join_send_slots=[-1], join_recv_slots=[2])
    train = of(b.plan(d1), Train)
    assert train.used.tolist() == [0, 1, 2]
    assert train.used[train.inverse].tolist() == [[0, 1], [2, 0]]
    assert train.hits == 1  # slot 0 only: 1 was fetched and 2 joined at this boundary


def test_a_writer_in_sync_later_holds_its_row_until_the_update_two_boundaries_on() -> None:
    b = Boundary()
    d0 = directive(0, inputs=[[0, 1]], sync_later_keys=[10, 11], sync_later_slots=[0, 1],
                   leave_slots=[1], write_keys=[11], write_slots=[1])
    end = b.plan(d0)
    launch = of(end, LaunchSyncLater)
    assert launch.positions.tolist() == [0, 1]
    assert of(end, UpdateAlone).slots.tolist() == []  # both used keys are synchronised
    leave = of(b.plan(directive(1, inputs=[[0]])), Leave)
    assert (leave.iteration, leave.keys.tolist(), leave.hold.tolist(), leave.flush.tolist()) == (0, [11], [True], [False])
    apply = of(b.plan(directive(2, inputs=[[0]])), ApplySyncLater)
    assert apply.iteration == 0
    assert apply.slots.tolist() == [0] and apply.positions.tolist() == [0]  # the copy that stays
    assert apply.held_keys.tolist() == [11] and apply.held_positions.tolist() == [1]


def test_a_write_marked_as_a_flush_is_sent_as_one_and_reported_once_sent() -> None:
    b = Boundary()
    b.plan(directive(0, inputs=[[0]], write_keys=[4], write_slots=[0], write_flush=[1], checkpoint=True))
    actions = b.plan(directive(1, inputs=[[0]]))
    leave = of(actions, Leave)
    assert leave.flush.tolist() == [True] and leave.hold.tolist() == [False]
    assert of(actions, CheckpointsWritten).iterations == ()
    assert of(b.plan(directive(2, inputs=[[0]])), CheckpointsWritten).iterations == (0,)


def test_a_flush_whose_copy_leaves_is_still_a_flush_held_for_sync_later() -> None:
    # Checkpoint 0's flush written by a copy that leaves after 0 while another trainer keeps
    # the row: that trainer's own write of a later version may reach the PS first, so this
    # one must travel as a flush (the PS takes a late flush into its checkpoint alone).
    b = Boundary()
    b.plan(directive(0, inputs=[[0]], sync_later_keys=[4], sync_later_slots=[0], leave_slots=[0],
                     write_keys=[4], write_slots=[0], write_flush=[1], checkpoint=True))
    leave = of(b.plan(directive(1, inputs=[[1]])), Leave)
    assert (leave.flush.tolist(), leave.hold.tolist(), leave.freed.tolist()) == ([True], [True], [0])
    apply = of(b.plan(directive(2, inputs=[[1]])), ApplySyncLater)
    assert apply.held_keys.tolist() == [4] and apply.held_flush.tolist() == [True]


def test_sync_positions_point_into_the_used_rows_or_minus_one() -> None:
    b = Boundary()
    d = directive(0, inputs=[[3, 1]], sync_now_keys=[7, 8, 9], sync_now_slots=[1, -1, 5])
    actions = b.plan(d)
    assert of(actions, SyncNow).positions.tolist() == [0, -1, -1]  # used = [1, 3]; slot 5 unused
    alone = of(actions, UpdateAlone)
    assert alone.slots.tolist() == [3] and alone.positions.tolist() == [1]


def test_drain_sends_everything_held_and_refuses_unused_fetches() -> None:
    b = Boundary()
    b.plan(directive(0, inputs=[[0]], sync_later_keys=[10], sync_later_slots=[0], leave_slots=[0],
                     write_keys=[10], write_slots=[0], checkpoint=True))
    kinds = [(type(a).__name__, getattr(a, "iteration", None)) for a in b.drain()]
    assert kinds == [("ApplySyncLater", -1), ("Leave", 0), ("ApplySyncLater", 0), ("CheckpointsWritten", None)]
    early = Boundary()
    early.plan(directive(0, inputs=[[0]], prefetch_keys=[5], prefetch_slots=[1], prefetch_min_versions=[-1], prefetch_targets=[3]))
    with pytest.raises(ValueError, match="never used"):
        early.drain()


def test_directives_must_come_in_order() -> None:
    b = Boundary()
    b.plan(directive(4, inputs=[[0]]))
    with pytest.raises(ValueError, match="directive 6 after directive 4"):
        b.plan(directive(6, inputs=[[0]]))


def test_an_input_without_a_slot_is_refused_before_anything_reads_it() -> None:
    """The table of used slots is indexed by the inputs' slots (trainer.kernels.used_slots
    does not check its bounds): a negative one must not reach it."""
    with pytest.raises(ValueError, match="directive 0: an input without a slot"):
        Boundary().plan(directive(0, inputs=[[0, -1]]))
