#!/usr/bin/env bash
# GPU check of the CRISP kernels: run on a CUDA machine from the repository root, with the
# package importable (installed, or the repository root on PYTHONPATH).
#
#   bash bench/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./gpu-check-out)
#
# 1. `pytest -m gpu`: every test marked gpu, including the kernel tests' cuda cases.
# 2. The kernel, ops and experts-module tests compiled on CUDA: TRITON_INTERPRET=0 and
#    CRISP_TEST_DEVICES=cuda make the `device` fixture yield only cuda (tests/conftest.py).
# 3. The kernel benchmark (Mixtral-8x7B, DeepSeek-MoE-16B, Qwen3-30B-A3B shapes), as a table
#    and JSON.
# Logs and JSON go to OUT_DIR; a summary of exit codes is printed last. Exit status: non-zero
# when any step failed.
set -u
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
export CRISP_TEST_DEVICES=cuda
py="${PYTHON:-python}"

{
  nvidia-smi || true
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} >"$out/env.txt" 2>&1

"$py" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/pytest-gpu.xml" tests >"$out/pytest-gpu.log" 2>&1
rc_gpu=$?

"$py" -m pytest -q -p no:cacheprovider --durations=15 --junitxml="$out/pytest-kernels-cuda.xml" \
  tests/test_expert_mlp.py tests/test_ops.py tests/test_experts_module.py tests/test_format.py tests/test_io.py \
  >"$out/pytest-kernels-cuda.log" 2>&1
rc_kernels=$?

"$py" -m crisp_bench.kernels --device cuda --json "$out/kernels.json" >"$out/kernels.txt" 2>&1
rc_bench=$?

echo "pytest -m gpu:          rc=$rc_gpu  ($out/pytest-gpu.log)"
echo "kernel tests on cuda:   rc=$rc_kernels  ($out/pytest-kernels-cuda.log)"
echo "kernel benchmark:       rc=$rc_bench  ($out/kernels.txt, $out/kernels.json)"
tail -n 3 "$out/pytest-gpu.log" "$out/pytest-kernels-cuda.log"
cat "$out/kernels.txt"
[ "$rc_gpu" -eq 0 ] || [ "$rc_gpu" -eq 5 ] || exit 1  # 5: no gpu tests collected
[ "$rc_kernels" -eq 0 ] && [ "$rc_bench" -eq 0 ]
