#!/usr/bin/env bash
# `memfit bench` on the built-in GPT at its default size (4 layers, 128 wide, 4 heads,
# sequence 128; ~0.84M parameters; batch 4, the bench default) on this machine, all 15 strategies.
# Usage:  benchmarks/bench_gpt.sh [OUT_DIR] [extra memfit bench options...]
# Writes OUT_DIR/bench.{md,json,csv,png} (default OUT_DIR: memfit-out/bench-gpt) and prints
# the table; copy it with the date, machine and command into benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-memfit-out/bench-gpt}"
shift || true
MEMFIT="${MEMFIT:-.venv/bin/memfit}"
start=$SECONDS
"$MEMFIT" bench --out "$OUT" --budget 60% "$@"
echo "wall time: $((SECONDS - start)) s on $(nproc) CPU cores (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
