"""The project's text speaks of the product, not of how its development was organised: no
sitting or session of work, no machine lent, nowhere it is read (code, tests, scripts, the
README, the docs); and the code, its tests and the docs say what and why, never in which issue
(`CHANGELOG.md` is where an issue number may appear)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# Where the product's text lives; the changelog is the one place that may name an issue.
READ = ("src", "tests", "benchmarks", "scripts", "compat", "deploy", "examples", "docs",
        "README.md", "Makefile")  # fmt: skip
DIARY = re.compile(
    r"\bsittings?\b"
    r"|\b(?:this|that|last|next|previous|earlier|later|first|second|third|fourth|fifth|sixth)"
    r" (?:work )?session\b"
    r"|\b(?:was|were|is|not|never|no GPU|no device) (?:machine )?lent\b"
    r"|\bmachines? (?:was |were |is )?lent\b"
    r"|\blent (?:a|one|us|to (?:this|that|the) session)\b",
    re.IGNORECASE,
)
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+\b")


def _files(*roots: str) -> list[Path]:
    """The tracked files under `roots` (what a clone holds), text ones only."""
    out = subprocess.run(
        ["git", "ls-files", "--", *roots], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    files = []
    for name in out:
        path = ROOT / name
        if path.suffix in {".png", ".gguf", ".jpg", ".whl", ".gz"} or not path.is_file():
            continue
        files.append(path)
    return files


def diary_lines(paths: list[Path], pattern: re.Pattern[str]) -> list[str]:
    """`file:line: text` for every line of `paths` that `pattern` finds."""
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return found


def test_no_text_about_how_the_work_was_organised() -> None:
    here = Path(__file__).resolve()
    paths = [p for p in _files(*READ) if p != here]
    assert len(paths) > 300  # the tree was read
    assert diary_lines(paths, DIARY) == []


def test_the_code_and_the_docs_name_no_issue() -> None:
    here = Path(__file__).resolve()
    paths = [p for p in _files(*READ) if p != here]
    assert len([p for p in paths if "src" in p.parts]) > 150
    assert diary_lines(paths, ISSUE) == []


@pytest.mark.parametrize(
    "planted",
    [
        "Measured in the fourth session on the 2-core machine.",
        "No GPU was lent, so vLLM was not tried.",
        "Tried on the crowded family in this sitting, not landed.",
        "A device machine lent to some sessions only.",
    ],
)
def test_the_guard_finds_a_planted_diary_sentence(tmp_path: Path, planted: str) -> None:
    doc = tmp_path / "planted.md"
    doc.write_text(f"# Figures\n\nThe relay costs 1.1x a bare proxy. {planted}\n")
    found = [line for line in doc.read_text().splitlines() if DIARY.search(line)]
    assert found == [f"The relay costs 1.1x a bare proxy. {planted}"]


def test_the_guard_finds_an_issue_number_and_leaves_product_words_alone() -> None:
    assert ISSUE.search("a lease that lapses (issue 25)")
    assert not DIARY.search("the client's session, a chat session, aiohttp.ClientSession")
    assert not DIARY.search("a keep-alive of 5 s; each session's cookies")
