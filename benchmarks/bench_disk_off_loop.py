"""What the prompt caches' disk work costs the serving loop: a saved state dropped (its file
removed: the file system frees its blocks) and the states' index rewritten and synced, done on
the loop as a plain call against `corral.atomic`'s `remove_soon` and `LatestText` (the work
handed to a thread), in the same run. A ticker on the loop wakes every 5 ms; per way, the
largest lag it saw across `--rounds` drops of a `--state-mb` file and index writes of
`--entries` entries (the size of a full states folder's index).

    .venv/bin/python benchmarks/bench_disk_off_loop.py [--state-mb 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from corral.atomic import LatestText, remove_soon, replace_text

TICK_S = 0.005


def index_text(entries: int) -> str:
    state = {"model": "m", "fingerprint": "f" * 32, "keys": ["k" * 16] * 50, "tokens": 4000,
             "bytes": 10**8, "saved_at": 0.0, "used_at": 0.0}  # fmt: skip
    return json.dumps({"version": 1, "states": [{"file": f"m-{i}.state", **state}
                                               for i in range(entries)]})  # fmt: skip


async def lags_while(work: list[tuple[str, object]], folder: Path, off_loop: bool) -> list[float]:
    """The ticker's lags (seconds) while each (kind, arg) of `work` runs on the loop."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - t - TICK_S)

    index = LatestText(folder / "index.json", sync=True)
    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.05)
    for kind, arg in work:
        if kind == "drop":
            assert isinstance(arg, Path)
            remove_soon(arg) if off_loop else arg.unlink()
        else:
            assert isinstance(arg, str)
            index.write(arg) if off_loop else replace_text(folder / "index.json", arg, sync=True)
        await asyncio.sleep(0.1)  # the loop serves on; a thread may still be at it
    await asyncio.to_thread(index.wait, 30.0)
    while any(p.exists() for k, p in work if k == "drop" and isinstance(p, Path)):
        await asyncio.sleep(0.05)
    stop.set()
    await tick
    return lags


def one_way(folder: Path, off_loop: bool, state_mb: int, entries: int) -> list[float]:
    text = index_text(entries)
    state = folder / "s.state"
    state.write_bytes(os.urandom(1 << 20) * state_mb)
    os.sync()  # its blocks on disk, as a state saved a while ago
    return asyncio.run(lags_while([("drop", state), ("index", text)], folder, off_loop))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=int, default=512)
    ap.add_argument("--entries", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (the disk)")
    args = ap.parse_args()
    worst: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(args.rounds):
            for off_loop in (False, True):  # alternating: both see the same disk
                lags = one_way(Path(tmp), off_loop, args.state_mb, args.entries)
                worst[off_loop].append(max(lags))
    print(f"{platform.machine()}, {os.cpu_count()} cores; a {args.state_mb} MB state dropped "
          f"and a {args.entries}-entry index written, {args.rounds} rounds")  # fmt: skip
    print("| way | the loop's largest lag: median | max |")
    print("|---|---:|---:|")
    for off_loop, name in ((False, "on the loop"), (True, "off the loop (Corral)")):
        ms = [x * 1e3 for x in worst[off_loop]]
        print(f"| {name} | {statistics.median(ms):.1f} ms | {max(ms):.1f} ms |")


if __name__ == "__main__":
    main()
