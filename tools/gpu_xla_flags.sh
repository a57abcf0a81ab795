#!/usr/bin/env bash
# The decode step under different XLA flag sets, one process per set (XLA reads XLA_FLAGS once).
#
#   FLAG_SETS="set1;set2;..." FORMATS="bf16 nvfp4" CASES=1x1024 PATHS=pallas,xla \
#     PARITY_SET=N bash tools/gpu_xla_flags.sh
#
# Each set is a space-separated XLA_FLAGS value ("default" = none). PARITY_SET (1-based, 0 =
# none) is the set whose run also checks Pallas-vs-XLA parity (16 greedy steps). Results:
# $OUT/flags_<format>_<set index>.json and a summary line per run on stdout.
set -uo pipefail
source tools/gpu_env.sh
IFS=';' read -r -a sets <<< "${FLAG_SETS:-default;--xla_gpu_enable_pdl=true}"
for fmt in ${FORMATS:-bf16 nvfp4}; do
  for i in "${!sets[@]}"; do
    n=$((i + 1)); flags=${sets[$i]}; [ "$flags" = default ] && flags=
    parity=0; [ "${PARITY_SET:-0}" = "$n" ] && parity=16
    echo "== $fmt set $n: XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" python3 benchmarks/gpu_suite.py --format "$fmt" --cases "${CASES:-1x1024}" \
      --paths "${PATHS:-pallas,xla}" --parity-steps $parity --v1-cases none --fused-cases none \
      --trace --out "$OUT/flags_${fmt}_$n.json" 2>&1 \
      | grep --line-buffered -v "DeprecationWarning\|warnings.warn" > "$OUT/flags_${fmt}_$n.log"
    grep -E "B=|parity|FAILED|Error|error" "$OUT/flags_${fmt}_$n.log" | cut -c1-400
  done
done
