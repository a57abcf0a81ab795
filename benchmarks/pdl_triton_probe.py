"""Programmatic dependent launch for the Pallas *Triton* kernels: does it engage, and does it pay?

Run on the GPU: ``PYTHONPATH=. python3 benchmarks/pdl_triton_probe.py --out DIR``.

Part 1, semantics (``flint_jax.pallas.pdl``: griddepcontrol by inline asm). Kernel A (one
program) optionally executes ``launch_dependents`` at its start, spins ``--spin-us`` on the
global timer, then writes a sequence number k; kernel B (one program) optionally executes
``grid_dependency_wait`` and then reads A's value with a volatile load. Both record the global
timer. Per (trigger, wait) variant, over many calls: how often B read this call's k, and when
B started and read relative to A's end. Run as one A -> B pair per jitted call (2 kernels:
stream launches) and as 4 pairs per call (8 kernels: XLA puts them in a command buffer, a CUDA
graph). Reading:

- trigger, no wait, B starts before A ends and reads a stale k -> XLA launches Triton kernels
  with PDL and inserts no wait of its own: every kernel after an early trigger must wait;
- trigger + wait, B starts before A ends but reads k -> the early launch works, the wait holds;
- B never starts before A ends -> no PDL launch for these kernels (or not in that mode).

Part 2, benefit: ``--layers`` layers of (one-program norm kernel -> bf16 GEMV ``[N, N]``, each
layer its own weight), all Pallas Triton, timed as one jitted call (command buffers). Variants:
``plain`` (no griddepcontrol), ``pdl`` (every kernel waits, then triggers, at its start),
``pdl_preN`` (the GEMV loads its first N weight tiles before the wait).
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import pdl, testing
from pdl_probe import jsonl_emitter, time_chain  # benchmarks/pdl_probe.py: median wall time of a jitted chain

warnings.filterwarnings("ignore", category=DeprecationWarning)

CEILING_TBS = 4.3


# ------------------------------------------------------------------------------------------
# Part 1: semantics


def _kernel_a(k_ref, flag_ref, t_ref, *, trigger: bool, wait: bool, spin_ns: int):
  t0 = pdl.global_timer_lo()
  tok = pdl.grid_dependency_wait() if wait else 0
  if trigger:
    tok = tok + pdl.launch_dependents()

  def cond(t):
    return (t - t0) < spin_ns                  # int32 wrap-around safe for spans < 2 s

  t1 = lax.while_loop(cond, lambda _: pdl.global_timer_lo(), t0)
  flag_ref[0] = k_ref[0] + tok
  t_ref[0] = t0
  t_ref[1] = t1


def _kernel_b(flag_ref, o_ref, *, wait: bool):
  t0 = pdl.global_timer_lo()
  tok = pdl.grid_dependency_wait() if wait else 0
  v = plgpu.load(flag_ref.at[tok], volatile=True)
  t1 = pdl.global_timer_lo()
  o_ref[0] = v
  o_ref[1] = t0
  o_ref[2] = t1


def _pair(k, *, trigger, wait_a, wait_b, spin_ns):
  params = C.compiler_params(1, 1)
  flag, ta = pl.pallas_call(
      functools.partial(_kernel_a, trigger=trigger, wait=wait_a, spin_ns=spin_ns),
      out_shape=(jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)),
      grid=(1,), compiler_params=params, name="pdl_probe_a")(k)
  tb = pl.pallas_call(functools.partial(_kernel_b, wait=wait_b),
                      out_shape=jax.ShapeDtypeStruct((3,), jnp.int32), grid=(1,),
                      compiler_params=params, name="pdl_probe_b")(flag)
  return ta, tb


def semantics(trigger: bool, wait: bool, pairs: int, calls: int, spin_us: float):
  """-> dict: fraction of reads that saw this call's k, median B start / B read relative to A's
  end (us; negative = before A ended), over calls x pairs."""
  spin_ns = int(spin_us * 1000)

  @jax.jit
  def run(k):
    outs = []
    for i in range(pairs):
      # A waits too when it follows a B of this call (the chain rule of pallas/pdl.py)
      outs.append(_pair(k + i, trigger=trigger, wait_a=wait and i > 0, wait_b=wait,
                        spin_ns=spin_ns))
    return outs

  fresh, start, read = [], [], []
  for c in range(calls + 2):
    k = 1000 * (c + 1)
    outs = jax.device_get(run(jnp.array([k], jnp.int32)))
    if c < 2:      # compile / warm-up
      continue
    for i, (ta, tb) in enumerate(outs):
      a_end = np.uint32(ta[1])
      fresh.append(int(tb[0]) == k + i)
      start.append(np.int32(np.uint32(tb[1]) - a_end) / 1000.0)
      read.append(np.int32(np.uint32(tb[2]) - a_end) / 1000.0)
  return dict(part="semantics", trigger=trigger, wait=wait, pairs=pairs, calls=calls,
              fresh_fraction=float(np.mean(fresh)), b_start_vs_a_end_us=float(np.median(start)),
              b_start_min_us=float(np.min(start)), b_read_vs_a_end_us=float(np.median(read)),
              b_read_min_us=float(np.min(read)))


# ------------------------------------------------------------------------------------------
# Part 2: a norm -> GEMV chain


def _norm_kernel(y_ref, o_ref, *, use_pdl: bool):
  tok = 0
  if use_pdl:
    tok = pdl.grid_dependency_wait()
    tok = tok + pdl.launch_dependents()
  h = y_ref[tok, :].astype(jnp.float32)
  x = (h * lax.rsqrt(jnp.mean(h * h) + 1e-6)).astype(jnp.bfloat16)
  o_ref[0, :] = x


def norm(y, use_pdl):
  n = y.shape[1]
  return pl.pallas_call(functools.partial(_norm_kernel, use_pdl=use_pdl),
                        out_shape=jax.ShapeDtypeStruct((1, n), jnp.bfloat16), grid=(1,),
                        compiler_params=C.compiler_params(8, 1), name="pdl_probe_norm")(y)


def _gemv_kernel(x_ref, w_ref, o_ref, *, bn, bk, k, use_pdl, preload):
  testing.preload_gemv_kernel(x_ref, w_ref, o_ref, bn=bn, bk=bk, k=k, preload=preload,
                              wait=use_pdl, trigger=use_pdl)


def gemv(x, w, use_pdl, preload, bn=64, bk=256, stages=4):
  n, k = w.shape
  return pl.pallas_call(
      functools.partial(_gemv_kernel, bn=bn, bk=bk, k=k, use_pdl=use_pdl, preload=preload),
      out_shape=jax.ShapeDtypeStruct((1, n), jnp.float32), grid=(n // bn,),
      compiler_params=C.compiler_params(4, stages), name="pdl_probe_gemv")(x, w)


def make_chain(variant: str):
  use_pdl = variant.startswith("pdl")
  preload = int(variant[len("pdl_pre"):]) if variant.startswith("pdl_pre") else 0

  @jax.jit
  def chain(ws, y):
    for w in ws:
      y = gemv(norm(y, use_pdl), w, use_pdl, preload)
    return y

  return chain


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="directory for pdl_triton.jsonl")
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--spin-us", type=float, default=20.0)
  p.add_argument("--sizes", default="2048,4096", help="N (= K) of the chain's GEMVs")
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--variants", default="plain,pdl,pdl_pre1,pdl_pre2")
  p.add_argument("--parts", default="semantics,chain")
  a = p.parse_args(argv)
  emit = jsonl_emitter(a.out, "pdl_triton.jsonl")

  if "semantics" in a.parts:
    for pairs in (1, 4):
      for trigger in (False, True):
        for wait in (False, True):
          try:
            emit(semantics(trigger, wait, pairs, a.calls, a.spin_us))
          except Exception as e:  # report and go on
            emit(dict(part="semantics", trigger=trigger, wait=wait, pairs=pairs,
                      error=repr(e)[:400]))
  if "chain" in a.parts:
    for n in [int(s) for s in a.sizes.split(",")]:
      run_chain_variants(make_chain, a.variants.split(","), *chain_inputs(n, a.layers), emit,
                         part="chain")
  return 0


def chain_inputs(n: int, layers: int):
  """(ws, y0): ``layers`` random bf16 [n, n] weights and an f32 [1, n] input."""
  ws = [(jax.random.normal(k, (n, n), jnp.float32) / n ** 0.5).astype(jnp.bfloat16)
        for k in jax.random.split(jax.random.key(n), layers)]
  return ws, jax.random.normal(jax.random.key(1), (1, n), jnp.float32)


def run_chain_variants(make_chain, variants, ws, y0, emit, *, part, spin_sec=0.0, **extra):
  """Times ``make_chain(variant)(ws, y0)`` for each variant; emits us per layer (less
  ``spin_sec``), the weights' HBM floor and the relative error against the first variant's
  output (a variant that read stale activations would differ)."""
  n, layers, ref = ws[0].shape[0], len(ws), None
  for variant in variants:
    try:
      sec, out = time_chain(make_chain(variant), ws, y0, windows=7)
      ref = out if ref is None else ref
      err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
      emit(dict(part=part, n=n, variant=variant, layers=layers, **extra,
                us_per_layer=(sec - spin_sec) / layers * 1e6,
                floor_us=n * n * 2 / (CEILING_TBS * 1e12) * 1e6, rel_err_vs_first=err))
    except Exception as e:  # report and go on
      emit(dict(part=part, n=n, variant=variant, **extra, error=repr(e)[:600]))


if __name__ == "__main__":
  sys.exit(main())
