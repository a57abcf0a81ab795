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
- ``ffi_all_preN``: the norm kernel launched by the FFI call too (PDL, waits at its start).

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
  return p.parse_args(argv)


def main(argv=None):
  a = _parse(argv)
  if a.command_buffers == "off":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_enable_command_buffer=").strip()
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from flint_jax.pallas import _common as C
  from flint_jax.pallas import ffi_launch
  import pdl_triton_probe as P
  from pdl_probe import jsonl_emitter, time_chain
  # pylint: enable=g-import-not-at-top
  emit = jsonl_emitter(a.out, "ffi_pdl.jsonl")

  def gemv(x, w, variant):
    n, k = w.shape
    preload = int(variant.rsplit("pre", 1)[1]) if "_pre" in variant else 0
    kern = functools.partial(P._gemv_kernel, bn=a.bn, bk=a.bk, k=k, use_pdl=True,
                             preload=preload)
    kw = dict(out_shape=jax.ShapeDtypeStruct((1, n), jnp.float32), grid=(n // a.bn,),
              compiler_params=C.compiler_params(4, 4), name="ffi_probe_gemv")
    if variant == "xla":
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

  def make_chain(variant):
    @jax.jit
    def chain(ws, y):
      for w in ws:
        y = gemv(norm(y, variant), w, variant)
      return y
    return chain

  for n in [int(s) for s in a.sizes.split(",")]:
    ws = [(jax.random.normal(k, (n, n), jnp.float32) / n ** 0.5).astype(jnp.bfloat16)
          for k in jax.random.split(jax.random.key(n), a.layers)]
    y0 = jax.random.normal(jax.random.key(1), (1, n), jnp.float32)
    # one GEMV, the same kernel compiled by XLA's Triton and by the triton package
    x1 = P.norm(y0, True)
    g_xla = jax.jit(lambda x, w: gemv(x, w, "xla"))(x1, ws[0])
    g_ffi = jax.jit(lambda x, w: gemv(x, w, "ffi_pdl"))(x1, ws[0])
    emit(dict(part="ffi_one_gemv", n=n, max_abs_diff=float(jnp.max(jnp.abs(g_xla - g_ffi))),
              max_abs=float(jnp.max(jnp.abs(g_xla))),
              rel_l2=float(jnp.linalg.norm(g_xla - g_ffi) / jnp.linalg.norm(g_xla))))
    ref = None
    for variant in a.variants.split(","):
      try:
        sec, out = time_chain(make_chain(variant), ws, y0, windows=7)
        ref = out if ref is None else ref
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        emit(dict(part="ffi_chain", n=n, variant=variant, layers=a.layers,
                  command_buffers=a.command_buffers, us_per_layer=sec / a.layers * 1e6,
                  floor_us=n * n * 2 / (P.CEILING_TBS * 1e12) * 1e6, rel_err_vs_first=err))
      except Exception as e:  # report and go on
        emit(dict(part="ffi_chain", n=n, variant=variant, command_buffers=a.command_buffers,
                  error=repr(e)[:600]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
