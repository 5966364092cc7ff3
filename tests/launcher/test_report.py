from __future__ import annotations

import dataclasses
import io
import logging
import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from launcher.report import (
    breakdown_ms,
    ProgressBar,
    ReportError,
    RunSummary,
    compare_bytes,
    compare_modes,
    format_summary,
    iteration_series,
    plot_modes,
    plot_run,
    remaining_seconds,
    summarise,
    write_report,
)
from trainer.records import CheckpointRecord, EvalRecord, FinalRecord, IterationRecord, Record
from trainer.timing import PHASES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def it_rec(iteration: int, time: float, **over: Any) -> IterationRecord:
    """An iteration record with small defaults; `phases` entries override the zero phases."""
    fields: dict[str, Any] = {
        "samples": 100, "loss": 0.5, "uses": 10, "hits": 5, "fetch_rows": 5, "fetch_bytes": 500,
        "write_back_rows": 4, "write_back_bytes": 400, "sync_rows": 2, "sync_bytes": 200, "join_rows": 1,
    }
    phases = {p: 0.0 for p in PHASES} | over.pop("phases", {})
    return IterationRecord(iteration=iteration, time=time, phases=phases, **(fields | over))


def eval_rec(iteration: int, auc: float, log_loss: float, count: int) -> EvalRecord:
    return EvalRecord(split="progressive", iteration=iteration, time=100.0 + iteration, auc=auc,
                      log_loss=log_loss, count=count)


def two_trainer_run() -> dict[int, list[Record]]:
    """Two trainers, iterations 0..3; every figure below is worked out by hand from these."""
    t0 = [
        it_rec(0, 10.0, samples=100, uses=10, hits=0, fetch_bytes=1000, loss=0.9,
               phases={"forward": 1.0}),
        it_rec(1, 10.5, samples=100, uses=10, hits=5, fetch_bytes=100, phases={"forward": 0.1}),
        it_rec(2, 11.0, samples=100, uses=10, hits=6, fetch_bytes=200, loss=0.5,
               phases={"forward": 0.2}),
        it_rec(3, 12.0, samples=100, uses=10, hits=7, fetch_bytes=300, loss=0.4,
               phases={"forward": 0.3}),
    ]
    t1 = [
        it_rec(0, 10.1, samples=60, uses=20, hits=0, fetch_bytes=2000, loss=0.9,
               phases={"forward": 1.0}),
        it_rec(1, 10.4, samples=60, uses=20, hits=10, fetch_bytes=400, phases={"forward": 0.3}),
        it_rec(2, 11.2, samples=60, uses=20, hits=12, fetch_bytes=500, loss=0.8,
               phases={"forward": 0.4}),
        it_rec(3, 11.9, samples=50, uses=20, hits=14, fetch_bytes=600, loss=0.6,
               phases={"forward": 0.5}),
    ]
    t0 += [eval_rec(1, 0.6, 0.7, 100), eval_rec(3, 0.7, 0.5, 100), FinalRecord(time=13.0, iterations=4)]
    t1 += [eval_rec(3, 0.8, 0.4, 300), FinalRecord(time=13.0, iterations=4)]
    return {0: t0, 1: t1}


# --------------------------------------------------------------------------- summarise


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


# --------------------------------------------------------------------------- text


def test_format_summary_shows_the_figures_with_units() -> None:
    s = summarise(two_trainer_run(), mode="bagpipe", global_batch=160, warmup=1, loss_window=2)
    text = format_summary(s)
    assert all(len(row) <= 100 for row in text.splitlines())
    rows = {row[:18].strip(): row[18:].split() for row in text.splitlines()}
    assert rows["throughput"] == ["247.4", "samples/s"]  # 470 samples / 1.9 s
    assert "633.33  ms" in text  # 1.9 s / 3
    assert "hit rate" in text and "60.0  %" in text
    assert "0.001  MB/iter (10.0 rows)" in text  # fetched 700 B/iter
    assert f"{168 / 310:.4f}" in text and "last 2 iterations" in text
    assert "eval AUC" in text and "0.7750" in text and "iteration 3, 400 samples" in text
    assert rows["forward"][:2] == ["300.000", "100.0%"]  # mean 0.3 s, all the phase time
    assert rows["boundary"] == ["0.000", "0.0%"]
    assert "iterations 1..3 (3 measured, first 1 excluded as warm-up)" in text


def _summary(mode: str, sps: float, hit: float, fetch: float, sync: float) -> RunSummary:
    base = summarise(two_trainer_run(), mode=mode, global_batch=160)
    return dataclasses.replace(base, samples_per_s=sps, iteration_time_s=0.02, hit_rate=hit,
                               fetch_bytes_per_iter=fetch, sync_bytes_per_iter=sync)


def test_compare_modes_lists_modes_in_order_with_ratios() -> None:
    table = compare_modes({
        "local": _summary("local", 4000.0, math.nan, 0.0, 1e6),
        "no-cache": _summary("no-cache", 1000.0, 0.0, 5e6, 0.0),
        "bagpipe": _summary("bagpipe", 3000.0, 0.9, 0.5e6, 0.25e6),
    })
    lines = table.splitlines()
    assert all(len(row) <= 100 for row in lines)
    assert "vs local" in lines[0] and "vs no-cache" in lines[0]
    assert [row.split()[0] for row in lines[2:]] == ["bagpipe", "no-cache", "local"]
    assert lines[2].split() == ["bagpipe", "3,000.0", "20.00", "90.0", "%", "0.500", "0.250",
                                "0.75x", "3.00x"]
    assert lines[3].split()[-2:] == ["0.25x", "1.00x"]
    assert lines[4].split()[3] == "n/a"


def test_bytes_by_kind_per_trainer_and_iteration_and_old_records_read_as_zero() -> None:
    kinds = {"fetch_bytes": 5e5, "write_back_bytes": 2e5, "sync_now_bytes": 3e6, "sync_later_bytes": 1e6,
             "join_bytes": 2e6, "dense_bytes": 4e6}
    run = {j: [it_rec(x, 10.0 + x, **kinds) for x in range(3)] for j in range(2)}
    s = summarise(run, mode="bagpipe", global_batch=200)
    assert s.bytes_per_iter == {k: 2 * v for k, v in kinds.items()}  # summed over the trainers
    old = summarise({0: [it_rec(0, 1.0), it_rec(1, 2.0)]}, mode="local", global_batch=100)
    assert old.bytes_per_iter["dense_bytes"] == 0 and old.bytes_per_iter["fetch_bytes"] == 500
    lines = compare_bytes({"bagpipe": s, "local": old}).splitlines()
    assert lines[0].split() == ["mode", "fetch", "write", "back", "sync", "now", "sync", "later", "join", "dense",
                                "total"]
    assert lines[2].split() == ["bagpipe", "0.500", "0.200", "3.000", "1.000", "2.000", "4.000", "10.700"]
    assert lines[3].split()[-3:] == ["0.000", "0.000", "0.001"]
    assert RunSummary.from_json(s.to_json()).bytes_per_iter == s.bytes_per_iter


def test_compare_modes_without_baselines_has_no_ratio_columns() -> None:
    table = compare_modes({"bagpipe": _summary("bagpipe", 3000.0, 0.9, 0.0, 0.0)})
    assert "vs " not in table and "3,000.0" in table


# --------------------------------------------------------------------------- files


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


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_plot_run_writes_three_pngs(tmp_path: Path) -> None:
    paths = plot_run(tmp_path, two_trainer_run())
    assert [p.name for p in paths] == ["throughput.png", "breakdown.png", "loss.png"]
    for p in paths:
        _assert_png(p)
    assert not list(tmp_path.glob("*.tmp"))


def test_plot_modes_writes_a_png(tmp_path: Path) -> None:
    path = plot_modes({"bagpipe": _summary("bagpipe", 3000.0, 0.9, 0.5e6, 0.25e6),
                       "no-cache": _summary("no-cache", 1000.0, 0.0, 5e6, 0.0)},
                      tmp_path / "modes.png")
    _assert_png(path)


# --------------------------------------------------------------------------- progress


def test_progress_bar_logs_every_tenth_when_not_a_terminal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = iter(float(i) for i in range(1000))
    bar = ProgressBar(20, "bagpipe", trainers=2, file=io.StringIO(), clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="launcher.report"):
        bar.update({0: [it_rec(0, 1.0), it_rec(1, 2.0)]})
        assert bar.done == 0 and caplog.records == []  # trainer 1 has done nothing yet
        bar.update({1: [it_rec(0, 1.0), it_rec(1, 2.0)]})
        assert bar.done == 2
        bar.update({0: [it_rec(2, 3.0)], 1: []})
        bar.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # 10 % once, then the closing line
    assert messages[0].startswith("bagpipe: 2/20 iterations (10%), 200 samples/s, loss 0.5000")
    assert "hit 50.0 %" in messages[0] and "ETA" in messages[0]


def test_progress_bar_draws_on_a_terminal_stream() -> None:
    out = io.StringIO()
    with ProgressBar(4, "run", file=out, enabled=True) as bar:
        bar.update({0: [it_rec(0, 1.0), it_rec(1, 1.5, samples=50)]})
    text = out.getvalue()
    assert "run" in text and "2/4" in text and "100 samples/s" in text and "hit 50.0 %" in text


def test_remaining_seconds_go_at_the_pace_of_the_recent_iterations() -> None:
    assert remaining_seconds([100.0, 100.1, 100.2, 100.3], 10) == pytest.approx(1.0)  # 0.1 s each
    assert remaining_seconds([5.0, 7.0], 0) == 0.0
    assert math.isnan(remaining_seconds([100.0], 10))  # one end: no pace yet
    assert math.isnan(remaining_seconds([], 10))


def _started_late(trainer_records: int) -> dict[int, list[Record]]:
    """Two trainers whose first iteration ended a minute after the launch (start-up), the
    next ones 0.1 s apart."""
    return {j: [it_rec(i, 60.0 + 0.1 * i) for i in range(trainer_records)] for j in range(2)}


def test_progress_eta_leaves_the_start_up_out(caplog: pytest.LogCaptureFixture) -> None:
    clock = iter([0.0, 60.3, 60.3])  # the bar was made at launch; 4 of 20 iterations took 60.3 s
    bar = ProgressBar(20, "run", trainers=2, file=io.StringIO(), clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="launcher.report"):
        bar.update(_started_late(4))
    assert caplog.records[0].getMessage().endswith(", ETA 00:01"), caplog.records[0].getMessage()  # 16 x 0.1 s


def test_progress_bar_shows_its_own_eta_only() -> None:
    out = io.StringIO()
    with ProgressBar(20, "run", trainers=2, file=out, enabled=True) as bar:
        bar.update(_started_late(4))
    text = out.getvalue()
    assert "4/20" in text and "ETA 00:01" in text, text
    assert "<" not in text and "it/s" not in text, text  # tqdm's ETA and rate count the start-up in


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
