#!/usr/bin/env bash
# On a GPU machine: build llama.cpp's server for the GPU present, then measure;
# every figure under $OUT (JSON, and the logs). Runs from the repository root.
#
#   here, once:     scripts/gpu_carry.sh                   (out/gpu/llama-src.tar.gz)
#   on the device:  run(command="scripts/gpu_check.sh", carry=["out/gpu"], timeout_s=560)
#   here, to test:  PY=/some/bare/venv/bin/python scripts/gpu_check.sh --cpu --sizes 0.25:qwen3
#
# Steps (each one's output in $OUT, a step that fails is logged and the next one runs):
#   machine.json     nvidia-smi's view, and `corral devices` (NVML: name, memory, UUID,
#                    CUDA_VISIBLE_DEVICES) -- item 1
#   build.log        llama-server and llama-fit-params built for this GPU's architecture only
#   memory-SIZE.json per zoo architecture at 4K and 32K: the file's estimate, llama-fit-params'
#                    projection, the server's own, and what NVML says the process holds --
#                    item 2 (benchmarks/bench_zoo_memory.py; step `memory`)
#   packing.json     three servers of one zoo file that Corral's figures fit together, then
#                    one more: the layers each offloaded, Corral's figure, NVML's -- item 3
#                    (benchmarks/bench_gpu_packing.py; step `packing`)
#   loads.json       each load mode's load time, cold and warm, against a plain read of the
#                    file -- item 4 (benchmarks/bench_load_modes.py; step `loads`)
#   restores.json    prefill, and a saved conversation restored after a restart, per
#                    architecture -- item 5 (benchmarks/bench_zoo_restores.py; step `restores`)
# `--steps "memory packing loads restores"` (the default) chooses; the machine and the build always run,
# the build only once per machine (out/gpu-build stays while the machine is held), so a run cut
# short by its limit goes on with `--steps` of the rest.
# Not yet scripted: the same packing through `corral serve --models`
# itself, and a swap's measured load against the scheduler's; NVML's time to hand memory back
# after a stop.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
cpu=0
steps="memory packing loads restores"
load_sizes=${LOAD_SIZES:-1 8}       # GB, for `loads`
restore_gb=${RESTORE_GB:-1}         # GB, for `restores`
restore_tokens=${RESTORE_TOKENS:-8000}
sizes="1:all 8:qwen3 30:qwen3"  # SIZE_GB:ARCHS (all, or a comma list), smallest first
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --sizes) sizes="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    *) echo "usage: $0 [--cpu] [--steps \"memory packing loads restores\"] [--sizes \"1:all\"]" >&2
       exit 2 ;;
  esac
  shift
done
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log" >&2; }
started=$(date +%s)

# Python: the machine's own (the device has no package index); Corral from this tree.
py=${PY:-$(command -v python3)}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
log "python: $py ($($py --version 2>&1))"
missing=$($py - <<'PY'
import importlib.util
need = ["pydantic", "yaml", "typer", "rich", "gguf", "psutil", "numpy", "httpx"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [[ -n "$missing" ]]; then
  log "missing Python packages: $missing; installing the carried wheels into out/gpu-pylib"
  $py -m pip install --quiet --no-index --no-deps --target out/gpu-pylib \
    $($py - <<'PY'
import glob, sys
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:  # pip's own copy
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename
ok = set(sys_tags())
best = {}
for f in sorted(glob.glob("out/gpu/wheels/*.whl")):
    name, version, _, tags = parse_wheel_filename(f.rsplit("/", 1)[1])
    if tags & ok and (name not in best or version > best[name][0]):
        best[name] = (version, f)
print(" ".join(f for _, f in best.values()))
PY
) >> "$OUT/steps.log" 2>&1 || log "installing the wheels failed"
  export PYTHONPATH="$PYTHONPATH:$PWD/out/gpu-pylib"
fi

# 1. The machine.
{
  if [[ $cpu == 0 ]]; then
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,uuid,compute_cap,driver_version \
      --format=csv
  fi
  $py -m corral devices
} > "$OUT/machine.txt" 2>&1 || log "machine: failed (see machine.txt)"

# 2. llama-server and llama-fit-params, for this GPU's architecture only, with every core.
build=out/gpu-build
if [[ ! -x $build/build/bin/llama-server ]]; then
  rm -rf "$build" && mkdir -p "$build"
  tar xzf out/gpu/llama-src.tar.gz -C "$build" || { log "no out/gpu/llama-src.tar.gz"; exit 1; }
  flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
         -DLLAMA_CURL=OFF)
  if [[ $cpu == 0 ]]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$cap")
  fi
  log "building llama.cpp: ${flags[*]}"
  { cmake -S "$build/llama.cpp" -B "$build/build" "${flags[@]}" &&
    cmake --build "$build/build" --config Release -j"$(nproc)" \
      --target llama-server llama-fit-params; } > "$OUT/build.log" 2>&1 ||
    { log "build failed (see build.log)"; exit 1; }
fi
export PATH="$PWD/$build/build/bin:$PATH"
log "built in $(( $(date +%s) - started )) s: $(command -v llama-server)"

wants() { [[ " $steps " == *" $1 "* ]]; }

# 3. Memory per architecture and size: estimate, projections, what the GPU really holds.
# Each size's figures are written as it ends: a run cut short by its time limit keeps them.
for spec in $(wants memory && echo "$sizes"); do
  size=${spec%%:*}
  archs=()
  if [[ $spec == *:* && ${spec#*:} != all ]]; then
    IFS=, read -ra names <<< "${spec#*:}"
    for a in "${names[@]}"; do archs+=(--arch "$a"); done
  fi
  log "memory at ${size} GB: ${archs[*]:-every architecture}"
  $py benchmarks/bench_zoo_memory.py --size-gb "$size" ${archs[@]+"${archs[@]}"} \
    --json "$OUT/memory-${size}GB.json" > "$OUT/memory-${size}GB.md" 2>&1 ||
    log "memory at ${size} GB: failed (see memory-${size}GB.md)"
  if [[ $cpu == 0 ]]; then
    rm -rf "out/zoo-${size}GB" "out/zoo-${size}GB-only"  # the device's disk holds 64 GB
  fi
done
# 3b. Packing: a file a little under a quarter of the GPU (at most 38 GB: the disk holds 64),
# served three times at once, then a fourth.
if wants packing; then
  if [[ -z "${PACK_GB:-}" ]]; then
    total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    PACK_GB=$(( total_mib * 26 / 100 / 1024 ))
    (( PACK_GB > 38 )) && PACK_GB=38
  fi
  log "packing: three servers of ${PACK_GB} GB, then one more"
  $py benchmarks/bench_gpu_packing.py --size-gb "$PACK_GB" --count 3 --over 1 \
    --json "$OUT/packing.json" > "$OUT/packing.md" 2>&1 || log "packing: failed (see packing.md)"
  [[ $cpu == 0 ]] && rm -rf "out/zoo-${PACK_GB}GB-packing"
fi

# 4. Load time per load mode, cold (dropped from the page cache) and warm.
if wants loads; then
  log "load modes at ${load_sizes} GB"
  # shellcheck disable=SC2086  # the sizes are words
  $py benchmarks/bench_load_modes.py --sizes $load_sizes --rounds 2 --arch qwen3 \
    --json "$OUT/loads.json" > "$OUT/loads.md" 2>&1 || log "loads: failed (see loads.md)"
fi

# 5. Prefill, and a saved conversation restored after a restart.
if wants restores; then
  log "restores at ${restore_gb} GB, ${restore_tokens} tokens"
  $py benchmarks/bench_zoo_restores.py --size-gb "$restore_gb" --tokens "$restore_tokens" \
    --json "$OUT/restores.json" > "$OUT/restores.md" 2>&1 || log "restores: failed (see restores.md)"
fi
log "done in $(( $(date +%s) - started )) s"
