"""Does a Pallas kernel gain from loading its weights under its predecessor? (our own PDL launch)

Run on the GPU: ``PYTHONPATH=.:benchmarks python3 benchmarks/ffi_pdl_probe.py --out DIR
[--command-buffers off]``.

XLA puts ``griddepcontrol.wait`` at the entry of every Pallas kernel, so its weight loads can
never overlap the kernel before it (docs/kernels.md, sessions 9-10). ``pallas/ffi_launch.py``
compiles the same Pallas kernel with the triton package and launches it from an FFI custom call
with programmatic stream serialization, the kernel placing its own wait. The chain of
``pdl_triton_probe.py`` part 2: ``--layers`` layers of (one-program norm kernel -> bf16 GEMV
``[N, N]``, each layer its own weight), timed as one jitted call. Variants of the GEMV:

- ``xla``: launched by XLA (entry wait), then waits + triggers itself (the step's kernels today);
- ``ffi_plain``: launched by the FFI call without PDL (starts after the norm ends);
- ``ffi_pdl``: FFI with PDL, waits at its start;
- ``ffi_pdl_preN``: FFI with PDL, loads its first N weight tiles, then waits;
- ``ffi_all_preN``: the norm kernel launched by the FFI call too (PDL, waits at its start);
- ``ffi_pdl_swp``: FFI with PDL, the wait (and trigger) inside the K loop at its first
  iteration, and x loaded there with an address that depends on the wait's result: Triton's
  software pipeliner issues the loop's prologue -- the first ``stages - 1`` weight tiles, by
  cp.async into shared memory -- before the loop, i.e. *before* the wait, while x cannot move
  above it. (``xla_swp``: the same kernel launched by XLA, whose entry wait comes first.)

Every variant's output is compared with the first's (a GEMV that read a stale x would differ).
``--command-buffers off`` sets ``--xla_gpu_enable_command_buffer=`` before jax starts: the FFI
call is not captured into XLA's CUDA graphs, which it splits.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="directory for ffi_pdl.jsonl")
  p.add_argument("--sizes", default="2048,4096", help="N (= K) of the chain's GEMVs")
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--variants",
                 default="xla,ffi_plain,ffi_pdl,ffi_pdl_pre1,ffi_pdl_pre2,ffi_pdl_pre4,"
                         "ffi_all_pre2")
  p.add_argument("--command-buffers", choices=("on", "off"), default="on")
  p.add_argument("--bn", type=int, default=64)
  p.add_argument("--bk", type=int, default=256)
  p.add_argument("--stages", type=int, default=4)
  p.add_argument("--spin-us", type=float, default=0.0,
                 help="run a one-program kernel that spins this long before the chain, so that "
                      "the host enqueues the whole chain while the GPU is busy (GPU-bound timing); "
                      "the spin alone is timed and subtracted")
  return p.parse_args(argv)


def main(argv=None):
  a = _parse(argv)
  if a.command_buffers == "off":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_enable_command_buffer=").strip()
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.experimental import pallas as pl
  from flint_jax.pallas import _common as C
  from flint_jax.pallas import ffi_launch
  from flint_jax.pallas import pdl
  import pdl_triton_probe as P
  from pdl_probe import jsonl_emitter, time_chain
  # pylint: enable=g-import-not-at-top
  emit = jsonl_emitter(a.out, "ffi_pdl.jsonl")

  def _gemv_swp_kernel(x_ref, w_ref, o_ref, *, bn, bk, k):
    n0 = pl.multiple_of(pl.program_id(0) * bn, bn)

    def first():
      return pdl.grid_dependency_wait() + pdl.launch_dependents()

    def body(j, acc):
      k0 = pl.multiple_of(j * bk, bk)
      tok = lax.cond(j == 0, first, lambda: j * 0)
      # offset by the wait's (zero) result: the address's alignment is unknown, so x is read
      # with 2-byte loads, which the pipeliner does not stage (cp.async needs >= 4 bytes)
      xt = jnp.broadcast_to(x_ref[0, pl.ds(k0 + tok, bk)][None, :], (16, bk))
      return acc + C.mm_tile(xt, w_ref[pl.ds(n0, bn), pl.ds(k0, bk)], "swap")

    acc = lax.fori_loop(0, k // bk, body, C.acc_zeros(16, bn, "swap"))
    C.store_tile(o_ref, (), acc, n0, bn, 1, 16, "swap")

  def gemv(x, w, variant):
    n, k = w.shape
    preload = int(variant.rsplit("pre", 1)[1]) if "_pre" in variant else 0
    kern = functools.partial(P._gemv_kernel, bn=a.bn, bk=a.bk, k=k, use_pdl=True,
                             preload=preload)
    if variant.endswith("_swp"):
      kern = functools.partial(_gemv_swp_kernel, bn=a.bn, bk=a.bk, k=k)
    kw = dict(out_shape=jax.ShapeDtypeStruct((1, n), jnp.float32), grid=(n // a.bn,),
              compiler_params=C.compiler_params(4, a.stages), name="ffi_probe_gemv")
    if variant.startswith("xla"):
      return pl.pallas_call(kern, **kw)(x, w)
    return ffi_launch.pallas_call(kern, entry_wait=False, pdl_launch=variant != "ffi_plain",
                                  **kw)(x, w)

  def norm(y, variant):
    if not variant.startswith("ffi_all"):
      return P.norm(y, True)
    n = y.shape[1]
    return ffi_launch.pallas_call(
        functools.partial(P._norm_kernel, use_pdl=True), entry_wait=False,
        out_shape=jax.ShapeDtypeStruct((1, n), jnp.bfloat16), grid=(1,),
        compiler_params=C.compiler_params(8, 1), name="ffi_probe_norm")(y)

  spin_ns = int(a.spin_us * 1000)

  def _spin_kernel(y_ref, o_ref):
    t0 = pdl.global_timer_lo()
    lax.while_loop(lambda t: (t - t0) < spin_ns, lambda _: pdl.global_timer_lo(), t0)
    o_ref[...] = y_ref[...]

  def spin(y):
    if not spin_ns:
      return y
    return pl.pallas_call(_spin_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
                          grid=(1,), compiler_params=C.compiler_params(1, 1),
                          name="ffi_probe_spin")(y)

  def make_chain(variant):
    @jax.jit
    def chain(ws, y):
      y = spin(y)
      for w in ws:
        y = gemv(norm(y, variant), w, variant)
      return y
    return chain

  spin_sec = 0.0
  if spin_ns:
    spin_sec, _ = time_chain(jax.jit(lambda ws, y: spin(y)), [], jnp.ones((1, 2048)), windows=7)
    emit(dict(part="spin", spin_us=a.spin_us, measured_us=spin_sec * 1e6,
              command_buffers=a.command_buffers))

  for n in [int(s) for s in a.sizes.split(",")]:
    ws, y0 = P.chain_inputs(n, a.layers)
    # one GEMV, the same kernel compiled by XLA's Triton and by the triton package
    try:
      x1 = P.norm(y0, True)
      g_xla = jax.jit(lambda x, w: gemv(x, w, "xla"))(x1, ws[0])
      g_ffi = jax.jit(lambda x, w: gemv(x, w, "ffi_pdl"))(x1, ws[0])
      emit(dict(part="ffi_one_gemv", n=n, max_abs_diff=float(jnp.max(jnp.abs(g_xla - g_ffi))),
                max_abs=float(jnp.max(jnp.abs(g_xla))),
                rel_l2=float(jnp.linalg.norm(g_xla - g_ffi) / jnp.linalg.norm(g_xla))))
    except Exception as e:  # report and go on
      emit(dict(part="ffi_one_gemv", n=n, error=repr(e)[:300]))
    P.run_chain_variants(make_chain, a.variants.split(","), ws, y0, emit, part="ffi_chain",
                         spin_sec=spin_sec, command_buffers=a.command_buffers,
                         spin_us=a.spin_us)
  return 0


if __name__ == "__main__":
  sys.exit(main())
