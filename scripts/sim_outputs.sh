#!/usr/bin/env bash
# The simulator's output on every built-in scenario (every policy, as JSON) and
# `make bench-robust`'s figures, written into DIR: run it before and after a move and compare
# the folders (`diff -r`) to check the scheduler's decisions stayed byte-identical.
# Usage: scripts/sim_outputs.sh DIR   (PYTHONPATH=OTHER/src runs another checkout's code)
set -euo pipefail
out=${1:?usage: scripts/sim_outputs.sh DIR}
mkdir -p "$out"
bin=${BIN:-.venv/bin}
for s in $("$bin/python" -c "from corral.sim.scenarios import SCENARIOS; print(*SCENARIOS)"); do
  "$bin/corral" simulate --scenario "$s" --policy all --json > "$out/sim-$s.json"
done
# The progress line (wall-clock time) left out: the rest must match byte for byte.
"$bin/python" benchmarks/bench_robust.py --json "$out/robust.json" | grep -v '━' > "$out/robust.txt"
