# Sourced by the GPU scripts (tools/gpu_all.sh, tools/gpu_kernels.sh), repository root as cwd:
# installs the wheels the device image lacks from .whl/ (see gpu_all.sh's header) and sets the
# environment every GPU run uses.
OUT=${OUT:-/tmp/flint_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
# Full-size BF16 weights (80 GB) plus a 100K-token batch-8 cache (30 GB) need most of the card.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
