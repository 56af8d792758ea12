"""A restore verified by the server's own figures (issue 47): the answer after a restore says
how many prompt tokens the server reused (`timings.cache_n`); at least half of what was
restored is honoured, less is not; once unhonoured restores outnumber honoured ones the model's
prompt caches are not kept (said once, the scheduler told, nothing saved or restored again)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from corral.config import PromptCacheConfig
from corral.prompt_cache.caches import PromptCaches
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
