"""GPU microbenchmarks of the flint_jax Pallas kernels against their XLA references.

Run on the GPU (tools/gpu_kernels.sh): ``PYTHONPATH=. python3 benchmarks/kernels.py --out DIR``.

Method (docs/kernels.md at 35c0874, "Method"):
- Every case is jitted once, warmed up, then called ``--calls`` times back to back inside one
  ``jax.profiler`` trace, rotating over enough independent input sets that the weights of one
  call are not in the 60 MB L2 when it runs (>= 3x L2 of distinct weights per rotation).
- **Device time** = the sum of the GPU kernel durations of one call (all kernels the op launches,
  e.g. attention's split + merge, split-K's XLA reduction), median over the calls, read from the
  perfetto trace. Launch gaps are not included (inside the model, XLA's command buffers make them
  ~1 us per kernel). **Wall** = host time of the back-to-back calls / calls (dispatch-bound below
  ~40 us per call, kept as a sanity check).
- Achieved bandwidth = the bytes the op must move (weights + KV read once, activations, outputs)
  / device time, against the 4.3 TB/s device-to-device copy ceiling.

Results go to ``DIR/bench.jsonl`` (one JSON per case, as soon as measured) and a table on stdout.
``--budget`` seconds bounds the run: lower-priority cases are skipped when it runs out.

The cases are the decode step's kernels at Flint sizes, on the tiles its plan gives them
(``fast_decode.decode_plan``), each against its XLA reference. (The tuning sweeps of the
retired experiments were removed after 35c0874.)
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

import jax
import jax.numpy as jnp

warnings.filterwarnings("ignore", category=DeprecationWarning)

from flint_jax import fast_decode  # noqa: E402
from flint_jax.pallas import add_rms_norm as NORM  # noqa: E402
from flint_jax.pallas import add_rms_norm_router as ARNR  # noqa: E402
from flint_jax.pallas import attention_block as ATT  # noqa: E402
from flint_jax.pallas import gemv as GEMV  # noqa: E402
from flint_jax.pallas import moe as MOE  # noqa: E402
from flint_jax.pallas import multi_gemv as MULTI  # noqa: E402
from flint_jax.pallas import norm_qkv as NQ  # noqa: E402
from flint_jax.pallas import nvfp4_gemv as NV  # noqa: E402

CEILING_TBS = 4.3
L2_BYTES = 60e6
D, H, KVH, DH, E, I, IS, DENSE, V = 2048, 32, 4, 128, 256, 512, 1024, 6144, 150144
BF = jnp.bfloat16

# ------------------------------------------------------------------------------------------
# Inputs (generated on the device)

_KEY = [jax.random.key(0)]


def _key():
  _KEY[0], k = jax.random.split(_KEY[0])
  return k


def randn(shape, dtype=BF, scale=1.0):
  return (scale * jax.random.normal(_key(), shape, jnp.float32)).astype(dtype)


def rand_nvfp4(shape):
  *lead, n, k = shape
  q = jax.random.randint(_key(), (*lead, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
  sb = jax.random.randint(_key(), (*lead, n, k // 16), 0x28, 0x40, jnp.int32).astype(jnp.uint8)
  s = jax.lax.bitcast_convert_type(sb, jnp.float8_e4m3fn)
  s2 = jax.random.uniform(_key(), tuple(lead), jnp.float32, 0.5, 2.0) / math.sqrt(k)
  return NV.NVFP4Weight(q, s, s2)


def n_sets(weight_bytes: float, cap: int = 64) -> int:
  return int(min(cap, max(1, math.ceil(3 * L2_BYTES / max(weight_bytes, 1)))))


def nbytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------------------------------
# Timing


class Timer:
  """Collects cases; times them inside one profiler trace; attributes GPU kernels by window."""

  def __init__(self, calls: int, out_dir: str):
    self.calls = calls
    self.out_dir = out_dir
    self.windows = []            # (case_id, t0_us, t1_us) host times
    self.results = {}

  def run_case(self, case_id, fn, arg_sets):
    """Compile, warm up, then time `calls` back-to-back calls rotating over arg_sets."""
    t0 = time.perf_counter()
    out = fn(*arg_sets[0])
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    self.last_out = [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]
    for a in arg_sets[1:3]:
      jax.block_until_ready(fn(*a))
    time.sleep(0.02)
    w0 = time.perf_counter()
    with jax.profiler.TraceAnnotation(f"case:{case_id}"):
      outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(self.calls)]
      jax.block_until_ready(outs)
    w1 = time.perf_counter()
    del outs
    time.sleep(0.02)
    return compile_s, (w1 - w0) / self.calls * 1e6


def parse_trace(trace_dir):
  """-> (annotation windows {case: (ts0, ts1)}, GPU kernel events [(ts, dur, name)])."""
  files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
  if not files:
    return {}, []
  with gzip.open(sorted(files)[-1]) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  pnames, tnames = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pnames[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      tnames[(e["pid"], e.get("tid"))] = e["args"]["name"]
  windows, kernels = {}, []
  counts = {}
  for e in events:
    if e.get("ph") == "X":
      key = (pnames.get(e["pid"], "?")[:40], tnames.get((e["pid"], e.get("tid")), "?")[:40])
      counts[key] = counts.get(key, 0) + 1
  print("trace threads (process, thread, X events):",
        sorted(counts.items(), key=lambda kv: -kv[1])[:12], flush=True)
  for e in events:
    if e.get("ph") != "X":
      continue
    name = e.get("name", "")
    if name.startswith("case:"):
      windows[name[5:]] = (e["ts"], e["ts"] + e["dur"])
      continue
    tname = tnames.get((e["pid"], e.get("tid")), "")
    pname = pnames.get(e["pid"], "")
    if "Stream" in tname or ("GPU" in pname and "Stream" in tname):
      if "memcpy" in name.lower() or "memset" in name.lower():
        continue
      kernels.append((e["ts"], e["dur"], name))
  return windows, kernels


def device_times(windows, kernels, case_id, calls):
  """Per-call device time (us): kernels inside the case window split into `calls` groups."""
  if case_id not in windows:
    return None, {}
  t0, t1 = windows[case_id]
  ks = sorted(k for k in kernels if t0 <= k[0] <= t1 + 2e3)
  if not ks:
    return None, {}
  total = sum(k[1] for k in ks)
  by_name = {}
  for _, dur, name in ks:
    by_name.setdefault(name, []).append(dur)
  per_kernel = {n: (statistics.median(v), len(v) / calls) for n, v in by_name.items()}
  if len(ks) % calls == 0:   # median over calls of the per-call sum
    per = len(ks) // calls
    sums = [sum(k[1] for k in ks[i * per:(i + 1) * per]) for i in range(calls)]
    return statistics.median(sums), per_kernel
  return total / calls, per_kernel


# ------------------------------------------------------------------------------------------
# Cases: each yields (case_id, group, label, fn, arg_sets, bytes_per_call)


GEMV_SWEEP = {   # (name, M) -> [(method, block_n, block_k, split_k, num_warps)]
    ("q_proj", 1): [(mt, bn, bk, 1, nw) for mt in ("swap", "reduce")
                    for bn, bk, nw in [(32, 256, 4), (64, 256, 4), (64, 512, 4), (128, 256, 4),
                                       (64, 512, 8), (128, 512, 8), (32, 512, 4)]],
    ("q_proj", 8): [(mt, bn, bk, 1, nw) for mt in ("dot", "swap")
                    for bn, bk, nw in [(32, 256, 4), (64, 256, 4), (64, 512, 4), (128, 256, 4),
                                       (64, 512, 8), (128, 512, 8)]],
    ("k_proj", 1): [(mt, bn, bk, sk, 4) for mt in ("swap", "reduce")
                    for bn, bk, sk in [(16, 256, 4), (32, 256, 2), (64, 256, 4), (32, 512, 2),
                                       (64, 512, 1)]],
    ("o_proj", 1): [(mt, bn, bk, sk, nw) for mt in ("dot", "swap", "reduce")
                    for bn, bk, sk, nw in [(32, 512, 1, 4), (64, 256, 2, 4), (64, 512, 1, 8),
                                           (128, 256, 2, 8), (32, 256, 2, 4)]],
    ("dense_down", 1): [(mt, bn, bk, sk, nw) for mt in ("swap", "reduce")
                        for bn, bk, sk, nw in [(32, 512, 1, 4), (64, 256, 2, 4), (64, 512, 1, 8),
                                               (128, 256, 2, 8)]],
    ("lm_head", 8): [(mt, bn, bk, 1, nw) for mt in ("dot", "swap")
                     for bn, bk, nw in [(64, 256, 4), (128, 256, 4), (64, 512, 8),
                                        (128, 512, 8), (128, 256, 8)]],
    ("lm_head", 1): [(mt, bn, bk, 1, nw) for mt in ("swap", "reduce")
                     for bn, bk, nw in [(64, 256, 4), (128, 256, 8), (64, 512, 8)]],
}
SILU_SWEEP = {
    ("dense_gate_up", 1): [(mt, bn, bk, nw) for mt in ("dot", "swap", "reduce")
                           for bn, bk, nw in [(32, 256, 4), (64, 256, 4), (64, 512, 8),
                                              (128, 256, 8)]],
    ("dense_gate_up", 8): [(mt, bn, bk, nw) for mt in ("dot", "swap")
                           for bn, bk, nw in [(32, 256, 4), (64, 256, 4), (64, 512, 8),
                                              (128, 256, 8)]],
    ("shared_gate_up", 1): [(mt, bn, bk, nw) for mt in ("swap", "reduce")
                            for bn, bk, nw in [(16, 512, 4), (32, 256, 4), (64, 256, 4)]],
}


# ------------------------------------------------------------------------------------------
# Cases: the decode step's kernels


QKV = (H * DH, KVH * DH, KVH * DH)


def _weights(fmt, n, k, scale=None):
  return randn((n, k), scale=scale or k ** -0.5) if fmt == "bf16" else rand_nvfp4((n, k))


def gemv_cases():
  """The BF16 dense gate|up + SiLU (the batch-1 step's ``gemv_silu_mul``)."""
  wb = 2 * DENSE * D * 2
  sets = [(randn((1, D)), randn((DENSE, D), scale=D ** -0.5), randn((DENSE, D), scale=D ** -0.5))
          for _ in range(n_sets(wb))]
  lbl = "dense_gate_up M=1"
  yield ("gemv_silu/M1/xla", "gemv", lbl, "xla", jax.jit(GEMV.gemv_silu_mul_reference), sets,
         wb + 2 * D * 2)
  yield ("gemv_silu/M1/pallas", "gemv", lbl, "pallas", GEMV.gemv_silu_mul, sets, wb + 2 * D * 2)


def nvfp4_cases():
  """The NVFP4 GEMVs: o_proj, dense down, LM head (the batch-1 one on the f16 operand), the
  dense gate|up pair, at M = 1, 2, 8."""
  shapes = [("o_proj", D, H * DH), ("dense_down", D, DENSE), ("lm_head", V, D)]
  for m in (1, 2, 8):
    for name, n, k in shapes:
      out = jnp.float32 if name == "lm_head" else BF
      wb = n * k * 5 // 8
      sets = [(randn((m, k)), *rand_nvfp4((n, k))) for _ in range(n_sets(wb))]
      lbl, bytes_ = f"{name} M={m}", wb + m * k * 2 + m * n * jnp.dtype(out).itemsize
      yield (f"nvfp4/{name}/M{m}/xla", "nvfp4", lbl, "xla",
             jax.jit(functools.partial(NV.nvfp4_gemv_reference, out_dtype=out)), sets, bytes_)
      yield (f"nvfp4/{name}/M{m}/pallas", "nvfp4", lbl, "pallas",
             functools.partial(NV.nvfp4_gemv, out_dtype=out), sets, bytes_)
      if name == "lm_head" and m == 1:
        def x16_head(x, q, s, s2):
          x16, inv = NV.x16_operand(x)
          return NV.nvfp4_gemv(x16, q, s, s2, out_dtype=jnp.float32, x_inv=inv)
        yield (f"nvfp4/{name}/M{m}/pallas_x16", "nvfp4", lbl, "pallas f16 operand",
               jax.jit(x16_head), sets, bytes_)
    wb = 2 * DENSE * D * 5 // 8
    sets = [(randn((m, D)), rand_nvfp4((DENSE, D)), rand_nvfp4((DENSE, D)))
            for _ in range(n_sets(wb))]
    lbl = f"dense_gate_up M={m}"
    yield (f"nvfp4/gate_up/M{m}/xla", "nvfp4", lbl, "xla",
           jax.jit(NV.nvfp4_gemv_silu_mul_reference), sets, wb)
    yield (f"nvfp4/gate_up/M{m}/pallas", "nvfp4", lbl, "pallas", NV.nvfp4_gemv_silu_mul, sets,
           wb)


def qkv_cases():
  """The fused q|k|v as the step runs it (``multi_gemv``; NVFP4 at batch 1 post-scaled; the
  plan's K slices summed by XLA here), and the BF16 batch-1 ``norm_qkv`` (MoE layer end)."""
  for fmt in ("bf16", "nvfp4"):
    for m in (1, 2, 8):
      plan = fast_decode.decode_plan(fmt == "nvfp4", m)
      ws = [tuple(_weights(fmt, n, D) for n in QKV) for _ in range(8)]
      sets = [(randn((m, D)), w) for w in ws]
      lbl = f"q|k|v {fmt} M={m}"
      bytes_ = nbytes(ws[0]) + m * D * 2 + m * sum(QKV) * 2
      yield (f"qkv/{fmt}/M{m}/xla", "qkv", lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets,
             bytes_)
      split = 1 if plan.layer_end == "qkv" else fast_decode._fit_split(  # pylint: disable=protected-access
          plan.qkv_split_k, D, plan.quant)
      yield (f"qkv/{fmt}/M{m}/pallas", "qkv", lbl, f"pallas split_k={split}",
             functools.partial(MULTI.multi_gemv, split_k=split, post_scale=plan.qkv_post_scale),
             sets, bytes_)
  ws = [tuple(randn((n, D), scale=D ** -0.5) for n in QKV) for _ in range(8)]
  sets = [(randn((1, D)), w, randn((D,)) + 1, randn((6 * 1 + 1, 1, D)),
           randn((1, 6), jnp.float32)) for w in ws]
  lbl = "norm_qkv bf16 M=1 (moe)"
  bytes_ = nbytes(ws[0]) + 8 * D * 2

  def nq(fn):
    return jax.jit(lambda h, w, wn, y, tl: fn(h, w, wn, y=y, top_logits=tl))
  yield ("qkv/norm_qkv/xla", "qkv", lbl, "xla", nq(NQ.norm_qkv_reference), sets, bytes_)
  yield ("qkv/norm_qkv/pallas", "qkv", lbl, "pallas", nq(NQ.norm_qkv), sets, bytes_)


def moe_weights(fmt):
  if fmt == "bf16":
    experts = dict(gate_up_proj=randn((E, 2 * I, D), scale=D ** -0.5),
                   down_proj=randn((E, D, I), scale=I ** -0.5))
    shared = dict(gate_proj=randn((IS, D), scale=D ** -0.5), up_proj=randn((IS, D), scale=D ** -0.5),
                  down_proj=randn((D, IS), scale=IS ** -0.5))
  else:
    g, dn = rand_nvfp4((E, 2 * I, D)), rand_nvfp4((E, D, I))
    experts = dict(gate_up_qweight=g.qweight, gate_up_weight_scale=g.weight_scale,
                   gate_up_weight_scale_2=jnp.stack([g.weight_scale_2] * 2, -1),
                   down_qweight=dn.qweight, down_weight_scale=dn.weight_scale,
                   down_weight_scale_2=dn.weight_scale_2)
    shared = dict(gate_proj=rand_nvfp4((IS, D)), up_proj=rand_nvfp4((IS, D)),
                  down_proj=rand_nvfp4((D, IS)))
  return experts, shared


def moe_cases():
  """The routed MoE on the step's plan (``decode_plan(...).moe``) at M = 1, 2, 8, fresh routing
  per call, against the reference (gathered experts, einsums); the bytes a call must read: the
  distinct experts of a route on average, the shared expert, x and y."""
  router = randn((E, D), jnp.float32, D ** -0.5)
  for fmt in ("bf16", "nvfp4"):
    experts, shared = moe_weights(fmt)
    per_expert = nbytes({k: v[0] for k, v in experts.items()})
    for m in (1, 2, 8):
      xs = [randn((m, D)) for _ in range(16)]
      logits = [MOE.moe_router_logits(x, router) for x in xs]
      n_exp = np.mean([len(np.unique(np.asarray(MOE.moe_topk_route(lg).ids))) for lg in logits])
      bytes_ = int(n_exp * per_expert + nbytes(shared) + 2 * m * D * 2)
      sets = [(x, lg, experts, shared) for x, lg in zip(xs, logits)]
      plan = fast_decode.decode_plan(fmt == "nvfp4", m).moe
      lbl = f"{fmt} M={m}"
      yield (f"moe/{fmt}/M{m}/xla", "moe", lbl, "xla (gather+einsum ref)",
             jax.jit(lambda *a: MOE.moe_decode_routed_reference(*a)[0]), sets, bytes_)
      if plan.gate_up_split_k > 1:   # the batch-1 BF16 step's K slices need their counter
        def split(x, lg, ex, sh, plan=plan):
          return MOE.moe_decode_routed(x, lg, ex, sh, plan=plan,
                                       gate_up_counter=jnp.zeros((4096,), jnp.int32))[0]
        fn = jax.jit(split)
      else:
        fn = jax.jit(lambda x, lg, ex, sh, plan=plan: MOE.moe_decode_routed(
            x, lg, ex, sh, plan=plan)[0])
      yield (f"moe/{fmt}/M{m}/pallas", "moe", lbl, f"pallas {plan.slot_rows} slots", fn, sets,
             bytes_)


def attention_cases():
  """The fused Q/K norm + RoPE + cache write + split-KV attention (and its merge)."""
  # (label, B, S, positions, ring)
  specs = [("full 100K", 1, 131072, [100_000], False),
           ("full 1K in 128K cache", 1, 131072, [1000], False),
           ("full B8 30K", 8, 32768, [30_000 - 977 * i for i in range(8)], False),
           ("ring B1", 1, 576, [5000], True),
           ("ring B8", 8, 576, [5000 + i for i in range(8)], True)]
  for label, b, s_len, pos, ring in specs:
    kc, vc = randn((b, KVH, s_len, DH)), randn((b, KVH, s_len, DH))
    sinks = randn((H,), jnp.float32)
    w = randn((DH,)) + 1
    sets = []
    for i in range(1 if not ring else 16):
      if i:
        kc, vc = randn((b, KVH, s_len, DH)), randn((b, KVH, s_len, DH))
      sets.append((randn((b, H, DH)), randn((b, KVH, DH)), randn((b, KVH, DH)), w, w,
                   jnp.asarray(pos, jnp.int32), kc, vc, sinks))
    live = sum(min(p + 1, 513 if ring else s_len) for p in pos)
    bytes_ = 2 * KVH * live * DH * 2 + 2 * b * H * DH * 2
    kw = dict(rope=ring, ring=ring, window=513 if ring else None)
    yield (f"attn/{label}/xla", "attention", label, "xla",
           jax.jit(functools.partial(ATT.qk_norm_rope_attention_reference, **kw)), sets, bytes_)
    yield (f"attn/{label}/pallas", "attention", label, "pallas",
           jax.jit(functools.partial(ATT.qk_norm_rope_attention, **kw)), sets, bytes_)


def norm_cases():
  """The residual add + RMSNorm kernels: add_rms_norm, add_rms_norm_router (batch 1), the MoE
  combine (batch > 1)."""
  router = randn((E, D), jnp.float32, D ** -0.5)
  for m in (1, 8):
    sets = [(randn((m, D)), randn((m, D)), randn((D,)) + 1) for _ in range(8)]
    bytes_ = 4 * m * D * 2 + D * 2
    yield (f"norm/add_rms/M{m}/xla", "norms", f"add_rms_norm M={m}", "xla",
           jax.jit(NORM.add_rms_norm_reference), sets, bytes_)
    yield (f"norm/add_rms/M{m}/pallas", "norms", f"add_rms_norm M={m}", "pallas",
           NORM.add_rms_norm, sets, bytes_)
    rsets = [(*a, router) for a in sets]
    lbl = f"add_rms_norm_router M={m}"
    yield (f"norm/router/M{m}/xla", "norms", lbl, "xla",
           jax.jit(ARNR.add_rms_norm_router_reference), rsets, bytes_ + E * D * 4)
    yield (f"norm/router/M{m}/pallas", "norms", lbl, "pallas", ARNR.add_rms_norm_router, rsets,
           bytes_ + E * D * 4)
    csets = [(randn((m, D)), randn((m * 6 + 1, m, D)), randn((m, 6), jnp.float32),
              randn((D,)) + 1) for _ in range(8)]
    lbl = f"moe_combine M={m}"
    yield (f"norm/combine/M{m}/xla", "norms", lbl, "xla",
           jax.jit(MOE.moe_combine_add_rms_norm_reference), csets, (7 * m + 3) * m * D * 2)
    yield (f"norm/combine/M{m}/pallas", "norms", lbl, "pallas", MOE.moe_combine_add_rms_norm,
           csets, (7 * m + 3) * m * D * 2)


def router_cases():
  """The fp32 router GEMV at M = 2, 4, 8 (the step's at batch > 1) against XLA's dot."""
  routers = [randn((E, D), jnp.float32, D ** -0.5) for _ in range(8)]
  for m in (2, 4, 8):
    sets = [(randn((m, D)), r) for r in routers]
    lbl, bytes_ = f"router M={m}", E * D * 4 + m * D * 2
    yield (f"router/M{m}/xla", "router", lbl, "xla", jax.jit(MOE.moe_router_logits), sets,
           bytes_)
    yield (f"router/M{m}/pallas", "router", lbl, "pallas", MOE.router_logits, sets, bytes_)


GROUPS = {"gemv": gemv_cases, "nvfp4": nvfp4_cases, "qkv": qkv_cases, "moe": moe_cases,
          "attention": attention_cases, "norms": norm_cases, "router": router_cases}


def _aot(fn, args):
  """AOT-compile fn for args (runs in a worker thread: XLA/Triton compilation releases the GIL)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
  ap.add_argument("--groups", default=",".join(GROUPS))
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
  ap.add_argument("--compile-threads", type=int, default=12)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  t_start = time.perf_counter()
  print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)

  # 1. Build every case (inputs on the device) in priority order: the groups as given.
  cases = []
  for group in args.groups.split(","):
    try:
      cases.extend(GROUPS[group]())
    except Exception as e:  # noqa: BLE001
      print(f"  FAILED building {group}: {e!r}"[:400], flush=True)
  print(f"{len(cases)} cases built in {time.perf_counter() - t_start:.0f}s", flush=True)

  # 2. AOT-compile them in parallel threads (stateful callables, e.g. the donated-cache qk
  #    chains, compile on first call instead).
  from concurrent.futures import ThreadPoolExecutor, wait  # pylint: disable=g-import-not-at-top
  compile_budget = max(30.0, 0.45 * args.budget - (time.perf_counter() - t_start))
  pool = ThreadPoolExecutor(args.compile_threads)
  futs = {c[0]: pool.submit(_aot, c[4], c[5][0]) for c in cases
          if not getattr(c[4], "stateful", False)}
  wait(list(futs.values()), timeout=compile_budget)
  print(f"compiled in {time.perf_counter() - t_start:.0f}s", flush=True)

  # 3. Time sequentially inside one profiler trace.
  timer = Timer(args.calls, args.out)
  meta, skipped, refs = {}, [], {}
  trace_dir = tempfile.mkdtemp(prefix="flint_trace_")
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  try:
    for case_id, grp, label, impl, fn, sets, bytes_ in cases:
      base = dict(case=case_id, group=grp, label=label, impl=impl)
      fut = futs.get(case_id)
      if time.perf_counter() - t_start > args.budget or (fut is not None and not fut.done()):
        skipped.append(case_id)
        continue
      try:
        compile_s = 0.0
        if fut is not None:
          fn, compile_s = fut.result()
        first_s, wall_us = timer.run_case(case_id, fn, sets)
        meta[case_id] = dict(base, bytes=bytes_, compile_s=round(compile_s + first_s, 2),
                             wall_us=round(wall_us, 2), sets=len(sets))
        key = (grp, label)
        if impl == "xla":
          refs[key] = timer.last_out
        elif key in refs:   # validate against the XLA reference
          errs = [float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                  for a, b in zip(timer.last_out, refs[key])]
          meta[case_id]["rel_l2"] = float(max(errs)) if errs else None
        print(f"  ran {case_id}: compile {compile_s + first_s:.1f}s wall {wall_us:.1f}us",
              flush=True)
      except Exception as e:  # noqa: BLE001 -- one failing variant must not stop the run
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        meta[case_id] = dict(base, error=msg[-800:])
        print(f"  FAILED {case_id}: {msg[-800:]}", flush=True)
  finally:
    jax.profiler.stop_trace()
    pool.shutdown(wait=False, cancel_futures=True)
  windows, kernels = parse_trace(trace_dir)
  print(f"trace: {len(windows)} windows, {len(kernels)} GPU kernels", flush=True)
  rows = []
  with open(os.path.join(args.out, "bench.jsonl"), "a") as jsonl:
    for case_id, r in meta.items():
      if "error" not in r:
        dev_us, per_kernel = device_times(windows, kernels, case_id, args.calls)
        r["device_us"] = None if dev_us is None else round(dev_us, 2)
        t_us = dev_us if dev_us else r["wall_us"]
        r["tbs"] = round(r["bytes"] / (t_us * 1e-6) / 1e12, 3)
        r["kernels"] = {n[:80]: [round(v[0], 2), round(v[1], 2)] for n, v in per_kernel.items()}
      jsonl.write(json.dumps(r) + "\n")
      rows.append(r)
  print_table(rows)
  if skipped:
    print(f"\nskipped (budget or compile not done): {len(skipped)}: {skipped[:30]}")
  print(f"total {time.perf_counter() - t_start:.0f}s")
  sys.stdout.flush()


def print_table(rows):
  """Per (group, case): each impl's device time, wall time, bandwidth, speed-up vs XLA."""
  print("\n| group | case | impl | device us | wall us | TB/s | % of 4.3 | vs xla | rel_l2 |")
  print("|---|---|---|---|---|---|---|---|---|")
  xla = {(r["group"], r["label"]): r.get("device_us") or r.get("wall_us") for r in rows
         if r["impl"].startswith("xla") and "error" not in r}
  for r in rows:
    if "error" in r:
      print(f"| {r['group']} | {r['label']} | {r['impl']} | FAILED | | | | |")
      continue
    t = r.get("device_us") or r["wall_us"]
    ref = xla.get((r["group"], r["label"]))
    sp = f"{ref / t:.2f}x" if ref else ""
    err = r.get("rel_l2")
    err = "" if err is None else f"{err:.1e}" + (" BAD" if not err < 2e-2 else "")
    print(f"| {r['group']} | {r['label']} | {r['impl']} | {r.get('device_us')} | "
          f"{r['wall_us']} | {r['tbs']} | {100 * r['tbs'] / CEILING_TBS:.0f}% | {sp} | {err} |")


if __name__ == "__main__":
  main()
