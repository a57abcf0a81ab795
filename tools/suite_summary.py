"""Compact per-path summary of gpu_suite.py JSON files (for the tail of a GPU run's output).

  python3 tools/suite_summary.py OUT/a.json [OUT/b.json ...] [--kernels PREFIX,PREFIX]

Prints, per case and path: in-loop ms, kernel busy us, kernel count, and the us per call of the
kernels whose names start with one of the prefixes (default: the heaviest five).
"""

from __future__ import annotations

import argparse
import json


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--kernels", default="", help="kernel name prefixes, comma separated")
  a = ap.parse_args()
  prefixes = [p for p in a.kernels.split(",") if p]
  for f in a.files:
    try:
      d = json.load(open(f))
    except (OSError, ValueError) as e:
      print(f"{f}: {e}")
      continue
    for c in d.get("cases", []):
      paths = sorted({k[:-len("_loop_ms")] for k in c if k.endswith("_loop_ms")})
      print(f"{f} {c['format']} {c['batch']}x{c['context']} floor {c['floor_ms']:.3f} ms")
      for p in paths:
        by = c.get(p + "_by_kernel") or []
        pick = [r for r in by if any(r[0].startswith(x) for x in prefixes)] if prefixes else by[:5]
        ks = " ".join(f"{n[:40]}={us / cnt:.2f}" for n, cnt, us in pick)
        idle = c.get(p + "_loop_idle_ms")
        print(f"  {p:18s} loop {c[p + '_loop_ms']:.3f} ms"
              + (f" (idle {idle:.3f})" if idle else "") + f"  busy {c.get(p + '_busy_us', 0):7.1f} us"
              f"  kernels {c.get(p + '_kernels', 0):4.0f}  {ks}")
      for k, v in c.items():
        if k.startswith("rel_l2") or "parity" in k or k.endswith("_error"):
          print(f"  {k}: {str(v)[:200]}")


if __name__ == "__main__":
  main()
