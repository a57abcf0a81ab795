"""A compact table from Nsight Compute's raw CSV page: one line per profiled kernel.

    ncu --import step.ncu-rep --page raw --csv > step.csv
    python3 tools/ncu_summary.py step.csv [--last N]

For each kernel: duration, grid / block, registers, waves per SM, achieved occupancy, issue
slots busy, DRAM throughput, instructions executed, and the three largest warp-stall reasons
(warps stalled per issued instruction, ``smsp__average_warps_issue_stalled_*``: how many warp
cycles each reason costs for every instruction issued). ``--steps N``: the profile holds N
decode steps, print the last; ``--last K``: only the last K kernels.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

COLUMNS = [  # (header, metric (or "a|b": the first present), scale to ns / bytes / counts, format)
    ("us", "gpu__time_duration.sum", 1e-3, "{:7.2f}"),
    ("grid", "launch__grid_size", 1, "{:6.0f}"),
    ("blk", "launch__block_size", 1, "{:4.0f}"),
    ("regs", "launch__registers_per_thread", 1, "{:4.0f}"),
    ("waves", "launch__waves_per_multiprocessor", 1, "{:5.2f}"),
    ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1, "{:5.1f}"),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1, "{:5.1f}"),
    ("dram%", "dram__throughput.avg.pct_of_peak_sustained_elapsed|"
              "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1, "{:5.1f}"),
    ("MB", "dram__bytes_read.sum", 1e-6, "{:7.2f}"),
    ("Minst", "smsp__inst_executed.sum", 1e-6, "{:6.2f}"),
]
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def _num(text: str) -> float | None:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def _unit_scale(unit: str) -> float:
  """Factor to the base unit the COLUMNS scales assume (ns, bytes, counts)."""
  return {"us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9,
          "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}.get(
              unit.strip(), 1.0)


def summarize(path: str, last: int | None = None, width: int = 60, steps: int = 1) -> str:
  with open(path, newline="") as f:
    rows = [r for r in csv.reader(f) if r]
  start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
  header, units, data = rows[start], rows[start + 1], rows[start + 2:]
  col = {h: i for i, h in enumerate(header)}
  if steps > 1:      # the same kernels, step after step: keep the last step's
    data = data[len(data) - len(data) // steps:]
  if last:
    data = data[-last:]
  stall_cols = [(m.group(1), i) for h, i in col.items() if (m := STALL.fullmatch(h))]
  lines = ["kernel".ljust(width) + " " + " ".join(h.rjust(len(fmt.format(0))) for h, _, _, fmt
                                                in COLUMNS) + "  top stalls (warps per issue)"]
  for r in data:
    name = r[col["Kernel Name"]]
    cells = []
    for _, metrics, scale, fmt in COLUMNS:
      i = next((col[m] for m in metrics.split("|") if m in col), None)
      v = _num(r[i]) if i is not None and i < len(r) else None
      if v is not None:
        v *= _unit_scale(units[i]) * scale
      cells.append(fmt.format(v) if v is not None else "-".rjust(len(fmt.format(0))))
    stalls = sorted(((v, reason) for reason, i in stall_cols
                     if (v := _num(r[i]) if i < len(r) else None) is not None), reverse=True)
    top = ", ".join(f"{reason} {v:.2f}" for v, reason in stalls[:3])
    lines.append(name[:width].ljust(width) + " " + " ".join(cells) + "  " + top)
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("csv", help="ncu --page raw --csv output")
  ap.add_argument("--last", type=int, default=None, help="only the last N kernels")
  ap.add_argument("--steps", type=int, default=1,
                  help="decode steps the profile holds: only the last one is printed")
  ap.add_argument("--width", type=int, default=60, help="kernel-name column width")
  a = ap.parse_args(argv)
  print(summarize(a.csv, a.last, a.width, a.steps))
  return 0


if __name__ == "__main__":
  sys.exit(main())
