"""A watched folder (common/data/live.py): which parts are complete, in which order they are
taken, their rows across part ends equal to the batch reader's over the same files, and the
log that makes a stream replayable."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import orjson
import pytest

from common.data.dataset import open_dataset
from common.data.live import LiveSource, StreamLog, TakenPart, complete_parts
from common.data.spec import DataSpec, parse_data_spec
from common.errors import ConfigError

SAMPLE = Path(__file__).resolve().parents[3] / "samples" / "criteo_kaggle_head8000.tsv"
SIZES = [97] * 26


def land(folder: Path, name: str, lines: list[str]) -> Path:
    """Write a part under a hidden name, then rename it into place, as a writer should."""
    tmp = folder / f".{name}.tmp"
    tmp.write_text("".join(lines))
    os.replace(tmp, folder / name)
    return folder / name


def watch_spec(path: Path, **fields: object) -> DataSpec:
    return DataSpec(format="criteo", path=str(path), table_sizes=tuple(SIZES), watch=True, on_error="skip", **fields)


def sample_lines(n: int) -> list[str]:
    with SAMPLE.open() as fh:
        return [next(fh) for _ in range(n)]


def test_parts_are_complete_once_renamed_into_place_and_taken_in_natural_order(tmp_path: Path) -> None:
    lines = sample_lines(30)
    for name in ("part-10.tsv", "part-2.tsv", "part-1.tsv"):
        land(tmp_path, name, lines[:3])
    (tmp_path / ".part-3.tsv.tmp").write_text(lines[0])  # still being written
    (tmp_path / "_part-4.tsv").write_text(lines[0])  # never a part
    assert [p.name for p in complete_parts(watch_spec(tmp_path / "*.tsv"))] == ["part-1.tsv", "part-2.tsv",
                                                                               "part-10.tsv"]
    assert [p.name for p in complete_parts(watch_spec(tmp_path))] == ["part-1.tsv", "part-2.tsv", "part-10.tsv"]


def test_success_files_mark_complete_folders(tmp_path: Path) -> None:
    lines = sample_lines(4)
    for hour in ("hour=9", "hour=10", "hour=11"):
        (tmp_path / hour).mkdir()
        land(tmp_path / hour, "part-0.tsv", lines)
    (tmp_path / "hour=9" / "_SUCCESS").touch()
    (tmp_path / "hour=10" / "_SUCCESS").touch()
    spec = watch_spec(tmp_path / "*" / "part-*.tsv", ready="success")
    assert [p.parent.name for p in complete_parts(spec)] == ["hour=9", "hour=10"]
    assert [p.parent.name for p in complete_parts(watch_spec(tmp_path, ready="success"))] == ["hour=9", "hour=10"]


def test_a_stream_reads_the_rows_the_batch_reader_reads_across_part_ends(tmp_path: Path) -> None:
    lines = sample_lines(700)
    incoming = tmp_path / "in"
    incoming.mkdir()
    source = LiveSource(watch_spec(incoming / "*.tsv"), tmp_path / "log")
    assert source.refresh() == 0
    for k, (a, b) in enumerate([(0, 250), (250, 255), (255, 700)]):
        land(incoming, f"part-{k}.tsv", lines[a:b])
        source.refresh()
    assert source.num_rows == 700 and [p.rows for p in source.parts] == [250, 5, 445]
    whole = tmp_path / "whole.tsv"
    whole.write_text("".join(lines))
    batch = open_dataset(DataSpec(format="criteo", path=str(whole), table_sizes=tuple(SIZES)))
    for start, stop in [(0, 700), (240, 260), (250, 255), (251, 256), (600, 700)]:
        got, want = source.rows(start, stop), batch.rows(start, stop)
        for name in ("labels", "dense", "sparse"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    with pytest.raises(ValueError, match="not taken yet"):
        source.rows(690, 701)
    # its caches are hidden (never parts), as a pattern's conversion cache is
    assert sorted(p.name for p in incoming.iterdir() if not p.name.startswith(".")) == [
        "part-0.tsv", "part-1.tsv", "part-2.tsv"]


def test_a_reopened_stream_takes_its_logged_parts_first_in_their_order(tmp_path: Path) -> None:
    lines = sample_lines(40)
    incoming, logs = tmp_path / "in", tmp_path / "log"
    incoming.mkdir()
    land(incoming, "part-5.tsv", lines[:10])
    first = LiveSource(watch_spec(incoming), logs)
    first.refresh()
    land(incoming, "part-2.tsv", lines[10:30])  # completes late; sorts first
    first.refresh()
    assert [Path(p.path).name for p in first.parts] == ["part-5.tsv", "part-2.tsv"]
    again = LiveSource(watch_spec(incoming), logs)
    again.refresh()
    assert [Path(p.path).name for p in again.parts] == ["part-5.tsv", "part-2.tsv"]
    np.testing.assert_array_equal(again.rows(0, 30).sparse, first.rows(0, 30).sparse)
    (incoming / "part-2.tsv").write_text("".join(lines[:5]))  # a part read must not change
    with pytest.raises(ConfigError, match="changed since"):
        LiveSource(watch_spec(incoming), logs).refresh()
    (incoming / "part-2.tsv").unlink()
    with pytest.raises(ConfigError, match="is gone"):
        LiveSource(watch_spec(incoming), logs).refresh()


def test_a_torn_last_log_line_is_dropped_and_a_torn_middle_one_refused(tmp_path: Path) -> None:
    log = StreamLog(tmp_path)
    part = TakenPart(path="/x/part-0.tsv", bytes=10, mtime_ns=1, rows=3, taken_s=0.0)
    log.append(part)
    with log.path.open("ab") as fh:
        fh.write(b'{"path": "/x/pa')
    assert log.read() == [part]
    log.append(part)
    assert log.read() == [part, part]
    log.path.write_bytes(b"garbage\n" + log.path.read_bytes())
    with pytest.raises(ConfigError, match="line 1"):
        log.read()


def test_bad_rows_are_quarantined_with_their_part_and_line_and_the_good_ones_read(tmp_path: Path) -> None:
    lines = sample_lines(40)
    bad = {3: "1\t2\n", 17: "x" + lines[17], 39: lines[39].replace("\t", "\tzz", 1)}  # 1-based line numbers
    written = [bad.get(n, line) for n, line in enumerate(lines, start=1)]
    incoming, logs = tmp_path / "in", tmp_path / "log"
    incoming.mkdir()
    land(incoming, "part-0.tsv", written)
    source = LiveSource(watch_spec(incoming), logs)
    assert source.refresh() == 37 and source.bad_rows == 3
    kept = [orjson.loads(line) for line in (logs / "quarantine.jsonl").read_bytes().splitlines()]
    assert [k["line"] for k in kept] == [3, 17, 39]
    assert [k["text"] for k in kept] == [bad[n].rstrip("\n") for n in (3, 17, 39)]
    assert all(k["part"] == str(incoming / "part-0.tsv") and k["why"] for k in kept)
    good = tmp_path / "good.tsv"
    good.write_text("".join(line for n, line in enumerate(lines, start=1) if n not in bad))
    want = open_dataset(DataSpec(format="criteo", path=str(good), table_sizes=tuple(SIZES))).rows(0, 37)
    np.testing.assert_array_equal(source.rows(0, 37).sparse, want.sparse)
    assert LiveSource(watch_spec(incoming), logs).refresh() == 37  # the log keeps the count


@pytest.mark.parametrize(("fields", "field"), [
    ({"format": "criteo-npy"}, "data.watch"),
    ({"hashing": "dictionary"}, "data.hashing"),
    ({"eval_fraction": 0.1}, "data.eval_fraction"),
    ({"ready": "soon"}, "data.ready"),
    ({"poll_s": 0}, "data.poll_s"),
    ({"on_error": "fail"}, "data.on_error"),
])
def test_a_stream_the_reader_cannot_follow_fails_naming_the_field(fields: dict, field: str) -> None:
    section = {"format": "criteo", "path": "in/*.tsv", "watch": True, **fields}
    with pytest.raises(ConfigError) as error:
        parse_data_spec(section, base_dir=Path("/tmp"))
    assert error.value.field == field


def test_stream_only_keys_need_watch() -> None:
    with pytest.raises(ConfigError) as error:
        parse_data_spec({"format": "criteo", "path": "x.tsv", "ready": "success"}, base_dir=Path("/tmp"))
    assert error.value.field == "data.ready"
    spec = parse_data_spec({"format": "criteo", "path": "in/*.tsv", "watch": True, "poll_s": 2}, base_dir=Path("/tmp"))
    assert spec.watch and spec.poll_s == 2.0 and spec.ready == "renamed"
