"""A restore verified by the server's own figures: the answer after a restore says
how many prompt tokens the server reused (`timings.cache_n`); at least half of what was
restored is honoured, less is not, counted by its cause; once restores the model's own state
explains (`model_state`) outnumber honoured ones the model's prompt caches are not kept (said
once, the scheduler told, nothing saved or restored again); no other cause ever says so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from corral.config import PromptCacheConfig, parse_config
from corral.core.conversations import Conversations
from corral.core.state import ModelRecord
from corral.core.types import Request
from corral.modelfiles.serving import read_state_facts
from corral.prompt_cache.blame import (
    Cause,
    StateFacts,
    blame,
    cannot_roll_back,
    kv_unified,
)
from corral.prompt_cache.caches import (
    PROBE_FIRST_STARTS,
    PROBE_MAX_STARTS,
    PromptCaches,
    recorded_verdicts,
)
from corral.prompt_cache.keys import text_keys
from corral.prompt_cache.server import Placement, ServerCache, held_tokens, reused_tokens
from corral.prompt_cache.slotmap import SlotMap

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
        caches.verdict("hybrid", restored=1005, reused=0, cause="model_state")
        caches.verdict("hybrid", restored=1005, reused=3, cause="model_state")
    assert not caches.kept("hybrid")
    assert caches.verified("hybrid").startswith("not kept: its server restored 1005 tokens")
    assert told == ["hybrid"]  # once
    said = [r for r in caplog.records if "not kept across swaps" in r.getMessage()]
    assert len(said) == 1
    view = caches.view("hybrid")
    assert (view["honoured"], view["not_honoured"], view["restore_failures"]) == (0, 2, 2)
    assert view["not_honoured_model_state"] == 2
    assert caches.view("dense")["verified"] == "kept and verified"


def test_a_verdict_outlives_a_restart_for_the_same_server(tmp_path: Path) -> None:
    first = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    first.verdict("hybrid", restored=1005, reused=0, fingerprint="fp-hybrid", cause="model_state")
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
    caches.verdict("m", restored=100, reused=0, fingerprint="fp", cause="model_state")  # whole
    assert "fp" in recorded_verdicts(tmp_path)


@pytest.mark.parametrize("cause", ["other_slot", "conversation_changed", "cache_full", "dropped"])
def test_only_the_models_own_state_ever_marks_it_not_kept(tmp_path: Path, cause: Cause) -> None:
    """A shared model whose restores land on the wrong slot, or whose conversations change, or
    whose server drops them, keeps its prompt caches however often it happens: the verdict
    cannot name the model for a placement's failure."""
    caches = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    told: list[str] = []
    caches.on_lost = told.append
    for _ in range(20):
        caches.verdict("shared", restored=500, reused=0, fingerprint="fp", cause=cause)
    assert caches.kept("shared")
    assert told == []
    assert recorded_verdicts(tmp_path) == {}
    view = caches.view("shared")
    assert view[f"not_honoured_{cause}"] == 20
    assert view["not_honoured"] == 20
    assert view["not_honoured_model_state"] == 0


def test_a_model_not_kept_is_probed_and_a_reused_restore_brings_it_back(tmp_path: Path) -> None:
    """A verdict is not forever: every few starts of its servers the model saves and restores
    once more; a probe its state explains failing doubles the wait for the next; a restore
    reused brings the model back (the scheduler told, the recorded verdict forgotten)."""
    caches = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    events: list[tuple[str, str]] = []
    caches.on_lost = lambda m: events.append(("lost", m))
    caches.on_found = lambda m: events.append(("found", m))
    caches.recall("m", "fp")
    caches.verdict("m", restored=800, reused=0, fingerprint="fp", cause="model_state")
    assert not caches.kept("m")
    assert "fp" in recorded_verdicts(tmp_path)

    def starts_until_probe() -> int:
        for n in range(1, 200):
            caches.recall("m", "fp")
            if caches.kept("m"):
                return n
        raise AssertionError("never probed")

    assert starts_until_probe() == PROBE_FIRST_STARTS
    assert caches.verified("m").endswith("trying again now")
    caches.recall("m", "fp")  # the probe's next server restores: still open
    assert caches.kept("m")
    caches.verdict("m", restored=800, reused=0, fingerprint="fp", cause="other_slot")
    assert caches.kept("m")  # a placement's failure says nothing of the model: still probing
    caches.verdict("m", restored=800, reused=2, fingerprint="fp", cause="model_state")
    assert not caches.kept("m")  # the probe failed
    assert starts_until_probe() == 2 * PROBE_FIRST_STARTS
    caches.verdict("m", restored=800, reused=0, fingerprint="fp", cause="model_state")
    waits = [starts_until_probe()]
    for _ in range(8):
        caches.verdict("m", restored=800, reused=0, fingerprint="fp", cause="model_state")
        waits.append(starts_until_probe())
    assert waits[-1] == PROBE_MAX_STARTS  # doubling, bounded
    assert events == [("lost", "m")]
    caches.verdict("m", restored=800, reused=790, fingerprint="fp")
    assert caches.kept("m")
    assert caches.verified("m") == "kept and verified"
    assert events == [("lost", "m"), ("found", "m")]
    assert recorded_verdicts(tmp_path) == {}  # the next run does not start from it
    # Judged afresh from here: one failure does not outweigh the restore just reused.
    caches.verdict("m", restored=800, reused=0, fingerprint="fp", cause="model_state")
    assert caches.kept("m")
    caches.verdict("m", restored=800, reused=0, fingerprint="fp", cause="model_state")
    assert not caches.kept("m")
    assert events[-1] == ("lost", "m")


def test_the_scheduler_prices_a_model_found_again_as_its_settings_say() -> None:
    config = parse_config(
        "models:\n  m:\n    cmd: llama-server -m m.gguf --port ${PORT}\n    prefill_tok_s: 1000\n"
    )
    conversations = Conversations(config)
    copy = ModelRecord("m", config.models["m"])
    r = Request(id=1, model="m")
    r.conversation, r.context_tokens = "c", 4000
    conversations.finished(copy, r)
    kept_s = conversations.refill_s(copy)
    conversations.lost("m")
    assert conversations.refill_s(copy) == pytest.approx(4.0)  # the whole prefill again
    conversations.found("m")
    assert conversations.refill_s(copy) == pytest.approx(kept_s)
    assert kept_s < 4.0


def test_a_verdict_recorded_without_its_cause_is_no_verdict(tmp_path: Path) -> None:
    """Earlier runs recorded verdicts that may have blamed a model for its placement."""
    (tmp_path / "verdicts.json").write_text('{"fp": {"model": "m", "why": "x", "at": 1}}')
    assert recorded_verdicts(tmp_path) == {}


@pytest.mark.parametrize(
    ("placed", "ran", "diverged", "explains", "over", "cause"),
    [
        (1, 2, False, True, True, "other_slot"),  # wherever the state came from, it went elsewhere
        (1, None, True, True, True, "conversation_changed"),
        (1, 1, True, False, False, "conversation_changed"),
        (1, 1, False, True, True, "cache_full"),  # a full cache is not the model's fault
        (1, None, False, False, True, "cache_full"),
        (1, 1, False, True, False, "model_state"),
        (1, None, False, False, False, "dropped"),
        (0, 0, False, False, False, "dropped"),
    ],
)
def test_blame_names_the_first_cause_that_holds(
    placed: int, ran: int | None, diverged: bool, explains: bool, over: bool, cause: Cause
) -> None:
    assert blame(placed, ran, diverged, explains, over) == cause


@pytest.mark.parametrize(
    ("flags", "unified"),
    [
        ("", True),  # one slot asked for: llama-server makes it four over one cache
        ("-np 1", True),
        ("--parallel=-1", True),
        ("-np 4", False),
        ("--parallel 4 -kvu", True),
        ("--kv-unified -np 2", True),
        ("-md draft.gguf", False),  # a draft model keeps the lone slot
        ("-np 4 --no-kv-unified", False),
    ],
)
def test_which_servers_share_one_kv_cache_among_their_slots(flags: str, unified: bool) -> None:
    assert kv_unified(["llama-server", "-m", "m.gguf", *flags.split()]) is unified


def test_which_models_cannot_roll_their_state_back() -> None:
    recurrent = StateFacts(recurrent=True, sliding_window=False)
    swa = StateFacts(recurrent=False, sliding_window=True)
    dense = StateFacts(recurrent=False, sliding_window=False)
    assert cannot_roll_back(recurrent, ["llama-server", "--swa-full"])
    assert cannot_roll_back(swa, ["llama-server", "-m", "x.gguf"])
    assert not cannot_roll_back(swa, ["llama-server", "--swa-full"])
    assert not cannot_roll_back(dense, [])
    assert not cannot_roll_back(None, [])  # a file that cannot be read: never blamed


def test_the_zoos_files_say_which_cannot_roll_back(tmp_path: Path) -> None:
    from corral.zoo import make

    facts = {
        arch: read_state_facts(make(arch, tmp_path).path)
        for arch in ("qwen3", "qwen35", "granitehybrid", "gemma3", "gpt-oss")
    }
    assert facts["qwen3"] == StateFacts(recurrent=False, sliding_window=False)
    assert facts["qwen35"] is not None
    assert facts["qwen35"].recurrent
    assert facts["granitehybrid"] is not None
    assert facts["granitehybrid"].recurrent
    assert facts["gemma3"] == StateFacts(recurrent=False, sliding_window=True)
    assert facts["gpt-oss"] == StateFacts(recurrent=False, sliding_window=True)
    assert read_state_facts(tmp_path / "missing.gguf") is None
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    assert read_state_facts(tmp_path / "junk.gguf") is None


def test_the_tokens_a_slot_holds_are_read_from_its_answers_timings() -> None:
    answer = b'data: {"timings": {"cache_n": 300, "prompt_n": 120, "predicted_n": 16}}\n\n'
    assert held_tokens(answer) == 436
    assert held_tokens(b'{"timings": {"cache_n": 3, "prompt_n": 1}}') is None  # not all three


@pytest.mark.parametrize(("others", "cause"), [(700, "cache_full"), (100, "dropped")])
def test_a_restore_lost_beside_a_full_unified_cache_is_blamed_on_it(
    tmp_path: Path, others: int, cause: Cause
) -> None:
    """The request's tokens (its answer's timings) and the other slots' did not fit the
    server's one KV cache: the cache was full, whatever the model; with room, the loss is
    one the server does not explain."""
    caches = PromptCaches(PromptCacheConfig(dir=str(tmp_path)), tmp_path)
    server = ServerCache("m", "llama-server -m m.gguf", caches)
    server.map = SlotMap(4, n_ctx=1_024, unified=True)
    server.map.done(0, text_keys("o" * 2048), others)
    keys = text_keys("k" * 2048)
    assert server.map.place(keys, now=1.0) == (1, 0)
    answer = b'{"timings": {"cache_n": 0, "prompt_n": 400, "predicted_n": 10}}'
    server.done(Placement(1, keys, b"{}", restored=390), answer)
    view = caches.view("m")
    assert view[f"not_honoured_{cause}"] == 1
    assert view["not_honoured"] == 1
    assert caches.kept("m")
    assert server.map.slots[1].tokens == 410  # what its slot holds now, as the answer says
