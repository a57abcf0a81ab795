"""Where a kernel's warps wait, region by region of its SASS, from ncu's source page.

    ncu --import step.ncu-rep --page source --csv --print-source sass -k regex:NAME \
        --launch-skip 1 --launch-count 1 > sass.csv          (tools/gpu_ncu.sh writes one)
    python3 tools/ncu_sass_regions.py sass.csv [--chunk 50]

Cuts the SASS into chunks of ``--chunk`` consecutive instructions and prints for each: its
share of the warp-state samples (where the warps spent their time), the range of times its
instructions were executed (which programs / loop trips run it: the routing prologue, the K
loop, the epilogue stand apart), the three largest stall reasons, and its opcodes.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import sys


def _opcode(source: str) -> str:
  """The opcode of one SASS line ("@!P0 BRA 0x560" -> "BRA")."""
  words = source.replace(",", " ").split()
  if words and words[0].startswith("@"):
    words = words[1:]
  return words[0] if words else ""


def regions(path: str, chunk: int = 50) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    rows = [r for r in csv.reader(f) if r]
  start = next(i for i, r in enumerate(rows) if "Source" in r and "# Samples" in r)
  hdr, data = rows[start], rows[start + 1:]
  ci = {h: i for i, h in enumerate(hdr)}
  stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
  num = lambda r, h: int(float(r[ci[h]] or 0))   # noqa: E731
  total = sum(num(r, "# Samples") for r in data) or 1
  out = [f"{len(data)} instructions, {total} samples; per {chunk}-instruction chunk: first "
         f"index, share of samples, executions (min, max), top stalls | opcodes"]
  for s in range(0, len(data), chunk):
    part = data[s:s + chunk]
    share = 100 * sum(num(r, "# Samples") for r in part) / total
    execs = [num(r, "Instructions Executed") for r in part]
    top = sorted(((sum(num(r, h) for r in part), h[6:]) for h in stalls), reverse=True)[:3]
    ops = sorted({_opcode(r[ci["Source"]]) for r in part} - {""})[:12]
    out.append(f"{s:5d} {share:5.1f}% exec ({min(execs)}, {max(execs)}) "
               + " ".join(f"{name} {v}" for v, name in top) + " | " + " ".join(ops))
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz too)")
  ap.add_argument("--chunk", type=int, default=50, help="instructions per region")
  a = ap.parse_args(argv)
  print(regions(a.csv, a.chunk))
  return 0


if __name__ == "__main__":
  sys.exit(main())
