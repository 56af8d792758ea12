"""Built-in scenarios that reproduce the situations Corral grew from (see docs/scenarios.md).

Each is a configuration plus a deterministic trace (seeded), so every figure is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from corral.config import Config, parse_config
from corral.errors import UnknownScenario
from corral.sim.trace import Trace, TraceLine


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    config: Config
    trace: Trace


def _trace(name: str, lines: list[dict[str, object]]) -> Trace:
    out = []
    for i, x in enumerate(lines, start=1):
        out.append(
            TraceLine(
                line=i,
                model=str(x["model"]),
                service_s=float(x["service_s"]),  # type: ignore[arg-type]
                priority=int(x.get("priority", 0)),  # type: ignore[call-overload]
                t=float(x["t"]) if "t" in x else None,  # type: ignore[arg-type]
                session=str(x["session"]) if "session" in x else None,
                think_s=float(x.get("think_s", 0.0)),  # type: ignore[arg-type]
                background=x.get("class") == "batch",
                context_tokens=int(x.get("context_tokens", 0)),  # type: ignore[call-overload]
                principal=str(x["principal"]) if "principal" in x else None,
            )
        )
    return Trace(out, f"<scenario {name}>")


def approvals() -> Scenario:
    """A user approves 10 jobs at once; each queues a cover letter and a company research task,
    alternating types (the job-board queue of seed 000)."""
    cfg = parse_config(
        """
models:
  cover-writer: {load_s: 4, unload_s: 1, service_s: 8}
  research-8b: {load_s: 12, unload_s: 2, service_s: 10}
scheduler: {policy: cost, max_wait_s: 300}
""",
        "<scenario approvals>",
    )
    rng = random.Random(2)
    lines: list[dict[str, object]] = []
    for job in range(10):
        t = job * 0.2
        lines.append({"t": t, "model": "cover-writer", "service_s": round(rng.uniform(6, 10), 2)})
        lines.append(
            {"t": t + 0.1, "model": "research-8b", "service_s": round(rng.uniform(8, 12), 2)}
        )
    return Scenario("approvals", approvals.__doc__ or "", cfg, _trace("approvals", lines))


def agents() -> Scenario:
    """An agent framework in closed loop: one orchestrator, three explorers and one coder session,
    each sending its next request a think-time after the last one finished (llama-swap PR #611)."""
    cfg = parse_config(
        """
models:
  orchestrator-14b: {load_s: 10, unload_s: 2, service_s: 4}
  explorer-7b: {load_s: 6, unload_s: 1, service_s: 3}
  coder-14b: {load_s: 12, unload_s: 2, service_s: 8}
scheduler: {policy: cost, max_wait_s: 60}
""",
        "<scenario agents>",
    )
    rng = random.Random(1)
    lines: list[dict[str, object]] = []
    sessions = [("orchestrator", "orchestrator-14b", 4.0, 1.0)]
    sessions += [(f"explorer-{i}", "explorer-7b", 3.0, 0.5) for i in range(1, 4)]
    sessions += [("coder", "coder-14b", 8.0, 1.0)]
    for name, model, svc, think in sessions:
        for k in range(30):
            line: dict[str, object] = {
                "session": name,
                "model": model,
                "service_s": round(svc * rng.uniform(0.6, 1.4), 2),
                "think_s": round(think * rng.uniform(0.5, 1.5), 2),
            }
            if k == 0:
                line["t"] = round(rng.uniform(0, 2), 2)
            lines.append(line)
    return Scenario("agents", agents.__doc__ or "", cfg, _trace("agents", lines))


def conversations() -> Scenario:
    """Two agent loops over an orchestrator, an explorer and a coder model on one device, each
    step going to the next model with the loop's conversation with it, grown by 600-1,200
    tokens: every step a swap, and what a swap throws away is that model's
    conversation, unless its prompt caches are kept (they are: `prompt_cache: true`)."""
    cfg = parse_config(
        """
models:
  orchestrator: {load_s: 6, unload_s: 1, service_s: 2, prefill_tok_s: 1500, prompt_cache: true,
                 kv_bytes_per_token: 40000}
  explorer: {load_s: 4, unload_s: 1, service_s: 1.5, prefill_tok_s: 2500, prompt_cache: true,
             kv_bytes_per_token: 20000}
  coder: {load_s: 8, unload_s: 1, service_s: 3, prefill_tok_s: 1000, prompt_cache: true,
          kv_bytes_per_token: 60000}
scheduler: {policy: cost, max_wait_s: 60}
""",
        "<scenario conversations>",
    )
    rng = random.Random(38)
    lines: list[dict[str, object]] = []
    for loop in ("loop-1", "loop-2"):
        context = {m: rng.randint(3000, 6000) for m in cfg.models}
        for k in range(12):
            model = list(cfg.models)[k % 3]
            line: dict[str, object] = {
                "session": loop,
                "model": model,
                "service_s": round(cfg.models[model].service_s * rng.uniform(0.6, 1.4), 2),
                "context_tokens": context[model],
                "think_s": round(rng.uniform(0.5, 1.5), 2),
            }
            if k == 0:
                line["t"] = round(rng.uniform(0, 2), 2)
                del line["think_s"]
            lines.append(line)
            context[model] += rng.randint(600, 1200)
    return Scenario(
        "conversations", conversations.__doc__ or "", cfg, _trace("conversations", lines)
    )


def two_batches() -> Scenario:
    """Two batch jobs per model submitted alternately (Qwen, Gemma, Qwen, Gemma), 500 prompts
    each, on a vLLM-style worker (the batch guide of seed 004)."""
    cfg = parse_config(
        """
models:
  qwen3-4b: {load_s: 35, unload_s: 2, service_s: 0.055}
  gemma3-4b: {load_s: 28, unload_s: 2, service_s: 0.027}
scheduler: {policy: cost, max_wait_s: 3600}
""",
        "<scenario two-batches>",
    )
    rng = random.Random(4)
    lines: list[dict[str, object]] = []
    for job, (model, svc) in enumerate(
        [("qwen3-4b", 0.055), ("gemma3-4b", 0.027), ("qwen3-4b", 0.055), ("gemma3-4b", 0.027)]
    ):
        t = job * 5.0
        lines += [
            {"t": t, "model": model, "service_s": round(svc * rng.uniform(0.8, 1.2), 4)}
            for _ in range(500)
        ]
    return Scenario("two-batches", two_batches.__doc__ or "", cfg, _trace("two-batches", lines))


def poisson() -> Scenario:
    """Poisson traffic to three models for an hour at load 0.6, with 6-9 s swaps."""
    cfg = parse_config(
        """
models:
  llama-8b: {load_s: 6, unload_s: 1, service_s: 2}
  qwen-7b: {load_s: 5, unload_s: 1, service_s: 2}
  mistral-7b: {load_s: 8, unload_s: 1, service_s: 2}
scheduler: {policy: cost, max_wait_s: 120}
""",
        "<scenario poisson>",
    )
    rng = random.Random(3)
    names = ["llama-8b", "qwen-7b", "mistral-7b"]
    # Load 0.6 at a 2 s mean service.
    lines = _poisson_hour(rng, 0.6 / 2.0, lambda: rng.choice(names))
    return Scenario("poisson", poisson.__doc__ or "", cfg, _trace("poisson", lines))


def _poisson_hour(
    rng: random.Random, rate: float, model: Callable[[], str]
) -> list[dict[str, object]]:
    """An hour of Poisson arrivals at `rate` per second, each for `model()`, with exponential
    service times of 2 s mean."""
    t = 0.0
    lines: list[dict[str, object]] = []
    while True:
        t += rng.expovariate(rate)
        if t > 3600:
            return lines
        lines.append(
            {
                "t": round(t, 3),
                "model": model(),
                "service_s": round(rng.expovariate(1 / 2.0) + 0.01, 3),
            }
        )


def chat_batch() -> Scenario:
    """A person chats (interactive, the default priority, closed loop, 10-60 s to read and type)
    with one model while a 2,000-request background batch (class batch) runs on another model,
    one device: the gateway's own defaults, nothing tuned."""
    cfg = parse_config(
        """
models:
  batch-8b: {load_s: 10, unload_s: 2, service_s: 1}
  chat-3b: {load_s: 3, unload_s: 1, service_s: 3}
scheduler: {policy: cost, max_wait_s: 120}
""",
        "<scenario chat-batch>",
    )
    rng = random.Random(5)
    lines: list[dict[str, object]] = [
        {
            "t": 0.0,
            "model": "batch-8b",
            "class": "batch",
            "service_s": round(rng.uniform(0.6, 1.4), 3),
        }
        for _ in range(2000)
    ]
    for k in range(40):
        line: dict[str, object] = {
            "session": "chat",
            "model": "chat-3b",
            "service_s": round(rng.uniform(2, 4), 2),
            "think_s": round(rng.uniform(10, 60), 1),
        }
        if k == 0:
            line["t"] = 30.0
        lines.append(line)
    return Scenario("chat-batch", chat_batch.__doc__ or "", cfg, _trace("chat-batch", lines))


def _devices(n_devices: int, n_models: int, seed: int) -> Scenario:
    """Poisson traffic for an hour to `n_models` models on `n_devices` devices, each model
    filling a device (swaps of 4-30 s), popularity skewed (Zipf, s = 1: the first model takes
    about a quarter of the traffic on 16 models), load about 0.67 per device, 2 s mean service."""
    name = f"devices-{n_devices}"
    rng = random.Random(seed)
    models = [f"m{i:02d}" for i in range(n_models)]
    lines_cfg = ["models:"]
    for m in models:
        load_s = round(rng.uniform(4, 30), 1)
        lines_cfg.append(
            f"  {m}: {{load_s: {load_s}, unload_s: {round(load_s / 10, 1)}, service_s: 2, "
            "memory_gb: 24}"
        )
    lines_cfg.append("devices:")
    lines_cfg += [f"  - {{name: gpu{d}, memory_gb: 24}}" for d in range(n_devices)]
    lines_cfg.append("scheduler: {policy: cost, max_wait_s: 120}")
    cfg = parse_config("\n".join(lines_cfg) + "\n", f"<scenario {name}>")
    popularity = [1.0 / (k + 1) for k in range(n_models)]
    # Load 0.67 per device at a 2 s mean service.
    lines = _poisson_hour(rng, 0.67 * n_devices / 2.0, lambda: rng.choices(models, popularity)[0])
    return Scenario(name, _devices.__doc__ or "", cfg, _trace(name, lines))


def devices_4() -> Scenario:
    """Four devices, 16 models, each filling a device; skewed popularity, Poisson for an hour
    at load 0.67 per device, 4-30 s swaps (the multi-device case)."""
    sc = _devices(4, 16, seed=10)
    return Scenario(sc.name, devices_4.__doc__ or "", sc.config, sc.trace)


def devices_8() -> Scenario:
    """Eight devices, 20 models, each filling a device; skewed popularity, Poisson for an hour
    at load 0.67 per device, 4-30 s swaps."""
    sc = _devices(8, 20, seed=11)
    return Scenario(sc.name, devices_8.__doc__ or "", sc.config, sc.trace)


SLEEP_CONFIG = """
devices: [{name: gpu0, memory_gb: 24}]
host: {memory_gb: 60}
models:
  orchestrator-14b: {load_s: 50, unload_s: 2, service_s: 4, memory_gb: 20,
                     sleep: {level: 1, wake_s: 2, sleep_s: 1}}
  explorer-7b: {load_s: 40, unload_s: 2, service_s: 3, memory_gb: 20,
                sleep: {level: 1, wake_s: 1, sleep_s: 1}}
  coder-14b: {load_s: 60, unload_s: 2, service_s: 8, memory_gb: 20,
              sleep: {level: 1, wake_s: 3, sleep_s: 1}}
  chat-8b: {load_s: 45, unload_s: 2, service_s: 3, memory_gb: 20,
            sleep: {level: 1, wake_s: 2, sleep_s: 1}}
scheduler: {policy: cost, max_wait_s: 120}
"""


def sleepers() -> Scenario:
    """Four models that each fill the device, three of which fit asleep in host memory
    (level-1 sleep, 1-3 s wakes against 40-60 s loads): an agent loop (orchestrator, explorer,
    coder in turn) beside Poisson chat to a fourth model, for an hour."""
    cfg = parse_config(SLEEP_CONFIG, "<scenario sleepers>")
    rng = random.Random(28)
    lines: list[dict[str, object]] = []
    steps = [("orchestrator-14b", 4.0), ("explorer-7b", 3.0), ("coder-14b", 8.0)]
    for k in range(240):  # one agent: orchestrate, explore, code, then think
        model, svc = steps[k % 3]
        line: dict[str, object] = {
            "session": "agent",
            "model": model,
            "service_s": round(svc * rng.uniform(0.6, 1.4), 2),
            "think_s": round(rng.uniform(0.5, 2.0), 2),
        }
        if k == 0:
            line["t"] = 0.0
        lines.append(line)
    t = 0.0
    while (t := t + rng.expovariate(1 / 40)) < 3600:  # a person every 40 s on average
        lines.append(
            {"t": round(t, 3), "model": "chat-8b", "service_s": round(rng.uniform(2, 4), 2)}
        )
    return Scenario("sleepers", sleepers.__doc__ or "", cfg, _trace("sleepers", lines))


BESIDE_BATCH_CONFIG = """
devices: [{name: gpu0, memory_gb: 24}]
host: {memory_gb: 40}
models:
  chat-8b: {load_s: 45, unload_s: 2, service_s: 3, memory_gb: 20,
            sleep: {level: 1, wake_s: 2, sleep_s: 1}}
  bulk-14b: {load_s: 50, unload_s: 2, service_s: 4, memory_gb: 20,
             sleep: {level: 1, wake_s: 2, sleep_s: 1}}
scheduler: {policy: cost, max_wait_s: 120}
"""


def beside_batch() -> Scenario:
    """A person chats (Poisson, every 90 s on average) with one model while an 800-line batch
    runs on another, one device, both models able to sleep (level-1 wakes of 2 s against 45-50 s
    loads), for an hour: each chat waits for a wake, or, without `sleep:`, a load."""
    cfg = parse_config(BESIDE_BATCH_CONFIG, "<scenario beside-batch>")
    rng = random.Random(281)
    lines: list[dict[str, object]] = [
        {"t": 0.0, "model": "bulk-14b", "class": "batch", "service_s": round(rng.uniform(3, 5), 2)}
        for _ in range(800)
    ]
    t = 0.0
    while (t := t + rng.expovariate(1 / 90)) < 3600:
        lines.append(
            {"t": round(t, 3), "model": "chat-8b", "service_s": round(rng.uniform(2, 4), 2)}
        )
    return Scenario("beside-batch", beside_batch.__doc__ or "", cfg, _trace("beside-batch", lines))


LIGHT_USERS = ("alice", "bob", "carol")
_MORE_USERS = ("dave", "erin", "frank")
_CHAT_SERVICE_S = 3.0  # the chat model's mean answer (uniform 2-4 s)


@dataclass(frozen=True)
class SharedBox:
    """A shared box's shape: who shares its one device and how hard the heavy user floods. The
    defaults are the `shared-box` scenario; `drawn` makes one of the family (fresh shapes for
    tuning to the family, not the scenario: benchmarks/bench_shares.py --family)."""

    light_users: tuple[str, ...] = LIGHT_USERS
    agent_loops: int = 2
    batch_lines: int = 1000  # an hour's
    flood_x: float = 1.5  # the heavy user's rate over what the chat model serves
    chat_concurrency: int = 2
    chat_load_s: float = 8.0
    coder_load_s: float = 12.0
    think_s: tuple[float, float] = (20.0, 90.0)  # a chat user's reading and typing

    @classmethod
    def drawn(cls, rng: random.Random) -> SharedBox:
        low = rng.uniform(5.0, 30.0)
        return cls(
            light_users=(LIGHT_USERS + _MORE_USERS)[: rng.randint(2, 6)],
            agent_loops=rng.randint(0, 3),
            batch_lines=rng.choice((0, 500, 1000, 2000)),
            flood_x=round(rng.uniform(1.2, 3.0), 2),
            chat_concurrency=rng.randint(1, 4),
            chat_load_s=round(rng.uniform(4.0, 30.0), 1),
            coder_load_s=round(rng.uniform(6.0, 45.0), 1),
            think_s=(round(low, 1), round(low + rng.uniform(20.0, 90.0), 1)),
        )

    def config_text(self) -> str:
        users = "".join(f"    {u}: {{}}\n" for u in self.light_users)
        return f"""
models:
  chat-8b: {{load_s: {self.chat_load_s:g}, unload_s: 2, service_s: 3, concurrency: {self.chat_concurrency}}}
  coder-14b: {{load_s: {self.coder_load_s:g}, unload_s: 2, service_s: 6}}
  bulk-8b: {{load_s: 8, unload_s: 2, service_s: 1}}
server:
  principals:
    heavy: {{}}
    agent: {{}}
{users}    etl: {{}}
scheduler: {{policy: cost, max_wait_s: 120}}
"""  # noqa: E501

    def lines(self, seed: int, heavy: bool = True, hours: float = 1.0) -> list[dict[str, object]]:
        """The traffic, drawn from `seed`; `heavy` False leaves the heavy user's flood out (the
        light users' waits without it)."""
        rng = random.Random(seed)
        end_s = 3600.0 * hours
        lines: list[dict[str, object]] = [
            {
                "t": 0.0,
                "model": "bulk-8b",
                "class": "batch",
                "principal": "etl",
                "service_s": round(rng.uniform(0.6, 1.4), 3),
            }
            for _ in range(int(self.batch_lines * hours))
        ]
        for loop in range(self.agent_loops):
            lines += _agent_loop(rng, f"agent-{loop}", end_s)
        for who in self.light_users:
            lines += self._chat_user(rng, who, end_s)
        if heavy:
            # A script floods the chat model (interactive) for half the run.
            rate = self.flood_x * self.chat_concurrency / _CHAT_SERVICE_S
            t = 0.25 * end_s
            while (t := t + rng.expovariate(rate)) < 0.75 * end_s:
                lines.append(
                    {
                        "t": round(t, 3),
                        "principal": "heavy",
                        "model": "chat-8b",
                        "service_s": round(rng.uniform(2, 4), 2),
                    }
                )
        return lines

    def _chat_user(self, rng: random.Random, who: str, end_s: float) -> list[dict[str, object]]:
        """A person's closed loop on the chat model."""
        out: list[dict[str, object]] = []
        t = rng.uniform(0, 60)
        while t < end_s:
            think = round(rng.uniform(*self.think_s), 1)
            line: dict[str, object] = {
                "session": who,
                "principal": who,
                "model": "chat-8b",
                "service_s": round(rng.uniform(2, 4), 2),
                "think_s": think,
            }
            if not out:
                line["t"] = round(t, 2)
            out.append(line)
            t += think + 3.0
        return out


def _agent_loop(rng: random.Random, session: str, end_s: float) -> list[dict[str, object]]:
    """An agent's loop: an orchestrator step on the chat model, then a coder step."""
    out: list[dict[str, object]] = []
    t = 0.0
    while t < end_s:
        for model, svc in (("chat-8b", 2.0), ("coder-14b", 6.0)):
            line: dict[str, object] = {
                "session": session,
                "principal": "agent",
                "model": model,
                "service_s": round(svc * rng.uniform(0.6, 1.4), 2),
                "think_s": round(rng.uniform(0.5, 2.0), 2),
            }
            if not out:
                line["t"] = round(rng.uniform(0, 30), 2)
            out.append(line)
            t += svc + 1.25 + 4.0  # the loop's pace, waits included, to bound its length
    return out


SHARED_BOX_CONFIG = SharedBox().config_text()


def shared_box_lines(seed: int, heavy: bool = True, hours: float = 1.0) -> list[dict[str, object]]:
    """The `shared-box` scenario's traffic (`SharedBox.lines` of the default shape)."""
    return SharedBox().lines(seed, heavy, hours)


def shared_box() -> Scenario:
    """A team shares one device for an hour: a heavy user's script floods the chat model with
    interactive requests for half of it (about 1.5x what the model serves), an agent runs two
    loops over the chat and coder models, three people chat with the chat model, and an ETL
    job queues 1,000 batch lines for a third model. Each is a principal (fair shares)."""
    cfg = parse_config(SHARED_BOX_CONFIG, "<scenario shared-box>")
    lines = shared_box_lines(6301)
    return Scenario("shared-box", shared_box.__doc__ or "", cfg, _trace("shared-box", lines))


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "approvals": approvals,
    "agents": agents,
    "two-batches": two_batches,
    "poisson": poisson,
    "chat-batch": chat_batch,
    "devices-4": devices_4,
    "devices-8": devices_8,
    "sleepers": sleepers,
    "beside-batch": beside_batch,
    "conversations": conversations,
    "shared-box": shared_box,
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]()
    except KeyError:
        raise UnknownScenario(
            f"no scenario named {name!r}; choose one of: {', '.join(SCENARIOS)}"
        ) from None
