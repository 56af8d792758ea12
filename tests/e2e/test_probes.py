"""Probes that never load a model: `/props?model=M` and `/upstream/M/props` of a
model that is not loaded are answered from what Corral knows, its server's last `/props` or
else its configuration, and the model stays unloaded; a loaded model's server answers itself."""

from __future__ import annotations

import httpx
import pytest

from tests.support.gateway import SIM, serve, wait_for

pytestmark = pytest.mark.e2e


def test_a_probe_of_a_model_that_is_not_loaded_never_loads_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = f"""
models:
  m:
    load_s: 0.3
    concurrency: 2
    capabilities: {{tools: true, context: 4096}}
    cmd: {SIM} --load-s 0.3 --parallel 2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
"""
    folder = tmp_path_factory.mktemp("probes")
    with serve(folder, config) as gw:

        def state() -> str:
            return str(gw.status()["models"]["m"]["state"])

        said = httpx.get(f"{gw.url}/upstream/m/props", timeout=30)
        assert said.headers["x-corral-props"] == "config"
        body = said.json()
        assert body["default_generation_settings"]["n_ctx"] == 4096
        assert body["chat_template_caps"]["supports_tools"] is True
        assert body["total_slots"] == 2
        assert httpx.get(f"{gw.url}/props", params={"model": "m"}).status_code == 200
        assert state() == "unloaded"  # neither probe loaded it
        gw.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        live = httpx.get(f"{gw.url}/props", params={"model": "m"}, timeout=30)
        assert "x-corral-props" not in live.headers  # the server itself answered
        assert live.json()["model_alias"] == "m"
        assert httpx.post(f"{gw.url}/api/models/m/unload", params={"wait": True}).is_success
        wait_for(lambda: state() == "unloaded")
        kept = httpx.get(f"{gw.url}/upstream/m/props", timeout=30)
        assert kept.headers["x-corral-props"] == "kept"
        assert kept.json() == live.json()  # its last answer
        assert state() == "unloaded"
    with serve(folder, config) as gw:  # restarted: the answer was kept in its data folder
        again = httpx.get(f"{gw.url}/upstream/m/props", timeout=30)
        assert again.headers["x-corral-props"] == "kept"
        assert again.json() == live.json()
        assert gw.status()["models"]["m"]["state"] == "unloaded"
    other = config.replace("--parallel 2", "--parallel 2 --answer-tokens 5")
    with serve(folder, other) as gw:  # another command: what it kept is not this server's
        assert httpx.get(f"{gw.url}/upstream/m/props").headers["x-corral-props"] == "config"
