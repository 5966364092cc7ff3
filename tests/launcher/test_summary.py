"""A run's summary from its records (`launcher.summary`): every figure against the hand
computation, the errors, and the summary's JSON (``report.json``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import orjson
import pytest

from launcher.summary import ReportError, RunSummary, breakdown_ms, iteration_series, summarise, write_report
from launcher.text import format_summary
from tests.launcher.factories import eval_rec, it_rec, two_trainer_run
from trainer.records import CheckpointRecord, FinalRecord, IterationRecord, Record
from trainer.timing import PHASES


def test_summary_figures_match_hand_computation() -> None:
    s = summarise(two_trainer_run(), mode="bagpipe", global_batch=160, warmup=1, loss_window=2)
    # end of an iteration = the slower trainer: 10.1, 10.5, 11.2, 12.0
    assert s.trainers == 2 and s.iterations == 3 and s.first_iteration == 1
    assert s.last_iteration == 3 and s.finished
    assert s.wall_time_s == pytest.approx(12.0 - 10.1)  # from the end of warm-up iteration 0
    assert s.samples == 160 + 160 + 150
    assert s.samples_per_s == pytest.approx(470 / 1.9)
    assert s.iteration_time_s == pytest.approx(1.9 / 3)
    assert s.hit_rate == pytest.approx((5 + 6 + 7 + 10 + 12 + 14) / 90)
    assert s.fetch_bytes_per_iter == pytest.approx((100 + 200 + 300 + 400 + 500 + 600) / 3)
    assert s.fetch_rows_per_iter == pytest.approx(10)
    assert s.write_back_bytes_per_iter == pytest.approx(800)
    assert s.sync_bytes_per_iter == pytest.approx(400)
    assert s.join_rows_per_iter == pytest.approx(2)
    assert s.phase_s["forward"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.3 + 0.4 + 0.5) / 6)
    assert s.phase_s["boundary"] == 0.0 and list(s.phase_s) == list(PHASES)
    assert s.final_loss == pytest.approx((0.5 * 100 + 0.4 * 100 + 0.8 * 60 + 0.6 * 50) / 310)
    assert s.loss_window == 2
    assert s.eval is not None and s.eval.iteration == 3 and s.eval.count == 400
    assert s.eval.auc == pytest.approx((0.7 * 100 + 0.8 * 300) / 400)
    assert s.eval.log_loss == pytest.approx((0.5 * 100 + 0.4 * 300) / 400)


def test_machinery_is_every_phase_but_the_models_own_work() -> None:
    run = {j: [dataclasses.replace(r, phases=r.phases | {"backward": 0.5, "dense_optimizer": 0.25,
                                                          "boundary": 0.125 * (j + 1), "other": 0.0625})
               if isinstance(r, IterationRecord) else r for r in records]
           for j, records in two_trainer_run().items()}
    s = summarise(run, mode="bagpipe", global_batch=160, warmup=1)
    assert s.machinery_s == pytest.approx((0.125 + 0.25) / 2 + 0.0625)
    assert RunSummary.from_json(s.to_json()).machinery_s == s.machinery_s
    assert "  machinery               250.00  ms/iter" in format_summary(s)


def test_compute_cpu_is_averaged_beside_the_wall_time_and_unknown_without_it() -> None:
    """The training thread's CPU time in the compute phases: measured iterations only, and
    NaN (n/a) where the records do not carry it, as records from before it did not."""
    cpu = {0: {"forward": 0.0625, "backward": 0.125, "dense_optimizer": 0.0},
           1: {"forward": 0.125, "backward": 0.125, "dense_optimizer": 0.0}}
    run = {j: [dataclasses.replace(r, compute_cpu=cpu[j]) if isinstance(r, IterationRecord) else r
               for r in records] for j, records in two_trainer_run().items()}
    s = summarise(run, mode="bagpipe", global_batch=160, warmup=1)
    assert s.compute_cpu_s == pytest.approx({"forward": (0.0625 + 0.125) / 2, "backward": 0.125, "dense_optimizer": 0.0})
    assert RunSummary.from_json(s.to_json()).compute_cpu_s == s.compute_cpu_s
    assert "  compute CPU             218.75  ms/iter" in format_summary(s)
    old = summarise(two_trainer_run(), mode="bagpipe", global_batch=160, warmup=1)
    assert all(math.isnan(v) for v in old.compute_cpu_s.values()) and len(old.compute_cpu_s) == 3
    assert "  compute CPU                n/a  ms/iter" in format_summary(old)
    before = {k: v for k, v in old.to_json().items() if k != "compute_cpu_s"}  # an older report
    assert RunSummary.from_json(before).compute_cpu_s == {}


def test_warmup_moves_the_clock_start_and_the_averages() -> None:
    s = summarise(two_trainer_run(), mode="bagpipe", global_batch=160, warmup=2)
    assert s.wall_time_s == pytest.approx(12.0 - 10.5)
    assert s.samples == 160 + 150
    assert s.samples_per_s == pytest.approx(310 / 1.5)
    assert s.hit_rate == pytest.approx((6 + 7 + 12 + 14) / 60)
    assert s.fetch_bytes_per_iter == pytest.approx((200 + 300 + 500 + 600) / 2)


def test_cooldown_moves_the_clock_end_and_the_averages() -> None:
    s = summarise(two_trainer_run(), mode="bagpipe", global_batch=160, warmup=1, cooldown=1, loss_window=1)
    assert s.iterations == 2 and s.first_iteration == 1 and s.last_iteration == 2
    assert s.wall_time_s == pytest.approx(11.2 - 10.1)
    assert s.samples == 160 + 160
    assert s.hit_rate == pytest.approx((5 + 6 + 10 + 12) / 60)
    assert s.fetch_bytes_per_iter == pytest.approx((100 + 200 + 400 + 500) / 2)
    assert s.final_loss == pytest.approx((0.5 * 100 + 0.8 * 60) / 160)
    assert RunSummary.from_json(s.to_json()).cooldown == 1
    assert "(2 measured, first 1 excluded as warm-up, last 1 excluded)" in format_summary(s)


def test_a_report_from_before_the_cooldown_reads_as_none_left_out() -> None:
    old = summarise(two_trainer_run(), mode="bagpipe", global_batch=160).to_json()
    del old["cooldown"]
    assert RunSummary.from_json(old).cooldown == 0


def test_no_warmup_counts_every_iteration_but_times_from_the_first_end() -> None:
    s = summarise(two_trainer_run(), mode="bagpipe", global_batch=160)
    assert s.iterations == 4 and s.samples == 470
    assert s.wall_time_s == pytest.approx(1.9)
    assert s.hit_rate == pytest.approx(54 / 120)
    assert s.fetch_bytes_per_iter == pytest.approx((3000 + 2100) / 4)


def test_unfinished_run_uses_iterations_every_trainer_did() -> None:
    run = two_trainer_run()
    run[1] = [r for r in run[1] if getattr(r, "iteration", None) != 3 and not isinstance(r, FinalRecord)]
    s = summarise(run, mode="bagpipe", global_batch=160)
    assert s.last_iteration == 2 and not s.finished
    assert s.wall_time_s == pytest.approx(11.2 - 10.1)


def test_a_resumed_trainers_last_record_of_an_iteration_wins() -> None:
    run = two_trainer_run()
    run[0].append(it_rec(2, 11.0, samples=100, uses=10, hits=10))
    s = summarise(run, mode="bagpipe", global_batch=160, warmup=2)
    assert s.hit_rate == pytest.approx((10 + 7 + 12 + 14) / 60)


def test_nan_auc_is_skipped_when_combining_evals() -> None:
    run = two_trainer_run()
    run[1][-2] = eval_rec(3, math.nan, 0.4, 300)
    ev = summarise(run, mode="bagpipe", global_batch=160).eval
    assert ev is not None and ev.auc == pytest.approx(0.7)


def test_no_eval_and_no_uses_give_none_and_nan() -> None:
    run = {0: [it_rec(0, 1.0, uses=0, hits=0), it_rec(1, 2.0, uses=0, hits=0)]}
    s = summarise(run, mode="local", global_batch=100)
    assert s.eval is None and math.isnan(s.hit_rate)
    assert s.samples_per_s == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("run", "kwargs", "match"),
    [
        ({0: [it_rec(0, 1.0)], 1: []}, {}, r"trainer\(s\) 1 "),
        ({0: [it_rec(0, 1.0)], 1: [eval_rec(0, 0.5, 0.5, 1)]}, {}, r"trainer\(s\) 1 "),
        ({0: [it_rec(0, 1.0)], 2: [it_rec(0, 1.0)]}, {}, r"trainer\(s\) 1 "),
        ({0: [it_rec(0, 1.0)]}, {"trainers": 3}, r"trainer\(s\) 1, 2 "),
        ({0: [it_rec(0, 1.0)], 3: [it_rec(0, 1.0)]}, {"trainers": 2}, r"trainer\(s\) 3 outside"),
        ({}, {}, "no trainer records"),
        ({0: [it_rec(0, 1.0), it_rec(1, 2.0)]}, {"warmup": 2}, "warmup=2 and cooldown=0 leave no iteration"),
        ({0: [it_rec(0, 1.0), it_rec(1, 2.0)]}, {"warmup": 1, "cooldown": 1}, "cooldown=1 leave no iteration"),
    ],
)
def test_errors_name_what_is_missing(run: dict[int, list[Record]], kwargs: dict[str, int],
                                     match: str) -> None:
    with pytest.raises(ReportError, match=match):
        summarise(run, mode="bagpipe", global_batch=100, **kwargs)


# --------------------------------------------------------------------------- report.json


def test_write_report_writes_json_with_nan_as_null(tmp_path: Path) -> None:
    s = summarise({0: [it_rec(0, 1.0, uses=0, hits=0), it_rec(1, 2.0, uses=0, hits=0)]},
                  mode="local", global_batch=100)
    path = write_report(tmp_path, s, {"spec": "examples/x.toml", "where": tmp_path})
    assert path == tmp_path / "report.json"
    data = orjson.loads(path.read_bytes())
    assert data["summary"]["hit_rate"] is None
    assert data["summary"]["samples_per_s"] == pytest.approx(100.0)
    assert data["extra"] == {"spec": "examples/x.toml", "where": str(tmp_path)}
    back = RunSummary.from_json(data["summary"])
    assert math.isnan(back.hit_rate)
    assert dataclasses.replace(back, hit_rate=0.0) == dataclasses.replace(s, hit_rate=0.0)


def test_summary_json_round_trip_keeps_the_eval() -> None:
    s = summarise(two_trainer_run(), mode="bagpipe", global_batch=160)
    assert RunSummary.from_json(orjson.loads(orjson.dumps(s.to_json()))) == s


# --------------------------------------------------------------------------- checkpoints and breakdown


def test_checkpoint_cost_is_summarised_and_printed() -> None:
    run = two_trainer_run()
    run[0] += [
        CheckpointRecord(iteration=4, time=1.0, bytes=3_000_000, seconds=0.5),
        CheckpointRecord(iteration=9, time=2.0, bytes=5_000_000, seconds=1.5),
        CheckpointRecord(iteration=9, time=3.0, bytes=5_000_000, seconds=1.5),  # after a resume
    ]
    s = summarise(run, mode="bagpipe", global_batch=8)
    assert (s.checkpoints, s.checkpoint_bytes, s.checkpoint_s) == (2, 4_000_000.0, 1.0)
    assert "checkpoints" in format_summary(s) and "4.00 MB and 1.00 s each" in format_summary(s)
    assert RunSummary.from_json(s.to_json()).checkpoints == 2
    assert summarise(two_trainer_run(), mode="bagpipe", global_batch=8).checkpoints == 0


def test_the_breakdown_leaves_the_warm_up_out() -> None:
    s = iteration_series(two_trainer_run())
    forward = breakdown_ms(s, slice(1, None))["forward"]
    assert forward == pytest.approx([1e3 * 0.6 / 3, 1e3 * 1.2 / 3, 1e3 * 0.3])
    assert breakdown_ms(s, slice(0, None))["forward"][0] == pytest.approx(1e3 * 1.6 / 4)
