#!/usr/bin/env bash
# Creates .venv with flint_jax installed from this checkout (editable, with the test extras).
# jax 0.11.x needs Python >= 3.12: the first one found is used (python3.13, python3.12, pyenv's
# 3.12, $PYTHON if set). On a GPU machine add the CUDA build: .venv/bin/pip install -e ".[cuda]".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
for cand in "${PYTHON:-}" python3.13 python3.12 python3 \
            "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12.1/bin/python3.12")"; do
  if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  echo "setup: no Python >= 3.12 found (jax 0.11 needs it); set PYTHON=/path/to/python3.12" >&2
  exit 1
fi
echo "setup: using $PY ($("$PY" --version))"
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
echo "setup: done; try .venv/bin/flint-jax demo"
