#!/usr/bin/env bash
# The one GPU check of CRISP, on a CUDA machine, with the package importable (installed with
# `pip install --no-deps -e .`, or via PYTHONPATH, set below). It has NOT run on a GPU yet in this
# form (none where it was written); `--dry-run` (below) and tests/test_gpu_check.py check it on a CPU.
#
#   bash bench/gpu_check.sh [--dry-run] [OUT_DIR]      (default OUT_DIR: $OUT, else ./gpu-check-out)
#
# A lent GPU has little time (15 minutes in all, start-up included), so the whole run has a
# deadline: TOTAL_BUDGET_S seconds (default 600) from the start of the first step. Steps run in
# order of value; a step whose estimated need is more than the time left is skipped with a line
# saying so, and each step's own limit is min(STEP_TIMEOUT (default 240), the time left). The
# order, most valuable first (what no run has measured yet, then correctness, then figures):
#  1. h2d-cpu-busy   the H2D copy rate alone and while the CPU streams host memory (the hybrid
#                    profile's assumed 25 -> 15 GB/s; `crisp_bench.hybrid_check copy`)
#  2. hybrid-step    one real hybrid layer step (hybrid, hybrid_split) against the simulator's
#                    prediction of that step (`crisp_bench.hybrid_check step`)
#  3. prefetch-step  two real layer steps, the next layer's experts prefetched during the first,
#                    against the simulator's timeline, with and without the prefetch (
#                    `crisp_bench.hybrid_check prefetch`)
#  4. e2e-hybrid     the hybrid path end to end on the GPU (copy stream beside the CPU worker):
#                    every CPU-placement layer step checked against the float64 reference
#  5. pytest-gpu     `pytest -m gpu`: every test marked gpu, the kernel tests' cuda cases included
#  6. kernel-tests   the kernel, ops and experts-module tests compiled on CUDA (TRITON_INTERPRET=0,
#                    CRISP_TEST_DEVICES=cuda: the `device` fixture yields only cuda)
#  7. transfer       pinned H2D prefix copies, and the `measured` hardware profile
#  8. e2e            end-to-end decode of the committed tiny Mixtral under every policy and under what
#                    apply(model, pack, gpu_budget=B) runs by default (`--default`: record crisp-default;
#                    routing and next-layer predictions recorded), then 9. simulate-measured: the measured
#                    profile against that run, crisp-default's prediction against its decode included
# 10. layer          layer steps of the real runtime vs the flow-shop bound, per order
# 11. kernels        the kernel benchmark (Mixtral-8x7B, DeepSeek-MoE-16B, Qwen3-30B-A3B shapes), 2-bit tails beside
# 12. cpu-kernel     the CPU expert kernels (native C against torch's int4pack op, same rounds) on the
#                    lent machine's many cores: the per-core figures so far come from a 2-core VM
# 13. planner        the planner's CPU overhead per step (a CPU figure: last)
# --dry-run (or DRY_RUN=1): print one line per step, `STEP <name> <needs s> <command...>`, in order,
# and run nothing. Logs and JSON go to OUT_DIR; `summary.txt` there lists each step's rc, time, or
# why it was skipped. Exit status: non-zero when a step failed (skipped steps do not fail).
set -u
dry_run="${DRY_RUN:-0}"
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
total_budget="${TOTAL_BUDGET_S:-600}"
step_timeout="${STEP_TIMEOUT:-240}"
for v in "$total_budget" "$step_timeout"; do
  case "$v" in ''|*[!0-9]*) echo "error: TOTAL_BUDGET_S and STEP_TIMEOUT must be whole seconds, got '$v'" >&2; exit 2;; esac
done
out="${1:-${OUT:-gpu-check-out}}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"

if [ "$dry_run" != 1 ]; then
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"  # absolute: the script changes directory below
  cd "$repo"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
  export TRITON_INTERPRET=0
  export CRISP_TEST_DEVICES=cuda
  # Not installed: bench/ and tools/ are imported as crisp_bench / crisp_tools (pyproject's
  # package-dir), which PYTHONPATH=$repo alone does not provide. Link them under those names.
  if ! "$py" -c "import crisp_bench, crisp_tools" >/dev/null 2>&1; then
    mkdir -p "$out/pythonpath"
    ln -sfn "$repo/bench" "$out/pythonpath/crisp_bench"
    ln -sfn "$repo/tools" "$out/pythonpath/crisp_tools"
    export PYTHONPATH="$out/pythonpath:$PYTHONPATH"
  fi
  {
    nvidia-smi || true
    "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
    for m in crisp_kernels crisp_runtime crisp_bench crisp_tools pytest pytest_benchmark hypothesis transformers safetensors matplotlib; do
      "$py" -c "import $m" >/dev/null 2>&1 || echo "missing python module: $m"
    done
  } >"$out/env.txt" 2>&1
  : >"$out/summary.txt"
fi
# pyproject's addopts has --benchmark-disable, an error without pytest-benchmark; a test
# module whose imports are missing (hypothesis, transformers) must not stop the others.
pytest_opts=(-p no:cacheprovider --continue-on-collection-errors)
[ "$dry_run" = 1 ] || "$py" -c "import pytest_benchmark" >/dev/null 2>&1 || pytest_opts+=(-o "addopts=-ra")

start=$SECONDS
failed=0
# step NAME NEEDS_S COMMAND...: run COMMAND (stdout and stderr to OUT_DIR/NAME.txt) if NEEDS_S seconds
# are left of the budget; a pytest rc of 5 (no test collected) is not a failure.
step() {
  local name=$1 needs=$2; shift 2
  if [ "$dry_run" = 1 ]; then echo "STEP $name $needs $*"; return 0; fi
  local left=$(( total_budget - (SECONDS - start) ))
  [ "$left" -ge 0 ] || left=0  # past the deadline: nothing left (not a negative count)
  if [ "$left" -lt "$needs" ]; then
    echo "$name: skipped: ${left}s left of TOTAL_BUDGET_S=${total_budget}s, it needs ~${needs}s" | tee -a "$out/summary.txt"
    return 0
  fi
  local limit=$(( left < step_timeout ? left : step_timeout )) t0=$SECONDS rc
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  [ "$rc" -eq 5 ] && [ "$3" = "pytest" ] && rc=0
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  echo "$name: rc=$rc ($((SECONDS - t0))s of a ${limit}s limit; $out/$name.txt)" | tee -a "$out/summary.txt"
}
cb=("$py" -m crisp_bench.cli)

step h2d-cpu-busy 30 "$py" -m crisp_bench.hybrid_check copy
step hybrid-step 120 "$py" -m crisp_bench.hybrid_check step
step prefetch-step 90 "$py" -m crisp_bench.hybrid_check prefetch
step e2e-hybrid 150 "${cb[@]}" e2e --tokens 32 --policies full,crisp \
  --placements gpu,hybrid,hybrid_split,static_hybrid,cpu_only --json "$out/e2e-hybrid.json"
step pytest-gpu 120 "$py" -m pytest -q -m gpu "${pytest_opts[@]}" --junitxml="$out/pytest-gpu.xml" tests
step kernel-tests 240 "$py" -m pytest -q "${pytest_opts[@]}" --durations=15 --junitxml="$out/pytest-kernels-cuda.xml" \
  tests/test_expert_mlp.py tests/test_ops.py tests/test_experts_module.py tests/test_format.py tests/test_io.py \
  tests/test_tail_kernels.py tests/test_tail_rows.py
step transfer 60 "${cb[@]}" transfer --shapes tiny,mixtral --profile-out "$out/measured-profile.json" \
  --json "$out/transfer.json"
step e2e 150 "${cb[@]}" e2e --tokens 128 --default --record-trace "$out/e2e-trace.npz" --json "$out/e2e.json" \
  --plot "$out/e2e.png"
step simulate-measured 30 "${cb[@]}" simulate --profile "$out/measured-profile.json" --target native \
  --trace "$out/e2e-trace.npz" --plan models/tiny-mixtral-crisp --compare "$out/e2e.json" \
  --json "$out/simulate-measured.json"
step layer 120 "${cb[@]}" layer --json "$out/layer.json"
step kernels 120 "${cb[@]}" kernels --device cuda --widths 0.25,0.5,0.75,1 --tokens 1,4,16,128 --tail-start 0.25 \
  --json "$out/kernels.json"
step cpu-kernel 60 "${cb[@]}" cpu --shapes mixtral --tokens 1,4 --widths 0.125,0.25,0.5,1 --repeats 5 \
  --impl native-fp32,int4pack-bf16 --json "$out/cpu-kernel.json"
step planner 20 "$py" -c "import json; from crisp_bench.runtime import measure_planner_overhead as m; print(json.dumps(m(), indent=1))"

[ "$dry_run" = 1 ] && exit 0
echo "gpu_check: $((SECONDS - start))s of TOTAL_BUDGET_S=${total_budget}s; $failed step(s) failed"
tail -n 3 "$out/pytest-gpu.txt" "$out/kernel-tests.txt" 2>/dev/null
[ "$failed" -eq 0 ]
