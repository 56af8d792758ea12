"""Files replaced whole, and rewritten from the event loop without waiting on the disk."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from corral.atomic import LatestText, remove_soon, replace_text

pytestmark = pytest.mark.unit


def test_a_replaced_file_holds_the_text_and_leaves_no_part(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.json"
    replace_text(path, "one", sync=True)
    replace_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]


def test_outside_a_loop_a_write_lands_before_it_returns(tmp_path: Path) -> None:
    w = LatestText(tmp_path / "f")
    w.write("a")
    assert (tmp_path / "f").read_text() == "a"


def test_on_the_loop_writes_run_in_a_thread_and_the_last_text_lands(tmp_path: Path) -> None:
    path = tmp_path / "f"
    w = LatestText(path, sync=True)
    threads: set[str] = set()
    real = w._drain

    def drain(loop: asyncio.AbstractEventLoop | None) -> None:
        threads.add(threading.current_thread().name)
        real(loop)

    w._drain = drain  # type: ignore[method-assign]

    async def main() -> None:
        for i in range(200):
            w.write(str(i))
            if i % 50 == 0:
                await asyncio.sleep(0)  # let some writes start while others are given
        await asyncio.to_thread(w.wait, 10.0)

    asyncio.run(main())
    assert path.read_text() == "199"
    assert threading.main_thread().name not in threads


def test_a_failed_write_is_told_on_the_loop_and_the_next_one_tries_again(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder should be")
    told: list[bool] = []  # each report: on the loop's own thread?

    async def main() -> None:
        loop_thread = threading.current_thread()
        w = LatestText(
            blocked / "f",
            failed=lambda exc: told.append(threading.current_thread() is loop_thread),
        )
        w.write("x")
        await asyncio.to_thread(w.wait, 10.0)
        for _ in range(100):  # the report is posted to the loop
            if told:
                break
            await asyncio.sleep(0.01)
        blocked.unlink()
        w.write("y")
        await asyncio.to_thread(w.wait, 10.0)

    asyncio.run(main())
    assert told == [True]  # once, and on the loop's own thread
    assert (blocked / "f").read_text() == "y"


def test_a_slow_disk_never_holds_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's turns go on while a write takes long: what it waits for is its own timer."""
    import corral.atomic

    real = corral.atomic.replace_text

    def slow(path: Path, text: str, *, sync: bool = False) -> None:
        time.sleep(0.5)
        real(path, text, sync=sync)

    monkeypatch.setattr(corral.atomic, "replace_text", slow)
    w = LatestText(tmp_path / "f")

    async def main() -> int:
        w.write("a")
        turns = 0
        while not w.wait(0):  # never blocks: only asks
            await asyncio.sleep(0.01)
            turns += 1
        return turns

    assert asyncio.run(main()) > 1  # the loop turned while the thread wrote
    assert (tmp_path / "f").read_text() == "a"


def test_a_file_removed_from_the_loop_goes_and_a_missing_one_is_no_error(tmp_path: Path) -> None:
    big = tmp_path / "state"
    big.write_bytes(b"\0" * (1 << 20))

    async def main() -> bool:
        remove_soon(big)
        remove_soon(tmp_path / "never-there")
        for _ in range(500):
            if not big.exists():
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    remove_soon(tmp_path / "never-there")  # and outside a loop
