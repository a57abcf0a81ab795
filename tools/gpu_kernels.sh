#!/usr/bin/env bash
# The one script run on the GPU machine (device `run`, repository root) for the Pallas kernels:
#   1. the kernel tests in compiled mode (tests/test_pallas_*.py; INTERPRET is False on a GPU,
#      so the same tests compare compiled kernels with their references, Flint-sized cases on)
#      and the decode-step tests (tests/test_fast_decode.py: compiled steps against XLA and
#      against each other), the prefill tests (test_prefill.py, test_cudnn_attention.py) and the
#      shape sweep (tests/test_shape_sweep.py with FLINT_SWEEP=full, compiled): 328 s on 8
#      workers in H200 run 196 (the sweep's cases failing fast there: give TEST_TIMEOUT >= 400),
#   2. benchmarks/kernels.py: device time of each kernel and its XLA reference at Flint sizes.
# Usage: tools/gpu_kernels.sh [all|tests|bench]   (env: BENCH_BUDGET, BENCH_ARGS, TEST_TIMEOUT)
# "all" does not fit one 10-minute device call: run "tests" and "bench" as two calls.
# Logs and bench.jsonl go to $OUT (the device tool brings them back).
set -u
OUT=${OUT:-/tmp/flint_kernels_out}
mkdir -p "$OUT"
# gpu_env.sh installs the wheels the image lacks (gguf, flax, ...) into /tmp/site on PYTHONPATH.
# JAX_PLATFORMS lists cpu after cuda (the default backend stays the GPU): the shape sweep's
# router taps (jax.debug.callback) need a CPU device (run 196: all 17 sweep cases failed without).
source tools/gpu_env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu
MODE=${1:-all}
BUDGET=${BENCH_BUDGET:-300}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
} 2>&1 | tee "$OUT/gpu.txt"

if [[ "$MODE" == all || "$MODE" == tests ]]; then
  echo "=== tests (compiled) ==="
  FLINT_SWEEP=full XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 FLINT_FAILURES_LOG="$OUT/failures.txt" timeout -k 10 "${TEST_TIMEOUT:-540}" \
    python3 -m pytest tests/test_pallas_*.py tests/test_cudnn_attention.py tests/test_fast_decode.py tests/test_prefill.py tests/test_shape_sweep.py \
    -q -n 8 \
    -p no:cacheprovider --durations=10 \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
fi

if [[ "$MODE" == all || "$MODE" == bench ]]; then
  echo "=== benchmarks ==="
  timeout $((BUDGET + 150)) python3 benchmarks/kernels.py --out "$OUT" --budget "$BUDGET" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench exit $?"
  grep -E "FAILED|trace:|skipped|total" "$OUT/bench.log" | cut -c1-300 | head -40
  sed -n '/^| group/,$p' "$OUT/bench.log"
fi
