"""bench/e2e.py's report of a mode's run: its phase and RSS tables and the JSON with every
role's curve; and the job it writes, whose data its specs find from any working directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.e2e import (
    SEED, SIZES, ModeRun, drop_saved_tables, figures, mode_sections, phase_table, prepare_data, rss_table, sections,
)
from common.checkpoints import final_paths
from common.job import build_job
from common.spec import load_spec, spec_toml
from launcher.memory import RssSample, rss_curves, summarise_rss
from launcher.summary import RunSummary


def bagpipe_run() -> ModeRun:
    iterations = np.arange(50)
    end_time = 100.0 + iterations
    samples = [RssSample(time=float(t), rss_mb={"oracle": 300.0, "trainer-0": 400.0 + (t - 99)},
                         cpu_s={"oracle": 0.002 * t, "trainer-0": 0.5 * t})
               for t in np.arange(99.0, 151.0)]
    curves = rss_curves(samples, iterations, end_time)
    summary = RunSummary.from_json({"mode": "bagpipe", "samples_per_s": 1000.0, "phase_s": {},
                                    "compute_cpu_s": {"forward": 0.015, "backward": 0.03}})
    return ModeRun(summary, summarise_rss(curves, 10, min_span=20), curves)


def test_the_phase_table_puts_forward_and_backward_cpu_beside_their_wall_time() -> None:
    phases = {"forward": 0.02, "backward": 0.04, "dense_optimizer": 0.001, "boundary": 0.009}
    timed = RunSummary.from_json({"mode": "bagpipe", "phase_s": phases, "machinery_s": 0.009,
                                  "compute_cpu_s": {"forward": 0.015, "backward": 0.03}})
    untimed = RunSummary.from_json({"mode": "torchrec", "phase_s": phases, "machinery_s": 0.009})
    lines = phase_table({"bagpipe": timed, "torchrec": untimed}).splitlines()
    assert lines[0].split()[-3:] == ["total", "fwd+bwd", "CPU"]
    assert lines[2].split() == ["bagpipe", "20.00", "40.00", "1.00", "9.00", "70.00", "45.00"]
    assert lines[3].split()[-1] == "n/a"  # a run whose records do not carry it


def test_the_rss_table_has_a_line_per_role_under_its_mode() -> None:
    lines = rss_table({"bagpipe": bagpipe_run()}, 10, 40).splitlines()
    assert lines[0] == ("RSS in MB (after iteration 10, until training ended) and CPU time per iteration "
                        "(iterations 10 to 40)")
    # One iteration a second: 2 ms and 500 ms of CPU an iteration.
    assert lines[3].split() == ["bagpipe", "oracle", "300.0", "300.0", "300.0", "+0.00", "2.0"]
    # 10 iterations done at t = 109 (400 + 10 MB); training ends at t = 149, with 50 done.
    assert lines[4].split() == ["trainer-0", "410.0", "450.0", "451.0", "+1000.00", "500.0"]


def test_a_growth_the_run_was_too_short_for_is_n_a() -> None:
    run = bagpipe_run()
    short = ModeRun(run.summary, summarise_rss(run.curves, 10), run.curves)  # 40 iterations after 10
    assert rss_table({"bagpipe": short}, 10, 40).splitlines()[3].split()[-2] == "n/a"


def test_the_json_of_a_mode_holds_each_roles_figures_and_curve() -> None:
    run = bagpipe_run()
    mode = figures(run, [run])
    assert mode["compute_cpu_s"] == {"forward": 0.015, "backward": 0.03}
    rss = mode["rss"]
    assert list(rss) == ["oracle", "trainer-0"]
    assert rss["trainer-0"]["growth_mb_per_1k"] == pytest.approx(1000.0)  # 1 MB an iteration
    assert rss["trainer-0"]["points"][:2] == [(0, 400.0), (1, 401.0)]  # (iterations done, MB)


def test_a_runs_saved_tables_are_dropped_and_the_rest_kept(tmp_path) -> None:
    final = final_paths(tmp_path)
    final.table.parent.mkdir()
    for path in (final.table, final.state, final.dense, final.info):
        path.write_bytes(b"x")
    snapshot = tmp_path / "checkpoints" / "ps-0" / "ckpt-0000000400"
    snapshot.mkdir(parents=True)
    (snapshot / "rows.npy").write_bytes(b"x")
    (tmp_path / "trainer-0.jsonl").write_bytes(b"{}")
    drop_saved_tables(tmp_path)
    drop_saved_tables(tmp_path)  # nothing left to drop: no error
    assert sorted(p.name for p in final.table.parent.iterdir()) == sorted([final.dense.name, final.info.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "trainer-0.jsonl"]


def test_a_modes_checkpoints_go_to_its_run_folder(tmp_path) -> None:
    """Not to the working directory's runs/, where every run of the benchmark left 140 MB."""
    base = {"oracle": {"lookahead": 100}, "train": {"batch_size": 2048}}
    sections = mode_sections("bagpipe", base, tmp_path / "bagpipe")
    assert sections["oracle"] == {"lookahead": 100, "mode": "bagpipe"} and base["oracle"] == {"lookahead": 100}
    assert sections["checkpoint"] == {"dir": str(tmp_path / "bagpipe" / "checkpoints")}
    assert sections["train"] == base["train"]


def test_a_rounds_spec_finds_the_data_prepared_under_a_relative_out(tmp_path: Path, monkeypatch) -> None:
    """The default --out is relative to the working directory (runs/bench/e2e); a spec's
    relative paths are relative to its own folder (a round's), so the data's must not be."""
    monkeypatch.chdir(tmp_path)
    size = SIZES["smoke"]
    out = Path("runs/bench/e2e")
    data = prepare_data(size, out / "data")
    round_dir = out / "round-1"
    round_dir.mkdir(parents=True)
    spec = round_dir / "bagpipe.toml"
    spec.write_text(spec_toml("e2e-bagpipe", SEED, mode_sections("bagpipe", sections(size, data), round_dir / "bagpipe")))
    job = build_job(load_spec(spec))
    assert job.data.path == str(tmp_path / out / "data" / data.name)
    assert job.layout.num_tables == 26 and job.spec.train.max_iterations == size.iterations
