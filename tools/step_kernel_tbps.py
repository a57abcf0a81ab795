"""Per-kernel achieved bandwidth inside the decode step, from a gpu_suite.py JSON (its `--trace`).

  python3 tools/step_kernel_tbps.py OUT/nvfp4.json [--path pallas] [--cases 1x1024,8x1024]

For each case, every kernel of the step's trace with its calls, device us per call, the bytes
one call must read at least (weights as the model holds them, the KV cache in use) and the
bandwidth that gives, against the 4.3 TB/s copy ceiling (spec section 9). Kernels without a
byte model (merges, norms, top-k, XLA glue) print "-": they are latency-bound by design.

The byte model follows `flint_jax.bench.step_bytes`, per kernel: NVFP4 weights as held
on the device (4-bit codes + bf16 pre-scaled block scales: 0.625 B per value), BF16 2 B; the
routed experts a batch touches counted by their expectation under uniform routing,
E * (1 - (1 - k/E)^B). Which matrix a GEMV kernel streams is told by its name and call count
(49 calls: o_proj; 2: the dense layers' down; 1: the LM head).

With the early PDL trigger on (BF16's default, `DecodePlan.early_trigger`) a kernel is placed
while its predecessor runs and its traced time includes that wait: read BF16 per-kernel times
from a suite run with `--option early_trigger=false` (the same step with the trigger off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flint_jax.config import FlintConfig, preset  # noqa: E402

CEILING_TBPS = 4.3
NVFP4_BYTES_PER_VALUE = 0.5 + 2 / 16  # codes + bf16 block scale per 16 values


def kernel_bytes(name: str, calls: int, cfg: FlintConfig, fmt: str, batch: int,
                 context: int) -> float | None:
    """Bytes one call of kernel `name` must read, or None where no model applies."""
    wb = NVFP4_BYTES_PER_VALUE if fmt == "nvfp4" else 2.0
    d, hd, kv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    experts = e * (1 - (1 - k / e) ** batch)
    mi, si = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    kv_token = 2 * kv * hd * 2  # K and V, bf16
    dense_layers = cfg.num_hidden_layers - sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    if name.startswith("flint_moe_gate_up"):
        return (experts * 2 * mi + 2 * si) * d * wb
    if name.startswith("flint_moe_down"):
        return (experts * mi + si) * d * wb
    if name.startswith(("flint_multi_gemv3", "flint_norm_qkv3")):
        return (cfg.num_attention_heads + 2 * kv) * hd * d * wb
    if "silu_mul" in name:
        return 2 * cfg.intermediate_size * d * wb
    if name.startswith(("flint_add_rms_norm_router", "flint_router")):
        return e * d * 4
    if name.startswith("flint_qk_norm_rope_attn_ring"):
        return batch * min(context, cfg.sliding_window) * kv_token
    if name.startswith("flint_qk_norm_attn_full"):
        return batch * context * kv_token
    gemv = name.startswith(("flint_nvfp4_gemv", "flint_gemv", "gemm_fusion_dot", "input_reduce_fusion"))
    if gemv and calls == cfg.num_hidden_layers:
        return d * cfg.num_attention_heads * hd * wb  # o_proj
    if gemv and calls == dense_layers:
        return d * cfg.intermediate_size * wb  # the dense MLP's down
    if gemv and calls == 1:
        return cfg.vocab_size * d * wb  # the LM head
    return None


def rows(case: dict, path: str, cfg: FlintConfig) -> list[tuple]:
    out = []
    for name, calls, us in case.get(path + "_by_kernel") or []:
        per = us / calls
        b = kernel_bytes(name, int(calls), cfg, case["format"], case["batch"], case["context"])
        tbps = b / (per * 1e-6) / 1e12 if b else None
        out.append((name, int(calls), per, b, tbps))
    return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--path", default="pallas", help="the suite path whose kernels to read")
  ap.add_argument("--cases", default="", help="BATCHxCONTEXT list (default: every case)")
  ap.add_argument("--min-us", type=float, default=20.0,
                  help="leave out kernels whose total time in the step is below this")
  a = ap.parse_args()
  cfg = preset("flint")
  want = {c for c in a.cases.split(",") if c}
  for f in a.files:
    for case in json.load(open(f)).get("cases", []):
      tag = f"{case['batch']}x{case['context']}"
      if want and tag not in want:
        continue
      print(f"\n{case['format']} {tag} ({a.path}: in-loop {case.get(a.path + '_loop_ms', 0):.3f} ms, "
            f"busy {case.get(a.path + '_busy_us', 0):.0f} us, {case.get(a.path + '_kernels', 0):.0f} "
            f"kernels; floor {case['floor_ms']:.3f} ms)\n")
      print("| kernel | calls | us per call | us in step | MB per call | TB/s | % of 4.3 |")
      print("|---|---|---|---|---|---|---|")
      for name, calls, per, b, tbps in rows(case, a.path, cfg):
        if per * calls < a.min_us:
          continue
        mb = f"{b / 1e6:.2f}" if b else "-"
        bw = f"{tbps:.2f}" if tbps else "-"
        pct = f"{100 * tbps / CEILING_TBPS:.0f}" if tbps else "-"
        print(f"| `{name}` | {calls} | {per:.2f} | {per * calls:.0f} | {mb} | {bw} | {pct} |")


if __name__ == "__main__":
  main()
