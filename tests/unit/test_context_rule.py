"""The context a found model gets: the default rule by trained context and memory
budget, a folder's and a model's setting, `--context`, and `num_ctx` at Ollama's door."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from corral.compose import with_contexts
from corral.config import Config, ModelsDir
from corral.errors import CorralError
from corral.gateway.doors.ollama_shapes import BadRequest, asked_context
from corral.modelfiles.folder import Contexts, default_context
from corral.modelfiles.gguf import GgufModel, estimate_memory

GB = 10**9


def model(context_length: int, layers: int = 36, kv_heads: int = 8) -> GgufModel:
    """A qwen3-8B-like dense model (4.7 GB of weights): 144 KiB of KV cache per token."""
    return GgufModel(
        path=Path("m.gguf"), architecture="qwen3", name="m", parameters=8_000_000_000,
        quantization="Q4_K_M", context_length=context_length, layers=layers, embedding=4096,
        feed_forward=12288, heads=32, kv_heads=kv_heads, key_length=128, value_length=128,
        vocab=151936, sliding_window=None, chat_template=None, weights_bytes=4_700_000_000,
    )  # fmt: skip


def test_agents_get_32k_where_it_fits_in_half_the_largest_device() -> None:
    m = model(131072)
    assert default_context(m, 24 * GB) == 32768
    assert default_context(m, None) == 32768  # unsized devices: the agents' window


def test_a_smaller_device_gets_the_largest_window_that_fits_half_of_it() -> None:
    m = model(131072)
    for budget_gb in (8, 10, 12, 14, 16, 20):
        context = default_context(m, budget_gb * GB)
        # What it picked fits half the device; twice it would not (unless it is the floor).
        assert 2 * estimate_memory(m, context).total_bytes <= budget_gb * GB or context == 4096
        if context < 32768:
            assert 2 * estimate_memory(m, 2 * context).total_bytes > budget_gb * GB
    assert default_context(m, 8 * GB) == 4096  # too big for half of 8 GB at any window: 4K


def test_large_devices_give_long_windows_and_training_caps_every_one() -> None:
    assert default_context(model(131072), 80 * GB) == 131072
    assert default_context(model(40960), 80 * GB) == 32768  # the largest step not past 40,960
    assert default_context(model(2048), 80 * GB) == 2048  # trained for less than any step
    assert default_context(model(8192), 24 * GB) == 8192


def test_a_models_setting_wins_over_its_folders_over_the_default() -> None:
    m = model(32768)
    rule = Contexts(24 * GB, folder=8192, per_model={"coder": 65536})
    assert rule.of("coder", m, False) == (65536, "set for the model")
    assert rule.of("other", m, False) == (8192, "set for the folder")
    assert Contexts(24 * GB).of("other", m, False) == (32768, "default")


def test_models_dir_takes_a_path_or_a_section_and_checks_the_numbers() -> None:
    config = Config.model_validate(
        {"models_dir": ["/a", {"path": "/b", "context": 65536, "contexts": {"x": 4096}}]}
    )
    assert config.models_dir == [
        ModelsDir(path="/a"),
        ModelsDir(path="/b", context=65536, contexts={"x": 4096}),
    ]
    assert ModelsDir(path="~/m").folder == Path.home() / "m"  # as a shell would read it
    with pytest.raises(ValidationError, match="context"):
        Config.model_validate({"models_dir": [{"path": "/b", "context": 10}]})
    with pytest.raises(ValidationError, match="contexts"):
        Config.model_validate({"models_dir": [{"path": "/b", "contexts": {"x": "big"}}]})
    with pytest.raises(ValidationError, match="contex"):
        Config.model_validate({"models_dir": [{"path": "/b", "contex": 4096}]})  # a typo


def test_the_context_option_applies_over_every_folder() -> None:
    dirs = [ModelsDir(path="/a", context=8192, contexts={"x": 4096}), ModelsDir(path="/b")]
    out = with_contexts(dirs, ["65536", "y=16384", "x=32_768"])
    assert [d.context for d in out] == [65536, 65536]
    assert out[0].contexts == {"x": 32768, "y": 16384}
    assert with_contexts(dirs, []) == dirs
    for bad in ("big", "=4096", "x=", "100", "x=99999999999"):
        with pytest.raises(CorralError, match="--context"):
            with_contexts(dirs, [bad])


def test_num_ctx_is_read_and_checked() -> None:
    assert asked_context({"options": {"num_ctx": 65536}}) == 65536
    assert asked_context({"options": {}}) is None
    assert asked_context({}) is None
    for bad in (0, -1, "8k", 1.5, True):
        with pytest.raises(BadRequest, match=r"options\.num_ctx"):
            asked_context({"options": {"num_ctx": bad}})
