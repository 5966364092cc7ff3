"""bench/__init__.py's results files and bench/render.py's document made from them: the
newest real results of each benchmark, smoke results never, and docs/benchmarks.md as
bench/results/ renders it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import orjson
import pytest

from bench import BENCHES, RESULTS, SMOKE_RESULTS, Table, commit, machine, results_path, write_results
from bench.render import DOC, format_value, main, newest_results, render

HEADLINE = Table(("mode", "samples/s", "hit rate %", "bit-identical"), (("bagpipe", 12345.678, 90.5, True),
                                                                       ("local", 23456.0, None, False)))


def results_in(folder: Path, name: str, file: str, *, smoke: bool = False, date: str | None = None,
               figure: float = 12345.678) -> Path:
    """A results file of bench `name` as the script writes it, its headline's first figure `figure`."""
    path = folder / file
    rows = ((HEADLINE.rows[0][0], figure, *HEADLINE.rows[0][2:]), HEADLINE.rows[1])
    write_results(path, bench=name, config={"smoke": smoke}, figures={"modes": {}},
                  headline=Table(HEADLINE.columns, rows), smoke=smoke)
    if date is not None:  # as if it had run then
        body = orjson.loads(path.read_bytes())
        path.write_bytes(orjson.dumps({**body, "date": date}))
    return path


def test_a_results_file_says_what_ran_where_and_when(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench/e2e.py", "--quick", "--rounds", "3"])
    body = orjson.loads(results_in(tmp_path, "e2e", "e2e.json").read_bytes())
    assert body["bench"] == "e2e" and body["smoke"] is False and body["modes"] == {}
    assert body["command"] == "python bench/e2e.py --quick --rounds 3"
    assert Table.from_json(body["headline"]) == HEADLINE
    assert body["machine"] == machine() and body["machine"]["cpus"] >= 1 and body["machine"]["memory_gb"] > 0
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", body["commit"]) and body["commit"] == commit()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", body["date"])


def test_figures_may_not_take_the_keys_of_the_results_around_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="headline"):
        write_results(tmp_path / "x.json", bench="e2e", config={}, figures={"headline": 1}, headline=HEADLINE,
                      smoke=False)
    with pytest.raises(ValueError, match="columns"):
        Table(("a", "b"), (("only one",),))


def test_results_go_to_bench_results_unless_smoke_or_told(tmp_path: Path) -> None:
    assert results_path("e2e", None, False) == RESULTS / "e2e.json"
    assert results_path("e2e", None, True) == SMOKE_RESULTS / "e2e.json"
    assert not SMOKE_RESULTS.is_absolute()  # under the working directory, like runs/
    assert results_path("e2e", tmp_path / "x.json", True) == tmp_path / "x.json"


def test_the_document_shows_the_newest_real_results_of_each_benchmark(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    results_in(folder, "e2e", "e2e-old.json", date="2020-01-01T00:00:00+00:00", figure=111.0)
    results_in(folder, "e2e", "e2e.json", date="2021-06-01T12:30:00+00:00", figure=222.0)
    results_in(folder, "e2e", "e2e-smoke.json", smoke=True, date="2022-01-01T00:00:00+00:00", figure=333.0)
    results_in(folder, "planner", "planner.json", date="2021-06-02T08:00:00+00:00")
    (folder / "notes.json").write_text('{"not": "results"}')
    (folder / "broken.json").write_text("{")
    out = tmp_path / "docs" / "benchmarks.md"
    assert main(["--results", str(folder), "--out", str(out)]) == 0
    doc = out.read_text()
    assert [line[3:] for line in doc.splitlines() if line.startswith("## ")] == list(BENCHES)
    e2e = doc.split("## e2e\n", 1)[1].split("\n## ", 1)[0]
    assert e2e.startswith("\nEnd-to-end throughput of every mode")  # the script's docstring, not a copy
    assert "| mode | samples/s | hit rate % | bit-identical |\n|---|---|---|---|\n" in e2e
    assert "| bagpipe | 222.0 | 90.50 | yes |" in e2e and "| local | 23,456 | n/a | no |" in e2e
    assert "111.0" not in doc and "333.0" not in doc  # older, and smoke
    assert re.search(r"Measured at commit `[0-9a-f]{12}(-dirty)?` on 2021-06-01 12:30 UTC: .+, \d+ CPUs", e2e)
    assert "No results yet: run `python bench/recovery.py`" in doc
    assert "bagpipe | 12,346" in doc.split("## planner\n", 1)[1]


def test_a_benchmark_outside_the_list_still_gets_a_section(tmp_path: Path) -> None:
    results_in(tmp_path, "newbench", "newbench.json")
    doc = render(newest_results(tmp_path), benches=("e2e",))
    assert doc.index("## e2e") < doc.index("## newbench") and "(no description)" in doc


def test_further_tables_follow_the_headline_under_their_titles(tmp_path: Path) -> None:
    shards = Table(("shards S", "client CPU us/row"), ((1, 0.25), (8, 0.5)))
    write_results(tmp_path / "ps_fetch.json", bench="ps_fetch", config={"smoke": False}, figures={},
                  headline=HEADLINE, smoke=False, tables={"Over S shards": shards})
    section = render(newest_results(tmp_path), benches=("ps_fetch",)).split("## ps_fetch\n", 1)[1]
    headline, rest = section.split("Over S shards:\n", 1)
    assert "| mode | samples/s |" in headline
    assert rest.startswith("\n| shards S | client CPU us/row |\n|---|---|\n| 1 | 0.25 |\n| 8 | 0.5 |\n")


@pytest.mark.parametrize(("value", "cell"), [
    (None, "n/a"), (float("nan"), "n/a"), (True, "yes"), (12345, "12,345"), (12345.6, "12,346"),
    (123.45, "123.5"), (1.2345, "1.23"), (0.0, "0.00"), (0.012345, "0.0123"), ("a|b", "a\\|b"),
])
def test_figures_read_at_three_digits_or_so(value: object, cell: str) -> None:
    assert format_value(value) == cell


def test_docs_benchmarks_md_is_what_bench_results_render_to() -> None:
    assert DOC.read_text() == render(newest_results(RESULTS)), (
        "docs/benchmarks.md is out of date with bench/results/ or the scripts' docstrings: "
        "run `python bench/render.py`")
