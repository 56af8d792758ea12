"""Wide random scenario families, for robustness checks nobody tuned the scheduler to.

`random_scenario(seed)` draws one scenario from the family below; the same seed gives the same
scenario. `make bench-robust` runs every policy over many seeds; the property tests draw from the
same ranges. Ranges (each drawn independently per scenario unless said):

- devices: 1-8 (1, 2, 3, 4, 6 or 8); half the scenarios pack by memory (devices of 24, 48 or
  80 GB, models of 1/8 to the whole of a device, log-uniform), half hold one model per device;
- models: 2-20; load 1-60 s (log-uniform), unload a tenth of it; mean service 0.2-10 s
  (log-uniform, exponential per request); a quarter of the scenarios give models 2-4 slots;
- offered load: 0.2-1.3 per device (work arriving per second over the devices' capacity);
  popularity Zipf with exponent 0-1.5; in a third of multi-device scenarios one hot model
  alone needs more than one device;
- arrivals: Poisson, or for a third of the models bursts of 5-50 requests at once;
- classes: a third of the scenarios carry batch work (1-2 models whose requests are class
  batch, in large bursts) beside the interactive traffic;
- length: arrivals for 300-1800 s (about 5,000 requests at most), then the queues drain.

The configuration uses Corral's defaults (`max_wait_s` 120, `batch.max_wait_s` 3600).

`random_sleep_scenario(seed)` is the same scenario with every model able to sleep:
level 1, wakes 2-10% of the load and falling asleep in half that, each model holding its
`memory_gb` (or 4-40 GB) of host memory asleep, and host memory for 20-100% of them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from corral.config import Config, parse_config
from corral.sim.scenarios import Scenario, _trace

MAX_REQUESTS = 5_000
DEVICE_COUNTS = (1, 2, 3, 4, 6, 8)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


@dataclass(frozen=True)
class Shape:
    """A narrower family: the values set here replace the wide family's draws (which are still
    drawn, so that the wide family's seeds give the scenarios they always gave)."""

    n_dev: int | None = None
    packing: bool | None = None
    n_models: int | None = None
    rho: tuple[float, float] = (0.2, 1.3)
    dev_gb: int | None = None
    mem_gb: tuple[float, float] | None = None  # else 1/8 to the whole of a device
    load_s: tuple[float, float] = (1.0, 60.0)
    service_s: tuple[float, float] = (0.2, 10.0)
    max_wait_s: float | None = None  # else Corral's default


# Shapes the wide family reaches too seldom to judge: `crowded`, two devices
# and three models that each fill one, overloaded, a long bound; `packed`, four 80 GB devices
# and eight models of 10-80 GB packed by memory (several fit together).
SHAPES = {
    "crowded": Shape(n_dev=2, packing=False, n_models=3, rho=(1.0, 1.3), load_s=(15.0, 35.0),
                     service_s=(1.5, 6.0), max_wait_s=300),
    "packed": Shape(n_dev=4, packing=True, dev_gb=80, n_models=8, mem_gb=(10.0, 80.0),
                    load_s=(6.0, 40.0), max_wait_s=120),
}  # fmt: skip


def random_scenario(
    seed: int, max_requests: int = MAX_REQUESTS, steady: bool = False, shape: str | None = None
) -> Scenario:
    """One scenario of the family described in the module docstring. A smaller `max_requests`
    (for property tests) shortens the arrivals in proportion, the shape of the scenario kept.
    `steady`: Poisson arrivals only, all interactive (no bursts, no batch work). `shape`: one of
    `SHAPES`, a narrower family."""
    rng = random.Random(seed)
    sh = SHAPES[shape] if shape is not None else Shape()
    n_dev = rng.choice(DEVICE_COUNTS)
    n_dev = sh.n_dev if sh.n_dev is not None else n_dev
    packing = rng.random() < 0.5
    packing = sh.packing if sh.packing is not None else packing
    n_models = rng.randint(2, 20)
    n_models = sh.n_models if sh.n_models is not None else n_models
    rho = rng.uniform(*sh.rho)
    slots = rng.random() < 0.25
    dev_gb = rng.choice((24, 48, 80)) if packing else None
    dev_gb = sh.dev_gb if sh.dev_gb is not None else dev_gb
    names = [f"m{i:02d}" for i in range(n_models)]
    service = {m: round(_log_uniform(rng, *sh.service_s), 2) for m in names}
    conc = {m: rng.choice((1, 1, 2, 4)) if slots else 1 for m in names}
    cfg = ["models:"]
    for m in names:
        load_s = round(_log_uniform(rng, *sh.load_s), 1)
        extra = f", concurrency: {conc[m]}" if conc[m] > 1 else ""
        if dev_gb is not None and sh.mem_gb is not None:
            extra += f", memory_gb: {round(_log_uniform(rng, *sh.mem_gb), 1)}"
        elif dev_gb is not None:
            extra += f", memory_gb: {round(dev_gb * _log_uniform(rng, 0.125, 1.0), 1)}"
        cfg.append(
            f"  {m}: {{load_s: {load_s}, unload_s: {round(load_s / 10, 2)}, "
            f"service_s: {service[m]}{extra}}}"
        )
    cfg.append("devices:")
    for d in range(n_dev):
        mem = f", memory_gb: {dev_gb}" if dev_gb is not None else ""
        cfg.append(f"  - {{name: d{d}{mem}}}")
    # Shares of the offered work (service-seconds per second over all devices).
    a = rng.uniform(0.0, 1.5)
    share = [1.0 / (k + 1) ** a for k in range(n_models)]
    total = sum(share)
    share = [s / total for s in share]
    work = rho * n_dev  # device-seconds of work per second
    if n_dev > 1 and rng.random() < 1 / 3 and work > 1.1:
        hot = rng.uniform(1.05, min(work * 0.8, n_dev * 0.9))
        hot = max(hot, 1.05)
        rest = 1.0 - hot / work
        share = [hot / work] + [s * rest / (1 - share[0]) for s in share[1:]]
    batch_models = set(rng.sample(names, rng.randint(1, 2))) if rng.random() < 1 / 3 else set()
    bursty = {m for m in names if rng.random() < 1 / 3}
    if steady:
        batch_models, bursty = set(), set()
    # Per-slot work: a model with c slots serves c at once, so its offered load is over c.
    rate = {m: work * s * conc[m] / service[m] for m, s in zip(names, share, strict=True)}
    total_rate = sum(rate.values())
    scale = max_requests / MAX_REQUESTS
    duration_s = min(1800.0 * scale, max(300.0 * scale, max_requests / total_rate))
    lines = _open_loop(rng, rate, service, batch_models, bursty, duration_s, scale)
    lines.sort(key=lambda x: (x["t"], x["model"]))
    name = f"random-{seed}"
    summary = (
        f"{n_dev} device(s){' packed by memory' if packing else ''}, {n_models} models, "
        f"offered load {rho:.2f} per device, {len(lines)} requests over {duration_s:.0f} s"
        + (f", batch on {len(batch_models)} model(s)" if batch_models else "")
    )
    if sh.max_wait_s is not None:
        cfg.append(f"scheduler: {{max_wait_s: {sh.max_wait_s}}}")
    if shape is not None:
        name = f"random-{shape}-{seed}"
    config = parse_config("\n".join(cfg) + "\n", f"<scenario {name}>")
    return Scenario(name, summary, config, _trace(name, lines))


def _open_loop(
    rng: random.Random,
    rate: dict[str, float],
    service: dict[str, float],
    batch_models: set[str],
    bursty: set[str],
    duration_s: float,
    scale: float,
) -> list[dict[str, object]]:
    """Each model's arrivals (Poisson, in bursts for batch and bursty models) until
    `duration_s`, with exponential service times: trace lines, in the models' order."""
    lines: list[dict[str, object]] = []
    for m in rate:  # the models in their order
        burst = 1
        if m in batch_models:
            burst = max(1, round(rng.randint(50, 500) * scale))
        elif m in bursty:
            burst = max(1, round(rng.randint(5, 50) * scale))
        t = 0.0
        while True:
            t += rng.expovariate(rate[m] / burst)
            if t > duration_s:
                break
            for _ in range(burst):
                line: dict[str, object] = {
                    "t": round(t, 3),
                    "model": m,
                    "service_s": round(rng.expovariate(1.0 / service[m]) + 0.01, 3),
                }
                if m in batch_models:
                    line["class"] = "batch"
                lines.append(line)
    return lines


def random_sleep_scenario(seed: int, max_requests: int = MAX_REQUESTS) -> Scenario:
    """`random_scenario(seed)` with every model able to sleep (the module docstring's ranges)."""
    sc = random_scenario(seed, max_requests)
    rng = random.Random(seed * 7919)
    raw = sc.config.model_dump(mode="json", by_alias=True, exclude_none=True)
    held_gb = 0.0
    for m in raw["models"].values():
        gb = m.get("memory_gb") or round(rng.uniform(4, 40), 1)
        wake_s = round(m["load_s"] * rng.uniform(0.02, 0.1), 2)
        m["sleep"] = {
            "level": 1,
            "wake_s": wake_s,
            "sleep_s": round(wake_s / 2, 2),
            "host_memory_gb": gb,
        }
        held_gb += gb
    raw["host"] = {"memory_gb": round(held_gb * rng.uniform(0.2, 1.0), 1)}
    return Scenario(
        sc.name.replace("random", "random-sleep"),
        sc.summary + ", every model able to sleep",
        Config.model_validate(raw),
        sc.trace,
    )


def random_conversation_scenario(seed: int, max_requests: int = MAX_REQUESTS) -> Scenario:
    """Agents' conversations: closed-loop sessions whose context grows each step, so
    that a swap throws away what a server holds of them. Ranges:

    - devices: 1-3, one model each at a time; models: 2-6, load 2-30 s (log-uniform), unload a
      tenth of it, prefill 300-5,000 tokens/s (log-uniform), 1 or 2 slots;
    - sessions: 2-12; each an agent loop over 1-3 models (an orchestrator, an explorer, a
      coder: a conversation with each), 5-30 steps, thinking 0.2-10 s between them; each
      conversation starts at 500-8,000 tokens and grows 100-1,500 a step; decoding 0.3-5 s;
    - prompt caches: kept in half the scenarios (models run llama-server, `prompt_cache` on,
      0.5-20 GB of states at 20-200 KB a token), not in the other half.
    """
    rng = random.Random(seed * 104729 + 17)
    n_dev = rng.choice((1, 1, 2, 3))
    n_models = rng.randint(2, 6)
    keeps = rng.random() < 0.5
    names = [f"m{i}" for i in range(n_models)]
    cfg = ["devices:", *[f"  - {{name: d{d}}}" for d in range(n_dev)], "models:"]
    for m in names:
        load_s = round(_log_uniform(rng, 2.0, 30.0), 1)
        cfg.append(
            f"  {m}: {{cmd: 'llama-server -m {m}.gguf', load_s: {load_s}, "
            f"unload_s: {round(load_s / 10, 2)}, concurrency: {rng.choice((1, 1, 2))}, "
            f"prefill_tok_s: {round(_log_uniform(rng, 300, 5000))}, "
            f"kv_bytes_per_token: {rng.randint(20, 200) * 1000}}}"
        )
    if keeps:
        cfg.append(f"prompt_cache: {{max_gb: {round(_log_uniform(rng, 0.5, 20), 2)}}}")
    else:
        cfg.append("prompt_cache: false")
    lines: list[dict[str, object]] = []
    n_sessions = rng.randint(2, 12)
    per_session = max(5, min(30, max_requests // n_sessions))
    for s in range(n_sessions):
        loop = rng.sample(names, min(len(names), rng.randint(1, 3)))
        context = {m: rng.randint(500, 8000) for m in loop}
        steps = rng.randint(5, per_session)
        think_s = round(rng.uniform(0.2, 10.0), 2)
        for k in range(steps):
            m = loop[k % len(loop)]
            line: dict[str, object] = {
                "session": f"agent-{s}",
                "model": m,
                "service_s": round(rng.uniform(0.3, 5.0), 3),
                "context_tokens": context[m],
            }
            if k == 0:
                line["t"] = round(rng.uniform(0, 30), 2)
            else:
                line["think_s"] = think_s
            lines.append(line)
            context[m] += rng.randint(100, 1500)
    name = f"random-conversations-{seed}"
    summary = (
        f"{n_dev} device(s), {n_models} models, {n_sessions} agent loops, {len(lines)} steps, "
        f"prompt caches {'kept' if keeps else 'not kept'}"
    )
    config = parse_config("\n".join(cfg) + "\n", f"<scenario {name}>")
    return Scenario(name, summary, config, _trace(name, lines))
