"""GPU microbenchmarks of the flint_jax Pallas kernels against their XLA references.

Run on the GPU (tools/gpu_kernels.sh): ``PYTHONPATH=. python3 benchmarks/kernels.py --out DIR``.

Method (see docs/kernels.md):
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

import importlib  # noqa: E402

# The package re-exports functions named like their modules: import the modules explicitly.
NORM = importlib.import_module("flint_jax.pallas.add_rms_norm")
ATT = importlib.import_module("flint_jax.pallas.decode_attention")
GEMV = importlib.import_module("flint_jax.pallas.gemv")
MOE = importlib.import_module("flint_jax.pallas.moe")
NV = importlib.import_module("flint_jax.pallas.nvfp4_gemv")
QK = importlib.import_module("flint_jax.pallas.qk_norm_rope")

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


def gemv_cases(variants):
  shapes = [("q_proj", 4096, D), ("k_proj", 512, D), ("o_proj", D, 4096),
            ("dense_down", D, DENSE), ("shared_down", D, IS), ("lm_head", V, D)]
  for m in (1, 8):
    for name, n, k in shapes:
      sweep = GEMV_SWEEP.get((name, m), [])
      if variants and not sweep:
        continue
      out = jnp.float32 if name == "lm_head" else BF
      wb = n * k * 2
      sets = [(randn((m, k)), randn((n, k), scale=k ** -0.5)) for _ in range(n_sets(wb))]
      bytes_ = wb + m * k * 2 + m * n * jnp.dtype(out).itemsize
      lbl = f"{name} M={m}"
      if not variants:
        yield (f"gemv/{name}/M{m}/xla", "gemv", lbl, "xla",
               jax.jit(functools.partial(GEMV.gemv_reference, out_dtype=out)), sets, bytes_)
        yield (f"gemv/{name}/M{m}/pallas", "gemv", lbl, "pallas default",
               functools.partial(GEMV.gemv, out_dtype=out), sets, bytes_)
        continue
      # The sweep pass has fresh inputs: re-run the reference so rel_l2 compares like with like.
      yield (f"gemv/{name}/M{m}/xla_sweep", "gemv", lbl, "xla",
             jax.jit(functools.partial(GEMV.gemv_reference, out_dtype=out)), sets, bytes_)
      for mt, bn, bk, sk, nw in sweep:
        if n % bn or k % (bk * sk):
          continue
        yield (f"gemv/{name}/M{m}/{mt}_bn{bn}_bk{bk}_sk{sk}_w{nw}", "gemv", lbl,
               f"{mt} bn{bn} bk{bk} sk{sk} w{nw}",
               functools.partial(GEMV.gemv, out_dtype=out, block_n=bn, block_k=bk,
                                 split_k=sk, num_warps=nw, method=mt), sets, bytes_)
  for m in (1, 8):
    for name, n in [("dense_gate_up", DENSE), ("shared_gate_up", IS)]:
      sweep = SILU_SWEEP.get((name, m), [])
      if variants and not sweep:
        continue
      wb = 2 * n * D * 2
      sets = [(randn((m, D)), randn((n, D), scale=D ** -0.5), randn((n, D), scale=D ** -0.5))
              for _ in range(n_sets(wb))]
      bytes_ = wb + m * D * 2 + m * n * 2
      lbl = f"{name} M={m}"
      if not variants:
        yield (f"gemv_silu/{name}/M{m}/xla", "gemv", lbl, "xla",
               jax.jit(GEMV.gemv_silu_mul_reference), sets, bytes_)
        yield (f"gemv_silu/{name}/M{m}/pallas", "gemv", lbl, "pallas default",
               GEMV.gemv_silu_mul, sets, bytes_)
        continue
      yield (f"gemv_silu/{name}/M{m}/xla_sweep", "gemv", lbl, "xla",
             jax.jit(GEMV.gemv_silu_mul_reference), sets, bytes_)
      for mt, bn, bk, nw in sweep:
        yield (f"gemv_silu/{name}/M{m}/{mt}_bn{bn}_bk{bk}_w{nw}", "gemv", lbl,
               f"{mt} bn{bn} bk{bk} w{nw}",
               functools.partial(GEMV.gemv_silu_mul, block_n=bn, block_k=bk, num_warps=nw,
                                 method=mt), sets, bytes_)


_NV_BLOCKS = [(64, 256, 4), (128, 256, 8), (64, 512, 8), (128, 512, 8), (32, 512, 4)]
NV_SWEEP = {   # (name, M) -> [(method, layout, block_n, block_k, split_k, num_warps)]
    ("q_proj", 1): [(mt, lay, bn, bk, 1, nw) for mt in ("dot", "swap", "reduce")
                    for lay in ("tile", "chunk") for bn, bk, nw in _NV_BLOCKS],
    ("q_proj", 8): [(mt, lay, bn, bk, 1, nw) for mt in ("dot", "swap")
                    for lay in ("tile", "chunk") for bn, bk, nw in _NV_BLOCKS],
    ("big65536", 8): [(mt, lay, bn, bk, 1, nw) for mt in ("dot", "swap")
                      for lay in ("tile", "chunk") for bn, bk, nw in _NV_BLOCKS],
    ("o_proj", 1): [(mt, "tile", bn, bk, sk, nw) for mt in ("dot", "swap", "reduce")
                    for bn, bk, sk, nw in [(64, 256, 2, 4), (64, 512, 2, 8), (128, 256, 4, 8),
                                           (32, 512, 1, 4), (64, 256, 4, 4)]],
    ("o_proj", 8): [(mt, "tile", bn, bk, sk, nw) for mt in ("dot", "swap")
                    for bn, bk, sk, nw in [(64, 256, 2, 4), (64, 512, 2, 8), (128, 256, 4, 8),
                                           (64, 256, 4, 4)]],
    ("dense_down", 1): [(mt, "tile", bn, bk, sk, nw) for mt in ("swap", "reduce")
                        for bn, bk, sk, nw in [(64, 256, 2, 4), (64, 512, 2, 8),
                                               (128, 256, 4, 8), (64, 512, 3, 8)]],
}
NV_SILU_SWEEP = {
    1: [(mt, bn, bk, nw) for mt in ("dot", "swap", "reduce")
        for bn, bk, nw in [(64, 256, 4), (128, 256, 8), (64, 512, 8)]],
    8: [(mt, bn, bk, nw) for mt in ("dot", "swap")
        for bn, bk, nw in [(64, 256, 4), (128, 256, 8), (64, 512, 8)]],
}


def nvfp4_cases(variants):
  shapes = [("big65536", 65536, D), ("q_proj", 4096, D), ("o_proj", D, 4096),
            ("dense_down", D, DENSE)]
  for m in (8, 1):
    for name, n, k in shapes:
      if m == 1 and name == "big65536":
        continue
      sweep = NV_SWEEP.get((name, m), [])
      if variants and not sweep:
        continue
      wb = n * k // 2 + n * k // 16
      sets = [(randn((m, k)), *rand_nvfp4((n, k))) for _ in range(n_sets(wb))]
      bytes_ = wb + m * k * 2 + m * n * 2
      lbl = f"{name} M={m}"
      if not variants:
        yield (f"nvfp4/{name}/M{m}/xla", "nvfp4", lbl, "xla",
               jax.jit(NV.nvfp4_gemv_reference), sets, bytes_)
        yield (f"nvfp4/{name}/M{m}/pallas", "nvfp4", lbl, "pallas default",
               NV.nvfp4_gemv, sets, bytes_)
        continue
      yield (f"nvfp4/{name}/M{m}/xla_sweep", "nvfp4", lbl, "xla",
             jax.jit(NV.nvfp4_gemv_reference), sets, bytes_)
      for mt, lay, bn, bk, sk, nw in sweep:
        if n % bn or k % (bk * sk):
          continue
        yield (f"nvfp4/{name}/M{m}/{mt}_{lay}_bn{bn}_bk{bk}_sk{sk}_w{nw}", "nvfp4", lbl,
               f"{mt} {lay} bn{bn} bk{bk} sk{sk} w{nw}",
               functools.partial(NV.nvfp4_gemv, method=mt, layout=lay, block_n=bn,
                                 block_k=bk, split_k=sk, num_warps=nw), sets, bytes_)
      if name == "big65536":   # decode comparison at the best-known blocks
        for dec in ("fp8", "asm"):
          yield (f"nvfp4/{name}/M{m}/{dec}_swap_tile_bn128_bk256_w8", "nvfp4", lbl,
                 f"{dec} swap tile bn128 bk256 w8",
                 functools.partial(NV.nvfp4_gemv, method="swap", decode=dec, block_n=128,
                                   block_k=256, num_warps=8), sets, bytes_)
  for m in (1, 8):
    n = DENSE
    wb = 2 * (n * D // 2 + n * D // 16)
    sets = [(randn((m, D)), rand_nvfp4((n, D)), rand_nvfp4((n, D))) for _ in range(n_sets(wb))]
    bytes_ = wb + m * D * 2 + m * n * 2
    lbl = f"dense_gate_up M={m}"
    if not variants:
      yield (f"nvfp4_silu/dense/M{m}/xla", "nvfp4", lbl, "xla",
             jax.jit(NV.nvfp4_gemv_silu_mul_reference), sets, bytes_)
      yield (f"nvfp4_silu/dense/M{m}/pallas", "nvfp4", lbl, "pallas default",
             NV.nvfp4_gemv_silu_mul, sets, bytes_)
      continue
    yield (f"nvfp4_silu/dense/M{m}/xla_sweep", "nvfp4", lbl, "xla",
           jax.jit(NV.nvfp4_gemv_silu_mul_reference), sets, bytes_)
    for mt, bn, bk, nw in NV_SILU_SWEEP[m]:
      yield (f"nvfp4_silu/dense/M{m}/{mt}_bn{bn}_bk{bk}_w{nw}", "nvfp4", lbl,
             f"{mt} bn{bn} bk{bk} w{nw}",
             functools.partial(NV.nvfp4_gemv_silu_mul, method=mt, block_n=bn, block_k=bk,
                               num_warps=nw), sets, bytes_)


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


def moe_inputs(m, router, experts, shared):
  """16 inputs x [M, D] (fresh routing per call: no L2 reuse), their router logits, their routes
  (ids, weights) from XLA, and the bytes a call must read: the distinct experts of a route on
  average, the shared expert, x and the output."""
  xs = [randn((m, D)) for _ in range(16)]
  logits = [MOE.moe_router_logits(x, router) for x in xs]
  routes = [MOE.moe_route(x, router) for x in xs]
  per_expert = nbytes({k: v[0] for k, v in experts.items()})
  n_exp = np.mean([len(np.unique(np.asarray(ids))) for ids, _ in routes])
  return xs, logits, routes, int(n_exp * per_expert + nbytes(shared) + 2 * m * D * 2)


def moe_cases(variants):
  router = randn((E, D), jnp.float32, D ** -0.5)
  for fmt in ("bf16", "nvfp4"):
    experts, shared = moe_weights(fmt)
    for m in (1, 8):
      xs, _, routed, bytes_ = moe_inputs(m, router, experts, shared)
      sets = [(x, ids, w, experts, shared) for x, (ids, w) in zip(xs, routed)]
      if not variants:
        yield (f"moe/{fmt}/M{m}/xla", "moe", f"{fmt} M={m}", "xla (gather+einsum ref)",
               jax.jit(MOE.moe_decode_reference), sets, bytes_)
      dedupes = [None] if m == 1 else [True, False]
      for dd in (dedupes if not variants else []):
        yield (f"moe/{fmt}/M{m}/pallas_dedupe{dd}", "moe", f"{fmt} M={m}",
               f"pallas dedupe={dd}", functools.partial(MOE.moe_decode, dedupe=dd), sets,
               bytes_)
      bsets = [(x, router, experts, shared) for x in xs]
      if not variants:
        yield (f"moe/{fmt}/M{m}/block_pallas", "moe", f"{fmt} M={m}", "route(XLA)+pallas",
               jax.jit(MOE.moe_block), bsets, bytes_ + E * D * 4)
      if variants:
        yield (f"moe/{fmt}/M{m}/xla_sweep", "moe", f"{fmt} M={m}", "xla (gather+einsum ref)",
               jax.jit(MOE.moe_decode_reference), sets, bytes_)
        meths = ("dot", "swap", "reduce") if m == 1 else ("dot", "swap")
        sweep = [dict(method=mt, block_n=bn, block_n_down=bnd, down_split=ds, num_warps=nw)
                 for mt in meths
                 for bn, bnd, ds, nw in [(32, 16, False, 4), (64, 64, True, 4),
                                         (64, 32, True, 4), (128, 64, True, 8),
                                         (64, 32, False, 8), (32, 64, True, 4)]]
        sweep += [dict(method="swap", method_down="dot", block_n=64, block_n_down=32,
                       down_split=True)]
        for kw in sweep:
          lbl = " ".join(f"{k}={v}" for k, v in kw.items())
          yield (f"moe/{fmt}/M{m}/{lbl}", "moe", f"{fmt} M={m}", f"pallas {lbl}",
                 functools.partial(MOE.moe_decode, **kw), sets, bytes_)


ATT_SWEEP_LABELS = ()   # the first GPU run settled the attention defaults (docs/kernels.md)


def attention_cases(variants):
  # (label, B, S, positions, ring)
  specs = [("full 100K", 1, 131072, [100_000], False),
           ("full 1K in 128K cache", 1, 131072, [1000], False),
           ("full B8 30K", 8, 32768, [30_000 - 977 * i for i in range(8)], False),
           ("ring B1", 1, 576, [5000], True),
           ("ring B8", 8, 576, [5000 + i for i in range(8)], True)]
  for label, b, s_len, pos, ring in specs:
    if variants and label not in ATT_SWEEP_LABELS:
      continue
    kc, vc = randn((b, KVH, s_len, DH)), randn((b, KVH, s_len, DH))
    sinks = randn((H,), jnp.float32)
    n_sets_ = 1 if not ring else 16
    sets = []
    for i in range(n_sets_):
      if i:
        kc, vc = randn((b, KVH, s_len, DH)), randn((b, KVH, s_len, DH))
      sets.append((randn((b, H, DH)), kc, vc, jnp.asarray(pos, jnp.int32), sinks))
    live = sum(min(p + 1, 513 if ring else s_len) for p in pos)
    bytes_ = 2 * KVH * live * DH * 2 + 2 * b * H * DH * 2
    kw = dict(ring=ring, window=513 if ring else None)
    if not variants:
      yield (f"attn/{label}/xla", "attention", label, "xla",
             jax.jit(functools.partial(ATT.decode_attention_reference, **kw)), sets, bytes_)
      yield (f"attn/{label}/pallas", "attention", label, "pallas default",
             functools.partial(ATT.decode_attention, **kw), sets, bytes_)
    if variants and label in ATT_SWEEP_LABELS:
      grid = [(ns, bk, nw, st) for ns, bk, nw, st in [
          (16, 128, 4, 2), (32, 128, 4, 2), (128, 128, 4, 2), (64, 64, 4, 2), (64, 256, 8, 2),
          (64, 128, 8, 2), (64, 128, 4, 3), (8, 64, 4, 2), (4, 64, 4, 2)]
          if s_len % bk == 0 and (ring or ns >= 8)]
      for ns, bk, nw, st in grid:
        yield (f"attn/{label}/ns{ns}_bk{bk}_w{nw}_s{st}", "attention", label,
               f"ns{ns} bk{bk} w{nw} s{st}",
               functools.partial(ATT.decode_attention, num_splits=ns, block_k=bk,
                                 num_warps=nw, num_stages=st, **kw), sets, bytes_)


def qk_cases(variants):
  for b in (1, 8) if not variants else ():
    for ring in (True, False):
      layers, s_len = (35, 576) if ring else (14, 8192)
      shape = (layers, b, KVH, s_len, DH)
      q, k, v = randn((b, H, DH)), randn((b, KVH, DH)), randn((b, KVH, DH))
      w = randn((DH,)) + 1
      pos = jnp.arange(b, dtype=jnp.int32) + 3000
      bytes_ = (b * H * DH * 2) * 2 + b * KVH * DH * 2 * 4
      label = f"{'ring+rope' if ring else 'full'} B={b}"
      for impl, f in [("xla", QK.qk_norm_rope_reference), ("pallas default", QK.qk_norm_rope)]:
        # Donated stacked caches, updated in place by a chain of layer writes.
        def run(q, k, v, w, pos, kc, vc, f=f, ring=ring):
          outs = []
          for layer in range(4):
            o, kc, vc = f(q, k, v, w, w, pos, kc, vc, layer, rope=ring, ring=ring)
            outs.append(o)
          return outs, kc, vc
        fn = jax.jit(run, donate_argnums=(5, 6))
        state = {"kc": jnp.zeros(shape, BF), "vc": jnp.zeros(shape, BF)}

        def call(q, k, v, w, pos, fn=fn, state=state):
          outs, state["kc"], state["vc"] = fn(q, k, v, w, pos, state["kc"], state["vc"])
          return outs
        call.stateful = True
        yield (f"qk/{label}/{impl}", "qk_norm_rope", label + " (x4 layers)", impl, call,
               [(q, k, v, w, pos)], 4 * bytes_)


def norm_cases(variants):
  for m in (1, 8) if not variants else ():
    sets = [(randn((m, D)), randn((m, D)), randn((D,)) + 1) for _ in range(8)]
    bytes_ = 4 * m * D * 2 + D * 2
    yield (f"norm/add_rms/M{m}/xla", "norms", f"add_rms_norm M={m}", "xla",
           jax.jit(NORM.add_rms_norm_reference), sets, bytes_)
    yield (f"norm/add_rms/M{m}/pallas", "norms", f"add_rms_norm M={m}", "pallas default",
           NORM.add_rms_norm, sets, bytes_)


# ------------------------------------------------------------------------------------------
# Session-3 tuning sweep of the decode step's heaviest kernels (group "tune"): the routed MoE
# (gate_up and down are separate kernels, told apart by name in each case's per-kernel times),
# the q|k|v multi_gemv, the NVFP4 o_proj and LM head. Run with --groups tune --variants 0.

MULTI = importlib.import_module("flint_jax.pallas.multi_gemv")

# (block_n, block_k, num_warps, num_stages | block_n_down, block_k_down, num_warps_down,
#  num_stages_down); None = the default.
TUNE_MOE = {
    ("bf16", 1): [(64, 256, 4, 3, 64, 512, 4, 3), (32, 256, 4, 3, 32, 256, 4, 3),
                  (16, 256, 4, 3, 64, 128, 4, 3), (32, 128, 4, 3, 32, 128, 4, 3),
                  (16, 512, 4, 2, 16, 512, 4, 2), (32, 256, 8, 3, 64, 256, 8, 3),
                  (16, 256, 8, 4, 32, 512, 4, 1), (32, 512, 8, 2, 128, 128, 8, 3),
                  (32, 256, 4, 4, 32, 128, 4, 4), (16, 128, 4, 4, 16, 256, 4, 2)],
    ("nvfp4", 1): [(32, 256, 4, 3, 64, 512, 4, 3), (16, 256, 4, 3, 32, 512, 4, 3),
                   (16, 512, 8, 3, 32, 256, 8, 3), (32, 512, 8, 3, 64, 256, 8, 3),
                   (16, 256, 8, 3, 16, 512, 4, 3), (32, 256, 8, 3, 64, 128, 4, 3),
                   (16, 128, 4, 3, 32, 128, 4, 3), (64, 256, 8, 3, 128, 512, 8, 3),
                   (16, 512, 4, 2, 64, 512, 8, 2), (16, 256, 4, 4, 16, 256, 8, 3)],
    ("bf16", 8): [(64, 256, 4, 3, 64, 512, 4, 3), (32, 256, 4, 3, 32, 256, 4, 3),
                  (32, 256, 8, 3, 64, 256, 8, 3), (16, 256, 4, 3, 32, 128, 4, 3),
                  (64, 128, 4, 4, 64, 128, 4, 4)],
    ("nvfp4", 8): [(64, 256, 4, 3, 64, 512, 4, 3), (32, 256, 4, 3, 32, 256, 4, 3),
                   (32, 256, 8, 3, 64, 256, 8, 3), (16, 256, 4, 3, 32, 128, 4, 3),
                   (64, 512, 8, 3, 64, 128, 4, 3)],
}
# (method, block_n, block_k, num_warps, num_stages); None = default.
TUNE_QKV = {
    ("bf16", 1): [(None, None, None, None, 3), ("dot", 32, 256, 4, 3), ("dot", 16, 256, 4, 3),
                  ("dot", 32, 512, 4, 3), ("dot", 16, 512, 8, 3), ("swap", 64, 512, 8, 3),
                  ("dot", 64, 256, 4, 3), ("dot", 32, 128, 4, 4), ("dot", 16, 256, 4, 4)],
    ("nvfp4", 1): [(None, None, None, None, 3), ("reduce", 16, 512, 4, 3),
                   ("reduce", 16, 256, 4, 3), ("reduce", 16, 512, 8, 3), ("reduce", 32, 512, 8, 3),
                   ("reduce", 32, 256, 4, 3), ("reduce", 64, 512, 8, 3), ("reduce", 16, 1024, 8, 2),
                   ("reduce", 16, 256, 8, 4)],
    ("bf16", 8): [(None, None, None, None, 3), ("dot", 32, 256, 4, 3), ("dot", 16, 256, 4, 3),
                  ("dot", 32, 512, 8, 3)],
    ("nvfp4", 8): [(None, None, None, None, 3), ("dot", 32, 256, 4, 3), ("dot", 16, 256, 4, 3),
                   ("dot", 32, 512, 8, 3), ("dot", 64, 512, 8, 3)],
}
# (block_n, block_k, split_k, num_warps); None = default.
TUNE_NV1 = {
    "o_proj": [(None, None, None, None), (16, 512, 2, 4), (32, 512, 2, 4), (16, 256, 4, 4),
               (32, 256, 4, 8), (16, 512, 1, 8), (32, 1024, 2, 8), (16, 1024, 4, 8),
               (64, 512, 2, 8)],
    "lm_head": [(None, None, None, None), (64, 512, 1, 8), (16, 512, 1, 4), (32, 1024, 1, 8),
                (64, 256, 1, 4), (128, 512, 1, 8), (32, 512, 1, 8)],
}


# Round 2 of the session-3 sweep (group "tune2"): around round 1's best points. Each entry is the
# kwargs of one call; {} = the current default.
def _moe_kw(bn, bk, nw, ns, bnd, bkd, nwd, nsd, **extra):
  return dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, block_n_down=bnd,
              block_k_down=bkd, num_warps_down=nwd, num_stages_down=nsd, **extra)


TUNE2_MOE = {
    ("bf16", 1): [{}, _moe_kw(64, 128, 4, 4, 64, 128, 4, 4), _moe_kw(64, 256, 4, 4, 32, 128, 4, 3),
                  _moe_kw(64, 512, 8, 2, 64, 64, 4, 4), _moe_kw(64, 256, 8, 3, 128, 128, 4, 3),
                  _moe_kw(64, 128, 4, 5, 64, 128, 8, 3), _moe_kw(64, 256, 4, 3, 64, 256, 4, 2)],
    ("bf16", 8): [{}, _moe_kw(64, 64, 4, 5, 64, 64, 4, 4), _moe_kw(32, 128, 4, 4, 32, 128, 4, 4),
                  _moe_kw(128, 128, 8, 3, 16, 128, 4, 4), _moe_kw(64, 128, 8, 4, 64, 128, 8, 4)],
    ("nvfp4", 1): [{}, _moe_kw(16, 1024, 8, 2, 16, 512, 8, 3), _moe_kw(16, 512, 8, 2, 16, 256, 4, 3),
                   _moe_kw(16, 512, 8, 4, 32, 512, 8, 3), _moe_kw(16, 1024, 16, 2, 16, 512, 4, 2),
                   _moe_kw(16, 512, 16, 3, 16, 512, 8, 2), _moe_kw(16, 2048, 8, 1, 16, 512, 4, 3)],
    ("nvfp4", 8): [{}, _moe_kw(64, 128, 4, 4, 64, 128, 4, 4), _moe_kw(128, 256, 8, 3, 64, 128, 4, 3),
                   _moe_kw(64, 256, 8, 3, 64, 128, 8, 3),
                   _moe_kw(64, 256, 4, 3, 64, 128, 4, 3, method="swap")],
}
TUNE2_QKV = {
    ("bf16", 1): [{}, dict(method="swap", block_n=64, block_k=128, num_warps=4, num_stages=4),
                  dict(method="swap", block_n=64, block_k=256, num_warps=4, num_stages=4),
                  dict(method="swap", block_n=128, block_k=128, num_warps=8, num_stages=3),
                  dict(method="dot", block_n=64, block_k=128, num_warps=4, num_stages=4),
                  dict(method="swap", block_n=64, block_k=256, num_warps=8, num_stages=3)],
    ("nvfp4", 1): [{}, dict(block_n=16, block_k=1024, num_warps=8, num_stages=3),
                   dict(block_n=16, block_k=512, num_warps=8, num_stages=4),
                   dict(block_n=16, block_k=1024, num_warps=16, num_stages=2),
                   dict(block_n=16, block_k=2048, num_warps=8, num_stages=1),
                   dict(block_n=16, block_k=512, num_warps=8, num_stages=2)],
}
TUNE2_NV = {
    "lm_head": [{}, dict(block_n=16, block_k=512, num_warps=8), dict(block_n=32, block_k=256,
                num_warps=4), dict(block_n=16, block_k=1024, num_warps=8),
                dict(block_n=16, block_k=256, num_warps=4, num_stages=4),
                dict(block_n=16, block_k=2048, num_warps=8, num_stages=2)],
    "o_proj": [{}, dict(block_n=16, block_k=1024, split_k=2, num_warps=8),
               dict(block_n=16, block_k=512, split_k=4, num_warps=8),
               dict(block_n=16, block_k=1024, split_k=4, num_warps=16),
               dict(block_n=16, block_k=2048, split_k=2, num_warps=8, num_stages=2)],
}
TUNE2_GEMV = {   # BF16 o_proj (XLA today: 5.7 us in the step)
    "o_proj": [dict(method="dot", block_n=16, block_k=256, split_k=2, num_warps=4),
               dict(method="dot", block_n=32, block_k=256, split_k=2, num_warps=4, num_stages=4),
               dict(method="swap", block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=4),
               dict(method="dot", block_n=16, block_k=512, split_k=1, num_warps=4),
               dict(method="swap", block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4)],
}


def _tag(kw):
  return " ".join(f"{k}={v}" for k, v in kw.items()) or "default"


def _kw(keys, values):
  """A sweep table row as kwargs (None = the kernel's default, left out)."""
  return {k: v for k, v in zip(keys, values) if v is not None}


_QKV_KEYS = ("method", "block_n", "block_k", "num_warps", "num_stages")
_NV_KEYS = ("block_n", "block_k", "split_k", "num_warps")
# Round 1 as kwargs tables, in the same shape as round 2's.
TUNE1 = dict(
    moe={fm: [_moe_kw(*row) for row in rows] for fm, rows in TUNE_MOE.items()},
    qkv={fm: [_kw(_QKV_KEYS, row) for row in rows] for fm, rows in TUNE_QKV.items()},
    nv={name: [_kw(_NV_KEYS, row) for row in rows] for name, rows in TUNE_NV1.items()},
    gemv={})
TUNE2 = dict(moe=TUNE2_MOE, qkv=TUNE2_QKV, nv=TUNE2_NV, gemv=TUNE2_GEMV)


def _sweep_cases(prefix, tables):
  """Cases of one sweep round: the XLA reference of each op, then every kwargs row of its table
  (the routed MoE, the q|k|v multi_gemv, the NVFP4 o_proj / LM head, the BF16 o_proj)."""
  router = randn((E, D), jnp.float32, D ** -0.5)
  for fmt in ("bf16", "nvfp4"):
    experts, shared = moe_weights(fmt)
    for m in (1, 8):
      if (fmt, m) not in tables["moe"]:
        continue
      xs, logits, _, bytes_ = moe_inputs(m, router, experts, shared)
      sets = [(x, lg, experts, shared) for x, lg in zip(xs, logits)]
      lbl = f"routed {fmt} M={m}"
      # both return (y, MoERoute(ids, logits)): the rel_l2 check covers the stored routing too
      yield (f"{prefix}/moe/{fmt}/M{m}/xla", "tune", lbl, "xla",
             jax.jit(MOE.moe_decode_routed_reference), sets, bytes_)
      for kw in tables["moe"][(fmt, m)]:
        yield (f"{prefix}/moe/{fmt}/M{m}/{_tag(kw)}", "tune", lbl, _tag(kw),
               functools.partial(MOE.moe_decode_routed, **kw), sets, bytes_)
    mk = ((lambda n, k: randn((n, k), scale=k ** -0.5)) if fmt == "bf16"
          else (lambda n, k: rand_nvfp4((n, k))))
    for m in (1, 8):
      if (fmt, m) not in tables["qkv"]:
        continue
      ws = [(mk(4096, D), mk(512, D), mk(512, D))
            for _ in range(n_sets(nbytes(mk(4096, D)) * 1.25, cap=12))]
      sets = [(randn((m, D)), w) for w in ws]
      lbl = f"qkv {fmt} M={m}"
      bytes_ = nbytes(ws[0]) + m * D * 2 + m * 5120 * 2
      yield (f"{prefix}/qkv/{fmt}/M{m}/xla", "tune", lbl, "xla",
             jax.jit(MULTI.multi_gemv_reference), sets, bytes_)
      for kw in tables["qkv"][(fmt, m)]:
        yield (f"{prefix}/qkv/{fmt}/M{m}/{_tag(kw)}", "tune", lbl, _tag(kw),
               functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)
  for name, n, k in [("o_proj", D, 4096), ("lm_head", V, D)]:
    wb = n * k // 2 + n * k // 16
    sets = [(randn((1, k)), *rand_nvfp4((n, k))) for _ in range(n_sets(wb, cap=8))]
    lbl = f"nvfp4 {name} M=1"
    yield (f"{prefix}/nv/{name}/xla", "tune", lbl, "xla", jax.jit(NV.nvfp4_gemv_reference), sets,
           wb + k * 2 + n * 2)
    for kw in tables["nv"].get(name, []):
      yield (f"{prefix}/nv/{name}/{_tag(kw)}", "tune", lbl, _tag(kw),
             functools.partial(NV.nvfp4_gemv, **kw), sets, wb + k * 2 + n * 2)
  if "o_proj" in tables["gemv"]:
    n, k = D, 4096
    sets = [(randn((1, k)), randn((n, k), scale=k ** -0.5)) for _ in range(n_sets(n * k * 2))]
    lbl = "bf16 o_proj M=1"
    yield (f"{prefix}/gemv/o_proj/xla", "tune", lbl, "xla", jax.jit(GEMV.gemv_reference), sets,
           n * k * 2 + k * 2 + n * 2)
    for kw in tables["gemv"]["o_proj"]:
      yield (f"{prefix}/gemv/o_proj/{_tag(kw)}", "tune", lbl, _tag(kw),
             functools.partial(GEMV.gemv, **kw), sets, n * k * 2 + k * 2 + n * 2)


def tune_cases(variants):
  """Round 1 of the session-3 sweep (run 10); only in the base pass (--variants 0)."""
  return iter(()) if variants else _sweep_cases("tune", TUNE1)


def tune2_cases(variants):
  """Round 2 (run 11), around round 1's best points."""
  return iter(()) if variants else _sweep_cases("tune2", TUNE2)


def route_cases(variants):
  """The MoE kernels with the routing computed in the gate_up kernel (the default: every program
  runs the top-k of its token's 256 logits before its first weight load) against the same
  kernels given the expert ids (``moe_decode``; the ids come from XLA's top-k outside the timed
  call). Compare the gate_up kernels' times: the difference is what the in-kernel top-k costs."""
  if variants:
    return
  router = randn((E, D), jnp.float32, D ** -0.5)
  for fmt in ("bf16", "nvfp4"):
    experts, shared = moe_weights(fmt)
    for m in (1, 8):
      xs, logits, routes, bytes_ = moe_inputs(m, router, experts, shared)
      lbl = f"{fmt} M={m}"
      yield (f"route/{fmt}/M{m}/routed", "route", lbl, "routed (top-k in gate_up)",
             MOE.moe_decode_routed, [
                 (x, lg, experts, shared) for x, lg in zip(xs, logits)], bytes_)
      yield (f"route/{fmt}/M{m}/ids", "route", lbl, "ids given (moe_decode, no dedupe)",
             functools.partial(MOE.moe_decode, dedupe=False), [
                 (x, ids, w, experts, shared) for x, (ids, w) in zip(xs, routes)], bytes_)


def gusk_cases(variants):
  """BF16 routed MoE (gate_up + down) with the gate_up kernel's K in 1 / 2 / 4 slices
  (``gate_up_split_k``): at M = 1 its 64 programs leave half the H200's 132 SMs idle. The down
  kernel sums the partials, or (``fin``) the gate_up kernel's last slice finishes h."""
  if variants:
    return
  router = randn((E, D), jnp.float32, D ** -0.5)
  experts, shared = moe_weights("bf16")
  for m in (1, 2):
    xs, logits, _, bytes_ = moe_inputs(m, router, experts, shared)
    lbl = f"bf16 M={m}"
    sets = [(x, lg, experts, shared) for x, lg in zip(xs, logits)]
    yield (f"gusk/bf16/M{m}/xla", "gusk", lbl, "xla",
           jax.jit(lambda x, lg, ex, sh: MOE.moe_decode_routed_reference(x, lg, ex, sh)[0]),
           sets, bytes_)
    for sk in (1, 2, 4):
      yield (f"gusk/bf16/M{m}/sk{sk}", "gusk", lbl, f"routed gate_up_split_k={sk}",
             lambda x, lg, ex, sh, sk=sk: MOE.moe_decode_routed(x, lg, ex, sh,
                                                                gate_up_split_k=sk)[0],
             sets, bytes_)
    for sk in (2, 4):   # h finished by the gate_up kernel (its zeroed counter: one more kernel)
      yield (f"gusk/bf16/M{m}/fin{sk}", "gusk", lbl, f"gate_up_split_k={sk} + counter (finish)",
             lambda x, lg, ex, sh, sk=sk: MOE.moe_decode_routed(
                 x, lg, ex, sh, gate_up_split_k=sk,
                 gate_up_counter=jnp.zeros((4096,), jnp.int32))[0],
             sets, bytes_)


NQ = importlib.import_module("flint_jax.pallas.norm_qkv")


def _layer_end_cases(group, fmt, m, top_k=6):
  """(sets, bytes, label, [the reference case, the default pair's case]) for the end of a MoE
  layer + the next q|k|v at Flint sizes: inputs (h, y, top_logits, w_norm, (Wq, Wk, Wv))."""
  def make_w():
    if fmt == "bf16":
      return tuple(randn((n, D), scale=D ** -0.5) for n in (H * DH, KVH * DH, KVH * DH))
    return tuple(rand_nvfp4((n, D)) for n in (H * DH, KVH * DH, KVH * DH))

  wb = nbytes(make_w())
  sets = [(randn((m, D)), randn((m * top_k + 1, m, D)), randn((m, top_k), jnp.float32),
           randn((D,)) + 1, make_w()) for _ in range(n_sets(wb))]
  bytes_ = wb + (m * top_k + 2) * m * D * 2
  lbl = f"{fmt} M={m}"

  def split(h, y, tl, w, ws):
    s, x = MOE.moe_combine_add_rms_norm(h, y, tl, w)
    return s, MULTI.multi_gemv(x, ws)

  base = [(f"{group}/{fmt}/M{m}/xla", group, lbl, "xla",
           jax.jit(lambda h, y, tl, w, ws: NQ.norm_qkv_reference(
               h, ws, w, y=y, top_logits=tl)), sets, bytes_),
          (f"{group}/{fmt}/M{m}/split", group, lbl, "combine + multi_gemv (default)", split,
           sets, bytes_)]
  return sets, bytes_, lbl, base


def nqtune_cases(variants):
  """``norm_qkv`` tiles at M = 1 (the BF16 batch-1 default since session 5) against the default
  pair of kernels; the reference first, so every variant's rel_l2 is checked. BF16: does
  ``multi_gemv``'s 4-stage pipeline help ``norm_qkv`` too? NVFP4: can a tile beat the pair?"""
  if variants:
    return
  for fmt in ("bf16", "nvfp4"):
    sets, bytes_, lbl, base = _layer_end_cases("nqtune", fmt, 1)
    yield from base
    rows = ([dict(), dict(num_stages=4), dict(num_stages=5), dict(block_n=32, num_stages=4),
             dict(block_k=512, num_stages=4), dict(num_warps=8, num_stages=4)]
            if fmt == "bf16" else
            [dict(), dict(block_n=32), dict(block_n=32, num_warps=16),
             dict(block_n=64, num_warps=16), dict(block_k=1024), dict(num_stages=2)])
    for kw in rows:
      name = " ".join(f"{k}={v}" for k, v in kw.items()) or "default"
      yield (f"nqtune/{fmt}/{name.replace(' ', '_')}", "nqtune", lbl, f"norm_qkv {name}",
             lambda h, y, tl, w, ws, kw=kw: NQ.norm_qkv(h, ws, w, y=y, top_logits=tl, **kw),
             sets, bytes_)


def nqlanes_cases(variants):
  """NVFP4, M = 1: ``norm_qkv`` on ``lanes`` tiles (session 8; ``multi_gemv``'s M = 1 default
  since session 7) against the default pair (``moe_combine_add_rms_norm`` + ``multi_gemv`` on
  lanes) and ``norm_qkv`` on ``reduce`` (its tiles until session 8). The reference first."""
  if variants:
    return
  sets, bytes_, lbl, base = _layer_end_cases("nqlanes", "nvfp4", 1)
  yield from base
  for kw in (dict(), dict(method="reduce"), dict(block_k=1024), dict(num_warps=4),
             dict(block_n=32, num_warps=16)):
    name = " ".join(f"{k}={v}" for k, v in kw.items()) or "default (lanes)"
    yield (f"nqlanes/nvfp4/{name.replace(' ', '_')}", "nqlanes", lbl, f"norm_qkv {name}",
           lambda h, y, tl, w, ws, kw=kw: NQ.norm_qkv(h, ws, w, y=y, top_logits=tl, **kw),
           sets, bytes_)


def _used_rows(fn, top_k=6):
  """fn's (y, route) with y cut to the rows every ``slot_rows`` mode defines (y[t*k+j, t] and the
  shared expert's), so the rel_l2 check compares like with like."""
  def wrapped(*args):
    y, route = fn(*args)
    m = y.shape[1]
    u = jnp.arange(m * top_k)
    return jnp.concatenate([y[u, u // top_k], y[m * top_k]], axis=0), route
  return wrapped


def slotrows_cases(variants):
  """The routed MoE at M > 1 with every slot's expert multiplied by all M tokens (``slot_rows=
  "all"``: tensor-core tiles) or only by its own token (``"token"``: M * top_k GEMVs at M = 1,
  the NVFP4 CUDA-core decode), with tiles around the M = 1 defaults. Same weight bytes."""
  if variants:
    return
  router = randn((E, D), jnp.float32, D ** -0.5)
  for fmt in ("nvfp4", "bf16"):
    experts, shared = moe_weights(fmt)
    for m in ((8, 4, 3, 2) if fmt == "nvfp4" else (8,)):
      xs, logits, _, bytes_ = moe_inputs(m, router, experts, shared)
      sets = [(x, lg, experts, shared) for x, lg in zip(xs, logits)]
      lbl = f"routed {fmt} M={m}"
      yield (f"slotrows/{fmt}/M{m}/xla", "slotrows", lbl, "xla",
             jax.jit(_used_rows(MOE.moe_decode_routed_reference)), sets, bytes_)
      rows = [dict(slot_rows="all"), dict(slot_rows="token")]
      if fmt == "nvfp4" and m == 8:   # (run 25's best token tiles, then around them)
        rows += [_moe_kw(32, 512, 8, 2, 16, 512, 4, 2, slot_rows="token"),
                 _moe_kw(16, 512, 8, 3, 16, 512, 4, 2, slot_rows="token"),
                 _moe_kw(32, 512, 8, 2, 16, 512, 4, 2, slot_rows="token", method="dot",
                         method_down="dot"),
                 _moe_kw(16, 1024, 8, 2, 16, 512, 8, 2, slot_rows="token")]
      for kw in rows:
        yield (f"slotrows/{fmt}/M{m}/{_tag(kw)}", "slotrows", lbl, _tag(kw),
               _used_rows(functools.partial(MOE.moe_decode_routed, **kw)), sets, bytes_)


def _nv_gemv_variants(group, case, lbl, sets, bytes_, kws, out=jnp.bfloat16, silu_mul=False):
  """An NVFP4 GEMV's XLA reference on ``sets`` (``nvfp4_gemv``, or the gate|up pair with
  ``silu_mul``), then one case per kwargs row in ``kws`` (ids ``{group}/{case}/...``)."""
  if silu_mul:
    ref, fn = NV.nvfp4_gemv_silu_mul_reference, NV.nvfp4_gemv_silu_mul
  else:
    ref = functools.partial(NV.nvfp4_gemv_reference, out_dtype=out)
    fn = functools.partial(NV.nvfp4_gemv, out_dtype=out)
  yield (f"{group}/{case}/xla", group, lbl, "xla", jax.jit(ref), sets, bytes_)
  for kw in kws:
    yield (f"{group}/{case}/{_tag(kw)}", group, lbl, _tag(kw), functools.partial(fn, **kw), sets,
           bytes_)


def rows_cases(variants):
  """NVFP4 GEMVs at M > 1 with the CUDA-core ``rows`` tiles (one decode, M row sums) against the
  default tensor-core ``dot`` tiles: the step's q|k|v, o_proj and LM head at M = 8 (and q|k|v at
  M = 2, 4). The reference first, so every variant's rel_l2 is checked."""
  if variants:
    return
  def qkv_w():
    return tuple(rand_nvfp4((n, D)) for n in (H * DH, KVH * DH, KVH * DH))
  ws = [qkv_w() for _ in range(n_sets(nbytes(qkv_w()) * 1.25, cap=12))]
  for m in (8, 4, 2):
    sets = [(randn((m, D)), w) for w in ws]
    lbl = f"qkv nvfp4 M={m}"
    bytes_ = nbytes(ws[0]) + m * D * 2 + m * 5120 * 2
    yield (f"rows/qkv/M{m}/xla", "rows", lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets,
           bytes_)
    rows = [dict(), dict(method="rows", block_n=16, block_k=512, num_warps=8),
            dict(method="rows", block_n=16, block_k=256, num_warps=8),
            dict(method="rows", block_n=32, block_k=256, num_warps=8),
            dict(method="rows", block_n=16, block_k=512, num_warps=16)]
    for kw in (rows if m == 8 else rows[:2]):
      yield (f"rows/qkv/M{m}/{_tag(kw)}", "rows", lbl, _tag(kw),
             functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)
  for name, n, k in [("o_proj", D, 4096), ("lm_head", V, D)]:
    wb = n * k // 2 + n * k // 16
    sets = [(randn((8, k)), *rand_nvfp4((n, k))) for _ in range(n_sets(wb, cap=8))]
    out = jnp.float32 if name == "lm_head" else jnp.bfloat16
    rows = [dict(), dict(method="rows", block_n=16, block_k=512, num_warps=8),
            dict(method="rows", block_n=16, block_k=256, num_warps=8),
            dict(method="rows", block_n=32, block_k=256, num_warps=8)]
    if name == "o_proj":
      rows += [dict(method="rows", block_n=16, block_k=512, split_k=4, num_warps=8),
               dict(method="rows", block_n=16, block_k=256, split_k=2, num_warps=8)]
    yield from _nv_gemv_variants("rows", name, f"nvfp4 {name} M=8", sets,
                                 wb + 8 * k * 2 + 8 * n * 2, rows, out=out)


def rows2_cases(variants):
  """The other NVFP4 GEMVs of the step at M = 2 and 4 (o_proj, dense down and gate|up, LM head):
  the default tensor-core tiles against ``rows`` with its default (M = 1) tiles, after q|k|v
  measured 2.5x / 1.4x faster on ``rows`` there (run 25)."""
  if variants:
    return
  for name, n, k in [("o_proj", D, 4096), ("dense_down", D, 6144), ("lm_head", V, D)]:
    wb = n * k // 2 + n * k // 16
    out = jnp.float32 if name == "lm_head" else jnp.bfloat16
    ws = [rand_nvfp4((n, k)) for _ in range(n_sets(wb, cap=8))]
    for m in (2, 4):
      sets = [(randn((m, k)), *w) for w in ws]
      yield from _nv_gemv_variants("rows2", f"{name}/M{m}", f"nvfp4 {name} M={m}", sets,
                                   wb + m * k * 2 + m * n * 2, (dict(), dict(method="rows")),
                                   out=out)
  gate_up = [(rand_nvfp4((6144, D)), rand_nvfp4((6144, D))) for _ in range(6)]
  wb = 2 * (6144 * D // 2 + 6144 * D // 16)
  for m in (2, 4):
    sets = [(randn((m, D)), g, u) for g, u in gate_up]
    yield from _nv_gemv_variants("rows2", f"gate_up/M{m}", f"nvfp4 dense gate|up M={m}", sets,
                                 wb + m * D * 2 + m * 6144 * 2, (dict(), dict(method="rows")),
                                 silu_mul=True)


def lanes_cases(variants):
  """The NVFP4 kernels of the batch-1 step with the ``lanes`` tile method (per-lane FFMAs, one
  reduction after the K loop) against ``reduce`` (a cross-warp row sum on every K step), at the
  default tiles and a few larger ones (fewer reductions make more values per thread cheaper):
  q|k|v, o_proj, dense gate|up and down, LM head, the routed MoE (gate_up + down)."""
  if variants:
    return
  def qkv_w():
    return tuple(rand_nvfp4((n, D)) for n in (H * DH, KVH * DH, KVH * DH))
  ws = [qkv_w() for _ in range(n_sets(nbytes(qkv_w()) * 1.25, cap=12))]
  sets = [(randn((1, D)), w) for w in ws]
  bytes_ = nbytes(ws[0]) + D * 2 + 5120 * 2
  yield ("lanes/qkv/xla", "lanes", "qkv nvfp4 M=1", "xla", jax.jit(MULTI.multi_gemv_reference),
         sets, bytes_)
  for kw in [dict(method="reduce"), dict(method="lanes"),
             dict(method="lanes", block_n=16, block_k=1024, num_warps=16),
             dict(method="lanes", block_n=32, block_k=512, num_warps=8),
             dict(method="lanes", block_n=16, block_k=512, num_warps=4)]:
    yield (f"lanes/qkv/{_tag(kw)}", "lanes", "qkv nvfp4 M=1", _tag(kw),
           functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)
  tables = {
      "o_proj": (D, 4096, [dict(method="lanes", block_n=16, block_k=512, split_k=4, num_warps=8),
                           dict(method="lanes", block_n=16, block_k=1024, split_k=2,
                                num_warps=8)]),
      "dense_down": (D, 6144, [dict(method="lanes", block_n=16, block_k=512, split_k=3,
                                    num_warps=8)]),
      "lm_head": (V, D, [dict(method="lanes", block_n=16, block_k=1024, num_warps=8),
                         dict(method="lanes", block_n=64, block_k=512, num_warps=8)]),
  }
  for name, (n, k, extra) in tables.items():
    wb = n * k // 2 + n * k // 16
    out = jnp.float32 if name == "lm_head" else jnp.bfloat16
    sets = [(randn((1, k)), *rand_nvfp4((n, k))) for _ in range(n_sets(wb, cap=8))]
    yield from _nv_gemv_variants("lanes", name, f"nvfp4 {name} M=1", sets, wb + k * 2 + n * 2,
                                 [dict(method="reduce"), dict(method="lanes")] + extra, out=out)
  gate_up = [(rand_nvfp4((DENSE, D)), rand_nvfp4((DENSE, D))) for _ in range(6)]
  wb = 2 * (DENSE * D // 2 + DENSE * D // 16)
  sets = [(randn((1, D)), g, u) for g, u in gate_up]
  yield from _nv_gemv_variants("lanes", "gate_up", "nvfp4 dense gate|up M=1", sets,
                               wb + D * 2 + DENSE * 2,
                               [dict(method="reduce"), dict(method="lanes"),
                                dict(method="lanes", block_n=32, block_k=512, num_warps=8)],
                               silu_mul=True)
  router = randn((E, D), jnp.float32, D ** -0.5)
  experts, shared = moe_weights("nvfp4")
  xs, logits, _, bytes_ = moe_inputs(1, router, experts, shared)
  sets = [(x, lg, experts, shared) for x, lg in zip(xs, logits)]
  yield ("lanes/moe/xla", "lanes", "routed nvfp4 M=1", "xla",
         jax.jit(MOE.moe_decode_routed_reference), sets, bytes_)
  for kw in [dict(method="reduce"), dict(method="lanes"),
             _moe_kw(16, 512, 8, 2, 16, 512, 4, 2, method="lanes"),
             _moe_kw(32, 1024, 16, 2, 16, 512, 8, 2, method="lanes"),
             _moe_kw(16, 1024, 16, 2, 32, 512, 8, 2, method="lanes")]:
    yield (f"lanes/moe/{_tag(kw)}", "lanes", "routed nvfp4 M=1", _tag(kw),
           functools.partial(MOE.moe_decode_routed, **kw), sets, bytes_)


ARNR = importlib.import_module("flint_jax.pallas.add_rms_norm_router")


def _norm_then_router(h, a, w, router):
  """The default step's pair: add_rms_norm (Pallas), then XLA's fp32 router dot."""
  s, x = NORM.add_rms_norm(h, a, w)
  return s, x, MOE.moe_router_logits(x, router)


def arnr_cases(variants):
  """``add_rms_norm_router`` (residual add + RMSNorm + fp32 router GEMV, one launch) against the
  default step's pair (``add_rms_norm`` + XLA's router dot), at M = 1 and 8, with bf16 [M, D]
  attention outputs (BF16 o_proj) and fp32 split-K partials [4, M, D] (NVFP4 o_proj)."""
  if variants:
    return
  routers = [randn((E, D), jnp.float32, D ** -0.5) for _ in range(8)]
  for m, parts in [(1, 0), (1, 4), (8, 0), (8, 4)]:
    a_shape, a_dt = ((parts, m, D), jnp.float32) if parts else ((m, D), BF)
    sets = [(randn((m, D)), randn(a_shape, a_dt), randn((D,)) + 1, r) for r in routers]
    case, lbl = f"M{m}{'_parts' if parts else ''}", f"norm+router M={m} S={parts or 1}"
    bytes_ = E * D * 4 + 4 * m * D * 2 + (parts or 1) * m * D * 4
    yield (f"arnr/{case}/xla", "arnr", lbl, "xla", jax.jit(ARNR.add_rms_norm_router_reference),
           sets, bytes_)
    yield (f"arnr/{case}/pair", "arnr", lbl, "add_rms_norm + XLA router",
           jax.jit(_norm_then_router), sets, bytes_)
    for kw in [dict(), dict(block_e=8, block_d=1024), dict(block_e=2), dict(block_e=8, block_d=2048),
               dict(block_e=4, num_warps=8), dict(block_e=2, num_warps=2),
               dict(block_e=16, block_d=512)]:
      yield (f"arnr/{case}/{_tag(kw)}", "arnr", lbl, _tag(kw),
             functools.partial(ARNR.add_rms_norm_router, **kw), sets, bytes_)


ROUTER = importlib.import_module("flint_jax.pallas.router")


def router_cases(variants):
  """The fp32 router GEMV at M = 2, 4, 8: XLA's dot (the step's op at batch > 1) against
  ``router_logits`` (default and other tilings)."""
  if variants:
    return
  routers = [randn((E, D), jnp.float32, D ** -0.5) for _ in range(8)]
  for m in (2, 4, 8):
    sets = [(randn((m, D)), r) for r in routers]
    lbl, bytes_ = f"router M={m}", E * D * 4 + m * D * 2
    yield (f"router/M{m}/xla", "router", lbl, "xla", jax.jit(MOE.moe_router_logits), sets,
           bytes_)
    for kw in [dict(), dict(block_e=2), dict(block_e=1), dict(block_e=2, num_warps=8),
               dict(block_e=4, block_k=128), dict(block_e=8, block_k=128)]:
      yield (f"router/M{m}/{_tag(kw)}", "router", lbl, _tag(kw) or "default",
             functools.partial(ROUTER.router_logits, **kw), sets, bytes_)


def prescale_cases(variants):
  """NVFP4 kernels with e4m3 block scales against pre-scaled bf16 ones
  (``nvfp4_gemv.prescale_block_scales``: no per-scale conversion in the decode, +11% bytes):
  the routed MoE and the q|k|v ``multi_gemv`` at M = 1 and 8."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  router = randn((E, D), jnp.float32, D ** -0.5)
  experts, shared = moe_weights("nvfp4")
  experts_p, shared_p = prescale_state((experts, shared))
  for m in (1, 8):
    xs, logits, _, bytes_ = moe_inputs(m, router, experts, shared)
    lbl = f"routed nvfp4 M={m}"
    for tag, ex, sh in (("e4m3", experts, shared), ("bf16 prescaled", experts_p, shared_p)):
      sets = [(x, lg, ex, sh) for x, lg in zip(xs, logits)]
      yield (f"prescale/moe/M{m}/{tag}", "prescale", lbl, tag,
             functools.partial(MOE.moe_decode_routed), sets, bytes_)
  ws = [(rand_nvfp4((4096, D)), rand_nvfp4((512, D)), rand_nvfp4((512, D))) for _ in range(8)]
  ws_p = prescale_state(ws)
  for m in (1, 8):
    lbl, bytes_ = f"qkv nvfp4 M={m}", nbytes(ws[0]) + m * D * 2 + m * 5120 * 2
    for tag, wl in (("e4m3", ws), ("bf16 prescaled", ws_p)):
      sets = [(randn((m, D)), w) for w in wl]
      yield (f"prescale/qkv/M{m}/{tag}", "prescale", lbl, tag, MULTI.multi_gemv, sets, bytes_)


def stream_cases(variants):
  """NVFP4 M = 1 GEMVs with persistent programs streaming the row tiles (``programs=``, the
  next step's weights loaded one step ahead with ``preload``) against one program per tile:
  a gate|up-sized [12288, 2048], the q|k|v-sized [5120, 2048] and the o_proj [2048, 4096];
  block scales pre-scaled (the step's format)."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  shapes = [("gu12288", 12288, D), ("qkv5120", 5120, D), ("o_proj", D, 4096)]
  tiles = [dict(block_n=16, block_k=1024, num_warps=16), dict(block_n=16, block_k=2048,
           num_warps=16), dict(block_n=32, block_k=1024, num_warps=16),
           dict(block_n=16, block_k=512, num_warps=8), dict(block_n=16, block_k=1024,
           num_warps=8)]
  for name, n, k in shapes:
    wb = n * k // 2 + n * k // 8
    sets = [(randn((1, k)), *prescale_state(rand_nvfp4((n, k)))) for _ in range(n_sets(wb))]
    kws = [{}, dict(block_n=16, block_k=1024, num_warps=16, num_stages=2),
           dict(block_n=16, block_k=512, num_warps=8)]
    for t in tiles:
      if k % t["block_k"]:
        continue
      for progs in (132, 264, 528):
        kws.append(dict(t, programs=progs, num_stages=1))
      kws.append(dict(t, programs=264, num_stages=1, preload=False))
    yield from _nv_gemv_variants("stream", name, f"{name} M=1", sets,
                                 wb + k * 2 + n * 2, kws)


def _routed_nvfp4_cases(group, ms, variants_for, wrap=lambda fn: fn, fmt="nvfp4"):
  """The routed MoE (``moe_decode_routed``; NVFP4 with its block scales pre-scaled, or
  ``fmt="bf16"``) at each M in ``ms``: its XLA reference, then one case per (impl label,
  callable) of ``variants_for(m)``; ``wrap`` applies to every callable (``_used_rows``: only the
  rows every ``slot_rows`` mode defines)."""
  from flint_jax.nvfp4 import prescale_state
  router = randn((E, D), jnp.float32, D ** -0.5)
  experts, shared = prescale_state(moe_weights(fmt))
  for m in ms:
    xs, logits, _, bytes_ = moe_inputs(m, router, experts, shared)
    sets = [(x, lg, experts, shared) for x, lg in zip(xs, logits)]
    lbl = f"routed {fmt} M={m}"
    yield (f"{group}/moe/M{m}/xla", group, lbl, "xla",
           jax.jit(wrap(MOE.moe_decode_routed_reference)), sets, bytes_)
    for impl, fn in variants_for(m):
      yield (f"{group}/moe/M{m}/{impl}", group, lbl, impl, wrap(fn), sets, bytes_)


def _kw_variants(kws):
  """(label, moe_decode_routed with those options) for each options dict."""
  return [(_tag(kw), functools.partial(MOE.moe_decode_routed, **kw)) for kw in kws]


def m1dot_cases(variants):
  """NVFP4 at M = 1 on the tensor cores (``dot`` / ``swap``: x padded to 16 rows, the decode
  straight into the MMA operand; ~4.7 instructions per weight in the SASS against 7-10 for the
  CUDA-core ``reduce`` / ``lanes``) against the default: three GEMV shapes and the routed MoE;
  block scales pre-scaled."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  tiles = [dict(method="dot", block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
           for bn, bk, nw, ns in [(64, 256, 4, 3), (32, 512, 4, 3), (32, 256, 4, 3),
                                  (64, 512, 8, 3), (32, 256, 2, 3), (16, 512, 4, 3),
                                  (64, 128, 4, 4), (16, 256, 2, 4)]]
  tiles += [dict(method="swap", block_n=64, block_k=bk, num_warps=4) for bk in (256, 512)]
  for name, n, k in [("gu12288", 12288, D), ("qkv5120", 5120, D), ("o_proj", D, 4096)]:
    wb = n * k // 2 + n * k // 8
    sets = [(randn((1, k)), *prescale_state(rand_nvfp4((n, k)))) for _ in range(n_sets(wb))]
    kws = [{}] + [dict(t, split_k=sk) for t in tiles
                  for sk in ((2, 4) if name == "o_proj" else (1,))]
    yield from _nv_gemv_variants("m1dot", name, f"{name} M=1", sets, wb + k * 2 + n * 2, kws)
  moe_kws = [{}]
  for bn, bk, nw in [(64, 256, 4), (32, 512, 4), (32, 256, 4), (16, 512, 4)]:
    moe_kws.append(dict(method="dot", block_n=bn, block_k=bk, num_warps=nw, num_stages=3))
  for bnd, bkd in [(64, 128), (32, 256), (16, 256)]:
    moe_kws.append(dict(method_down="dot", block_n_down=bnd, block_k_down=bkd,
                        num_warps_down=4, num_stages_down=3))
  moe_kws.append(dict(moe_kws[2], **moe_kws[-2]))
  yield from _routed_nvfp4_cases("m1dot", (1,), lambda m: _kw_variants(moe_kws))


def _qkv_nvfp4_weights(count=8):
  """``count`` q|k|v weight triples, NVFP4 with pre-scaled block scales (as the GPU step holds
  them)."""
  from flint_jax.nvfp4 import prescale_state
  return prescale_state([(rand_nvfp4((4096, D)), rand_nvfp4((512, D)), rand_nvfp4((512, D)))
                         for _ in range(count)])


def _qkv_nvfp4_sets(m, ws):
  """(label, sets, bytes) of the q|k|v ``multi_gemv`` at M = m on the weights ``ws``."""
  bytes_ = nbytes(ws[0]) + m * D * 2 + m * 5120 * 2
  return f"qkv nvfp4 M={m}", [(randn((m, D)), w) for w in ws], bytes_


def _nvfp4_gemv_sets(name, n, k, m=1):
  """(sets, packed weight + scale bytes) of an [n, k] NVFP4 GEMV at M = m, block scales
  pre-scaled; fewer sets for the LM head."""
  from flint_jax.nvfp4 import prescale_state
  wb = n * k // 2 + n * k // 8
  sets = [(randn((m, k)), *prescale_state(rand_nvfp4((n, k))))
          for _ in range(n_sets(wb, cap=4 if name == "lm_head" else 8))]
  return sets, wb


def _with_asm(fn, asm):
  """``fn`` traced with the NVFP4 ``asm`` decode's instruction sequence ``asm``."""
  def wrapped(*args):
    with NV.asm_decode(asm):
      return fn(*args)
  return wrapped


def asmdec_cases(variants):
  """The NVFP4 ``asm`` decode's two instruction sequences (``nvfp4_gemv.asm_decode``: "mul",
  one integer multiply per pair, against session 11's "shift"): the routed MoE and the q|k|v
  ``multi_gemv`` at M = 1 and 8, the o_proj at M = 1; block scales pre-scaled."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  seqs = ("shift", "mul_bf16", "mul", "shift#2", "mul_bf16#2", "mul#2")   # twice each
  yield from _routed_nvfp4_cases("asmdec", (1, 8), lambda m: [
      (asm, _with_asm(MOE.moe_decode_routed, asm.split("#")[0])) for asm in seqs])
  ws = _qkv_nvfp4_weights()
  for m in (1, 8):
    lbl, sets, bytes_ = _qkv_nvfp4_sets(m, ws)
    yield (f"asmdec/qkv/M{m}/xla", "asmdec", lbl, "xla", jax.jit(MULTI.multi_gemv_reference),
           sets, bytes_)
    for asm in ("shift", "mul_bf16", "mul"):
      yield (f"asmdec/qkv/M{m}/{asm}", "asmdec", lbl, asm, _with_asm(MULTI.multi_gemv, asm),
             sets, bytes_)
  wb = D * 4096 // 2 + D * 4096 // 8
  sets = [(randn((1, 4096)), *prescale_state(rand_nvfp4((D, 4096)))) for _ in range(n_sets(wb))]
  yield ("asmdec/o_proj/xla", "asmdec", "o_proj nvfp4 M=1", "xla",
         jax.jit(NV.nvfp4_gemv_reference), sets, wb)
  for asm in ("shift", "mul_bf16", "mul"):
    yield (f"asmdec/o_proj/{asm}", "asmdec", "o_proj nvfp4 M=1", asm,
           _with_asm(NV.nvfp4_gemv, asm), sets, wb)
  # the LM head at M = 1 (one launch, ~88 us in the step): its tiles with the f32 decode
  wb = V * D // 2 + V * D // 8
  sets = [(randn((1, D)), *prescale_state(rand_nvfp4((V, D)))) for _ in range(n_sets(wb, 4))]
  lbl = "lm_head nvfp4 M=1"
  yield ("asmdec/lm_head/xla", "asmdec", lbl, "xla",
         jax.jit(functools.partial(NV.nvfp4_gemv_reference, out_dtype=jnp.float32)), sets, wb)
  lm = functools.partial(NV.nvfp4_gemv, out_dtype=jnp.float32)
  for asm in ("mul_bf16", "mul"):
    yield (f"asmdec/lm_head/{asm}", "asmdec", lbl, asm, _with_asm(lm, asm), sets, wb)
  for mt, bn, bk, nw in [("reduce", 16, 512, 4), ("reduce", 16, 1024, 8), ("reduce", 32, 256, 4),
                         ("lanes", 32, 256, 4), ("lanes", 16, 512, 8), ("lanes", 64, 256, 8),
                         ("lanes", 16, 256, 4)]:
    kw = dict(method=mt, block_n=bn, block_k=bk, num_warps=nw)
    yield (f"asmdec/lm_head/mul {_tag(kw)}", "asmdec", lbl, f"mul {_tag(kw)}",
           functools.partial(lm, **kw), sets, wb)


def _gu(bn, bk, nw, ns, **extra):
  return dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, **extra)


def _dn(bn, bk, nw, ns, **extra):
  return dict(block_n_down=bn, block_k_down=bk, num_warps_down=nw, num_stages_down=ns, **extra)


MOETUNE = {
    8: [{}] + [_gu(*t) for t in [(64, 256, 8, 3), (64, 128, 4, 4), (64, 128, 8, 4),
                                 (128, 256, 8, 3), (128, 128, 8, 3), (32, 256, 4, 3),
                                 (32, 256, 2, 3), (32, 512, 4, 3), (64, 512, 8, 3),
                                 (64, 256, 4, 2), (64, 256, 4, 4)]]
       + [_gu(*t, method="swap") for t in [(64, 256, 4, 3), (128, 256, 8, 3), (128, 128, 4, 3)]]
       + [_dn(*t) for t in [(32, 128, 4, 3), (64, 256, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3),
                            (32, 256, 4, 3)]],
    1: [{}] + [dict(_gu(*g), **_dn(*d)) for g, d in [
        ((16, 1024, 8, 2), (16, 512, 8, 3)), ((16, 512, 8, 2), (16, 256, 4, 3)),
        ((16, 1024, 16, 3), (16, 512, 4, 3)), ((16, 2048, 16, 1), (16, 512, 4, 1)),
        ((32, 1024, 16, 2), (16, 512, 8, 2))]],
}


def moetune_cases(variants):
  """The NVFP4 routed MoE's tiles re-swept with the current decode (pre-scaled scales, the
  ``mul`` sequence): gate_up then down variants at M = 8, both kernels at M = 1."""
  if variants:
    return
  yield from _routed_nvfp4_cases("moetune", (8, 1), lambda m: _kw_variants(MOETUNE[m]))


_SWAP8 = [dict(method="swap", block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
          for bn, bk, nw, ns in [(128, 256, 8, 3), (128, 128, 8, 4), (128, 128, 8, 3),
                                 (128, 256, 8, 2), (128, 256, 8, 4), (256, 128, 8, 3),
                                 (64, 256, 4, 3), (128, 256, 4, 3)]]


def m8swap_cases(variants):
  """NVFP4 at M = 8 on swap-AB tiles (the decoded weights as wgmma's register A operand, x as
  its N = 16 side) against the defaults (``dot``, mma.sync): the routed MoE's gate_up and
  down, the q|k|v ``multi_gemv``, the o_proj and the LM head; block scales pre-scaled."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  down = [_dn(128, 128, 8, 3, method_down="swap"), _dn(64, 128, 4, 3, method_down="swap"),
          _dn(128, 256, 8, 3, method_down="swap")]
  kws = [{}] + _SWAP8 + down + [dict(_SWAP8[0], **down[0]), dict(_SWAP8[0], **down[1])]
  yield from _routed_nvfp4_cases("m8swap", (8,), lambda m: _kw_variants(kws))
  lbl, sets, bytes_ = _qkv_nvfp4_sets(8, _qkv_nvfp4_weights())
  yield ("m8swap/qkv/xla", "m8swap", lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets,
         bytes_)
  for kw in [{}] + _SWAP8:
    yield (f"m8swap/qkv/{_tag(kw)}", "m8swap", lbl, _tag(kw),
           functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)
  for name, n, k, m, out in [("o_proj", D, 4096, 8, BF), ("lm_head", V, D, 8, jnp.float32),
                             ("lm_head", V, D, 1, jnp.float32)]:
    wb = n * k // 2 + n * k // 8
    sets = [(randn((m, k)), *prescale_state(rand_nvfp4((n, k)))) for _ in range(n_sets(wb, 4))]
    kws = [{}] + [dict(kw, split_k=sk) for kw in _SWAP8[:3] + _SWAP8[5:7]
                  for sk in ((1, 2, 4) if name == "o_proj" else (1,))]
    yield from _nv_gemv_variants("m8swap", f"{name}/M{m}", f"{name} M={m}", sets,
                                 wb + m * k * 2 + m * n * 2, kws, out=out)


def _blk(bn, bk, nw, **extra):
  return dict(method="blocks", block_n=bn, block_k=bk, num_warps=nw, **extra)


def blocks_cases(variants):
  """The NVFP4 ``blocks`` tile method (per-block sums in the thread, the M = 1 default since
  run 84) on its own tiles: the routed MoE (gate_up, then down tiles), the LM head, o_proj,
  dense gate|up and down, q|k|v (``lanes`` default) at M = 1; ``reduce`` on the default tiles
  for comparison; block scales pre-scaled."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  moe = ([{}, dict(method="reduce")]
         + [_gu(*t, method="blocks") for t in [(16, 512, 8, 2), (16, 1024, 8, 2),
                                               (16, 2048, 16, 1), (32, 1024, 16, 2),
                                               (16, 512, 16, 2), (16, 1024, 16, 3),
                                               (32, 512, 8, 2)]]
         + [_dn(*t, method_down="blocks") for t in [(16, 512, 8, 2), (16, 256, 4, 3),
                                                    (32, 512, 8, 2), (16, 512, 4, 3),
                                                    (16, 256, 8, 2)]])
  yield from _routed_nvfp4_cases("blocks", (1,), lambda m: _kw_variants(moe))
  tables = {
      "lm_head": (V, D, jnp.float32, [_blk(16, 512, 8), _blk(32, 512, 4), _blk(64, 256, 8),
                                      _blk(16, 256, 4), _blk(32, 256, 8), _blk(64, 128, 4),
                                      _blk(32, 128, 4)]),
      "o_proj": (D, 4096, BF, [_blk(16, 512, 8, split_k=4), _blk(16, 1024, 4, split_k=4),
                               _blk(32, 1024, 8, split_k=4), _blk(16, 1024, 8, split_k=2)]),
      "dense_down": (D, 6144, BF, [_blk(16, 512, 8, split_k=3), _blk(16, 1024, 8, split_k=2),
                                   _blk(32, 1024, 8, split_k=3)]),
  }
  for name, (n, k, out, extra) in tables.items():
    sets, wb = _nvfp4_gemv_sets(name, n, k)
    yield from _nv_gemv_variants("blocks", name, f"nvfp4 {name} M=1", sets, wb + k * 2 + n * 2,
                                 [{}, dict(method="reduce")] + extra, out=out)
  gate_up = [prescale_state((rand_nvfp4((DENSE, D)), rand_nvfp4((DENSE, D)))) for _ in range(6)]
  wb = 2 * (DENSE * D // 2 + DENSE * D // 8)
  sets = [(randn((1, D)), g, u) for g, u in gate_up]
  yield from _nv_gemv_variants("blocks", "gate_up", "nvfp4 dense gate|up M=1", sets,
                               wb + D * 2 + DENSE * 2,
                               [{}, dict(method="reduce"), _blk(32, 512, 8), _blk(32, 1024, 8),
                                _blk(64, 256, 4), _blk(16, 1024, 8), _blk(128, 512, 8)],
                               silu_mul=True)
  lbl, sets, bytes_ = _qkv_nvfp4_sets(1, _qkv_nvfp4_weights())
  yield ("blocks/qkv/xla", "blocks", lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets,
         bytes_)
  for kw in [{}, _blk(16, 512, 8), _blk(16, 1024, 16), _blk(16, 1024, 8), _blk(16, 512, 4),
             _blk(32, 512, 8)]:
    yield (f"blocks/qkv/{_tag(kw)}", "blocks", lbl, _tag(kw),
           functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)


def post_cases(variants):
  """The ``post`` decode (``asm_decode``: the blocks tiles scale each 16-value block's sum, no
  bf16x2 scale multiply per weight; SASS 7-8% fewer instructions per K step, the MoE gate_up
  at 64 registers instead of 82) against the default "mul" at M = 1: the routed MoE (default
  tiles, then gate_up tiles the freed registers may allow), the LM head, o_proj and q|k|v."""
  if variants:
    return
  post = lambda fn: _with_asm(fn, "post")   # noqa: E731
  moe_kws = [{}] + [_gu(*t, method="blocks") for t in [(16, 1024, 16, 3), (32, 1024, 16, 2),
                                                       (16, 2048, 16, 2), (16, 1024, 8, 2)]]
  yield from _routed_nvfp4_cases("post", (1,), lambda m: (
      [("mul", MOE.moe_decode_routed)]
      + [(f"post {_tag(kw)}", post(functools.partial(MOE.moe_decode_routed, **kw)))
         for kw in moe_kws]))
  for name, n, k, out, kws in [("lm_head", V, D, jnp.float32, [{}, _blk(16, 512, 8)]),
                               ("o_proj", D, 4096, BF, [{}]),
                               ("dense_down", D, DENSE, BF, [{}])]:
    sets, wb = _nvfp4_gemv_sets(name, n, k)
    fn = functools.partial(NV.nvfp4_gemv, out_dtype=out)
    lbl = f"nvfp4 {name} M=1"
    yield (f"post/{name}/xla", "post", lbl, "xla",
           jax.jit(functools.partial(NV.nvfp4_gemv_reference, out_dtype=out)), sets, wb)
    yield (f"post/{name}/mul", "post", lbl, "mul", fn, sets, wb)
    for kw in kws:
      yield (f"post/{name}/post {_tag(kw)}", "post", lbl, f"post {_tag(kw)}",
             post(functools.partial(fn, **kw)), sets, wb)
  lbl, sets, bytes_ = _qkv_nvfp4_sets(1, _qkv_nvfp4_weights())
  yield ("post/qkv/xla", "post", lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets, bytes_)
  yield ("post/qkv/mul", "post", lbl, "mul", MULTI.multi_gemv, sets, bytes_)
  yield ("post/qkv/post", "post", lbl, "post", post(MULTI.multi_gemv), sets, bytes_)


def _tok(gu=None, dn=None, **extra):
  """``slot_rows="token"`` options with optional gate_up / down tiles (bn, bk, warps, stages)."""
  return dict(slot_rows="token", **(_gu(*gu) if gu else {}), **(_dn(*dn) if dn else {}), **extra)


M8TOKEN = {
    8: [{}, _tok(), _tok(token_method="reduce")]
       + [_tok(gu=t) for t in [(16, 1024, 8, 2), (16, 512, 8, 2), (16, 512, 4, 2),
                               (32, 1024, 16, 2), (16, 1024, 16, 3), (16, 2048, 16, 1),
                               (32, 512, 8, 2), (64, 512, 8, 2)]]
       + [_tok(dn=t) for t in [(16, 256, 4, 2), (16, 512, 8, 2), (32, 512, 4, 2),
                               (16, 512, 2, 2), (64, 512, 8, 2)]],
    4: [{}, _tok(token_method="reduce"), dict(slot_rows="all")],
    2: [{}, _tok(token_method="reduce"), dict(slot_rows="all")],
}


def _routed_table_cases(group, table, doc, fmt="nvfp4"):
  """A group function timing the routed MoE (NVFP4 with block scales pre-scaled, or ``fmt``) at
  each M of ``table`` (M -> option dicts, in its key order) against the XLA reference, comparing
  only the rows every ``slot_rows`` mode defines (``_used_rows``)."""
  def cases(variants):
    if variants:
      return
    yield from _routed_nvfp4_cases(group, tuple(table), lambda m: _kw_variants(table[m]),
                                   wrap=_used_rows, fmt=fmt)
  cases.__doc__ = doc
  return cases


m8token_cases = _routed_table_cases("m8token", M8TOKEN, """Session 15: the routed NVFP4 MoE at
  M = 8 (and 4, 2) with per-token slots (``slot_rows="token"``: M * top_k GEMVs at M = 1) on
  the ``blocks`` tiles of the batch-1 step, against the default (M = 8 then: every slot
  multiplied by all 8 tokens on swap-AB tensor-core tiles) and the token mode's old ``reduce``
  tiles; token-mode tile sweeps at M = 8.""")


def m8diag_cases(variants):
  """Why a per-token slot costs more than a batch-1 slot: the slot path (``moe_decode``, the
  experts given) at M = 1 with 6 / 12 / 24 / 48 distinct experts per token (every slot on the
  batch-1 ``blocks`` tiles, the shared expert once, as at batch 1), then the token mode at M = 8
  on more tiles (the shared expert's 8 rows on ``rows`` or ``dot`` tiles)."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  experts, shared = prescale_state(moe_weights("nvfp4"))
  per_expert = nbytes({k: v[0] for k, v in experts.items()})
  for k in (6, 12, 24, 48):
    sets = []
    for _ in range(16):
      ids = jax.random.permutation(_key(), E)[:k][None].astype(jnp.int32)
      w = jax.random.uniform(_key(), (1, k), jnp.float32, 0.1, 1.0)
      sets.append((randn((1, D)), ids, w / w.sum(), experts, shared))
    lbl, bytes_ = f"slots nvfp4 M=1 k={k}", k * per_expert + nbytes(shared) + 2 * D * 2
    yield (f"m8diag/slots{k}/xla", "m8diag", lbl, "xla", jax.jit(MOE.moe_decode_reference),
           sets, bytes_)
    kws = [{}] + ([_gu(16, 1024, 8, 2), _gu(16, 512, 4, 2)] if k == 48 else [])
    for kw in kws:
      yield (f"m8diag/slots{k}/{_tag(kw)}", "m8diag", lbl, _tag(kw),
             functools.partial(MOE.moe_decode, **kw), sets, bytes_)
  tok = [_tok(gu=(16, 1024, 8, 2)), _tok(gu=(16, 1024, 8, 2), dn=(16, 512, 8, 2)),
         _tok(gu=(16, 1024, 8, 2), method="dot"), _tok(gu=(16, 1024, 4, 2)),
         _tok(gu=(16, 2048, 8, 1)), _tok(gu=(16, 1024, 8, 3)), _tok(gu=(16, 1024, 4, 1))]
  yield from _routed_nvfp4_cases("m8diag", (8,), lambda m: _kw_variants([{}] + tok),
                                 wrap=_used_rows)


def m8diag2_cases(variants):
  """What makes a per-token slot at M = 8 cost more than a batch-1 one (session 15, after run
  97: 48 slots of M = 1 work take 66 us on the slot path, 182 in the token mode): the routed MoE
  at M = 1 with top_k = 48 (the in-kernel top-k grows, the slots equal run 97's), and the token
  and all modes at M = 8 with a 64-wide shared expert (its M rows nearly gone)."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  router = randn((E, D), jnp.float32, D ** -0.5)
  experts, shared = prescale_state(moe_weights("nvfp4"))
  tiny = prescale_state(dict(gate_proj=rand_nvfp4((64, D)), up_proj=rand_nvfp4((64, D)),
                             down_proj=rand_nvfp4((D, 64))))
  for m, top_k, sh, kws in [
      (1, 48, shared, [{}, _gu(16, 1024, 8, 2)]),
      (8, 6, tiny, [{}, _tok(gu=(16, 1024, 8, 2)), _tok()]),
      (8, 6, shared, [_tok(gu=(16, 1024, 8, 2))])]:
    xs, logits, _, bytes_ = moe_inputs(m, router, experts, sh)
    sets = [(x, lg, experts, sh) for x, lg in zip(xs, logits)]
    lbl = f"routed nvfp4 M={m} k={top_k} shared {sh['gate_proj'][0].shape[0]}"
    ref = functools.partial(MOE.moe_decode_routed_reference, top_k=top_k)
    yield (f"m8diag2/{lbl}/xla", "m8diag2", lbl, "xla", jax.jit(_used_rows(ref, top_k)), sets,
           bytes_)
    for kw in kws:
      fn = functools.partial(MOE.moe_decode_routed, top_k=top_k, **kw)
      yield (f"m8diag2/{lbl}/{_tag(kw)}", "m8diag2", lbl, _tag(kw), _used_rows(fn, top_k), sets,
             bytes_)


M8PRE = {
    8: [{}, dict(prerouted=True), dict(prerouted=True, shared_first=True), _tok(),
        _tok(prerouted=True), _tok(shared_first=True), _tok(prerouted=True, shared_first=True),
        _tok(gu=(16, 1024, 16, 2), prerouted=True, shared_first=True),
        _tok(gu=(16, 512, 4, 2), prerouted=True, shared_first=True),
        _tok(gu=(16, 1024, 4, 2), prerouted=True, shared_first=True),
        _tok(gu=(16, 512, 8, 2), prerouted=True, shared_first=True),
        _tok(dn=(16, 512, 8, 2), prerouted=True, shared_first=True),
        _tok(dn=(32, 512, 4, 2), prerouted=True, shared_first=True)],
    4: [{}, _tok(prerouted=True, shared_first=True),
        _tok(gu=(16, 1024, 8, 2), prerouted=True, shared_first=True),
        _tok(gu=(16, 1024, 8, 2))],
    2: [{}, _tok(prerouted=True, shared_first=True),
        _tok(gu=(16, 1024, 8, 2), prerouted=True, shared_first=True)],
    1: [{}, dict(prerouted=True), dict(shared_first=True)],
}


m8pre_cases = _routed_table_cases("m8pre", M8PRE, """Session 15: the routed NVFP4 MoE with the
  routing computed once (``prerouted``) and the shared expert's programs first
  (``shared_first``), in both slot modes at M = 8, 4, 2 and at M = 1; the token mode's tiles
  again with both.""")


SHTOK = {
    8: [{}, _tok(shared_rows="token")]
       + [_tok(gu=t, shared_rows="token") for t in [(16, 1024, 16, 2), (16, 1024, 8, 2),
                                                    (16, 512, 8, 2), (16, 2048, 16, 1),
                                                    (32, 1024, 16, 2)]]
       + [_tok(dn=t, shared_rows="token") for t in [(16, 512, 8, 2), (32, 512, 4, 2),
                                                    (16, 256, 4, 2)]],
    4: [{}, _tok(shared_rows="token"), _tok(gu=(16, 512, 4, 2), shared_rows="token")],
    2: [{}, _tok(shared_rows="token"), _tok(gu=(16, 512, 4, 2), shared_rows="token")],
}


shtok_cases = _routed_table_cases("shtok", SHTOK, """Session 15: the routed NVFP4 MoE at M = 8 /
  4 / 2 with the shared expert per token on the M = 1 tiles (``shared_rows="token"``: no
  ``rows`` tile, whose [M, BN, BK] products gave the gate_up a 6.6 KB stack frame and the down
  kernel 137 registers) against the default, and its tiles.""")


M8DENSE = {   # op -> option dicts (kwargs of multi_gemv / nvfp4_gemv), {} = the default
    "qkv": [{}] + [dict(method="dot", block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                   for bn, bk, nw, ns in [(32, 256, 4, 3), (16, 256, 4, 3), (32, 128, 4, 4),
                                          (64, 128, 4, 4), (32, 512, 8, 3), (16, 512, 4, 3),
                                          (64, 256, 8, 3)]]
           + [dict(method="swap", block_n=64, block_k=256, num_warps=4),
              dict(method="rows", block_n=16, block_k=512, num_warps=8)],
    "o_proj": [{}] + [dict(method="dot", block_n=bn, block_k=bk, split_k=sk, num_warps=nw)
                      for bn, bk, sk, nw in [(32, 256, 4, 4), (16, 256, 4, 4), (32, 512, 4, 4),
                                             (64, 256, 2, 4), (64, 128, 4, 4), (32, 256, 2, 4),
                                             (32, 128, 4, 4), (64, 512, 2, 8)]],
    "lm_head": [{}] + [dict(method=mt, block_n=bn, block_k=bk, num_warps=nw)
                       for mt, bn, bk, nw in [("swap", 64, 128, 4), ("swap", 128, 256, 8),
                                              ("swap", 128, 128, 4), ("dot", 64, 256, 4),
                                              ("dot", 128, 128, 8), ("swap", 64, 256, 4)]],
}


M8DENSE2 = {   # round 2 (run 105) around run 104's bests: larger row blocks, shorter K steps
    "qkv": [{}] + [dict(method="dot", block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                   for bn, bk, nw, ns in [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4),
                                          (64, 64, 4, 6), (128, 64, 4, 6), (64, 128, 4, 5),
                                          (64, 128, 8, 4), (128, 256, 8, 3), (64, 64, 4, 4)]],
    "o_proj": [{}] + [dict(method="dot", block_n=bn, block_k=bk, split_k=sk, num_warps=nw,
                           num_stages=ns)
                      for bn, bk, sk, nw, ns in [(64, 128, 4, 4, 3), (128, 128, 4, 4, 3),
                                                 (128, 128, 4, 8, 3), (64, 64, 4, 4, 4),
                                                 (64, 128, 8, 4, 3), (128, 128, 8, 8, 3),
                                                 (64, 128, 2, 4, 4), (128, 64, 4, 4, 4),
                                                 (64, 128, 4, 4, 4), (64, 64, 8, 4, 4)]],
    "lm_head": [],
}


BF16TOK = {   # the NVFP4 batch > 1 MoE options (sessions 15-16), on BF16 experts
    8: [{}, _tok(), _tok(shared_rows="token"), _tok(prerouted=False, shared_first=False),
        _tok(gu=(32, 256, 4, 3), shared_rows="token"), _tok(gu=(16, 256, 4, 3), shared_rows="token"),
        _tok(gu=(64, 128, 4, 4), shared_rows="token"), _tok(dn=(32, 128, 4, 3), shared_rows="token")],
    4: [{}, _tok(), _tok(shared_rows="token")],
    2: [{}, _tok(), _tok(shared_rows="token")],
}


bf16tok_cases = _routed_table_cases("bf16tok", BF16TOK, """Session 16 (for session 17): the
  routed BF16 MoE at M = 8 / 4 / 2 in the per-token slot mode with the options that made it the
  NVFP4 default (the routing given, the shared expert's programs first, the shared expert per
  token) against its default (all rows on tensor-core tiles; the token mode measured equal at
  M = 8 before those options, 86 against 88 us, session 6), and a few tiles.""", fmt="bf16")


M8SILU = {   # the NVFP4 dense gate|up pair (2 of Flint's layers) at M = 8
    8: [{}] + [dict(method="dot", block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
               for bn, bk, nw, ns in [(64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 3),
                                      (128, 128, 8, 3), (64, 64, 4, 4)]],
}


def m8silu_cases(variants):
  """Session 16 (for session 17): the NVFP4 dense gate|up + SiLU (``nvfp4_gemv_silu_mul``, [6144,
  2048] each, block scales pre-scaled) at M = 8 on 128-wide K steps against its bk256 default
  (28.3 us in the 8x1K step, run 106), as the single matrices gained with them (perf log 64)."""
  if variants:
    return
  from flint_jax.nvfp4 import prescale_state
  n = DENSE
  for m, table in M8SILU.items():
    ws = [prescale_state((rand_nvfp4((n, D)), rand_nvfp4((n, D)))) for _ in range(4)]
    sets = [(randn((m, D)), g, u) for g, u in ws]
    lbl, bytes_ = f"dense_gate_up nvfp4 M={m}", nbytes(ws[0]) + m * D * 2 + m * n * 2
    yield (f"m8silu/M{m}/xla", "m8silu", lbl, "xla",
           jax.jit(NV.nvfp4_gemv_silu_mul_reference), sets, bytes_)
    for kw in table:
      yield (f"m8silu/M{m}/{_tag(kw)}", "m8silu", lbl, _tag(kw),
             functools.partial(NV.nvfp4_gemv_silu_mul, **kw), sets, bytes_)


def m4qkv_cases(variants):
  """Session 16: the NVFP4 q|k|v ``multi_gemv`` at M = 2 / 3 / 4 (block scales pre-scaled): its
  default there (``rows``, CUDA-core tiles, measured faster than the tensor-core tile in run
  25) against ``dot`` and ``swap`` on their current tiles (bn64 bk128, 4 stages; 13.2 us at M = 8,
  run 104)."""
  if variants:
    return
  ws = _qkv_nvfp4_weights(12)
  for m in (2, 3, 4):
    lbl, sets, bytes_ = _qkv_nvfp4_sets(m, ws)
    yield (f"m4qkv/M{m}/xla", "m4qkv", lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets,
           bytes_)
    for kw in [{}, dict(method="dot"), dict(method="swap")]:
      yield (f"m4qkv/M{m}/{_tag(kw)}", "m4qkv", lbl, _tag(kw),
             functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)


def m8dense2_cases(variants):
  """Round 2 of ``m8dense`` (run 104: q|k|v 13.2 us on bn64 bk128 4 stages against 16.3, o_proj
  8.05 on bn64 bk128 split-K 4 against 9.31; smaller row blocks lost, up to 5x): larger blocks
  and shorter K steps."""
  return m8dense_cases(variants, M8DENSE2, "m8dense2")


M8QSK = {   # session 22: the q|k|v in K slices (multi_gemv split_k; fp32 partials, which the
    # step's attention kernel sums: here a separate XLA sum, the flint kernel's own time is its
    # "kernels" entry)
    "qkv": [{}] + [dict(split_k=sk, **kw) for sk in (2, 4) for kw in (
        {}, dict(block_n=128, num_warps=8), dict(block_n=32))] + [dict(split_k=8, block_k=64)]
           # round 2 (run 143) around run 142's best (S = 8 on 4 K steps of 64: 8.88 us)
           + [dict(split_k=sk, block_k=bk, **kw) for sk, bk, kw in [
               (8, 128, {}), (16, 64, {}), (16, 128, {}), (4, 64, {}), (8, 64, dict(num_stages=3)),
               (8, 64, dict(block_n=128, num_warps=8)), (8, 64, dict(num_warps=8)),
               (32, 64, {})]],
    "o_proj": [], "lm_head": [],
}


def m8qsk_cases(variants):
  """Session 22: the NVFP4 q|k|v at M = 8 in K slices (``multi_gemv(split_k=S)``): the default
  tile runs 80 programs of 16 K steps (13.5 us per layer in the 8x1K step); S slices give S x
  the programs, each S x shorter."""
  return m8dense_cases(variants, M8QSK, "m8qsk")


def m8dense_cases(variants, table=None, group="m8dense"):
  """Session 16: the NVFP4 dense GEMVs of the batch-8 step on other tiles (block scales
  pre-scaled, as ``flint_jax.load`` gives them): the q|k|v ``multi_gemv`` (17.1 us per layer in
  the 8x1K step, 80 programs on bn64), the o_proj with split-K partials left unsummed (10.2 us,
  128 programs) and the LM head (141 us); the defaults date from session 3 (q|k|v, o_proj) and
  session 12 (LM head on swap tiles)."""
  if variants:
    return
  table = table or M8DENSE
  m = 8
  lbl, sets, bytes_ = _qkv_nvfp4_sets(m, _qkv_nvfp4_weights(12))
  yield (f"{group}/qkv/xla", group, lbl, "xla", jax.jit(MULTI.multi_gemv_reference), sets,
         bytes_)
  for kw in table["qkv"]:
    yield (f"{group}/qkv/{_tag(kw)}", group, lbl, _tag(kw),
           functools.partial(MULTI.multi_gemv, **kw), sets, bytes_)
  for name, n, k, extra in [("o_proj", D, 4096, dict(sum_splits=False)), ("lm_head", V, D, {})]:
    if not table[name]:
      continue
    sets, wb = _nvfp4_gemv_sets(name, n, k, m)
    lbl, bytes_ = f"nvfp4 {name} M={m}", wb + m * k * 2 + m * n * 2
    yield (f"{group}/{name}/xla", group, lbl, "xla", jax.jit(NV.nvfp4_gemv_reference), sets,
           bytes_)
    for kw in table[name]:
      fn = functools.partial(NV.nvfp4_gemv, **extra, **kw)
      if extra:   # the o_proj's fp32 partials [S, M, N] summed by a separate XLA kernel (in the
        # step add_rms_norm sums them): the flint kernel's own time is its "kernels" entry
        fn = jax.jit(lambda *a, fn=fn: jnp.sum(fn(*a), axis=0).astype(jnp.bfloat16))
      yield (f"{group}/{name}/{_tag(kw)}", group, lbl, _tag(kw), fn, sets, bytes_)


GROUPS = {"gemv": gemv_cases, "nvfp4": nvfp4_cases, "moe": moe_cases,
          "attention": attention_cases, "qk": qk_cases, "norms": norm_cases, "tune": tune_cases,
          "tune2": tune2_cases, "route": route_cases,
          "nqtune": nqtune_cases, "slotrows": slotrows_cases, "rows": rows_cases,
          "rows2": rows2_cases, "lanes": lanes_cases, "arnr": arnr_cases,
          "nqlanes": nqlanes_cases, "gusk": gusk_cases, "router": router_cases,
          "prescale": prescale_cases, "stream": stream_cases, "m1dot": m1dot_cases,
          "asmdec": asmdec_cases, "moetune": moetune_cases,
          "m8swap": m8swap_cases, "blocks": blocks_cases,
          "post": post_cases, "m8token": m8token_cases,
          "m8diag": m8diag_cases, "m8diag2": m8diag2_cases,
          "m8pre": m8pre_cases, "shtok": shtok_cases, "m8dense": m8dense_cases,
          "m8dense2": m8dense2_cases, "m4qkv": m4qkv_cases, "bf16tok": bf16tok_cases,
          "m8silu": m8silu_cases, "m8qsk": m8qsk_cases}


# ------------------------------------------------------------------------------------------


def _aot(fn, args):
  """AOT-compile fn for args (runs in a worker thread: XLA/Triton compilation releases the GIL)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
  ap.add_argument("--groups", default="nvfp4,moe,attention,gemv,qk,norms")
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
  ap.add_argument("--compile-threads", type=int, default=12)
  ap.add_argument("--variants", type=int, default=1)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  t_start = time.perf_counter()
  print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)

  # 1. Build every case (inputs on the device) in priority order: base cases of all groups,
  #    then the variant sweeps.
  cases = []
  passes = [(g, False) for g in args.groups.split(",")]
  if args.variants:
    passes += [(g, True) for g in args.groups.split(",")]
  for group, variants in passes:
    try:
      cases.extend(GROUPS[group](variants))
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
        elif key in refs and grp != "qk_norm_rope":   # validate against the XLA reference
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
