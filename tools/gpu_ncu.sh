#!/bin/bash
# Nsight Compute on the decode step's Pallas kernels (one H200, Firecracker runtime: ncu reads
# the hardware counters there; KINDS.md). Repository root as cwd, after `source tools/gpu_env.sh`.
#
#   bash tools/gpu_ncu.sh NAME FORMAT BATCH [PATH] [KERNELS...]
#
# profiles every `flint_` kernel of two decode steps of a 6-layer full-width model
# (benchmarks/ncu_step.py) and writes under $OUT:
#   NAME.txt          one line per kernel of the second step (tools/ncu_summary.py): duration,
#                     grid, registers, occupancy, issue slots busy, DRAM, top warp stalls
#   NAME_details.txt  ncu's details page (sections and its rule notes) for each regex in
#                     KERNELS (second-step instance)
#   NAME_sass.csv     per-SASS-instruction counters (stall samples) of the first KERNELS regex
# NCU_FILTER (a kernel-name regex, default flint_) narrows what is profiled.
# Clocks are left alone (--clock-control none, METHOD.md); caches are flushed before each
# replayed pass (ncu's default), so the weights are cold as in the step, and so are the
# activations, which the step finds in the L2.
set -u
name=$1 fmt=$2 batch=$3 path=${4:-pallas}
shift $(( $# < 4 ? $# : 4 ))
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -x "$NCU" ] || { echo "ncu not found"; exit 1; }
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="   # kernels, not graphs
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # room for ncu's memory save / restore
rep=/tmp/ncu_$name
timeout ${NCU_TIMEOUT:-300} "$NCU" --clock-control none --target-processes all \
  -k regex:${NCU_FILTER:-flint_} --launch-count 600 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
  --metrics dram__bytes_read.sum,smsp__inst_executed.sum \
  -f -o $rep python3 benchmarks/ncu_step.py --format $fmt --batch $batch --path $path \
  --steps 2 > $OUT/${name}.log 2>&1
echo "ncu rc $? ($name)"; tail -3 $OUT/${name}.log
"$NCU" --import $rep.ncu-rep --page raw --csv --print-units base > $rep.csv 2>> $OUT/${name}.log
python3 tools/ncu_summary.py $rep.csv --steps 2 > $OUT/${name}.txt   # the second step
for k in "$@"; do
  "$NCU" --import $rep.ncu-rep --page details -k regex:$k --launch-skip 1 --launch-count 1 \
    2>&1 | head -c 400000 >> $OUT/${name}_details.txt
done
if [ $# -gt 0 ]; then
  "$NCU" --import $rep.ncu-rep --page source --csv --print-source sass -k regex:$1 \
    --launch-skip 1 --launch-count 1 2>&1 | head -c 12000000 > $OUT/${name}_sass.csv
fi
ls -la $OUT | grep $name
