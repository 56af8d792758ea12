"""What a hostile or merely large models folder costs to scan: a folder of 5,000
files (junk, empty, text, hostile headers, a few small models) through `corral models`, and
1 GB sparse files whose headers claim the most a header can, each read in a process of its own
so its peak memory is its own. An older walker (efdb423) reads the same files in the
same run, within a 20 s and 2 GB limit, for comparison.

    make bench-folder-scan        # ~2 min; figures in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gguf import GGUFValueType as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.gguf_files import gguf_bytes, kv, llama_fields, text, write  # noqa: E402

GB = 1 << 30
BEFORE = "efdb423"  # the last commit before the bounded walker


def hostile_files(folder: Path) -> dict[str, Path]:
    """1 GB sparse files, each claiming the most of one kind."""
    fields = llama_fields()
    head_kv = b"".join(kv(k, t, v) for k, (t, v) in fields.items())

    def sparse(name: str, head: bytes) -> Path:
        path = write(folder / f"{name}.gguf", head)
        with path.open("r+b") as f:
            f.truncate(GB)
        return path

    def with_keys(extra: bytes, keys: int) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields) + keys) + head_kv + extra

    return {
        "2^60 keys": sparse("keys", b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60)),
        "2^60 tensors": sparse("tensors", b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0)),
        "2^62-byte string": sparse(
            "string", with_keys(text("x.s") + struct.pack("<IQ", T.STRING, 1 << 62), 1)
        ),
        "900 MB string": sparse(
            "string900", with_keys(text("x.s") + struct.pack("<IQ", T.STRING, 900 << 20), 1)
        ),
        "130M empty strings": sparse(
            "strings",
            with_keys(text("x.a") + struct.pack("<IIQ", T.ARRAY, T.STRING, GB // 8 - 64), 1),
        ),
        "2^40 u8 array": sparse(
            "array", with_keys(text("x.a") + struct.pack("<IIQ", T.ARRAY, T.UINT8, 1 << 40), 1)
        ),
        "65,536 keys of 16 KB": sparse(
            "manykeys",
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 16)
            + b"".join(kv(f"k{i}", T.STRING, "v" * 16000) for i in range(1 << 16)),
        ),
    }  # fmt: skip


def junk_folder(folder: Path, files: int) -> None:
    rng = __import__("random").Random(36)
    good = gguf_bytes(llama_fields())
    for i in range(files):
        sub = folder / f"d{i % 50:02d}"
        kind = i % 10
        if kind == 0:
            write(sub / f"model {i}.gguf", good)
        elif kind in (1, 2):
            write(sub / f"junk {i}.gguf", rng.randbytes(rng.randint(0, 4096)))
        elif kind == 3:
            write(sub / f"trunc {i}.gguf", good[: rng.randint(4, len(good) - 1)])
        else:
            write(sub / f"notes {i}.txt", b"not a model\n" * 100)


CHILD = """
import resource, sys, time, importlib.util
from pathlib import Path
spec = importlib.util.spec_from_file_location("walker", sys.argv[1])
walker = importlib.util.module_from_spec(spec); sys.modules["walker"] = walker
spec.loader.exec_module(walker)
started = time.perf_counter()
try:
    walker.read_gguf(Path(sys.argv[2])); out = "read"
except Exception as exc:
    out = type(exc).__name__ + ": " + str(exc).split("(", 1)[-1][:70]
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{time.perf_counter() - started:.3f}\\t{peak_kib}\\t{out}")
"""


def read_in_child(walker: Path, path: Path, limit_s: float, limit_bytes: int) -> str:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(walker), str(path)],
            capture_output=True, text=True, timeout=limit_s, preexec_fn=limits,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f">{limit_s:g} s\t-\tstill walking at the limit"
    line = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
    if done.returncode != 0:
        return f"-\t-\tdied: {line[:80]}"
    seconds, kib, out = line.split("\t", 2)
    return f"{float(seconds):.2f} s\t{int(kib) / 1024:.0f} MB\t{out}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=5000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-folder-"))
    try:
        old = work / "gguf_before.py"
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{BEFORE}:src/corral/modelfiles/gguf.py"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        old.write_text(shown.stdout)
        new = ROOT / "src" / "corral" / "modelfiles" / "gguf.py"
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"machine: {os.cpu_count()} cores; load {load}")
        folder = work / "folder"
        junk_folder(folder, args.files)
        corral = Path(sys.executable).parent / "corral"
        started = time.perf_counter()
        done = subprocess.run([corral, "models", str(folder)], capture_output=True, text=True)
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        skipped = done.stderr.count("skipped")
        print(
            f"corral models on {args.files:,} files: {seconds:.1f} s, peak {peak:.0f} MB, "
            f"exit {done.returncode}, {skipped:,} skipped lines, traceback: "
            f"{'Traceback' in done.stderr}"
        )
        hostile = hostile_files(work / "hostile")
        print("\nfile (1 GB, sparse)\twalker\ttime\tpeak RSS\toutcome")
        for name, path in hostile.items():
            for label, walker in (("now", new), (f"before ({BEFORE})", old)):
                print(f"{name}\t{label}\t{read_in_child(walker, path, 20, 2 * GB)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
