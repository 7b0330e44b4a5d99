#!/usr/bin/env bash
# GPU check: the GPU-marked tests, a real CUDA out-of-memory step that must be re-planned and
# run again, a step that does not fit the capped allocator planned and trained, compiled training beside the compiler's own activation_memory_budget, then
# `memfit bench` on a GPT-2-medium-sized built-in GPT
# (24 layers, 1024 wide, 16 heads, sequence 1024, ~302M parameters) with fp32, bf16 and fp16
# on CUDA, peaks from the CUDA allocator's statistics. Sized to finish in under 10 minutes on
# one NVIDIA H200 (copies not running are parked in host memory: ~55 GiB of host RAM).
#
# Usage:  benchmarks/gpu_check.sh [OUT_DIR]        (default OUT_DIR: gpu-check-out)
# Env:    PYTHON (default: .venv/bin/python if present, else python3) with a CUDA build of torch;
#         BATCH (default 8), STEPS (default 3), STRATEGIES (default all 15).
# Budget: GPU tests at most 120 s, the out-of-memory step at most 90 s (expected ~20 s: a GPT of
#         25M parameters profiled once, then 2 + 3 + 5 training steps), the step that does not fit
#         at most 90 s (expected ~20 s: an 8 x 512 GPT planned under fake tensors), offload at most 60 s
#         (expected ~10 s: one forward and backward of a 6-layer GPT with and without offload), the
#         offload benchmark at most 120 s (expected ~1 min: four 8 x 1024 LLaMAs at 32k tokens, 7 steps
#         each: full checkpointing alone, + offload, + the tiled MLP, + both), the
#         compiled comparison at most 150 s (expected ~1-2 min: 8 variants of a 6 x 512 GPT compiled
#         once each), the bench at most 330 s
#         (expected ~3-4 min: 15 strategies, each copied to the GPU, warmed up, tracked, then 3
#         interleaved timed steps).
# Output: OUT_DIR/pytest-gpu.log, OUT_DIR/oom-cuda.log, OUT_DIR/room-cuda.log (its RESULT line), OUT_DIR/offload-cuda.log,
#         OUT_DIR/offload-bench.md (peaks, time ratios, the host link's speed), OUT_DIR/compile.md,
#         OUT_DIR/bench.{md,json,csv,png}, OUT_DIR/bench.log;
#         copy the table from OUT_DIR/bench.md into benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-out}"
mkdir -p "$OUT"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to $PYTHON (torch $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)); set PYTHON to a Python with a CUDA build of torch." >&2
  exit 2
fi
"$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')"

status=0
echo "== pytest -m gpu"
start=$SECONDS
timeout 120 "$PYTHON" -m pytest -q -rs -m gpu -p no:cacheprovider \
  -k "not cuda_out_of_memory and not offload and not cuda_step_that_does_not_fit" 2>&1 \
  | tee "$OUT/pytest-gpu.log"
rc=${PIPESTATUS[0]}
# exit code 5: no test is marked gpu yet, which is not a failure of this check
if [[ $rc -ne 0 && $rc -ne 5 ]]; then echo "gpu_check: GPU tests failed (exit $rc)"; status=1; fi
echo "pytest -m gpu: $((SECONDS - start)) s"

echo "== out of memory on CUDA: the allocator capped mid-run; the step must be re-planned and run again"
start=$SECONDS
timeout 90 "$PYTHON" -m pytest -q -s -p no:cacheprovider \
  "tests/test_oom.py::test_cuda_out_of_memory_is_replanned_and_matches_the_new_plan" 2>&1 | tee "$OUT/oom-cuda.log"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_check: CUDA out-of-memory re-plan failed (exit $rc)"; status=1; fi
echo "CUDA out-of-memory re-plan: $((SECONDS - start)) s"

echo "== a step that does not fit: the allocator capped at half the plain step's extra bytes; plan, train"
start=$SECONDS
timeout 90 "$PYTHON" -m pytest -q -s -p no:cacheprovider \
  "tests/test_plan_room.py::test_a_cuda_step_that_does_not_fit_is_planned_and_trained" 2>&1 | tee "$OUT/room-cuda.log"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_check: planning a step that does not fit failed (exit $rc)"; status=1; fi
echo "planning a step that does not fit: $((SECONDS - start)) s"

echo "== offload lever on CUDA: every block's saved activations in pinned host memory"
start=$SECONDS
timeout 60 "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider \
  "tests/test_offload.py::test_offload_on_cuda_lowers_the_peak_and_keeps_the_gradients" \
  "tests/test_offload.py::test_offload_on_cuda_is_exact_and_lowers_the_peak_as_priced" 2>&1 | tee "$OUT/offload-cuda.log"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_check: offload on CUDA failed (exit $rc)"; status=1; fi
echo "offload on CUDA: $((SECONDS - start)) s"

echo "== activation offload and the tiled MLP on CUDA: peak with and without, time ratio (8 x 1024 LLaMA, 32k tokens)"
start=$SECONDS
timeout 120 "$PYTHON" benchmarks/bench_offload.py --device cuda --layers 8 --width 1024 --seq 32768 --steps 5 2>&1 \
  | tee "$OUT/offload-bench.md"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_check: offload benchmark failed (exit $rc)"; status=1; fi
echo "offload benchmark: $((SECONDS - start)) s"

echo "== compiled: memfit's checkpointing and plan vs activation_memory_budget, CUDA"
start=$SECONDS
timeout 150 "$PYTHON" benchmarks/bench_compile.py --device cuda --layers 6 --width 512 --seq 512 \
  --batch-size 8 --rounds 5 --budget 50% --amb 0.5,0.3,0.1 2>&1 | tee "$OUT/compile.md"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_check: compiled comparison failed (exit $rc)"; status=1; fi
echo "compiled comparison: $((SECONDS - start)) s"

echo "== memfit bench, GPT-2-medium size, CUDA"
start=$SECONDS
timeout 330 "$PYTHON" -m memfit.cli.main bench \
  --set model.n_layer=24 --set model.n_embd=1024 --set model.n_head=16 --set model.block_size=1024 \
  --set train.device=cuda --set data.max_bytes=4000000 \
  --batch-size "${BATCH:-8}" --steps "${STEPS:-3}" --strategies "${STRATEGIES:-all}" \
  --budget 50% --out "$OUT" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_check: memfit bench failed (exit $rc)"; status=1; fi
echo "memfit bench: $((SECONDS - start)) s"
exit $status
