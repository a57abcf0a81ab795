"""Prefill on the H200: the Pallas prefill kernels checked and timed, then whole-model prefill.

    PYTHONPATH=. python3 tools/gpu_prefill.py --out $OUT/prefill.json          # H200, ~6 min
    PYTHONPATH=. JAX_PLATFORMS=cpu python3 tools/gpu_prefill.py --config tiny --out /tmp/p.json

Stages (each result is printed and the JSON rewritten as soon as it exists, so a run cut short
still reports what it finished; stages that would start after ``--budget`` seconds are skipped):

1. ``check``: the compiled kernels against their references at realistic sizes (max |err| /
   max |ref| and rel-L2): ``moe_experts`` (BF16, NVFP4 with the asm and fp8 decodes) and
   ``prefill_attention`` (full cache and ring + chunk, ragged rows).
2. ``kernels``: device time of one MoE layer's routed experts and of the attention of one layer
   at an 8K-token chunk, with TFLOP/s, beside a dense GEMM of the same FLOPs and cuDNN's causal
   attention (no sinks; bottom-right = top-left there since q = kv); ``--sweep`` tries a few
   block sizes of each (the fastest is reported).
3. ``model``: full-size random weights built on the device (``benchmarks/decode_bench.
   build_state``; NVFP4 block scales pre-scaled as ``flint_jax.load`` does on a GPU), prefill of
   1 x 8K, 8 x 2K and 1 x 32K (8K-token chunks) through ``flint_jax.prefill.prefill`` -- the
   median of ``--reps`` runs after a warm-up that compiles (its time is reported as
   ``first_s``) -- beside the compute floor (matmul + attention FLOPs at 790 TFLOP/s) and the
   XLA path (``decode.prefill``, 256-token chunks) at 8K, whose last-token logits are also
   compared with the Pallas path's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flint_jax import decode, prefill  # noqa: E402
from flint_jax.config import preset  # noqa: E402
from flint_jax.pallas import grouped_matmul as gm  # noqa: E402
from flint_jax.pallas.prefill_attention import (prefill_attention,  # noqa: E402
                                                prefill_attention_reference)

PEAK_FLOPS = 790e12   # bf16 dense, measured on the H200 (FLINT_SPEC section 9)
F32, BF = jnp.float32, jnp.bfloat16
T0 = time.perf_counter()
RESULTS: dict = {"check": [], "kernels": [], "model": [], "skipped": []}


def elapsed() -> float:
  return time.perf_counter() - T0


OUT_PATH = None


def save(path=None):
  path = path or OUT_PATH
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(RESULTS, f, indent=1, default=str)


def log(msg):
  print(f"[{elapsed():6.1f}s] {msg}", flush=True)
  save()   # the JSON holds every result printed so far


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


# ---- stages ---------------------------------------------------------------------------------

def stage_check(cfg, small):
  t = 256 if small else 2048
  for fmt, decode_kind in (("bf16", "asm"), ("nvfp4", "asm"), ("nvfp4", "fp8")):
    x, w, ids, ex = moe_inputs(cfg, t, fmt)
    out = gm.moe_experts(x, w, ids, ex, decode=decode_kind, interpret=INTERPRET)
    ref = gm.moe_experts_reference(x, w, ids, ex)
    r = {"what": f"moe_experts {fmt} decode={decode_kind} T={t}", **errors(out, ref)}
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


# The first variant is the default; ``--sweep`` (default on) tries the others too.
MOE_SWEEP = [  # (block_m, gate_up (bn, bk), down (bn, bk), warps, stages)
    (None, None, None, 8, 3), (128, None, None, 8, 3), (64, (64, 64), (128, 64), 4, 3),
    (128, (128, 64), (128, 64), 8, 4)]
ATTN_SWEEP = [(None, None, 8, 2), (16, 128, 8, 2), (8, 64, 4, 2), (32, 64, 8, 3)]  # (bq, bk, ..)


def stage_kernels(cfg, small, sweep):
  t = 512 if small else 8192
  e, d, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
  moe_flop = 2 * t * k * 3 * d * i
  if not INTERPRET:   # the dense GEMM of the same FLOPs ([T*k, D] x [D, 3I])
    a = jnp.ones((t * k, d), BF)
    bmat = jnp.ones((d, 3 * i), BF)
    ms = time_ms(jax.jit(lambda a, b: a @ b), a, bmat)
    RESULTS["kernels"].append({"what": "dense GEMM, routed-expert FLOPs", "ms": ms,
                               "tflops": moe_flop / ms / 1e9})
    log(RESULTS["kernels"][-1])
  for fmt in ("bf16", "nvfp4"):
    x, w, ids, ex = moe_inputs(cfg, t, fmt)
    best = None
    for v in (MOE_SWEEP if sweep else MOE_SWEEP[:1]):
      bm, gu, dn, nw, ns = v
      fn = jax.jit(lambda x, w, ids, ex, v=v: gm.moe_experts(
          x, w, ids, ex, block_m=v[0], gate_up_blocks=v[1], down_blocks=v[2], num_warps=v[3],
          num_stages=v[4], interpret=INTERPRET))
      try:
        ms = time_ms(fn, x, w, ids, ex, reps=3 if INTERPRET else 10)
      except Exception as exc:   # a tile that does not fit shared memory, ...
        RESULTS["kernels"].append({"what": f"moe_experts {fmt} {v}", "error": repr(exc)[:300]})
        log(RESULTS["kernels"][-1])
        continue
      r = {"what": f"moe_experts {fmt} T={t}", "variant": v, "ms": ms,
           "tflops": moe_flop / ms / 1e9}
      RESULTS["kernels"].append(r)
      log(r)
      best = r if best is None or ms < best["ms"] else best
    if best:
      RESULTS["kernels"].append({**best, "what": f"best moe_experts {fmt}"})
  h, dh = cfg.num_attention_heads, cfg.head_dim
  w_ = cfg.sliding_window
  for ring in (False, True):
    args = attn_inputs(cfg, 1, t, t, [0], [t], ring)
    pairs = t * (t + 1) // 2 if not ring else sum(min(p + 1, w_) for p in range(t))
    flop = 4 * pairs * h * dh
    best = None
    for v in (ATTN_SWEEP if sweep else ATTN_SWEEP[:1]):
      bq, bk, nw, ns = v
      fn = jax.jit(lambda *a, v=v: prefill_attention(
          *a, ring=ring, window=w_ if ring else None, block_q=v[0], block_k=v[1],
          num_warps=v[2], num_stages=v[3], interpret=INTERPRET))
      try:
        ms = time_ms(fn, *args, reps=3 if INTERPRET else 10)
      except Exception as exc:
        RESULTS["kernels"].append({"what": f"attention {'ring' if ring else 'full'} {v}",
                                   "error": repr(exc)[:300]})
        log(RESULTS["kernels"][-1])
        continue
      r = {"what": f"prefill_attention {'ring' if ring else 'full'} 1x{t}", "variant": v,
           "ms": ms, "tflops": flop / ms / 1e9}
      RESULTS["kernels"].append(r)
      log(r)
      best = r if best is None or ms < best["ms"] else best
    if best:
      RESULTS["kernels"].append({**best, "what": f"best attention {'ring' if ring else 'full'}"})
    if not INTERPRET:   # cuDNN, no sinks, q = kv = T (top-left = bottom-right causal)
      q = args[0]
      kfull = jax.random.normal(jax.random.key(9), (1, t, cfg.num_key_value_heads, dh), BF)
      try:
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn",
            local_window_size=(w_ - 1, 0) if ring else None))
        ms = time_ms(fn, q, kfull, kfull)
        RESULTS["kernels"].append({"what": f"cudnn attention {'window' if ring else 'causal'} "
                                           f"1x{t} (no sinks)", "ms": ms,
                                   "tflops": flop / ms / 1e9})
      except Exception as exc:
        RESULTS["kernels"].append({"what": "cudnn attention", "error": repr(exc)[:300]})
      log(RESULTS["kernels"][-1])


def flops(cfg, lengths) -> dict:
  """Matmul and attention FLOPs of prefilling rows of ``lengths`` tokens from position 0."""
  d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  per_tok = d * (h * hd * 2 + kv * hd * 2)
  for i in range(cfg.num_hidden_layers):
    if cfg.is_moe(i):
      per_tok += cfg.num_experts * d + 3 * d * (cfg.num_experts_per_tok * cfg.moe_intermediate_size
                                                + cfg.shared_expert_intermediate_size)
    else:
      per_tok += 3 * d * cfg.intermediate_size
  tokens = sum(lengths)
  mm = 2 * per_tok * tokens + 2 * d * cfg.vocab_size * len(lengths)
  w = cfg.sliding_window
  full = sum(n * (n + 1) // 2 for n in lengths)
  slide = sum(sum(min(p + 1, w) for p in range(n)) for n in lengths)
  attn = 4 * h * hd * (len(cfg.full_layers) * full + len(cfg.sliding_layers) * slide)
  return {"matmul": mm, "attention": attn, "floor_ms": (mm + attn) / PEAK_FLOPS * 1e3}


def build_model(cfg, quant):
  from decode_bench import build_state   # benchmarks/decode_bench.py
  from flint_jax.engine import Flint
  from flint_jax.nvfp4 import prescale_state
  graphdef, state = build_state(cfg, quant)
  if quant:
    state = prescale_state(state)
  jax.block_until_ready(jax.tree.leaves(state))
  return Flint(config=cfg, graphdef=graphdef, state=state, dtype=BF, quant=quant,
               kernels="pallas", max_length=cfg.max_position_embeddings)


def run_prefill(fn, model, rows, cache_len, reps):
  t0 = time.perf_counter()
  logits, cache = fn(model, rows, cache_len)
  jax.block_until_ready(logits)
  first = time.perf_counter() - t0
  del cache
  per = []
  for _ in range(reps):
    t0 = time.perf_counter()
    logits, cache = fn(model, rows, cache_len)
    jax.block_until_ready(logits)
    per.append((time.perf_counter() - t0) * 1e3)
    del cache
  return logits, first, per


def stage_model(cfg, small, fmt, budget, reps, xla):
  quant = fmt == "nvfp4"
  if elapsed() > budget:
    RESULTS["skipped"].append(f"{fmt} model")
    log(f"skipped the {fmt} model (budget)")
    return
  t0 = time.perf_counter()
  model = build_model(cfg, quant)
  log(f"{fmt} model built in {time.perf_counter() - t0:.1f}s")
  k8 = 256 if small else 8192
  # (name, row lengths, chunk T): two compiled chunk shapes, [1, 8K] (also 4 chunks of 32K) and
  # [8, 2K]
  cases = [("1x8K", [k8], k8), ("1x32K", [4 * k8], k8), ("8x2K", [k8 // 4] * 8, k8 // 4)]
  gen = np.random.default_rng(0)
  pallas_8k = None
  for name, lengths, chunk in cases:
    if elapsed() > budget:
      RESULTS["skipped"].append(f"{fmt} {name}")
      log(f"skipped {fmt} {name} (budget)")
      continue
    rows = [gen.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    cache_len = decode.bucket_length(max(lengths) + 256, cfg.max_position_embeddings)
    fn = lambda m, r, c, chunk=chunk: prefill.prefill(m, r, c, chunk)   # noqa: E731
    try:
      logits, first, per = run_prefill(fn, model, rows, cache_len, reps)
    except Exception:
      RESULTS["model"].append({"fmt": fmt, "case": name, "error": traceback.format_exc()[-1500:]})
      log(RESULTS["model"][-1])
      continue
    fl = flops(cfg, lengths)
    med = statistics.median(per)
    r = {"fmt": fmt, "case": name, "path": "pallas", "chunk": [len(rows), chunk],
         "ms": med, "runs_ms": per, "first_s": first, "floor_ms": fl["floor_ms"],
         "pct_of_floor": 100 * fl["floor_ms"] / med, "tokens_per_s": sum(lengths) / med * 1e3,
         "finite": bool(np.isfinite(np.asarray(logits)).all())}
    RESULTS["model"].append(r)
    log(r)
    if name == "1x8K":
      pallas_8k = (rows, cache_len, logits)
  if xla and pallas_8k is not None and elapsed() < budget:
    rows, cache_len, logits_p = pallas_8k
    fn = lambda m, r, c: decode.prefill(m, r, c, 256)   # noqa: E731
    logits_x, first, per = run_prefill(fn, model, rows, cache_len, 1)
    fl = flops(cfg, [len(rows[0])])
    r = {"fmt": fmt, "case": "1x8K", "path": "xla (256-token chunks)", "ms": per[0],
         "first_s": first, "tokens_per_s": len(rows[0]) / per[0] * 1e3,
         "floor_ms": fl["floor_ms"], "pct_of_floor": 100 * fl["floor_ms"] / per[0],
         "pallas_vs_xla_logits": errors(logits_p, logits_x)}
    RESULTS["model"].append(r)
    log(r)
  elif xla:
    RESULTS["skipped"].append(f"{fmt} xla 1x8K")
  del model


def print_table():
  print("\n| format | prompt | path | median ms | first call s | floor ms | % of floor | tok/s |")
  print("|---|---|---|---|---|---|---|---|")
  for r in RESULTS["model"]:
    if "ms" in r:
      print(f"| {r['fmt']} | {r['case']} | {r['path']} | {r['ms']:.1f} | {r['first_s']:.1f} | "
            f"{r['floor_ms']:.1f} | {r['pct_of_floor']:.1f}% | "
            f"{r.get('tokens_per_s', 0):.0f} |")
  print("\n| kernel | variant | ms | TFLOP/s |")
  print("|---|---|---|---|")
  for r in RESULTS["kernels"]:
    if "ms" in r:
      print(f"| {r['what']} | {r.get('variant', '')} | {r['ms']:.3f} | {r['tflops']:.0f} |")
  for r in RESULTS["check"]:
    print(f"check {r['what']}: max_err {r['max_err']:.2e} rel_l2 {r['rel_l2']:.2e} "
          f"finite {r['finite']}")
  if RESULTS["skipped"]:
    print("skipped:", RESULTS["skipped"])


INTERPRET = False


def main(argv=None):
  global INTERPRET, OUT_PATH
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="JSON results path")
  p.add_argument("--config", default="flint", help="config preset (tiny: a CPU smoke run)")
  p.add_argument("--budget", type=float, default=330.0,
                 help="seconds after which no new stage starts")
  p.add_argument("--reps", type=int, default=3, help="timed prefill runs per case")
  p.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
  p.add_argument("--stages", nargs="+", default=["check", "kernels", "model"])
  p.add_argument("--no-sweep", dest="sweep", action="store_false")
  p.add_argument("--no-xla", dest="xla", action="store_false")
  a = p.parse_args(argv)
  OUT_PATH = a.out
  INTERPRET = jax.default_backend() != "gpu"
  small = a.config != "flint"
  cfg = preset(a.config)
  RESULTS["env"] = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
                    "config": a.config, "interpret": INTERPRET}
  log(RESULTS["env"])
  for st in a.stages:
    try:
      if st == "check":
        stage_check(cfg, small)
      elif st == "kernels":
        stage_kernels(cfg, small, a.sweep)
      elif st == "model":
        for fmt in a.formats:
          stage_model(cfg, small, fmt, a.budget, a.reps, a.xla)
          save(a.out)
    except Exception:
      RESULTS.setdefault("errors", []).append({"stage": st,
                                               "trace": traceback.format_exc()[-3000:]})
      log(f"stage {st} failed:\n{traceback.format_exc()[-3000:]}")
    save(a.out)
  RESULTS["total_s"] = elapsed()
  save(a.out)
  print_table()


if __name__ == "__main__":
  main()
