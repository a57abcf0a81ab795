"""Prefill on the H200: the Pallas prefill kernels checked and timed, a profile, whole-model prefill.

    PYTHONPATH=. python3 tools/gpu_prefill.py --out $OUT/prefill.json          # H200, ~6-7 min
    PYTHONPATH=. JAX_PLATFORMS=cpu python3 tools/gpu_prefill.py --config tiny --out /tmp/p.json

Stages (``--stages``, default ``check kernels profile model``; each result is printed and the JSON
rewritten as soon as it exists, so a run cut short still reports what it finished; a stage or
case whose estimated time would end past ``--budget`` seconds is skipped and listed):

1. ``check``: the compiled kernels against their references at realistic sizes (max |err| /
   max |ref| and rel-L2): ``moe_experts`` (BF16, NVFP4 decoded in the kernels and dequantized
   first) and ``prefill_attention`` (full cache and ring + chunk, ragged rows). No pytest.
2. ``kernels``: device time of one MoE layer's routed experts at 8K- and 16K-token chunks (BF16,
   NVFP4 fused and dequantized, the dequantization alone) beside a dense GEMM of the same FLOPs,
   of the router at an 8K chunk (``PrefillOptions.router``: HIGHEST and bf16x6, the latter's
   scores against the former's), and of one layer's attention (full: 1 x 8K from position 0 and a 16K chunk after 16K; ring)
   beside cuDNN (no sinks); TFLOP/s of useful work. ``--sweep`` also tries block variants around
   the defaults (the defaults are run "prefill-1"'s best).
3. ``profile``: per format, a perfetto trace of one 1 x 8K prefill (one chunk, after the warm-up
   that compiles it), summarised as GPU kernel time by kernel name (top 30: launches, ms, share)
   and by kind (Pallas grouped GEMM, Pallas attention, GEMMs, sort / top-k, the rest), against
   the wall time of the same call untraced (XLA turns its command buffers off while profiling, so
   the traced gaps between kernels are not the real ones; the kernel durations are). The trace
   file is copied next to ``--out``; ``--hlo`` also writes the chunk step's optimized HLO (one
   more compile) and its memory analysis.
4. ``model``: ``--cases`` (default ``bf16:1x8K bf16:8x2K bf16:1x32K bf16:1x100K nvfp4:1x8K
   nvfp4:1x32K``; ``bf16:1x262K`` on request; ``fmt:case@key=value,...`` sets string-valued
   ``PrefillOptions`` fields for one case, e.g. ``bf16:1x32K@attention=cudnn,router=bf16x6``) through ``flint_jax.prefill.prefill`` with its
   chunk policy (16K tokens per chunk) on full-size random weights built on the device
   (``flint_jax.bench.build_state``; NVFP4 block scales pre-scaled as ``flint_jax.load``
   does on a GPU): the first call (compile + run) and the median of ``--reps`` runs (1 for the
   100K+ cases), the compute floor (matmul + attention FLOPs at 790 TFLOP/s), memory (weights,
   cache, device peak). ``--xla`` adds the XLA path at 1 x 8K (256-token chunks, ~60 s) and the
   rel-L2 of its last-token logits against the Pallas path's.

``--stages tests`` (not a default; run it in a call of its own, ~3-4 min estimated) runs the
three prefill test files compiled (pytest -n 4) before anything else touches the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flint_jax import decode, layers, prefill  # noqa: E402
from flint_jax.bench_prefill import (NAMED_CASES, build_model, cache_length,  # noqa: E402
                                    prefill_flops, reference_model, run_prefill)
from flint_jax.config import kv_cache_bytes, preset  # noqa: E402
from flint_jax.pallas import grouped_matmul as gm  # noqa: E402
from flint_jax.pallas.prefill_attention import (prefill_attention,  # noqa: E402
                                                prefill_attention_reference)

F32, BF = jnp.float32, jnp.bfloat16
T0 = time.perf_counter()
RESULTS: dict = {"check": [], "kernels": [], "profile": [], "model": [], "skipped": []}
OUT_PATH = None
INTERPRET = False

# name -> (row lengths, timed runs at most, estimated seconds per run for the budget guard)
CASES = {name: (NAMED_CASES[name], reps, est) for name, reps, est in (
    ("1x8K", 3, 0.5), ("8x2K", 3, 0.5), ("1x32K", 3, 2), ("1x100K", 1, 12), ("1x262K", 1, 50))}
DEFAULT_CASES = ["bf16:1x8K", "bf16:8x2K", "bf16:1x32K", "bf16:1x100K", "nvfp4:1x8K",
                 "nvfp4:1x32K"]
COMPILE_S = 40        # a first call of a new chunk shape (run 1: 19-35 s), for the budget guard


def elapsed() -> float:
  return time.perf_counter() - T0


def save(path=None):
  path = path or OUT_PATH
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(RESULTS, f, indent=1, default=str)


def log(msg):
  print(f"[{elapsed():6.1f}s] {msg}", flush=True)
  save()   # the JSON holds every result printed so far


def out_dir() -> str | None:
  return os.path.dirname(os.path.abspath(OUT_PATH)) if OUT_PATH else None


def fits(what: str, seconds: float, budget: float) -> bool:
  """False (and the item listed as skipped) when it would end past the budget."""
  if elapsed() + seconds <= budget:
    return True
  RESULTS["skipped"].append(what)
  log(f"skipped {what} (budget: {elapsed():.0f} s + ~{seconds:.0f} s > {budget:.0f} s)")
  return False


def errors(out, ref) -> dict:
  o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return {"max_err": float(np.max(np.abs(o - r)) / max(np.max(np.abs(r)), 1e-30)),
          "rel_l2": float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)),
          "finite": bool(np.isfinite(o).all())}


def time_ms(fn, *args, reps=10, windows=3) -> float:
  """Median over ``windows`` of the mean time of ``reps`` back-to-back asynchronous calls."""
  jax.block_until_ready(fn(*args))
  per = []
  for _ in range(windows):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    per.append((time.perf_counter() - t0) * 1e3 / reps)
  return statistics.median(per)


def memory() -> dict:
  try:
    st = jax.devices()[0].memory_stats() or {}
  except Exception:   # the CPU backend
    st = {}
  return {k: int(st[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in st}


# ---- inputs ---------------------------------------------------------------------------------

def moe_inputs(cfg, t, fmt, seed=0):
  key = jax.random.split(jax.random.key(seed), 8)
  e, d, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
  x = jax.random.normal(key[0], (t, d), BF)
  logits = jax.random.normal(key[1], (t, e), F32)
  w, ids = jax.lax.top_k(jax.nn.sigmoid(logits), k)
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  if fmt == "bf16":
    experts = dict(gate_up_proj=(jax.random.normal(key[2], (e, 2 * i, d), F32) * 2 * d ** -0.5)
                   .astype(BF),
                   down_proj=(jax.random.normal(key[3], (e, d, i), F32) * i ** -0.5).astype(BF))
  else:
    def nv(kq, ks, n, kk, lead):
      q = jax.random.randint(kq, (*lead, n, kk // 2), 0, 256, jnp.int32).astype(jnp.uint8)
      s = jax.random.uniform(ks, (*lead, n, kk // 16), F32, 0.03, 0.9).astype(jnp.float8_e4m3fn)
      return q, (s.astype(F32) * 2.0 ** 119).astype(BF)       # pre-scaled (prescale_state)
    gq, gs = nv(key[2], key[4], 2 * i, d, (e,))
    dq, ds = nv(key[3], key[5], d, i, (e,))
    experts = dict(gate_up_qweight=gq, gate_up_weight_scale=gs,
                   gate_up_weight_scale_2=jnp.full((e, 2), 0.5 / d ** 0.5, F32),
                   down_qweight=dq, down_weight_scale=ds,
                   down_weight_scale_2=jnp.full((e,), 0.5 / i ** 0.5, F32))
  return x, w, ids.astype(jnp.int32), experts


def attn_inputs(cfg, b, t, s_len, lengths, n, ring, seed=0):
  key = jax.random.split(jax.random.key(seed), 6)
  h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  q = jax.random.normal(key[0], (b, t, h, dh), BF)
  slots = cfg.ring_size if ring else s_len
  kc = jax.random.normal(key[1], (b, kvh, slots, dh), BF) * 2
  vc = jax.random.normal(key[2], (b, kvh, slots, dh), BF)
  sinks = jax.random.normal(key[3], (h,), F32)
  args = [q, kc, vc, jnp.asarray(lengths, jnp.int32), jnp.asarray(n, jnp.int32), sinks, None]
  if ring:
    args += [jax.random.normal(key[4], (b, t, kvh, dh), BF) * 2,
             jax.random.normal(key[5], (b, t, kvh, dh), BF)]
  return args


def valid_rows(o, n):
  return jnp.concatenate([o[i, :int(k)] for i, k in enumerate(n)], axis=0)


# ---- stage 1: check -------------------------------------------------------------------------

def stage_check(cfg, small):
  t = 256 if small else 2048
  for fmt, mode in (("bf16", "auto"), ("nvfp4", "fused"), ("nvfp4", "dequant")):
    x, w, ids, ex = moe_inputs(cfg, t, fmt)
    out = gm.moe_experts(x, w, ids, ex, nvfp4=mode, interpret=INTERPRET)
    ref = gm.moe_experts_reference(x, w, ids, ex)
    r = {"what": f"moe_experts {fmt} {mode} T={t}", **errors(out, ref)}
    RESULTS["check"].append(r)
    log(r)
  b, tq = 2, (64 if small else 1024)
  s_len = 4 * tq
  for ring in (False, True):
    lengths, n = [tq + tq // 2 - 3, 0 if not ring else 100], [tq, tq - 300 if not small else 40]
    args = attn_inputs(cfg, b, tq, s_len, lengths, n, ring)
    kw = dict(ring=ring, window=cfg.sliding_window if ring else None)
    out = prefill_attention(*args, interpret=INTERPRET, **kw)
    ref = prefill_attention_reference(*args, **kw)
    r = {"what": f"prefill_attention {'ring' if ring else 'full'} B={b} T={tq}",
         **errors(valid_rows(out, n), valid_rows(ref, n))}
    RESULTS["check"].append(r)
    log(r)


# ---- stage 2: kernels -----------------------------------------------------------------------

# Variants tried with --sweep (None: the default); the defaults are run prefill-1's best.
MOE_SWEEP = [  # (block_m, gate_up (bn, bk), down (bn, bk), warps, stages)
    (64, None, None, None, None), (128, (64, 64), (128, 64), None, None),
    (128, (128, 64), (128, 128), None, None), (None, None, None, 4, 4),
    (None, None, None, None, 3), (None, None, None, None, 5)]
ATTN_SWEEP = [(16, 64, 8, 3), (32, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3),
              (32, 64, 8, 4)]  # (block_q, block_k, warps, stages), full and ring


def _record(r):
  RESULTS["kernels"].append(r)
  log(r)
  return r


def stage_kernels(cfg, small, sweep):
  e, d, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
  reps = 3 if INTERPRET else 10
  for t in ((512,) if small else (8192, 16384)):
    moe_flop = 2 * t * k * 3 * d * i
    if not INTERPRET:   # the dense GEMM of the same FLOPs ([T*k, D] x [D, 3I])
      a, bmat = jnp.ones((t * k, d), BF), jnp.ones((d, 3 * i), BF)
      ms = time_ms(jax.jit(lambda a, b: a @ b), a, bmat)
      _record({"what": f"dense GEMM, routed-expert FLOPs T={t}", "ms": ms,
               "tflops": moe_flop / ms / 1e9})
    for fmt, mode in (("bf16", "auto"), ("nvfp4", "fused"), ("nvfp4", "dequant")):
      x, w, ids, ex = moe_inputs(cfg, t, fmt)
      variants = [(None,) * 5] + (MOE_SWEEP if sweep and t == 8192 else [])
      for v in variants:
        fn = jax.jit(lambda x, w, ids, ex, v=v, mode=mode: gm.moe_experts(
            x, w, ids, ex, block_m=v[0], gate_up_blocks=v[1], down_blocks=v[2], num_warps=v[3],
            num_stages=v[4], nvfp4=mode, interpret=INTERPRET))
        try:
          ms = time_ms(fn, x, w, ids, ex, reps=reps)
        except Exception as exc:   # a tile that does not fit shared memory, ...
          _record({"what": f"moe_experts {fmt} {mode} T={t} {v}", "error": repr(exc)[:300]})
          continue
        _record({"what": f"moe_experts {fmt} {mode} T={t}", "variant": v, "ms": ms,
                 "tflops": moe_flop / ms / 1e9})
      if fmt == "nvfp4" and mode == "dequant":   # the dequantization alone
        gu, dn = gm.expert_weights(ex)
        fn = jax.jit(lambda gu, dn: (gm.dequantize_experts(gu).weight,
                                     gm.dequantize_experts(dn).weight))
        ms = time_ms(fn, gu, dn, reps=reps)
        nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((gu, dn)))
        _record({"what": "dequantize_experts (gate_up + down of one layer)", "ms": ms,
                 "tb_per_s": (nbytes + 2 * e * 3 * d * i) / ms / 1e9})
  # The router (fp32 logits + top-k) at an 8K chunk, as prefill.PrefillOptions.router runs it.
  t = 512 if small else 8192
  xr = jax.random.normal(jax.random.key(3), (t, d), BF)
  wr = jax.random.normal(jax.random.key(4), (e, d), F32) * d ** -0.5
  want = None
  for name, prec in prefill.ROUTER_PRECISIONS.items():
    fn = jax.jit(lambda x, w, prec=prec: layers.router_topk(x, w, k, True, prec))
    try:
      ms = time_ms(fn, xr, wr, reps=reps)
      scores = fn(xr, wr)[0]
    except Exception as exc:
      _record({"what": f"router {name} T={t}", "error": repr(exc)[:300]})
      continue
    want = scores if want is None else want
    _record({"what": f"router {name} T={t} (logits + sigmoid + top-k)", "ms": ms,
             "tflops": 2 * t * d * e / ms / 1e9, **errors(scores, want)})
  h, dh, w_ = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
  # (label, ring, T, cache S, position before the chunk)
  attn_cases = [("full 1x8K", False, t, t, 0), ("ring 1x8K", True, t, t, 0)]
  if not small:
    attn_cases.insert(1, ("full 16K chunk after 16K", False, 16384, 32768, 16384))
  for label, ring, tq, s_len, p0 in attn_cases:
    args = attn_inputs(cfg, 1, tq, s_len, [p0], [tq], ring)
    if ring:
      pairs = sum(min(p + 1, w_) for p in range(p0, p0 + tq))
    else:
      pairs = tq * p0 + tq * (tq + 1) // 2
    flop = 4 * pairs * h * dh
    for v in [(None,) * 4] + (ATTN_SWEEP if sweep else []):
      fn = jax.jit(lambda *a, v=v, ring=ring: prefill_attention(
          *a, ring=ring, window=w_ if ring else None, block_q=v[0], block_k=v[1],
          num_warps=v[2], num_stages=v[3], interpret=INTERPRET))
      try:
        ms = time_ms(fn, *args, reps=reps)
      except Exception as exc:
        _record({"what": f"attention {label} {v}", "error": repr(exc)[:300]})
        continue
      _record({"what": f"prefill_attention {label}", "variant": v, "ms": ms,
               "tflops": flop / ms / 1e9})
    if not INTERPRET and p0 == 0:   # cuDNN, no sinks, q = kv = T (top-left = bottom-right)
      q = args[0]
      kfull = jax.random.normal(jax.random.key(9), (1, tq, cfg.num_key_value_heads, dh), BF)
      try:
        fn = jax.jit(lambda q, k, v, ring=ring: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn",
            local_window_size=(w_ - 1, 0) if ring else None))
        ms = time_ms(fn, q, kfull, kfull)
        _record({"what": f"cudnn attention {'window' if ring else 'causal'} 1x{tq} (no sinks)",
                 "ms": ms, "tflops": flop / ms / 1e9})
      except Exception as exc:
        _record({"what": "cudnn attention", "error": repr(exc)[:300]})


# ---- whole model ----------------------------------------------------------------------------

def case_rows(cfg, name, small):
  lengths = CASES[name][0]
  if small:
    lengths = [max(16, n // 64) for n in lengths]
  gen = np.random.default_rng(len(lengths) * 1000 + lengths[0])
  return [gen.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def _kind(name: str) -> str:
  if name.startswith("flint_grouped"):
    return "Pallas grouped GEMM (routed experts)"
  if name.startswith("flint_prefill_attn"):
    return "Pallas attention"
  if re.search(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm80_", name, re.I):
    return "GEMM (cuBLAS / XLA Triton)"
  if re.search(r"sort|topk|top_k|radix|cub::", name, re.I):
    return "sort / top-k"
  if re.search(r"scatter|gather", name, re.I):
    return "scatter / gather"
  if re.search(r"reduce|reduction", name, re.I):
    return "reductions"
  return "other fusions / copies"


def profile_summary(trace, top=30) -> dict:
  """GPU kernels of a perfetto trace by name and by kind (``flint_jax.bench.kernel_stats``' rules:
  complete events on threads named "Stream...")."""
  from flint_jax.bench import busy_time
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  streams = {(ev.get("pid"), ev.get("tid")) for ev in events
             if ev.get("ph") == "M" and ev.get("name") == "thread_name"
             and str(ev.get("args", {}).get("name", "")).startswith("Stream")}
  by_name, spans = {}, []
  for ev in events:
    if ev.get("ph") == "X" and (ev.get("pid"), ev.get("tid")) in streams:
      dur, ts = float(ev.get("dur", 0.0)), float(ev.get("ts", 0.0))
      spans.append((ts, dur))
      rec = by_name.setdefault(str(ev.get("name", "?")), [0, 0.0])
      rec[0] += 1
      rec[1] += dur
  total = sum(d for _, d in spans)
  kinds: dict = {}
  families: dict = {}   # XLA names each layer's fusions apart (loop_add_fusion_12, _13, ...)
  for name, (c, d) in by_name.items():
    for table, key in ((kinds, _kind(name)), (families, re.sub(r"([._]\d+)+$", "", name))):
      rec = table.setdefault(key, [0, 0.0])
      rec[0] += c
      rec[1] += d
  span = (max(s + d for s, d in spans) - min(s for s, _ in spans)) if spans else 0.0
  def table(d, n):
    ranked = sorted(d.items(), key=lambda kv: -kv[1][1])[:n]
    return [[k, c, round(t / 1e3, 3), round(100 * t / max(total, 1e-9), 1)]
            for k, (c, t) in ranked]

  return {
      "kernels": len(spans), "kernel_ms": total / 1e3, "busy_ms": busy_time(spans) / 1e3,
      "span_ms": span / 1e3, "distinct_names": len(by_name),
      "by_kind": table(kinds, len(kinds)), "by_family": table(families, top),
      "by_name": table(by_name, top)}


def stage_profile(model, cfg, fmt, small, options, hlo):
  """One 1x8K prefill traced after its warm-up; the untraced wall time of the same call."""
  rows = case_rows(cfg, "1x8K", small)
  cl = cache_length(cfg, rows)
  fn = lambda m, r, c: prefill.prefill(m, r, c, options=options)   # noqa: E731
  _, first, per = run_prefill(fn, model, rows, cl, 2)
  logdir = tempfile.mkdtemp(prefix="flint-prefill-trace-")
  t0 = time.perf_counter()
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    logits, cache = fn(model, rows, cl)
    jax.block_until_ready(logits)
  traced = (time.perf_counter() - t0) * 1e3
  del cache
  files = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
  r = {"fmt": fmt, "case": "1x8K", "first_s": first, "wall_ms_untraced": min(per),
       "wall_ms_traced": traced}
  if files:
    with gzip.open(files[0]) as f:
      r.update(profile_summary(json.load(f)))
    if out_dir() and os.path.getsize(files[0]) < 60e6:
      dst = os.path.join(out_dir(), f"trace_{fmt}_1x8K.json.gz")
      shutil.copy(files[0], dst)
      r["trace_file"] = dst
  else:
    r["error"] = f"no perfetto trace under {logdir}"
  if hlo:
    r.update(dump_hlo(model, rows, cl, options, fmt))
  RESULTS["profile"].append(r)
  log({k: v for k, v in r.items() if k not in ("by_name", "by_kind", "by_family")})
  print_profile(r)


def dump_hlo(model, rows, cl, options, fmt) -> dict:
  """The 1x8K chunk step's optimized HLO (gzipped next to --out) and memory analysis."""
  from flint_jax.cache import init_cache
  try:
    t = len(rows[0])
    fn = prefill.chunk_fn(model, "last", options)
    cache = init_cache(model.config, 1, cl, model.dtype)
    compiled = fn.lower(model.leaves, jnp.zeros((1, t), jnp.int32), cache,
                        jnp.asarray([t], jnp.int32)).compile()
    out = {}
    ma = compiled.memory_analysis()
    if ma is not None:
      out["memory_analysis"] = {k: int(getattr(ma, k)) for k in (
          "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes") if hasattr(ma, k)}
    if out_dir():
      path = os.path.join(out_dir(), f"hlo_{fmt}_1x8K.txt.gz")
      with gzip.open(path, "wt") as f:
        f.write(compiled.as_text())
      out["hlo_file"] = path
    del cache
    return out
  except Exception:
    return {"hlo_error": traceback.format_exc()[-1500:]}


def print_profile(r):
  if "by_kind" not in r:
    return
  print(f"\n{r['fmt']} 1x8K: {r['kernels']} kernels, kernel time {r['kernel_ms']:.1f} ms "
        f"(busy {r['busy_ms']:.1f}, span {r['span_ms']:.1f}), wall untraced "
        f"{r['wall_ms_untraced']:.1f} ms, traced {r['wall_ms_traced']:.1f} ms")
  print("| kind | launches | ms | share |\n|---|---|---|---|")
  for k, c, ms, sh in r["by_kind"]:
    print(f"| {k} | {c} | {ms:.2f} | {sh:.1f}% |")
  for key, title in (("by_family", "kernel family (name less its numeric suffix)"),
                     ("by_name", "kernel")):
    print(f"| {title} | launches | ms | share |\n|---|---|---|---|")
    for n, c, ms, sh in r[key]:
      print(f"| {n[:90]} | {c} | {ms:.2f} | {sh:.1f}% |")


def case_options(extra: str) -> dict:
  """"attention=cudnn,router=bf16x6" (a case's text after @) -> PrefillOptions fields."""
  return dict(kv.split("=", 1) for kv in extra.split(",") if kv)


def changed_options(options) -> str:
  """The PrefillOptions fields that differ from the defaults, as "key=value,..." ("" if none)."""
  default = prefill.PrefillOptions()
  return ",".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options)
                  if getattr(options, f.name) != getattr(default, f.name))


def run_case(model, cfg, fmt, name, small, reps, options, budget):
  rows = case_rows(cfg, name, small)
  lengths = [len(r) for r in rows]
  n_reps = min(reps, CASES[name][1])
  if not fits(f"{fmt} {name}", COMPILE_S + CASES[name][2] * (1 + n_reps), budget):
    return None
  cl = cache_length(cfg, rows)
  chunk = prefill.chunk_length(len(rows), max(lengths))
  fn = lambda m, r, c: prefill.prefill(m, r, c, options=options)   # noqa: E731
  mem0 = memory()
  try:
    logits, first, per = run_prefill(fn, model, rows, cl, n_reps)
  except Exception:
    RESULTS["model"].append({"fmt": fmt, "case": name, "error": traceback.format_exc()[-1500:]})
    log(RESULTS["model"][-1])
    return None
  mem1 = memory()
  fl = prefill_flops(cfg, lengths)
  med = statistics.median(per)
  cache_b = kv_cache_bytes(cfg, len(rows), cl)["total"]
  r = {"fmt": fmt, "case": name, "path": "pallas", "options": changed_options(options), "chunk": [len(rows), chunk],
       "cache_length": cl, "ms": med, "runs_ms": per, "first_s": first,
       "floor_ms": fl["floor_ms"], "pct_of_floor": 100 * fl["floor_ms"] / med,
       "tokens_per_s": sum(lengths) / med * 1e3,
       "finite": bool(np.isfinite(np.asarray(logits)).all()),
       "memory": {"weights": sum(a.size * a.dtype.itemsize for a in model.leaves),
                  "cache": cache_b, "in_use_before": mem0.get("bytes_in_use"),
                  "peak_before": mem0.get("peak_bytes_in_use"),
                  "peak_after": mem1.get("peak_bytes_in_use"),
                  "limit": mem1.get("bytes_limit")}}
  # The device's peak is monotonic: it bounds this case's activations only when it grew here.
  if mem1.get("peak_bytes_in_use", 0) > mem0.get("peak_bytes_in_use", 0):
    r["memory"]["activations_est"] = (mem1["peak_bytes_in_use"] - mem0["bytes_in_use"]
                                      - cache_b)
  RESULTS["model"].append(r)
  log(r)
  return rows, cl, logits


def stage_model(cfg, small, fmt, cases, stages, a):
  """Builds one format's model, then its profile and cases."""
  quant = fmt == "nvfp4"
  want_profile = "profile" in stages
  if not cases and not want_profile:
    return
  if not fits(f"{fmt} model build", 20 + (COMPILE_S + 15 if want_profile else 0), a.budget):
    RESULTS["skipped"] += [f"{fmt} {c}" for c in cases]
    return
  t0 = time.perf_counter()
  model = build_model(cfg, quant)
  log(f"{fmt} model built in {time.perf_counter() - t0:.1f}s; memory {memory()}")
  options = prefill.PrefillOptions(nvfp4_experts=a.nvfp4_experts, router=a.router,
                                   attention=a.attention)
  if want_profile:
    try:
      stage_profile(model, cfg, fmt, small, options, a.hlo)
    except Exception:
      RESULTS.setdefault("errors", []).append({"stage": f"profile {fmt}",
                                               "trace": traceback.format_exc()[-3000:]})
      log(f"profile {fmt} failed:\n{traceback.format_exc()[-3000:]}")
  done = {}
  for name in cases:
    base, _, extra = name.partition("@")
    opts = dataclasses.replace(options, **case_options(extra))
    out = run_case(model, cfg, fmt, base, small, a.reps, opts, a.budget)
    if out and not extra:
      done[name] = out
  if a.xla and "1x8K" in done and fits(f"{fmt} xla 1x8K", 75, a.budget):
    rows, cl, logits_p = done["1x8K"]
    fn = lambda m, r, c: decode.prefill(m, r, c, 256)   # noqa: E731
    logits_x, first, per = run_prefill(fn, reference_model(model), rows, cl, 1)
    fl = prefill_flops(cfg, [len(rows[0])])
    r = {"fmt": fmt, "case": "1x8K", "path": "xla (256-token chunks)", "ms": per[0],
         "first_s": first, "tokens_per_s": len(rows[0]) / per[0] * 1e3,
         "floor_ms": fl["floor_ms"], "pct_of_floor": 100 * fl["floor_ms"] / per[0],
         "pallas_vs_xla_logits": errors(logits_p, logits_x)}
    RESULTS["model"].append(r)
    log(r)
  del model, done
  gc.collect()


def stage_tests(a):
  """The three prefill test files, compiled on the GPU (pytest -n 4 in a subprocess, run before
  this process touches the GPU; its log next to --out). ~3-4 min (estimate): its own call."""
  files = ["tests/test_pallas_grouped_matmul.py", "tests/test_pallas_prefill_attention.py",
           "tests/test_prefill.py"]
  log_path = os.path.join(out_dir() or tempfile.gettempdir(), "prefill_tests.log")
  os.makedirs(os.path.dirname(log_path), exist_ok=True)
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.2", JAX_PLATFORMS="cuda")
  t0 = time.perf_counter()
  with open(log_path, "w") as f:
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "4", *files], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                         timeout=a.tests_timeout)
  tail = open(log_path).read().splitlines()[-15:]
  RESULTS["tests"] = {"rc": rc, "s": time.perf_counter() - t0, "log": log_path, "tail": tail}
  log(RESULTS["tests"])


def print_table():
  print("\n| format | prompt | path | chunk | median ms | first call s | floor ms | % of floor | "
        "tok/s | peak GiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in RESULTS["model"]:
    if "ms" in r:
      peak = (r.get("memory") or {}).get("peak_after")
      print(f"| {r['fmt']} | {r['case']} | {r['path']}{' ' + r['options'] if r.get('options') else ''} | {r.get('chunk', '')} | {r['ms']:.1f} | "
            f"{r['first_s']:.1f} | {r['floor_ms']:.1f} | {r['pct_of_floor']:.1f}% | "
            f"{r.get('tokens_per_s', 0):.0f} | {peak / 2**30 if peak else 0:.1f} |")
  gib = lambda v: f"{v / 2**30:.1f} GiB" if v is not None else "?"   # noqa: E731
  for r in RESULTS["model"]:
    mem = r.get("memory")
    if mem:
      print(f"memory {r['fmt']} {r['case']}: weights {gib(mem['weights'])}, cache "
            f"{gib(mem['cache'])}, in use before {gib(mem['in_use_before'])}, device peak "
            f"{gib(mem['peak_after'])} of {gib(mem['limit'])}, activations (peak - in use - "
            f"cache) {gib(mem.get('activations_est'))}")
  print("\n| kernel | variant | ms | TFLOP/s |")
  print("|---|---|---|---|")
  for r in RESULTS["kernels"]:
    if "ms" in r:
      rate = f"{r['tflops']:.0f}" if "tflops" in r else f"{r.get('tb_per_s', 0):.2f} TB/s"
      print(f"| {r['what']} | {r.get('variant', '')} | {r['ms']:.3f} | {rate} |")
  for r in RESULTS["check"]:
    print(f"check {r['what']}: max_err {r['max_err']:.2e} rel_l2 {r['rel_l2']:.2e} "
          f"finite {r['finite']}")
  for r in RESULTS["profile"]:
    if "kernel_ms" in r:
      print(f"profile {r['fmt']} 1x8K: kernels {r['kernel_ms']:.1f} ms of wall "
            f"{r['wall_ms_untraced']:.1f} ms untraced; by kind: "
            + ", ".join(f"{k} {ms:.1f}" for k, _, ms, _ in r["by_kind"]))
  if RESULTS["skipped"]:
    print("skipped:", RESULTS["skipped"])


def main(argv=None):
  global INTERPRET, OUT_PATH
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="JSON results path (traces, HLO, logs beside it)")
  p.add_argument("--config", default="flint", help="config preset (tiny: a CPU smoke run)")
  p.add_argument("--budget", type=float, default=420.0,
                 help="seconds: no stage or case starts that would end later (estimated)")
  p.add_argument("--reps", type=int, default=3, help="timed prefill runs per case (at most)")
  p.add_argument("--stages", nargs="+", default=["check", "kernels", "profile", "model"],
                 choices=["tests", "check", "kernels", "profile", "model"])
  p.add_argument("--cases", nargs="+", default=DEFAULT_CASES,
                 help=f"fmt:case, fmt in bf16/nvfp4, case in {sorted(CASES)}")
  p.add_argument("--nvfp4-experts", default="auto", choices=gm.NVFP4_MODES,
                 help="NVFP4 experts in the model cases: decoded in the kernels or dequantized")
  p.add_argument("--router", default=prefill.PrefillOptions.router, choices=sorted(prefill.ROUTER_PRECISIONS),
                 help="the router logits' dot in the model cases (PrefillOptions.router)")
  p.add_argument("--attention", default=prefill.PrefillOptions.attention, choices=prefill.ATTENTION,
                 help="full layers' attention in the model cases (a case's @attention=... overrides)")
  p.add_argument("--sweep", action="store_true", help="kernel variants around the defaults")
  p.add_argument("--xla", action="store_true", help="the XLA path at 1x8K and a logits check")
  p.add_argument("--hlo", action="store_true", help="dump the 1x8K chunk step's optimized HLO")
  p.add_argument("--tests-timeout", type=int, default=300)
  a = p.parse_args(argv)
  OUT_PATH = a.out
  if "tests" in a.stages:   # first: the pytest workers need the GPU memory this process takes
    try:
      stage_tests(a)
    except Exception:
      RESULTS.setdefault("errors", []).append({"stage": "tests",
                                               "trace": traceback.format_exc()[-3000:]})
      log(f"stage tests failed:\n{traceback.format_exc()[-3000:]}")
  INTERPRET = jax.default_backend() != "gpu"
  small = a.config != "flint"
  cfg = preset(a.config)
  cases: dict = {}
  for c in a.cases:
    fmt, _, name = c.partition(":")
    base, _, extra = name.partition("@")
    if fmt not in ("bf16", "nvfp4") or base not in CASES:
      p.error(f"bad case {c!r}: fmt:case[@key=value,...] with fmt bf16/nvfp4, case one of "
              f"{sorted(CASES)}")
    try:
      dataclasses.replace(prefill.PrefillOptions(), **case_options(extra))
    except (TypeError, ValueError) as e:
      p.error(f"bad case {c!r}: the options after @ must be PrefillOptions fields ({e})")
    cases.setdefault(fmt, []).append(name)
  RESULTS["env"] = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
                    "config": a.config, "interpret": INTERPRET, "argv": sys.argv[1:]}
  log(RESULTS["env"])
  for st in [s for s in a.stages if s not in ("tests", "profile", "model")]:
    try:
      if st == "check" and fits("check", 60, a.budget):
        stage_check(cfg, small)
      elif st == "kernels" and fits("kernels", 45, a.budget):
        stage_kernels(cfg, small, a.sweep)
    except Exception:
      RESULTS.setdefault("errors", []).append({"stage": st,
                                               "trace": traceback.format_exc()[-3000:]})
      log(f"stage {st} failed:\n{traceback.format_exc()[-3000:]}")
    save()
  if "profile" in a.stages or "model" in a.stages:
    for fmt in ("bf16", "nvfp4"):
      fmt_cases = cases.get(fmt, []) if "model" in a.stages else []
      if "profile" not in a.stages and not fmt_cases:
        continue
      if "profile" in a.stages and fmt not in cases and "model" in a.stages:
        continue   # profile only the formats asked for
      try:
        stage_model(cfg, small, fmt, fmt_cases, a.stages, a)
      except Exception:
        RESULTS.setdefault("errors", []).append({"stage": f"model {fmt}",
                                                 "trace": traceback.format_exc()[-3000:]})
        log(f"model {fmt} failed:\n{traceback.format_exc()[-3000:]}")
      save()
  RESULTS["total_s"] = elapsed()
  save()
  print_table()


if __name__ == "__main__":
  main()
