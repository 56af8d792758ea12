"""A restore verified by the server's own figures: the answer after a restore says
how many prompt tokens the server reused (`timings.cache_n`); at least half of what was
restored is honoured, less is not; once unhonoured restores outnumber honoured ones the model's
prompt caches are not kept (said once, the scheduler told, nothing saved or restored again)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from corral.config import PromptCacheConfig
from corral.prompt_cache.caches import PromptCaches, recorded_verdicts
from corral.prompt_cache.server import reused_tokens

pytestmark = pytest.mark.unit


def test_the_reused_tokens_are_read_from_an_answer_or_a_streams_tail() -> None:
    whole = b'{"choices":[],"timings":{"cache_n":990,"prompt_n":12,"prompt_ms":3.1}}'
    assert reused_tokens(whole) == 990
    tail = b'data: {"choices":[]}\n\ndata: {"timings": {"cache_n" : 0, "prompt_n": 1002}}\n\n'
    assert reused_tokens(tail) == 0
    assert reused_tokens(b'{"usage": {"prompt_tokens": 12}}') is None  # not a llama-server
    assert reused_tokens(b"") is None


def test_a_model_is_not_kept_once_its_restores_prove_useless(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caches = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    told: list[str] = []
    caches.on_lost = told.append
    assert caches.verified("dense") == "kept"
    caches.verdict("dense", restored=1005, reused=990)  # the prompt was a prefix: honoured
    assert caches.verified("dense") == "kept and verified"
    caches.verdict("dense", restored=1005, reused=0)  # one miss among honoured ones: kept
    assert caches.kept("dense")
    with caplog.at_level(logging.WARNING, logger="corral.prompt_cache"):
        caches.verdict("hybrid", restored=1005, reused=0)
        caches.verdict("hybrid", restored=1005, reused=3)
    assert not caches.kept("hybrid")
    assert caches.verified("hybrid").startswith("not kept: its server restored 1005 tokens")
    assert told == ["hybrid"]  # once
    said = [r for r in caplog.records if "not kept across swaps" in r.getMessage()]
    assert len(said) == 1
    view = caches.view("hybrid")
    assert (view["honoured"], view["not_honoured"], view["restore_failures"]) == (0, 2, 2)
    assert caches.view("dense")["verified"] == "kept and verified"


def test_a_verdict_outlives_a_restart_for_the_same_server(tmp_path: Path) -> None:
    first = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    first.verdict("hybrid", restored=1005, reused=0, fingerprint="fp-hybrid")
    assert recorded_verdicts(tmp_path)["fp-hybrid"].startswith("its server restored 1005")
    again = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    told: list[str] = []
    again.on_lost = told.append
    again.recall("hybrid", "fp-other")  # another file or other flags: verified afresh
    assert again.kept("hybrid")
    again.recall("hybrid", "fp-hybrid")
    assert not again.kept("hybrid")
    assert "found in an earlier run" in again.verified("hybrid")
    assert told == ["hybrid"]
    again.recall("hybrid", "fp-hybrid")  # said once
    assert told == ["hybrid"]


@pytest.mark.parametrize("damaged", ["{", "[]", '{"fp": 3}', '{"fp": {"why": 7}}', "\\x00"])
def test_a_damaged_verdicts_file_is_no_verdict(tmp_path: Path, damaged: str) -> None:
    (tmp_path / "verdicts.json").write_text(damaged)
    assert recorded_verdicts(tmp_path) == {}
    caches = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    caches.recall("m", "fp")
    assert caches.kept("m")
    caches.verdict("m", restored=100, reused=0, fingerprint="fp")  # written over it, whole
    assert "fp" in recorded_verdicts(tmp_path)
