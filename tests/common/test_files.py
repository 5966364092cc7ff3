"""An atomic write leaves the new content or the old one, and never its temporary file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from common.files import write_atomically


def test_a_write_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    write_atomically(path, b"first, and longer")
    write_atomically(path, b"second")
    assert path.read_bytes() == b"second" and os.listdir(tmp_path) == ["manifest.json"]


def test_a_full_disk_keeps_the_old_content_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "manifest.json"
    write_atomically(path, b"old")

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as err:
        write_atomically(path, b"new")
    assert err.value.errno == errno.ENOSPC
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["manifest.json"]
