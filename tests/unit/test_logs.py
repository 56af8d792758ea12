"""A model server's log file: rotated by size, read back across the rotation, followed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.backends.logs import Follower, LogLimits, RotatingLog, rotated, tail


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="files >= 1"):
        LogLimits(max_bytes=10, files=0)


def test_a_write_that_fills_the_log_leaves_its_next_file_begun(tmp_path: Path) -> None:
    """The last words of a server that exits just as its log fills: rotated into `.1`, and the
    log's own name names an empty file (a server's last write is often the one that fills it)."""
    log = RotatingLog(tmp_path / "m.log", LogLimits(max_bytes=10, files=2))
    log.write(b"0123456789\n")
    assert (tmp_path / "m.log").read_bytes() == b""
    assert (tmp_path / "m.log.1").read_bytes() == b"0123456789\n"
    assert log.size == 0


def test_one_file_kept_means_the_log_is_cut_when_full(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "m.log", LogLimits(max_bytes=100, files=1))
    for i in range(50):
        log.write(f"line {i:02d}\n".encode())
    assert rotated(tmp_path / "m.log", 1) == [tmp_path / "m.log"]
    assert (tmp_path / "m.log").stat().st_size < 100
    assert tail(tmp_path / "m.log", 1, 1000).endswith(b"line 49\n")


@settings(max_examples=40, deadline=None)
@given(
    lines=st.lists(
        st.binary(min_size=0, max_size=70).map(lambda b: b.replace(b"\n", b"")), max_size=120
    ),
    max_bytes=st.integers(1, 300),
    files=st.integers(1, 4),
)
def test_what_is_kept_is_bounded_and_is_the_end_of_what_was_written(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], max_bytes: int, files: int
) -> None:
    folder = tmp_path_factory.mktemp("log")
    log = RotatingLog(folder / "m.log", LogLimits(max_bytes=max_bytes, files=files))
    written = b""
    for x in lines:
        log.write(x + b"\n")
        written += x + b"\n"
    if lines:  # after a write, rotated or not, the log's own name names a file
        assert (folder / "m.log").exists()
    log.close()
    kept = rotated(folder / "m.log", files)
    assert len(kept) <= files
    assert not (folder / f"m.log.{files}").exists()
    # Each file holds at most max_bytes plus one write past it.
    assert all(p.stat().st_size < max_bytes + 72 for p in kept)
    back = tail(folder / "m.log", files, 1 << 20)
    assert written.endswith(back)  # in order, nothing invented, the newest kept
    if files > 1:
        assert len(back) >= min(len(written), (files - 1) * max_bytes)


def test_a_follower_reads_across_a_rotation_without_losing_a_line(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    log = RotatingLog(path, LogLimits(max_bytes=200, files=2))
    log.write(b"before\n")
    f = Follower(path)
    f.skip()
    seen: list[str] = []
    for i in range(100):
        log.write(f"line {i:03d}\n".encode())
        if i % 7 == 0:
            seen += f.read()
    seen += f.read()
    assert seen == [f"line {i:03d}" for i in range(100)]
    assert log.rotations > 3
