#!/usr/bin/env bash
# Full-scale checkpoint pipeline on the H200 machine: synth -> convert -> load -> generate.
#
#   nvfp4    (nvidia-h200, ~22 GB GGUF + ~22 GB converted on the 64 GiB disk):
#            synth the full 49-layer NVFP4 GGUF into /tmp, convert it, load it on the GPU and
#            generate 16 tokens (kernels="xla")
#   bf16     (nvidia-h200): the same with BF16 HF safetensors, $BF16_LAYERS full-size layers
#            (default 12: ~18 GB, twice on disk while converting)
#   sharded  (nvidia-h200-x2): restore a BF16 checkpoint (4 full-size layers) on 1 GPU and
#            sharded over a Mesh of 2 GPUs; logits and greedy tokens compared (fp32 and bf16)
#   all      all three (one machine with >= 2 GPUs; may not fit one 10-minute command)
#   bf16,sharded   a comma-separated list runs those stages in order
#
# Reports file sizes, conversion / load / generation times and each stage's peak host memory
# (VmHWM and getrusage max RSS of the stage's own process) in $OUT/checkpoints.json.
#
# The GPU image has no `gguf` package: carry its wheel (pure Python; numpy, pyyaml, requests and
# tqdm are in the image). Once, here, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl gguf==0.19.0
# then, with the device tool:
#   run(command="bash tools/gpu_checkpoints.sh nvfp4", carry=[".whl"], kind="nvidia-h200", timeout_s=600)
#   run(command="bash tools/gpu_checkpoints.sh bf16", carry=[".whl"], kind="nvidia-h200", timeout_s=600)
#   run(command="bash tools/gpu_checkpoints.sh sharded", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
# Local check at tiny scale (no GPU):
#   JAX_PLATFORMS=cpu CONFIG=tiny OUT=/tmp/ck_out bash tools/gpu_checkpoints.sh all
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-nvfp4}"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import gguf" 2>/dev/null || { echo "gguf is not importable: carry .whl (see the header)"; exit 2; }
export PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/flint_ckpt_out}"
# Leave the GPU memory to XLA's allocator but do not grab 75% up front: the load's own peak is
# what we report.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/nvidia_smi.txt" 2>/dev/null || true
df -h /tmp > "$OUT/df.txt" 2>/dev/null || true
exec "$PY" tools/gpu_checkpoints.py run --mode "$MODE" --config "${CONFIG:-flint}" \
  --bf16-layers "${BF16_LAYERS:-12}" --sharded-layers "${SHARDED_LAYERS:-4}" \
  --workdir "${WORKDIR:-/tmp/flint_ckpt}" --out "$OUT" ${KEEP:+--keep}
