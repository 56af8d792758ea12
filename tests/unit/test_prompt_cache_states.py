"""Saved prompt caches on disk (prompt_cache/states.py) and conversation keys (keys.py): the
budget, the lifetime across a restart, and what cannot be trusted dropped with a log line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.prompt_cache.keys import MAX_KEYS, chat_keys, shared, text_keys
from corral.prompt_cache.states import INDEX, SavedState, SavedStates, fingerprint
from tests.support.disks import tmpfs


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def conversation(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(n)]


def saved(
    states: SavedStates, model: str, keys: list[str], size: int, fp: str = "fp"
) -> SavedState:
    """A state as the server would leave it: its file written, then indexed."""
    name = states.new_file(model)
    (states.folder / name).write_bytes(b"x" * size)
    s = SavedState(name, model, fp, keys, tokens=size // 10, bytes=size, saved_at=states._clock())
    states.add(s)
    return s


def test_conversation_keys_share_exactly_their_common_prefix() -> None:
    a, b = (
        chat_keys(conversation(6)),
        chat_keys([*conversation(4), {"role": "user", "content": "x"}]),
    )
    assert len(a) == 6
    assert shared(a, b) == 4
    assert shared(a, chat_keys(conversation(6))) == 6
    # The same words in another role are another conversation.
    assert (
        shared(
            chat_keys([{"role": "user", "content": "hi"}]),
            chat_keys([{"role": "system", "content": "hi"}]),
        )
        == 0
    )
    # Hostile or odd messages hash, never raise; the number of keys is bounded.
    odd = chat_keys(
        [None, 3, {"content": [{"type": "text", "text": "\udcff"}]}, {"role": object()}]
    )
    assert len(odd) == 4
    assert len(chat_keys([{"role": "user", "content": "x"}] * (MAX_KEYS + 10))) == MAX_KEYS
    p = "abc" * 2000
    assert shared(text_keys(p), text_keys(p + "more")) == len(p) // 1024
    assert shared(text_keys(p), text_keys("x" + p)) == 0
    # Whole chunks only: a prompt that goes on from another holds all of its keys.
    assert len(text_keys(p)) == len(p) // 1024
    assert text_keys("short") == []
    assert text_keys(p + "more")[: len(text_keys(p))] == text_keys(p)


def test_the_best_state_shares_the_longest_prefix_of_the_same_model_and_fingerprint(
    tmp_path: Path,
) -> None:
    states = SavedStates(tmp_path, max_bytes=10_000, clock=Clock())
    states.load()
    short = saved(states, "coder", chat_keys(conversation(3)), 100)
    long = saved(states, "coder", chat_keys(conversation(8)), 100)
    saved(states, "coder", chat_keys(conversation(8)), 100, fp="other flags")
    saved(states, "explorer", chat_keys(conversation(9)), 100)
    asked = chat_keys([*conversation(8), {"role": "user", "content": "next"}])
    assert states.best("coder", "fp", asked) == (long, 8)
    assert states.best("coder", "fp", chat_keys(conversation(3))) == (long, 3)  # newest of equals
    assert states.best("coder", "fp", asked, exclude=[long.file]) == (short, 3)
    assert states.best("coder", "fp", chat_keys([{"role": "user", "content": "new"}])) is None
    assert states.best("nobody", "fp", asked) is None


def test_the_budget_drops_the_least_recently_used_first(tmp_path: Path) -> None:
    clock = Clock()
    states = SavedStates(tmp_path, max_bytes=300, clock=clock)
    states.load()
    a = saved(states, "m", ["a"], 100)
    b = saved(states, "m", ["b"], 100)
    c = saved(states, "m", ["c"], 100)
    states.used(a)  # restored: now the most recently used
    dropped = saved(states, "m", ["d"], 100)
    assert [s.file for s in states.states()] == [a.file, c.file, dropped.file]
    assert not (tmp_path / b.file).exists()
    assert states.total_bytes == 300
    huge = saved(states, "m", ["e"], 1_000)  # bigger than the whole budget: not kept
    assert huge.file not in [s.file for s in states.states()]
    assert not (tmp_path / huge.file).exists()
    assert states.total_bytes <= 300


def test_states_outlive_a_restart_and_what_cannot_be_trusted_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    states = SavedStates(tmp_path, max_bytes=10_000, clock=Clock())
    states.load()
    kept = saved(states, "m", ["k1", "k2"], 100)
    truncated = saved(states, "m", ["t"], 100)
    missing = saved(states, "m", ["m"], 100)
    (tmp_path / truncated.file).write_bytes(b"x" * 10)
    (tmp_path / missing.file).unlink()
    (tmp_path / "orphan.1.2.3.state").write_bytes(b"left by a crash before the index")
    (tmp_path / "notes.txt").write_text("not Corral's")
    with caplog.at_level(logging.INFO, logger="corral.prompt_cache"):
        again = SavedStates(tmp_path, max_bytes=10_000, clock=Clock())
        again.load()
    assert [s.file for s in again.states()] == [kept.file]
    assert again.states()[0].keys == ["k1", "k2"]
    said = caplog.text
    assert "truncated" in said
    assert "missing" in said
    assert "orphan.1.2.3.state" in said
    assert not (tmp_path / "orphan.1.2.3.state").exists()
    assert (tmp_path / "notes.txt").exists()  # files Corral did not name are left alone


@pytest.mark.parametrize(
    "index",
    [
        b"{not json",
        b"[]",
        json.dumps({"version": 99, "states": []}).encode(),
        json.dumps(
            {
                "version": 1,
                "states": [
                    {"file": "../../etc/passwd.state", "model": "m", "fingerprint": "f",
                     "keys": [], "tokens": 1, "bytes": 1, "saved_at": 1},
                    {"file": "a.state", "model": "m", "fingerprint": "f", "keys": "nope",
                     "tokens": -1, "bytes": 1, "saved_at": 1},
                    "not an entry",
                ],
            }
        ).encode(),
    ],
)  # fmt: skip
def test_a_corrupt_or_hostile_index_starts_empty_and_is_rewritten(
    tmp_path: Path, index: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / INDEX).write_bytes(index)
    states = SavedStates(tmp_path, max_bytes=1_000)
    with caplog.at_level(logging.INFO, logger="corral.prompt_cache"):
        states.load()
    assert states.states() == []
    assert caplog.records  # each said in a line
    assert json.loads((tmp_path / INDEX).read_text()) == {"version": 1, "states": []}


def test_a_state_made_by_another_model_file_or_other_flags_never_matches(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    made = fingerprint(gguf, ["--ctx-size", "4096", "--swa-full"])
    assert made == fingerprint(gguf, ["--ctx-size", "4096", "--swa-full"])
    assert made != fingerprint(gguf, ["--ctx-size", "8192", "--swa-full"])
    gguf.write_bytes(b"GGUF" + b"\0" * 101)  # another file at the same path
    assert made != fingerprint(gguf, ["--ctx-size", "4096", "--swa-full"])
    assert fingerprint(tmp_path / "gone.gguf", []) != made


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs."""
    with tmpfs(tmp_path / "disk", "64k") as where:
        yield where


def test_a_full_disk_stops_saving_never_serving(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    states = SavedStates(small_disk, max_bytes=10**9, clock=Clock())
    states.load()
    first = saved(states, "m", ["a"], 8_000)
    assert states.saving
    (small_disk / "filler").write_bytes(b"x" * (60 * 1024 - 8_000 - 4096))
    with caplog.at_level(logging.WARNING, logger="corral.prompt_cache"):
        for i in range(40):  # index entries grow until the index no longer fits
            name = states.new_file("m")
            s = SavedState(name, "m", "fp", [f"k{i}"] * 200, 1, 0, 0.0)
            (small_disk / name).write_bytes(b"")
            states.add(s)
            if not states.saving:
                break
    assert not states.saving
    assert "no more states are saved" in caplog.text
    assert not states.worth_saving(10**6)
    assert states.best("m", "fp", ["a"]) == (first, 1)  # what is saved still restores
