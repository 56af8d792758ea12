"""Any name a file system allows becomes a usable model name, the same folder always
gives the same names, and nothing taken from a file is expanded as a macro."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from corral.backends.process import substitute
from corral.modelfiles.folder import model_name, scan, shown
from tests.support.gguf_files import gguf_bytes, llama_fields, write

GOOD = gguf_bytes(llama_fields())


@pytest.mark.parametrize(
    ("stem", "name"),
    [
        ("Llama 3.1 8B Instruct (Q4_K_M)", "Llama-3.1-8B-Instruct-(Q4_K_M)"),
        ("  tabs\tand\nnewlines  ", "tabs-and-newlines"),
        ("qwen2.5:7b", "qwen2.5:7b"),
        ("ünïcödé-模型", "ünïcödé-模型"),
        ("bell\x07", "bell%07"),
        (os.fsdecode(b"latin1-\xe9t\xe9"), "latin1-%E9t%E9"),
        ("   ", "-"),
        ("x${env.SECRET}", "x${env.SECRET}"),  # kept: a name is data, never expanded
    ],
)
def test_a_file_name_maps_to_a_usable_model_name(stem: str, name: str) -> None:
    assert model_name(stem) == name
    assert name.isprintable()
    assert not any(c.isspace() for c in name)
    name.encode("utf-8")  # strict: it goes into JSON, headers and logs


def test_names_that_collide_are_told_apart_the_same_way_every_time(tmp_path: Path) -> None:
    for rel in ("a b.gguf", "a-b.gguf", "x/a b.gguf", "y/x/a b.gguf", "z/x/a b.gguf"):
        write(tmp_path / rel, GOOD)
    names = [sorted((m.name, m.info.path.relative_to(tmp_path)) for m in scan(tmp_path)[0])]
    names.append(sorted((m.name, m.info.path.relative_to(tmp_path)) for m in scan(tmp_path)[0]))
    assert names[0] == names[1]
    assert sorted(n for n, _ in names[0]) == ["a-b", "a-b-2", "x/a-b", "y/x/a-b", "z/x/a-b"]


def test_a_name_with_a_macro_reaches_the_server_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file named `x${env.SECRET}.gguf` once put the variable's value on the server's
    command line: the command Corral builds from files keeps it as text."""
    monkeypatch.setenv("SECRET", "hunter2")
    path = write(tmp_path / "x${env.SECRET} $${PORT}.gguf", GOOD)
    (m,), bad = scan(tmp_path)
    assert bad == []
    argv = shlex.split(substitute(m.command("llama-server"), {"PORT": "9"}, "test"))
    assert argv[argv.index("-m") + 1] == str(path)
    assert argv[argv.index("--alias") + 1] == "x${env.SECRET}-$${PORT}"
    assert argv[argv.index("--port") + 1] == "9"
    assert "hunter2" not in " ".join(argv)


def test_substitute_reads_a_doubled_dollar_as_a_literal() -> None:
    assert substitute("a $${PORT} ${PORT} $$${PORT}", {"PORT": "9"}, "t") == "a ${PORT} 9 $${PORT}"


def test_a_name_that_is_not_utf8_is_served_under_an_escaped_name(tmp_path: Path) -> None:
    raw = os.fsencode(tmp_path) + b"/caf\xe9.gguf"
    with open(raw, "wb") as f:
        f.write(GOOD)
    (m,), _ = scan(tmp_path)
    assert m.name == "caf%E9"
    assert os.fsencode(m.info.path) == raw  # the server gets the file's own bytes
    assert shown(m.info.path).endswith("caf\\xe9.gguf")


def test_one_bad_file_never_stops_the_rest(tmp_path: Path) -> None:
    write(tmp_path / "good one.gguf", GOOD)
    write(tmp_path / "junk.gguf", b"GGUF" + b"\xff" * 40)
    write(tmp_path / "empty.gguf", b"")
    (tmp_path / "folder.gguf").mkdir()
    os.mkfifo(tmp_path / "pipe.gguf")
    found, bad = scan(tmp_path)
    assert [m.name for m in found] == ["good-one"]
    assert sorted(u.name or "" for u in bad) == ["empty", "folder", "junk", "pipe"]
    for u in bad:
        assert shown(u.path) in u.why
