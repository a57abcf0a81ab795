#!/usr/bin/env bash
# Every GPU check and benchmark of flint_jax, on an H200 (device machine, repo root as cwd).
#
#   bash tools/gpu_all.sh STAGE...     STAGE: kernels | parity | bench | checkpoints | sharded | all
#
# Results land in $OUT (logs and JSON). A device command may run 10 minutes at most, so the
# stages are separate: `all` runs them in order for a machine without that limit.
#
# Wheels the image lacks travel in .whl/ (ignored by git; carry it). Fetch them here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     gguf==0.19.0 flax==0.12.12 orbax-checkpoint==0.12.8
set -uo pipefail
OUT=${OUT:-/tmp/flint_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}

stages=("$@")
[ "${stages[0]:-all}" = all ] && stages=(kernels parity bench checkpoints)
{
  date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/env.txt"

for stage in "${stages[@]}"; do
  echo "=== $stage ($(date -u +%T))"
  case $stage in
    kernels)      # every kernel against its reference, compiled; then the per-kernel microbenchmarks
      FLINT_JAX_GPU_TESTS=1 python3 -m pytest -q -x tests/test_pallas_*.py 2>&1 | tail -30 | tee "$OUT/kernel_tests.log"
      python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" ;;
    parity)       # full-size model, Pallas vs XLA: logits and 32 greedy steps, BF16 and NVFP4
      python3 benchmarks/gpu_parity.py --steps 32 --out "$OUT/parity.json" 2>&1 | tee "$OUT/parity.log" ;;
    bench)        # decode ms/step, tokens/s, % of the HBM floor, kernels per step
      python3 -m flint_jax.cli bench --dtype bf16 nvfp4 --batch 1 8 --context 1024 8192 100000 \
        --steps 30 --trace --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    checkpoints)  # synth -> convert -> load -> generate at full size (issue 3)
      bash tools/gpu_checkpoints.sh 2>&1 | tee "$OUT/checkpoints.log" ;;
    sharded)      # 2 GPUs: a BF16 checkpoint restored over both equals one GPU
      bash tools/gpu_checkpoints.sh sharded 2>&1 | tee "$OUT/sharded.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
