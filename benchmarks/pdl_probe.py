"""Does programmatic dependent launch hide a GEMV's ramp? A chain of (norm -> GEMV) layers.

Run on the GPU: ``PYTHONPATH=. python3 benchmarks/pdl_probe.py --out DIR``.

Each of ``--layers`` layers is a small latency-bound Triton kernel (``producer``: sums the
previous GEMV's output, RMS-normalises it, writes the next x) followed by a GEMV with its own
``[N, N]`` bf16 weight (every layer a different matrix, so the weights stream from HBM as in the
model). Variants of the GEMV, the producer the same kernel in all of them:

- ``xla``: XLA's dot;  ``triton``: flint_jax's Pallas Triton ``gemv`` (the step's tiles);
- ``mosaic``: ``mosaic_gemv`` (TMA ring, wgmma) launched normally;
- ``mosaic_pdl``: the same kernel with ``griddepcontrol.wait`` after its weight loads (launched
  with PDL), the producer calling ``griddepcontrol.launch_dependents`` at its start so the
  GEMV's CTAs may start while the producer runs;
- ``mosaic_pdl_notrig``: PDL launch, the producer without the early trigger.

Reported: wall time per layer (one jitted call runs the whole chain; median of windows of
back-to-back calls, so command buffers are in use as in the decode step), the HBM floor of the
weight bytes, and the relative error of the chain's output against the ``xla`` variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

warnings.filterwarnings("ignore", category=DeprecationWarning)

import importlib  # noqa: E402

GEMV = importlib.import_module("flint_jax.pallas.gemv")
MG = importlib.import_module("flint_jax.pallas.mosaic_gemv")

CEILING_TBS = 4.3
BK = 64


def _trigger_token():
  """0 at run time, computed by inline asm that also runs griddepcontrol.launch_dependents."""
  (t,) = plgpu_triton.elementwise_inline_asm(
      "griddepcontrol.launch_dependents;\nmov.b32 $0, $1;",
      args=[jnp.zeros((128,), jnp.int32)], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct((128,), jnp.int32)])
  return jnp.sum(t).astype(jnp.float32)


def producer(y, *, n: int, layout_out: str, trigger: bool, interpret: bool = False):
  """y: [S, N, 8] f32 partials (column 0 = the token) or [1, N] -> x = rms_norm(sum) as
  [N/64, 8, 64] bf16 tiles (row 0 = x, rows 1-7 zero) or [1, N] bf16."""
  parts = y.ndim == 3

  def kernel(y_ref, o_ref):
    bump = _trigger_token() if trigger and not interpret else 0.0
    if parts:
      h = jnp.sum(y_ref[:, :, 0].astype(jnp.float32), axis=0)           # [N]
    else:
      h = y_ref[0, :].astype(jnp.float32)
    h = h + bump
    x = (h * jax.lax.rsqrt(jnp.mean(h * h) + 1e-6)).astype(jnp.bfloat16)
    if layout_out == "tiles":
      xt = x.reshape(n // BK, 1, BK)
      row = jax.lax.broadcasted_iota(jnp.int32, (n // BK, 8, BK), 1)
      o_ref[...] = jnp.where(row == 0, xt, jnp.zeros_like(xt))
    else:
      o_ref[0, :] = x

  out = (jax.ShapeDtypeStruct((n // BK, 8, BK), jnp.bfloat16) if layout_out == "tiles"
         else jax.ShapeDtypeStruct((1, n), jnp.bfloat16))
  return pl.pallas_call(kernel, out_shape=out, grid=(1,),
                        compiler_params=plgpu_triton.CompilerParams(num_warps=8, num_stages=1),
                        interpret=interpret, name="probe_producer")(y)


def make_chain(variant: str, n: int, split_k: int, stages: int, interpret: bool = False):
  mosaic = variant.startswith("mosaic")
  pdl = variant in ("mosaic_pdl", "mosaic_pdl_notrig")
  trigger = variant == "mosaic_pdl"

  def chain(ws, y):
    for w in ws:
      if mosaic:
        x = producer(y, n=n, layout_out="tiles", trigger=trigger, interpret=interpret)
        y = MG.mosaic_gemv(x, w, split_k=split_k, stages=stages, pdl=pdl, interpret=interpret)
      else:
        x = producer(y, n=n, layout_out="row", trigger=False, interpret=interpret)
        if variant == "xla":
          y = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
        else:
          y = GEMV.gemv(x, w, out_dtype=jnp.float32, interpret=interpret)
    if mosaic:
      y = jnp.sum(y[:, :, 0], axis=0)[None]
    return y

  return jax.jit(chain)


def window_times(fn, *args, windows: int = 5, calls: int = 20):
  """-> ([seconds per call in each window of back-to-back calls of fn(*args)], the warm-up
  call's output). The calls are GPU-bound: only each window's last result is waited for."""
  out = fn(*args).block_until_ready()
  per = []
  for _ in range(windows):
    t = time.perf_counter()
    for _ in range(calls):
      o = fn(*args)
    o.block_until_ready()
    per.append((time.perf_counter() - t) / calls)
  return per, out


def time_chain(fn, ws, y0, windows: int = 5, calls: int = 20):
  """-> (median seconds per call of fn(ws, y0), its output)."""
  per, out = window_times(fn, ws, y0, windows=windows, calls=calls)
  return statistics.median(per), out


def jsonl_emitter(out_dir, filename):
  """emit(row): prints row as JSON and, with an out_dir, appends it to out_dir/filename (the
  probes' result files)."""
  sink = open(os.path.join(out_dir, filename), "a") if out_dir else None

  def emit(row):
    print(json.dumps(row), flush=True)
    if sink:
      sink.write(json.dumps(row) + "\n")
      sink.flush()

  return emit


def kernel_gaps(fn, ws, y0, trace_dir):
  """Traces one call; -> (median, min) gap in us between consecutive kernels on the stream
  (start of one minus end of the previous: negative = the next kernel started before the
  previous one ended, i.e. a programmatic dependent launch overlapped them). Profiling turns
  XLA's command buffers off, so this shows stream launches."""
  import kernels as KB  # benchmarks/kernels.py: the perfetto trace parser
  fn(ws, y0).block_until_ready()
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    fn(ws, y0).block_until_ready()
  _, evs = KB.parse_trace(trace_dir)
  evs = sorted(evs)
  gaps = [b[0] - (a[0] + a[1]) for a, b in zip(evs, evs[1:])]
  return (statistics.median(gaps), min(gaps), len(evs)) if gaps else (None, None, len(evs))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="directory for probe.jsonl")
  p.add_argument("--sizes", default="2048,4096", help="N (= K) of the square GEMVs")
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--variants", default="xla,triton,mosaic,mosaic_pdl,mosaic_pdl_notrig")
  p.add_argument("--trace", action="store_true",
                 help="also trace one call per variant and report the gaps between kernels")
  p.add_argument("--configs", default="4:4,4:8,2:8",
                 help="mosaic split_k:stages pairs, comma separated")
  a = p.parse_args(argv)
  rows = []
  emit = jsonl_emitter(a.out, "probe.jsonl")
  for n in [int(s) for s in a.sizes.split(",")]:
    key = jax.random.key(n)
    ws = [(jax.random.normal(k, (n, n), jnp.float32) / (n ** 0.5)).astype(jnp.bfloat16)
          for k in jax.random.split(key, a.layers)]
    y0 = jax.random.normal(jax.random.key(1), (1, n), jnp.float32)
    floor_us = n * n * 2 / (CEILING_TBS * 1e12) * 1e6
    ref = None
    for variant in a.variants.split(","):
      cfgs = a.configs.split(",") if variant.startswith("mosaic") else ["-"]
      for cfg in cfgs:
        sk, st = (int(v) for v in cfg.split(":")) if cfg != "-" else (1, 1)
        if variant.startswith("mosaic"):
          y_in = jnp.zeros((sk, n, 8), jnp.float32).at[:, :, 0].set(y0[0] / sk)
        else:
          y_in = y0
        try:
          fn = make_chain(variant, n, sk, st)
          sec, out = time_chain(fn, ws, y_in)
          out = out.astype(jnp.float32).reshape(-1)
          if ref is None and variant == "xla":
            ref = out
          err = (float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) if ref is not None
                 else None)
          row = dict(n=n, variant=variant, split_k=sk, stages=st, layers=a.layers,
                     us_per_layer=sec / a.layers * 1e6, floor_us=floor_us, rel_err=err)
          if a.trace:
            tdir = os.path.join(a.out or "/tmp", f"trace_{n}_{variant}_{sk}_{st}")
            med, low, nk = kernel_gaps(fn, ws, y_in, tdir)
            row.update(gap_median_us=med, gap_min_us=low, kernels=nk)
        except Exception as e:  # report and go on: one failing variant must not hide the rest
          row = dict(n=n, variant=variant, split_k=sk, stages=st, error=repr(e)[:400])
        rows.append(row)
        emit(row)
  return rows


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
