from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml

from corral.config import load_config, parse_config
from corral.errors import ConfigError

ISSUE_EXAMPLE = """\
devices:
  - name: gpu0
    memory_gb: 24
models:
  cover-writer:
    load_s: 4
    unload_s: 1
    memory_gb: 2
    concurrency: 1
    priority: 0
    unload_delay_s: 0
  research-8b: {load_s: 12, unload_s: 2}
scheduler:
  policy: cost
  max_wait_s: 120
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "c.yaml")
    return [str(p) for p in exc.value.problems]


def test_issue_example_parses_with_defaults() -> None:
    c = parse_config(ISSUE_EXAMPLE)
    assert c.devices[0].memory_gb == 24
    assert c.models["research-8b"].load_s == 12
    assert c.models["research-8b"].concurrency == 1
    assert c.scheduler.policy == "cost"
    assert c.scheduler.max_wait_s == 120


def test_defaults_one_device_and_cost_policy() -> None:
    c = parse_config("models:\n  m: {load_s: 3}\n")
    assert [d.name for d in c.devices] == ["device0"]
    assert c.devices[0].memory_gb is None
    assert c.scheduler.policy == "cost"


def test_max_wait_null_disables_the_bound() -> None:
    c = parse_config("models: {m: {}}\nscheduler: {max_wait_s: null}\n")
    assert c.scheduler.max_wait_s is None


def test_unknown_key_names_path_line_and_allowed_keys() -> None:
    (p,) = problems("models:\n  m:\n    load_s: 3\n    laod_s: 4\n")
    assert p.startswith("c.yaml:4: models.m.laod_s: unknown key")
    assert "load_s" in p
    assert "unload_delay_s" in p


def test_allowed_keys_are_the_keys_a_file_uses_not_the_code_names() -> None:
    (p,) = problems("models:\n  m:\n    laod_s: 4\n")
    assert "batch" in p.split("allowed:")[1]
    assert "coalesce" not in p
    (p,) = problems("models:\n  m:\n    batch:\n      max_sise: 4\n")
    assert p.startswith("c.yaml:4: models.m.batch.max_sise: unknown key")
    assert "max_size" in p
    assert "max_wait_ms" in p


def test_unknown_top_level_and_scheduler_keys() -> None:
    ps = problems("models: {m: {}}\nschedular: {}\nscheduler: {polcy: cost}\n")
    assert any(p.startswith("c.yaml:2: schedular: unknown key") for p in ps)
    assert any("scheduler.polcy: unknown key" in p and "max_wait_s" in p for p in ps)


def test_bad_policy_lists_the_allowed_ones() -> None:
    (p,) = problems("models: {m: {}}\nscheduler:\n  policy: lifo\n")
    assert p.startswith("c.yaml:3: scheduler.policy:")
    for name in ("fifo", "grouped", "fifo-plus", "priority", "cost"):
        assert name in p


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("models: {m: {load_s: -1}}\n", "models.m.load_s: Input should be greater than or equal"),
        ("models: {m: {concurrency: 0}}\n", "models.m.concurrency"),
        ("models: {m: {load_s: fast}}\n", "models.m.load_s"),
        ("models: {}\n", "models"),
        ("devices: []\nmodels: {m: {}}\n", "devices"),
    ],
)
def test_bad_values_name_the_key(text: str, fragment: str) -> None:
    assert any(fragment in p for p in problems(text))


def test_every_problem_is_reported_at_once() -> None:
    ps = problems("models:\n  a: {load_s: -1}\n  b: {concurrency: 0, colour: red}\n")
    assert len(ps) == 3


def test_duplicate_keys_are_errors() -> None:
    ps = problems("models:\n  m: {load_s: 1}\n  m: {load_s: 2}\n")
    assert any("c.yaml:3: models.m: key appears twice" in p for p in ps)


def test_model_larger_than_every_device() -> None:
    (p,) = problems("devices: [{name: g, memory_gb: 8}]\nmodels: {big: {memory_gb: 20}}\n")
    assert "needs memory_gb 20 but the largest device has 8" in p


def test_a_model_pinned_to_an_unknown_or_too_small_device() -> None:
    (p,) = problems("devices: [{name: g}]\nmodels: {m: {devices: [h]}}\n")
    assert "model 'm' names devices 'h', which are not defined; devices: g" in p
    text = "devices: [{name: g, memory_gb: 8}, {name: h, memory_gb: 80}]\n"
    (p,) = problems(text + "models: {m: {memory_gb: 20, devices: [g]}}\n")
    assert "needs memory_gb 20, more than any of its devices (g) has" in p


def test_preload_and_ttl() -> None:
    config = parse_config("models: {m: {ttl_s: 300, aliases: [mm]}}\nserver: {preload: [mm]}\n")
    assert config.models["m"].ttl_s == 300
    assert config.server.preload == ["mm"]
    (p,) = problems("models: {m: {}}\nserver: {preload: [x]}\n")
    assert "server.preload names 'x', which is not a model or alias; models: m" in p
    assert any("models.m.ttl_s" in p for p in problems("models: {m: {ttl_s: 0}}\n"))


def test_device_names_unique() -> None:
    assert any(
        "repeated: g" in p for p in problems("devices: [{name: g}, {name: g}]\nmodels: {m: {}}\n")
    )


def test_yaml_syntax_error_has_line() -> None:
    (p,) = problems("models:\n  m: {load_s: 1\n")
    assert p.startswith("c.yaml:3: not valid YAML") or p.startswith("c.yaml:2: not valid YAML")


def test_empty_and_non_mapping_files() -> None:
    assert "empty" in problems("")[0]
    assert "must be a mapping" in problems("- a\n- b\n")[0]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_with_policy_copies() -> None:
    c = parse_config(ISSUE_EXAMPLE)
    assert c.with_policy("fifo").scheduler.policy == "fifo"
    assert c.scheduler.policy == "cost"


def test_env_variables_expand_in_corrals_own_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_K", "real-secret")
    monkeypatch.setenv("CORRAL_PORT", "9001")
    c = parse_config(
        "models:\n  m: {cmd: 'serve --port ${env.CORRAL_PORT}'}\n"
        "server:\n  api_keys: ['${env.CORRAL_K}', 'k-${env.CORRAL_K}']\n"
    )
    assert c.server.api_keys == ["real-secret", "k-real-secret"]
    assert c.models["m"].cmd == "serve --port 9001"


def test_an_unset_env_variable_is_an_error_naming_it_and_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CORRAL_NOPE", raising=False)
    with pytest.raises(ConfigError) as exc:
        parse_config(
            "models:\n  m: {load_s: 1}\nserver:\n  api_keys:\n    - ${env.CORRAL_NOPE}\n", "c.yaml"
        )
    assert str(exc.value.problems[0]) == (
        "c.yaml:5: server.api_keys.0: environment variable CORRAL_NOPE is not set "
        "(${env.CORRAL_NOPE})"
    )


def test_a_yaml_alias_inside_its_own_anchor_is_a_config_error() -> None:
    # Found by tests/unit/test_fuzz_parsers.py: it was a RecursionError and a traceback.
    with pytest.raises(ConfigError, match="refers to itself"):
        parse_config("models:\n  m: {load_s: 1}\nx: &a [*a]\n", "c.yaml")


def test_a_dumped_configuration_reads_back_with_the_keys_as_written() -> None:
    """Keys whose code name differs (a model's `batch:` is coalescing, `coalesce` in code; a
    hook's `json`) are dumped as a file spells them, so `corral config check`'s resolved
    configuration and a saved scenario read back."""
    text = """
models:
  e:
    batch: {max_size: 8}
    upstream: http://127.0.0.1:9
    load_hook: {path: /wake_up, json: {tags: [weights]}}
"""
    config = parse_config(text, "c.yaml")
    assert config.models["e"].coalesce is not None
    dumped = config.model_dump(mode="json", exclude_none=True)
    assert dumped["models"]["e"]["batch"]["max_size"] == 8
    assert dumped["models"]["e"]["load_hook"]["json"] == {"tags": ["weights"]}
    assert parse_config(yaml.safe_dump(dumped), "again.yaml") == config


def test_a_name_without_a_tag_finds_its_latest_as_ollama_does() -> None:
    """In an Ollama store only `good:latest` was found for `good`."""
    config = parse_config(
        "models:\n  'good:latest': {}\n  'other:7b': {}\n  plain: {aliases: [alias]}\n"
    )
    assert config.resolve("good") == "good:latest"
    assert config.resolve("good:latest") == "good:latest"
    assert config.resolve("other") is None  # only `latest` is implied, as in Ollama
    assert config.resolve("plain") == "plain"
    assert config.resolve("alias") == "plain"
    assert config.resolve("hf.co/org/good") is None


def test_the_names_table_answers_as_resolve_does() -> None:
    """`Config.names` (pickled to a batch's checking process) against `resolve` itself, with a
    name claimed twice (an alias, a filter's id): the first model to claim it wins."""
    config = parse_config(
        """
models:
  'good:latest': {}
  a: {aliases: [x]}
  b: {aliases: [y]}
  c: {filters: {set_params_by_id: {fast: {temperature: 0}, x: {}}}}
"""
    )
    names = config.names()
    asked = ["good", "good:latest", "a", "b", "c", "x", "y", "fast", "nope", "a:7b"]
    assert [names(n) for n in asked] == [config.resolve(n) for n in asked]
    assert [names(n) for n in ("good", "x", "fast")] == ["good:latest", "a", "c"]
    assert pickle.loads(pickle.dumps(names)) == names


def test_a_skipped_model_is_told_under_the_names_resolve_takes() -> None:
    from corral.gateway.pipeline.calls import unknown_model

    config = parse_config("models:\n  served: {cmd: x}\n")
    config.skipped.update({"good:latest": "a.gguf: why one", "plain": "b.gguf: why two"})
    for asked, why in [
        ("good", "why one"), ("good:latest", "why one"), ("plain", "why two"),
        ("plain:latest", "why two"),
    ]:  # fmt: skip
        error = unknown_model(asked, config)
        assert error.code == "model_not_served"
        assert why in error.message
    assert unknown_model("other", config).code == "model_not_found"
