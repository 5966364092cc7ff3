"""A summary as text (`launcher.text`): the run's table and the comparisons of modes."""

from __future__ import annotations

import math

from launcher.summary import RunSummary, summarise
from launcher.text import compare_bytes, compare_modes, format_summary
from tests.launcher.factories import it_rec, summary_of, two_trainer_run


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


def test_compare_modes_lists_modes_in_order_with_ratios() -> None:
    table = compare_modes({
        "local": summary_of("local", 4000.0, math.nan, 0.0, 1e6),
        "no-cache": summary_of("no-cache", 1000.0, 0.0, 5e6, 0.0),
        "bagpipe": summary_of("bagpipe", 3000.0, 0.9, 0.5e6, 0.25e6),
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
    table = compare_modes({"bagpipe": summary_of("bagpipe", 3000.0, 0.9, 0.0, 0.0)})
    assert "vs " not in table and "3,000.0" in table
