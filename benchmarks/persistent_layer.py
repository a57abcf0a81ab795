"""Issue #43: one persistent kernel for a batch-1 BF16 MoE layer against today's kernel chain.

Run on the GPU (one call, ~2-4 min with compiles):
  source tools/gpu_env.sh; JAX_PLATFORMS=cuda python3 benchmarks/persistent_layer.py \
      --out $OUT/persistent.json
CPU smoke (interpret mode, tiny shapes): ``python benchmarks/persistent_layer.py --config tiny``.

What it measures, at Flint size (D 2048, E 256, top-6, I 512, shared I 1024, q|k|v 5120 rows),
random weights (std 0.02, router fp32, norm weights 1 + 0.02 N(0, 1)), batch 1, BF16:

- ``chain``: the kernels ``fast_decode`` runs for this part of a MoE layer at batch 1 BF16
  (``decode_plan(False, 1)``: ``add_rms_norm_router`` -> ``moe_decode_routed`` (gate_up with
  2 K slices on the counters, down) -> ``norm_qkv`` of the next layer, every kernel with the
  early PDL trigger), called as ``fast_decode`` calls them;
- ``persistent``, ``persistent_b8``, ``persistent_nohold``:
  ``pallas.persistent_layer.persistent_moe_layer`` (one kernel, G = the SM count): the default
  tiles; 8-row gate_up and q|k|v groups; without ``hold_prefetch`` (``PERSISTENT``; a variant
  not compiled by ``--budget`` seconds is skipped).

Correctness first (one layer, against ``persistent_moe_layer_reference``: rel-L2 of s and q|k|v,
finiteness, routing equal), then timing: each variant is one jitted function of ``--layers`` (49)
layers back to back, h flowing from layer to layer (a, the attention output, fixed), cycling
through ``--copies`` (4) distinct weight copies so that one layer's weights (~70 MB touched) are
not in the 60 MB L2 when it runs again. A window = ``--calls`` calls back to back, then a sync;
device-side time per layer = window wall / (calls x layers) (dispatch is asynchronous and
overlaps; one sync per window adds <= ~80 us / (calls x layers)). Windows alternate between the
variants; median (and min) of ``--windows`` windows each.

Safety: the persistent kernel deadlocks if its programs are not all resident. The measurement
runs in a child process under a ``--timeout``; partial results are written to --out after every
phase, and a timeout is recorded there (``error``) instead of hanging the device call.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

CONFIGS = {
    # d, n_exp, inter, inter_s, n_qkv (q|k|v rows), top_k
    "flint": dict(d=2048, e=256, i=512, i_s=1024, n=(4096, 512, 512), k=6),
    "tiny": dict(d=64, e=16, i=16, i_s=32, n=(64, 16, 16), k=4),
}


# the persistent kernel's variants: persistent_moe_layer tuning arguments
PERSISTENT = {
    "persistent": {},                                   # 8 warps, 4-row groups: 171 registers
    "persistent_b8": dict(block_gu=8, block_qkv=8),     # 2x the bytes per load: 242 registers
    "persistent_nohold": dict(hold_prefetch=False),     # same SASS order (ptxas drops the movs)
}


def _log(*a):
  print(*a, flush=True)


def make_weights(cfg, key, std=0.02):
  """One layer's weights (the kernels' layouts; q|k|v both fused and separate)."""
  import jax
  import jax.numpy as jnp
  d, e, i, i_s, k = cfg["d"], cfg["e"], cfg["i"], cfg["i_s"], cfg["k"]
  n = sum(cfg["n"])
  ks = iter(jax.random.split(key, 10))
  bf = jnp.bfloat16
  def rn(shape, dt=bf):
    return (std * jax.random.normal(next(ks), shape, jnp.float32)).astype(dt)
  wqkv = rn((n, d))
  nq, nk, _ = cfg["n"]
  return dict(
      w_post=(1.0 + rn((d,), jnp.float32)).astype(bf), router=rn((e, d), jnp.float32),
      experts=dict(gate_up_proj=rn((e, 2 * i, d)), down_proj=rn((e, d, i))),
      shared=dict(gate_proj=rn((i_s, d)), up_proj=rn((i_s, d)), down_proj=rn((d, i_s))),
      w_in=(1.0 + rn((d,), jnp.float32)).astype(bf), wqkv=wqkv,
      qkv=(wqkv[:nq], wqkv[nq:nq + nk], wqkv[nq + nk:]))


def bytes_touched(cfg):
  """Weight bytes one layer reads (router fp32, 6 routed + shared experts, q|k|v)."""
  d, e, i, i_s, k = cfg["d"], cfg["e"], cfg["i"], cfg["i_s"], cfg["k"]
  return 4 * e * d + 2 * (k * 3 * i * d + 3 * i_s * d + sum(cfg["n"]) * d)


def build_variants(cfg, layers, programs, interpret):
  """{name: jitted f(ws, a, h, counters) -> (h, qkv, counters)} over ``layers`` layers.

  The weights ``ws`` (a list of copies, layer l uses copy l % len(ws)) are arguments, never
  closed over: as constants, 4 copies (6.6 GB) keep XLA hashing and compiling for minutes.
  """
  import jax
  import jax.numpy as jnp
  from flint_jax import fast_decode
  from flint_jax.pallas.add_rms_norm_router import add_rms_norm_router
  from flint_jax.pallas.moe import moe_decode_routed
  from flint_jax.pallas.norm_qkv import norm_qkv
  from flint_jax.pallas.persistent_layer import persistent_moe_layer
  plan = fast_decode.decode_plan(False, 1)
  moe_plan = plan.moe
  fit = fast_decode._fit_split   # pylint: disable=protected-access  (as the step does)
  gsk = fit(moe_plan.gate_up_split_k, cfg["d"], False)
  if gsk != moe_plan.gate_up_split_k:
    import dataclasses
    moe_plan = dataclasses.replace(moe_plan, gate_up_split_k=gsk)
  kw = dict(interpret=interpret, early_trigger=plan.early_trigger)
  k = cfg["k"]

  def chain(ws, a, h, cnt):
    qkv = None
    for l in range(layers):
      w = ws[l % len(ws)]
      s1, x, logits = add_rms_norm_router(h, a, w["w_post"], w["router"], **kw)
      extra = dict(gate_up_counter=cnt) if moe_plan.gate_up_split_k > 1 else {}
      y, route, *c = moe_decode_routed(x, logits, w["experts"], w["shared"], top_k=k,
                                       plan=moe_plan, **extra, **kw)
      cnt = c[0] if c else cnt
      h, qkv = norm_qkv(s1, w["qkv"], w["w_in"], y=y, top_logits=route.logits, **kw)
    return h, jnp.concatenate(qkv, axis=-1), cnt

  def persistent(tuning):
    def f(ws, a, h, cnt):
      qkv = None
      for l in range(layers):
        w = ws[l % len(ws)]
        h, qkv, _, _, cnt = persistent_moe_layer(
            a, h, w["w_post"], w["router"], w["experts"], w["shared"], w["w_in"], w["wqkv"],
            cnt, top_k=k, programs=programs, interpret=interpret, **tuning)
      return h, qkv, cnt
    return f

  return {"chain": jax.jit(chain), **{n: jax.jit(persistent(t)) for n, t in PERSISTENT.items()}}


STAGES = ("A: norm + router", "B: wait for the routing", "C: gate_up", "D: down + combine",
          "E0: wait for s", "E: norm + q|k|v")


def stage_breakdown(PL, a, h, wargs, cfg, programs, interpret):  # noqa: N803
  """One call of the default persistent kernel with ``timestamps``: per stage, the median and
  max over programs of its duration, and the kernel's span (first start to last end), in us."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  runs = []
  for _ in range(3):                      # the last of 3 (warm caches, as in the timed loop)
    *_, st = PL.persistent_moe_layer(a, h, *wargs, jnp.zeros((PL.N_COUNTERS,), jnp.int32),
                                     top_k=cfg["k"], programs=programs, timestamps=True,
                                     interpret=interpret)
    runs.append(np.asarray(jax.device_get(st)).astype(np.uint32))
  st = runs[-1]
  rel = (st - st[:, :1].min()).astype(np.int64)   # mod 2^32 ns, from the earliest start
  d = np.diff(rel[:, :7], axis=1) / 1e3
  out = {name: [round(float(np.median(d[:, i])), 3), round(float(d[:, i].max()), 3)]
         for i, name in enumerate(STAGES)}
  out["span"] = round(float((rel[:, 6].max() - rel[:, 0].min()) / 1e3), 3)
  out["start_skew"] = round(float((rel[:, 0].max() - rel[:, 0].min()) / 1e3), 3)
  return out


def child(args):
  # a hang prints every thread's Python stack (compile or kernel?) before the parent's timeout
  faulthandler.dump_traceback_later(max(args.timeout - 10, 5), exit=False)
  import jax
  import jax.numpy as jnp
  from flint_jax.cache import COUNTER_ENTRIES
  from flint_jax.pallas import persistent_layer as PL
  res = dict(config=args.config, backend=jax.default_backend(),
             device=str(jax.devices()[0].device_kind), layers=args.layers, copies=args.copies,
             calls=args.calls, windows=args.windows, phase="start")

  def save(phase):
    res["phase"] = phase
    if args.out:
      with open(args.out, "w") as f:
        json.dump(res, f, indent=1)

  t0 = time.perf_counter()
  cfg = CONFIGS[args.config]
  interpret = jax.default_backend() == "cpu"
  programs = args.programs or min(132, getattr(jax.devices()[0], "core_count", 0) or 132)
  if args.config == "tiny":
    programs = min(programs, 4)
  res["programs"] = programs
  keys = jax.random.split(jax.random.key(0), args.copies + 1)
  make = jax.jit(lambda kk: make_weights(cfg, kk))
  weights = [make(kk) for kk in keys[:args.copies]]
  d = cfg["d"]
  a = (0.1 * jax.random.normal(keys[-1], (1, d), jnp.float32)).astype(jnp.bfloat16)
  h = jax.random.normal(jax.random.fold_in(keys[-1], 1), (1, d), jnp.float32).astype(jnp.bfloat16)
  jax.block_until_ready(weights)
  _log(f"[{time.perf_counter() - t0:.0f}s] weights: {args.copies} copies, "
       f"{bytes_touched(cfg) / 1e6:.1f} MB touched per layer, G = {programs} programs")

  # ---- correctness: one layer, copy 0
  w = weights[0]
  wargs = (w["w_post"], w["router"], w["experts"], w["shared"], w["w_in"], w["wqkv"])
  ref = jax.jit(lambda a, h, wargs: PL.persistent_moe_layer_reference(
      a, h, *wargs, top_k=cfg["k"]))(a, h, wargs)
  def rel(o, r):
    o, r = o.astype(jnp.float32).ravel(), r.astype(jnp.float32).ravel()
    return float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r))
  zero16 = jnp.zeros((PL.N_COUNTERS,), jnp.int32)
  checks = {}
  if "chain" in args.variants:   # the chain on the same layer: the same contract
    one = build_variants(cfg, 1, programs, interpret)["chain"]
    c0 = jnp.zeros((COUNTER_ENTRIES,), jnp.int32)
    _log(f"[{time.perf_counter() - t0:.0f}s] chain: compiling one layer")
    one = one.lower([w], a, h, c0).compile()
    _log(f"[{time.perf_counter() - t0:.0f}s] chain: compiled; one call")
    cs, cq, _ = jax.block_until_ready(one([w], a, h, c0))
    checks["chain"] = dict(rel_l2_s=rel(cs, ref[0]), rel_l2_qkv=rel(cq, ref[1]))
    _log(f"[{time.perf_counter() - t0:.0f}s] chain: {checks['chain']}")
  for name, tuning in PERSISTENT.items():
    if name not in args.variants:
      continue
    if time.perf_counter() - t0 > args.budget:
      _log(f"    {name}: skipped (over --budget)")
      args.variants.remove(name)
      continue
    _log(f"[{time.perf_counter() - t0:.0f}s] {name}: compile + one call (a hang here = not all "
         "programs resident)")
    try:
      out = PL.persistent_moe_layer(a, h, *wargs, zero16, top_k=cfg["k"], programs=programs,
                                    interpret=interpret, **tuning)
      out = jax.block_until_ready(out)
    except Exception as e:  # pylint: disable=broad-except  (a variant XLA's Triton rejects)
      checks[name] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
      _log(f"    {name} FAILED: {checks[name]['error'][:500]}")
      args.variants.remove(name)
      res["correctness"] = checks
      save("correctness")
      continue
    checks[name] = dict(
        rel_l2_s=rel(out[0], ref[0]), rel_l2_qkv=rel(out[1], ref[1]),
        finite=bool(jnp.isfinite(out[0].astype(jnp.float32)).all()
                    & jnp.isfinite(out[1].astype(jnp.float32)).all()),
        routing_equal=bool((out[2] == ref[2]).all()),
        counters_zero=bool((out[4] == 0).all()))
    out2 = jax.block_until_ready(PL.persistent_moe_layer(   # again, on the returned counters
        a, h, *wargs, out[4], top_k=cfg["k"], programs=programs, interpret=interpret,
        **tuning))
    checks[name]["second_call_equal"] = bool((out2[0] == out[0]).all() & (out2[1] == out[1]).all())
    _log(f"    {checks[name]}")
    res["correctness"] = checks
    save("correctness")

  # ---- timing
  cnt_len = {"chain": COUNTER_ENTRIES}
  fns = build_variants(cfg, args.layers, programs, interpret)
  fns = {n: f for n, f in fns.items() if n in args.variants}
  state = {}
  final_h = {}
  for name, f in fns.items():
    if name != "chain" and time.perf_counter() - t0 > args.budget:
      _log(f"    {name}: not timed (over --budget)")
      continue
    t = time.perf_counter()
    c = jnp.zeros((cnt_len.get(name, PL.N_COUNTERS),), jnp.int32)
    try:
      compiled = f.lower(weights, a, h, c).compile()
      out = jax.block_until_ready(compiled(weights, a, h, c))      # warm-up
    except Exception as e:  # pylint: disable=broad-except
      res.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:2000]}"
      _log(f"    {name} FAILED: {res['errors'][name][:500]}")
      continue
    state[name] = (compiled, out[2])
    res.setdefault("compile_s", {})[name] = time.perf_counter() - t
    final_h[name] = out[0]
    _log(f"[{time.perf_counter() - t0:.0f}s] {name}: compiled + warm in "
         f"{time.perf_counter() - t:.1f}s")
  if "chain" in final_h:   # informational: 49 layers can flip a near-tied routing
    res["rel_l2_final_h_vs_chain"] = {n: rel(v, final_h["chain"]) for n, v in final_h.items()}
  save("compiled")
  per_layer = {n: [] for n in state}
  for _ in range(args.windows):
    for name, (compiled, cnt) in state.items():
      hh = h
      ws = time.perf_counter()
      for _ in range(args.calls):
        hh, _, cnt = compiled(weights, a, hh, cnt)
      jax.block_until_ready((hh, cnt))
      per_layer[name].append((time.perf_counter() - ws) / (args.calls * args.layers))
      state[name] = (compiled, cnt)
  # ---- where the time goes: one call with per-program %globaltimer stamps (ns)
  if "persistent" in state and not interpret:     # (interpret mode has no clock)
    try:
      res["stages_us"] = stage_breakdown(PL, a, h, wargs, cfg, programs, interpret)
      _log(f"    stages (us; median / max over programs): {res['stages_us']}")
    except Exception as e:  # pylint: disable=broad-except
      res.setdefault("errors", {})["timestamps"] = f"{type(e).__name__}: {str(e)[:2000]}"
  nbytes = bytes_touched(cfg)
  rows = {}
  for name, ts in per_layer.items():
    med = statistics.median(ts)
    rows[name] = dict(us_per_layer_median=1e6 * med, us_per_layer_min=1e6 * min(ts),
                      us_per_layer_windows=[1e6 * t for t in ts], tb_s=nbytes / med / 1e12)
  res["timing"] = rows
  if "chain" in rows:
    for name in rows:
      if name != "chain":
        rows[name]["speedup_vs_chain"] = (rows["chain"]["us_per_layer_median"]
                                          / rows[name]["us_per_layer_median"])
    best = max((n for n in rows if n != "chain"), default=None,
               key=lambda n: rows[n]["speedup_vs_chain"])
    if best:
      sp = rows[best]["speedup_vs_chain"]
      res["decision"] = dict(best=best, speedup=sp, bar=1.25,
                             verdict="n/a: interpret mode" if interpret else
                             "meets the >= 25% bar" if sp >= 1.25 else
                             "below the 25% bar: blocked, with these measurements")
  save("done")
  _log(f"\n{'variant':<20} {'us/layer med':>12} {'min':>8} {'TB/s':>6} {'x chain':>8}")
  for name, r in rows.items():
    _log(f"{name:<20} {r['us_per_layer_median']:>12.2f} {r['us_per_layer_min']:>8.2f} "
         f"{r['tb_s']:>6.2f} {r.get('speedup_vs_chain', 1.0):>8.3f}")
  if "decision" in res:
    _log(f"decision: {res['decision']}")
  if interpret:
    res["note"] = "interpret mode on the CPU: the timings say nothing about the GPU"
    _log(res["note"])
    save("done")
  _log(f"[{time.perf_counter() - t0:.0f}s] done ({nbytes / 1e6:.1f} MB of weights per layer)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="JSON file for the results")
  p.add_argument("--config", choices=sorted(CONFIGS), default="flint")
  p.add_argument("--layers", type=int, default=None, help="layers per call (49; tiny: 2)")
  p.add_argument("--copies", type=int, default=None, help="distinct weight copies (4; tiny: 2)")
  p.add_argument("--calls", type=int, default=3, help="calls per timing window")
  p.add_argument("--windows", type=int, default=None, help="windows per variant (7; tiny: 2)")
  p.add_argument("--programs", type=int, default=0, help="G (default: the SM count, <= 132)")
  p.add_argument("--variants", default="chain," + ",".join(PERSISTENT))
  p.add_argument("--budget", type=float, default=200.0, help="seconds after which no further "
                 "persistent variant is compiled")
  p.add_argument("--timeout", type=float, default=360.0, help="seconds before the child is "
                 "killed (a deadlock: not all programs resident)")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  tiny = args.config == "tiny"
  args.layers = args.layers or (2 if tiny else 49)
  args.copies = args.copies or (2 if tiny else 4)
  args.windows = args.windows or (2 if tiny else 7)
  args.variants = args.variants.split(",")
  if tiny:
    args.calls = min(args.calls, 1)
  if args.child:
    return child(args)
  # the parent only watches: a deadlocked kernel cannot hang the device call
  cmd = [sys.executable, os.path.abspath(__file__), "--child", *(argv or sys.argv[1:])]
  try:
    rc = subprocess.run(cmd, timeout=args.timeout, check=False).returncode
  except subprocess.TimeoutExpired:
    rc = "timeout"
  if rc != 0:
    res = {}
    if args.out and os.path.exists(args.out):
      with open(args.out) as f:
        res = json.load(f)
    res["error"] = (f"child timed out after {args.timeout:.0f}s in phase "
                    f"{res.get('phase', 'start')!r} (a hang: not all programs resident?)"
                    if rc == "timeout" else f"child exited with {rc}")
    _log(f"ERROR: {res['error']}")
    if args.out:
      with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
