#!/usr/bin/env bash
# The one GPU check of CRISP: tests compiled on CUDA and every benchmark, on a CUDA machine, with
# the package importable (installed with `pip install --no-deps -e .`, or via PYTHONPATH, set below).
#
#   bash bench/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./gpu-check-out)
#
# 1. `pytest -m gpu`: every test marked gpu, including the kernel tests' cuda cases.
# 2. The kernel, ops and experts-module tests compiled on CUDA: TRITON_INTERPRET=0 and
#    CRISP_TEST_DEVICES=cuda make the `device` fixture yield only cuda (tests/conftest.py).
# 3. The kernel benchmark (Mixtral-8x7B, DeepSeek-MoE-16B, Qwen3-30B-A3B shapes), as a table
#    and JSON.
# 4. The runtime: planner overhead, pinned H2D prefix copies vs the measured pinned bandwidth,
#    layer steps vs the flow-shop bound, end-to-end decode of the committed tiny Mixtral under
#    every policy (its routing recorded), and the `measured` simulator profile checked against
#    that e2e run (prediction error per policy).
# Logs and JSON go to OUT_DIR; a summary of exit codes is printed last. Exit status: non-zero
# when any step failed.
set -u
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # absolute: the script changes directory below
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
export CRISP_TEST_DEVICES=cuda
py="${PYTHON:-python}"
# Not installed: bench/ and tools/ are imported as crisp_bench / crisp_tools (pyproject's
# package-dir), which PYTHONPATH=$repo alone does not provide. Link them under those names.
if ! "$py" -c "import crisp_bench, crisp_tools" >/dev/null 2>&1; then
  mkdir -p "$out/pythonpath"
  ln -sfn "$repo/bench" "$out/pythonpath/crisp_bench"
  ln -sfn "$repo/tools" "$out/pythonpath/crisp_tools"
  export PYTHONPATH="$out/pythonpath:$PYTHONPATH"
fi
# pyproject's addopts has --benchmark-disable, an error without pytest-benchmark; a test
# module whose imports are missing (hypothesis, transformers) must not stop the others.
pytest_opts=(-p no:cacheprovider --continue-on-collection-errors)
"$py" -c "import pytest_benchmark" >/dev/null 2>&1 || pytest_opts+=(-o "addopts=-ra")

{
  nvidia-smi || true
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
  for m in crisp_kernels crisp_runtime crisp_bench crisp_tools pytest pytest_benchmark hypothesis transformers safetensors matplotlib; do
    "$py" -c "import $m" >/dev/null 2>&1 || echo "missing python module: $m"
  done
} >"$out/env.txt" 2>&1

# Each step is bounded (STEP_TIMEOUT seconds, default 240) so one slow step cannot eat a lent
# GPU's whole time: the kernel tests compile a few hundred Triton variants on first contact.
step_timeout="${STEP_TIMEOUT:-240}"
t() { timeout "$step_timeout" "$@"; }

t "$py" -m pytest -q -m gpu "${pytest_opts[@]}" --junitxml="$out/pytest-gpu.xml" tests >"$out/pytest-gpu.log" 2>&1
rc_gpu=$?

t "$py" -m pytest -q "${pytest_opts[@]}" --durations=15 --junitxml="$out/pytest-kernels-cuda.xml" \
  tests/test_expert_mlp.py tests/test_ops.py tests/test_experts_module.py tests/test_format.py tests/test_io.py \
  >"$out/pytest-kernels-cuda.log" 2>&1
rc_kernels=$?

t "$py" -m crisp_bench.cli kernels --device cuda --widths 0.25,0.5,0.75,1 --tokens 1,4,16,128 \
  --json "$out/kernels.json" >"$out/kernels.txt" 2>&1
rc_bench=$?

bench() {  # name, then the crisp-bench arguments
  local name=$1; shift
  t "$py" -m crisp_bench.cli "$@" >"$out/$name.txt" 2>&1
  echo "$name: rc=$?" >>"$out/bench-rc.txt"
}
: >"$out/bench-rc.txt"
bench transfer transfer --shapes tiny,mixtral --profile-out "$out/measured-profile.json" --json "$out/transfer.json"
bench layer layer --json "$out/layer.json"
bench e2e e2e --tokens 128 --record-trace "$out/e2e-trace.npz" --json "$out/e2e.json" --plot "$out/e2e.png"
bench simulate-measured simulate --profile "$out/measured-profile.json" --target native --trace "$out/e2e-trace.npz" \
  --plan models/tiny-mixtral-crisp --compare "$out/e2e.json" --json "$out/simulate-measured.json"
t "$py" -c "import json; from crisp_bench.runtime import measure_planner_overhead as m; print(json.dumps(m(), indent=1))" \
  >"$out/planner-overhead.json" 2>&1
# issue 11: copy rate with and without the CPU streaming; the hybrid path and its baselines end to end on the GPU
t "$py" -c "from crisp_bench.hybrid_check import main; raise SystemExit(main())" >"$out/h2d-cpu-busy.json" 2>&1
echo "h2d-cpu-busy: rc=$?" >>"$out/bench-rc.txt"
bench e2e-hybrid e2e --tokens 64 --policies full,crisp --placements gpu,hybrid,static_hybrid,cpu_only \
  --json "$out/e2e-hybrid.json"
rc_runtime=$(grep -c -v "rc=0" "$out/bench-rc.txt")

echo "pytest -m gpu:          rc=$rc_gpu  ($out/pytest-gpu.log)"
echo "kernel tests on cuda:   rc=$rc_kernels  ($out/pytest-kernels-cuda.log)"
echo "kernel benchmark:       rc=$rc_bench  ($out/kernels.txt, $out/kernels.json)"
echo "runtime benchmarks:     $rc_runtime failed  ($out/bench-rc.txt)"; cat "$out/bench-rc.txt"
tail -n 3 "$out/pytest-gpu.log" "$out/pytest-kernels-cuda.log"
cat "$out/kernels.txt"
[ "$rc_gpu" -eq 0 ] || [ "$rc_gpu" -eq 5 ] || exit 1  # 5: no gpu tests collected
[ "$rc_kernels" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_runtime" -eq 0 ]
