#!/usr/bin/env bash
# Every GPU check and benchmark of flint_jax, on an H200 device machine (repo root as cwd).
#
#   bash tools/gpu_all.sh STAGE...
#
#   tests         each Pallas kernel against its reference and the decode steps against XLA,
#                 compiled (tools/gpu_kernels.sh tests; ~400 s)
#   kernels       per-kernel timings (tools/gpu_kernels.sh bench; docs/kernels.md)
#   suite_bf16    full-size model, BF16: Pallas vs XLA parity (32 greedy steps) and the decode
#                 benchmark (ms/step, tokens/s, % of HBM floor, kernels/step) (benchmarks/gpu_suite.py
#                 on flint_jax/bench.py; a plan variant: OPTIONS="KEY=VALUE ...", see suites_x2)
#   suite_nvfp4   the same with NVFP4 weights
#   checkpoints   synth -> convert -> load -> generate at full size (tools/gpu_checkpoints.sh nvfp4)
#   sharded       2 GPUs (nvidia-h200-x2): a BF16 checkpoint restored over both equals one GPU
#   suites_x2     (nvidia-h200-x2) both suites at once, BF16 on GPU 0 and NVFP4 on GPU 1, with
#                 the compiled tests of the newest kernels on GPU 1 alongside (one 10-minute call);
#                 on one GPU the suites run one after the other, then the tests
#   demo_parity   the shipped trained demo model: Pallas decode step vs the XLA path, greedy, 8
#                 prompts x 128 tokens, batch 1 and 8, BF16 and NVFP4, margins at each divergence
#                 (tools/demo_parity.py; issue #42)
#   demo_train    tools/train_demo.py on the GPU (its defaults: 64 x 512 tokens/step) for
#                 TRAIN_MINUTES (default 8), resuming from .train_demo-gpu (git-ignored: it stays on
#                 a warm machine between calls), then exports to $OUT: the two weight shards, the
#                 other files in demo_model_files.tar, the loss curve and the log; TRAIN_ARGS
#                 adds train_demo.py arguments (e.g. "--steps 5000 --save-every 1000")
#   all           everything above but `sharded` and the demo stages, in order (needs more than
#                 one 10-minute call)
#
# Each stage fits one 10-minute device command; results (logs, JSON) land in $OUT.
# Wheels the image lacks travel in .whl/ (git-ignored; name it in `carry`). Fetch them with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     gguf==0.19.0 flax==0.12.12 orbax-checkpoint==0.12.8
#   (demo_train also needs optax, and matplotlib for the loss curve, if the image lacks them: add
#   them, with the versions of .venv here, to that download)
# The numbers in docs/performance.md came from:
#   run(command="bash tools/gpu_all.sh suite_bf16", carry=[".whl"], timeout_s=600)   (and so on)
set -uo pipefail
source tools/gpu_env.sh

stages=("$@")
[ "${stages[0]:-all}" = all ] && stages=(tests kernels suite_bf16 suite_nvfp4 checkpoints)
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/env.txt"

opts=""; for o in ${OPTIONS:-}; do opts="$opts --option $o"; done
for stage in "${stages[@]}"; do
  echo "=== $stage ($(date -u +%T))"
  case $stage in
    tests)       OUT=$OUT bash tools/gpu_kernels.sh tests ;;
    kernels)     OUT=$OUT bash tools/gpu_kernels.sh bench ;;
    suite_bf16)  python3 benchmarks/gpu_suite.py --format bf16 --trace --out "$OUT/suite_bf16.json" $opts \
                   2>&1 | grep -v "DeprecationWarning\|warnings.warn" | tee "$OUT/suite_bf16.log" ;;
    suite_nvfp4) python3 benchmarks/gpu_suite.py --format nvfp4 --trace --out "$OUT/suite_nvfp4.json" $opts \
                   2>&1 | grep -v "DeprecationWarning\|warnings.warn" | tee "$OUT/suite_nvfp4.log" ;;
    suites_x2)
      # FORMATS (default "bf16 nvfp4"): BF16 suite on GPU 0, NVFP4 suite on GPU 1; the compiled
      # tests of the newest kernels without preallocation (4 workers), see TESTS_WHEN.
      # CASES, PATHS (xla,pallas | pallas), PARITY_STEPS, PARITY_BATCH, OPTIONS (a plan variant:
      # space-separated KEY=VALUE, each passed as --option, e.g. "early_trigger=false
      # moe.slot_rows=all"; see flint_jax/bench.py parse_options), SUITE_BUDGET (s;
      # SUITE_BUDGET_NVFP4 for the NVFP4 suite) choose the work:
      # a 10-minute call fits parity + about 4 cases per format (compiles dominate).
      CASES=${CASES:-1x1024,8x1024,1x8192,8x8192,8x100000,1x100000}
      SUITE="python3 benchmarks/gpu_suite.py --trace --cases $CASES
             --paths ${PATHS:-xla,pallas}
             --parity-steps ${PARITY_STEPS:-32} --parity-batch ${PARITY_BATCH:-2}"
      for o in ${OPTIONS:-}; do SUITE="$SUITE --option $o"; done
      # TESTS_WHEN: "concurrent" (default: on GPU 1 beside the NVFP4 suite, whose timings it then
      # disturbs), "after" (on GPU 0 once the BF16 suite is done: clean timings) or "none";
      # TEST_FILES overrides the test files.
      run_tests() {
        CUDA_VISIBLE_DEVICES=$1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda \
          timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -n 4 -p no:cacheprovider \
          ${TEST_FILES:-tests/test_pallas_multi_gemv.py tests/test_pallas_moe.py \
            tests/test_pallas_add_rms_norm.py tests/test_fast_decode.py \
            tests/test_pallas_add_rms_norm_router.py tests/test_pallas_norm_qkv.py \
            tests/test_pallas_attention_block.py} \
          > "$OUT/tests_new_kernels.log" 2>&1
      }
      # On a one-GPU machine (nvidia-h200) the formats run one after the other on GPU 0 and the
      # tests never run concurrently.
      ngpu=$(nvidia-smi -L | grep -c GPU)
      [ "$ngpu" -lt 2 ] && [ "${TESTS_WHEN:-concurrent}" = concurrent ] && TESTS_WHEN=after
      [ "${TESTS_WHEN:-concurrent}" = concurrent ] && run_tests 1 &
      for fmt in ${FORMATS:-bf16 nvfp4}; do
        gpu=0; frac=0.95
        [ "$fmt" = nvfp4 ] && [ "$ngpu" -ge 2 ] && { gpu=1; frac=0.75; }
        budget=${SUITE_BUDGET:-400}
        [ "$fmt" = nvfp4 ] && budget=${SUITE_BUDGET_NVFP4:-$budget}
        CUDA_VISIBLE_DEVICES=$gpu XLA_PYTHON_CLIENT_MEM_FRACTION=$frac $SUITE --format "$fmt" \
          --budget-s "$budget" \
          --out "$OUT/suite_$fmt.json" 2>&1 \
          | grep --line-buffered -v "DeprecationWarning\|warnings.warn" > "$OUT/suite_$fmt.log" &
        [ "$fmt" = bf16 ] && bf16_pid=$!
        [ "$ngpu" -lt 2 ] && { wait $!; bf16_pid=; }
      done
      if [ "${TESTS_WHEN:-concurrent}" = after ]; then
        [ -n "${bf16_pid:-}" ] && wait "$bf16_pid"
        run_tests 0
      fi
      # KERNEL_GROUPS (e.g. "moe,router"; benchmarks/kernels.py GROUPS: gemv, nvfp4, qkv, moe,
      # attention, norms, router): kernel microbenchmark groups run on GPU 0 after the BF16 suite.
      if [ -n "${KERNEL_GROUPS:-}" ]; then
        [ -n "${bf16_pid:-}" ] && wait "$bf16_pid"
        CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${KERNEL_TIMEOUT:-240} \
          python3 benchmarks/kernels.py --out "$OUT/kernels" --groups "$KERNEL_GROUPS" \
          --budget "${KERNEL_BUDGET:-180}" --compile-threads 16 > "$OUT/kernels.log" 2>&1
        sed -n '/^| group/,$p' "$OUT/kernels.log" | cut -c1-200
      fi
      wait
      [ -f "$OUT/tests_new_kernels.log" ] && tail -n 3 "$OUT/tests_new_kernels.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests_new_kernels.log" | head -20
      for fmt in ${FORMATS:-bf16 nvfp4}; do grep -v "^|" "$OUT/suite_$fmt.log" | cut -c1-600; done ;;
    demo_parity) python3 tools/demo_parity.py --out "$OUT/demo_parity.json" 2>&1 \
                   | grep -v "DeprecationWarning\|warnings.warn" | tee "$OUT/demo_parity.log" ;;
    demo_train)
      python3 tools/train_demo.py --work .train_demo-gpu --minutes "${TRAIN_MINUTES:-8}" \
        --out "$OUT/demo_model" --plot "$OUT/demo_model_loss.png" ${TRAIN_ARGS:-} 2>&1 \
        | tee "$OUT/demo_train.log"
      # $OUT returns at most 8 files: the shards as they are, everything else in one tar.
      (cd "$OUT/demo_model" && tar cf ../demo_model_files.tar $(ls | grep -v '\.safetensors$') \
        && mv ./*.safetensors .. && cd .. && rm -r demo_model) ;;
    checkpoints) OUT=$OUT bash tools/gpu_checkpoints.sh nvfp4 ;;
    sharded)     OUT=$OUT bash tools/gpu_checkpoints.sh sharded ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
