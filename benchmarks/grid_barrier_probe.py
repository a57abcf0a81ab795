"""What does a grid-wide barrier inside one kernel cost, against a kernel boundary?

Run on the GPU: ``PYTHONPATH=.:benchmarks python3 benchmarks/grid_barrier_probe.py --out DIR``.

The batch-1 decode step is a chain of ~7 dependent kernels per layer, each paying ~2-3 us of
fixed cost (docs/performance.md, "What costs the rest"). A persistent kernel that owns a layer
replaces each kernel boundary by a grid-wide barrier; it can only pay if that barrier is cheaper
than the boundary. This probe measures both on the same work:

- a *stage*: every one of G programs reads the whole previous vector (D f32, written by all
  programs of the previous stage: an activation gathered through the L2), sums it, and writes
  its own D / G slice of the next vector (``mean + 1``);
- ``chain``: R stages as R ``pallas_call`` s in one jitted function (XLA's launches: a command
  buffer, programmatic dependent launch, the entry wait), with or without every kernel's early
  trigger (``pdl.early_trigger``: on for the BF16 step, off for NVFP4);
- ``barrier``: R stages in one kernel of G programs, each stage ended by a grid barrier
  (CTA barrier, one ``atom.add.acq_rel`` arrival on a counter, volatile polls until it reaches
  G x (stage + 1), an acquiring atomic; the next stage's loads are volatile and addressed
  through the acquire's result, so they cannot move above it); ``barrier_fence``: the acquire
  a ``fence.acq_rel.gpu`` instead of the atomic; ``nosync``: the same kernel without any
  barrier (what the stages cost alone; the programs race, so no result check).

Per variant it reports us per stage as the slope between R = ``--rounds`` lo and hi (fixed
costs of a call cancel; of the median and of the fastest window), and checks the result (every element of the last vector equals R: a
stage that read a stale vector would leave a smaller value). G must fit the GPU at once (every
program resident), or the barrier deadlocks: G <= 2 x 132 here.

In interpret mode (CPU) the programs run one after another, so the barrier kernel only works
with G = 1; the tests run it so and the chain with any G (tests/test_grid_barrier_probe.py).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import pdl

warnings.filterwarnings("ignore", category=DeprecationWarning)

D = 2048   # the model's hidden size: the vector every stage gathers


def _stage(x, p, dst_ref, dst_off, *, g, d):
  """One stage's work given the gathered vector x [D]: its slice of the next one."""
  mean = jnp.sum(x) * (1.0 / d)
  sl = d // g
  dst_ref[pl.ds(dst_off + p * sl, sl)] = jnp.full((sl,), mean + 1.0, jnp.float32)


def _stage_kernel(src_ref, dst_ref, *, g, d):
  _stage(src_ref[...], pl.program_id(0), dst_ref, 0, g=g, d=d)


def chain(rounds: int, g: int, d: int = D, *, trigger: bool = False, interpret: bool = False):
  """-> jitted f(): R stages as R kernels; returns the last vector [D] f32 (all R if right)."""
  C.check(d % g == 0, f"D={d} must be a multiple of G={g}")
  body = functools.partial(_stage_kernel, g=g, d=d)
  call = pl.pallas_call(pdl.with_early_trigger(body) if trigger else body,
                        out_shape=jax.ShapeDtypeStruct((d,), jnp.float32), grid=(g,),
                        compiler_params=C.compiler_params(4, 1), interpret=interpret,
                        name=f"barrier_probe_stage_g{g}")

  @jax.jit
  def run():
    x = jnp.zeros((d,), jnp.float32)
    for _ in range(rounds):
      x = call(x)
    return x

  return run


# ``fence.acq_rel.gpu`` (the "fence" acquire): 0, effectful (pallas/pdl.py's inline-asm helper)
_fence_p = pdl._asm_primitive(   # pylint: disable=protected-access
    "flint_probe_fence_acq_rel_gpu", "fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r,~{memory}")

SYNCS = ("atomic", "fence", "none")


def _grid_barrier(cnt_ref, target, interpret, sync="atomic"):
  """Arrive on the counter, wait until it reaches ``target``; -> 0, data-dependent on the
  acquire (add it to the next loads' addresses). ``sync``: the acquire after the polls, an
  atomic read ("atomic", what layer_end_qkv does) or ``fence.acq_rel.gpu`` ("fence"). (The
  kernel's sync "none" skips the barrier: the stages' own cost; the programs then race.)"""
  if not interpret:        # every thread's stores precede the arrival (no CPU lowering)
    plgpu.debug_barrier()
  zero_idx = (jnp.int32(0),)
  plgpu.atomic_add(cnt_ref, zero_idx, jnp.int32(1))
  seen = lax.while_loop(lambda v: v < target,
                        lambda v: plgpu.load(cnt_ref.at[zero_idx], volatile=True),
                        plgpu.load(cnt_ref.at[zero_idx], volatile=True))
  if sync == "fence":
    return jnp.minimum(seen, target) - target + _fence_p.bind()
  acquired = plgpu.atomic_add(cnt_ref, (jnp.minimum(seen, target) - target,), jnp.int32(0))
  return jnp.minimum(acquired, target) - target


def _persistent_kernel(buf_in, cnt_in, buf_ref, cnt_ref, *, rounds, g, d, interpret, sync):
  del buf_in, cnt_in      # aliased to the outputs
  p = pl.program_id(0)

  def body(r, zero):
    odd = jnp.bitwise_and(r, 1)           # (Triton's lowering of % mis-types the constant)
    src = (1 - odd) * d + zero            # stage r reads the vector of stage r - 1
    x = plgpu.load(buf_ref.at[pl.ds(src, d)], volatile=True)
    _stage(x, p, buf_ref, odd * d, g=g, d=d)
    if sync == "none":       # the carry itself (a fresh constant does not lower as a yield)
      return zero
    return _grid_barrier(cnt_ref, g * (r + 1), interpret, sync)

  lax.fori_loop(0, rounds, body, jnp.int32(0))


def persistent(rounds: int, g: int, d: int = D, *, interpret: bool = False, sync: str = "atomic"):
  """-> jitted f(): R stages in one kernel with a grid barrier after each (its acquire:
  ``sync``, see ``_grid_barrier``); returns the last vector [D] f32 (all R if right)."""
  C.check(sync in SYNCS, f"sync must be one of {SYNCS}, got {sync!r}")
  C.check(d % g == 0, f"D={d} must be a multiple of G={g}")
  C.check(interpret is False or g == 1,
          "interpret mode runs the programs one after another: the barrier needs G = 1 there")
  call = pl.pallas_call(
      functools.partial(_persistent_kernel, rounds=rounds, g=g, d=d, interpret=interpret,
                        sync=sync),
      out_shape=(jax.ShapeDtypeStruct((2 * d,), jnp.float32),
                 jax.ShapeDtypeStruct((1,), jnp.int32)),
      grid=(g,), input_output_aliases={0: 0, 1: 1}, compiler_params=C.compiler_params(4, 1),
      interpret=interpret, name=f"barrier_probe_persistent_{sync}_g{g}")

  @jax.jit
  def run():
    buf, _ = call(jnp.zeros((2 * d,), jnp.float32), jnp.zeros((1,), jnp.int32))
    last = (rounds - 1) % 2
    return buf[last * d:(last + 1) * d]

  return run


VARIANTS = {
    "chain": lambda r, g: chain(r, g),
    "chain_trigger": lambda r, g: chain(r, g, trigger=True),
    "barrier": lambda r, g: persistent(r, g),
    "barrier_fence": lambda r, g: persistent(r, g, sync="fence"),
    "nosync": lambda r, g: persistent(r, g, sync="none"),
}


def measure(variant: str, g: int, lo: int, hi: int) -> dict:
  """us per stage (slope between lo and hi stages) and whether both results were right."""
  from pdl_probe import window_times   # benchmarks/pdl_probe.py
  times, ok = {}, True
  for r in (lo, hi):
    per, out = window_times(VARIANTS[variant](r, g), windows=9, calls=10)
    ok = ok and bool((jax.device_get(out) == r).all())
    times[r] = (statistics.median(per), min(per))   # (median, fastest window)
  slope = lambda i: 1e6 * (times[hi][i] - times[lo][i]) / (hi - lo)  # noqa: E731
  return {"variant": variant, "programs": g, "rounds": [lo, hi],
          "us_per_stage": slope(0), "us_per_stage_of_mins": slope(1),
          "ms_per_call": {str(r): 1e3 * t[0] for r, t in times.items()},
          "correct": None if variant == "nosync" else ok}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="directory for grid_barrier.jsonl")
  p.add_argument("--programs", default="64,128,256", help="G values (each divides 2048)")
  p.add_argument("--variants", default="chain,chain_trigger,barrier,barrier_fence,nosync")
  p.add_argument("--rounds", default="64,320", help="lo,hi stages per call (the slope's ends)")
  a = p.parse_args(argv)
  from pdl_probe import jsonl_emitter   # benchmarks/pdl_probe.py
  emit = jsonl_emitter(a.out, "grid_barrier.jsonl")
  lo, hi = (int(v) for v in a.rounds.split(","))
  for g in (int(v) for v in a.programs.split(",")):
    for variant in a.variants.split(","):
      emit(measure(variant, g, lo, hi))


if __name__ == "__main__":
  main()
