"""Does prefetching a GEMV's weights into the L2 from the kernel before it pay? (GPU probe)

Run on the GPU: ``PYTHONPATH=. python3 benchmarks/l2_prefetch_probe.py --out DIR``.

A chain of ``--layers`` layers, each its own weights (so nothing stays in the 50 MB L2 from one
call to the next), timed as one jitted call (command buffers), us per layer:

  host kernel (``--host``) -> GEMV of x [1, K] by W_i [N, K]

- host ``spin``: a latency-bound stand-in for the attention kernel: ``--programs`` programs that
  spin ``--spin-us`` on the global timer, then one of them RMS-normalises y into x;
- host ``gemv``: a streaming stand-in for the MoE down kernel: a Pallas GEMV by its own
  [N, K] weight (the layer's "A" weight), whose output is x.

With ``prefetch`` the host kernel's programs first issue ``l2_prefetch.prefetch_slice`` of the
*next* GEMV's weight arrays (cp.async.bulk.prefetch.L2), each its share. The GEMV is XLA's dot
(BF16), the Pallas BF16 GEMV, or the NVFP4 GEMV (``--formats``). Reading: the prefetch pays if
``us_per_layer`` drops by more than noise; the GEMV-alone rows (host ``none``) give the floor of
the chain without a host kernel.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C
from flint_jax.pallas import l2_prefetch, pdl
from flint_jax.pallas.gemv import gemv as pallas_gemv
from flint_jax.pallas.nvfp4_gemv import nvfp4_gemv
from flint_jax.pallas.testing import random_nvfp4
from pdl_probe import jsonl_emitter, time_chain  # benchmarks/pdl_probe.py: median wall time of a jitted chain

warnings.filterwarnings("ignore", category=DeprecationWarning)


def _spin_kernel(y_ref, *rest, spin_ns, n_pf):
  pf, (x_ref,) = rest[:n_pf], rest[n_pf:]
  pid, parts = pl.program_id(0), pl.num_programs(0)
  for ref in pf:
    l2_prefetch.prefetch_slice(ref, pid, parts)
  t0 = pdl.global_timer_lo()
  lax.while_loop(lambda t: (t - t0) < spin_ns, lambda _: pdl.global_timer_lo(), t0)

  @pl.when(pid == 0)
  def _():
    h = y_ref[0, :].astype(jnp.float32)
    x_ref[0, :] = (h * lax.rsqrt(jnp.mean(h * h) + 1e-6)).astype(x_ref.dtype)


def spin(y, prefetch, *, programs, spin_us, k):
  kern = functools.partial(_spin_kernel, spin_ns=int(spin_us * 1000), n_pf=len(prefetch))
  return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((1, k), jnp.bfloat16),
                        grid=(programs,), compiler_params=C.compiler_params(4, 1),
                        name="l2pf_spin")(y, *prefetch)


def _host_gemv_kernel(x_ref, w_ref, *rest, bn, bk, k, n_pf):
  pf, (o_ref,) = rest[:n_pf], rest[n_pf:]
  pid = pl.program_id(0)
  for ref in pf:
    l2_prefetch.prefetch_slice(ref, pid, pl.num_programs(0))
  n0 = pl.multiple_of(pid * bn, bn)

  def body(j, acc):
    k0 = pl.multiple_of(j * bk, bk)
    x = jnp.broadcast_to(x_ref[0, pl.ds(k0, bk)][None, :], (16, bk))
    return acc + C.mm_tile(x, w_ref[pl.ds(n0, bn), pl.ds(k0, bk)], "swap")

  acc = lax.fori_loop(0, k // bk, body, C.acc_zeros(16, bn, "swap"))
  C.store_tile(o_ref, (), acc, n0, bn, 1, 16, "swap")


def host_gemv(x, w, prefetch, bn=64, bk=256):
  """x [1, K] by w [K', K] -> [1, K'] bf16 (the host GEMV); prefetches ``prefetch``."""
  n, k = w.shape
  kern = functools.partial(_host_gemv_kernel, bn=bn, bk=bk, k=k, n_pf=len(prefetch))
  return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((1, n), jnp.bfloat16),
                        grid=(n // bn,), compiler_params=C.compiler_params(4, 4),
                        name="l2pf_host_gemv")(x, w, *prefetch)


def weight_arrays(w):
  return list(w) if isinstance(w, tuple) else [w]


def apply_gemv(kind, x, w):
  if kind == "xla":
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  if kind == "pallas":
    return pallas_gemv(x, w, out_dtype=jnp.float32)
  return nvfp4_gemv(x, *w, out_dtype=jnp.float32)


def make_chain(kind, host, prefetch, programs, spin_us):
  @jax.jit
  def chain(ws, hosts, y):
    for i, w in enumerate(ws):
      pf = weight_arrays(w) if prefetch else []
      if host == "spin":
        x = spin(y, pf, programs=programs, spin_us=spin_us, k=y.shape[1])
      elif host == "gemv":
        x = host_gemv(y.astype(jnp.bfloat16), hosts[i], pf)
      else:
        x = y.astype(jnp.bfloat16)
      y = apply_gemv(kind, x, w)
      k = x.shape[1]   # back to the chain's width
      y = y[:, :k] if y.shape[1] >= k else jnp.tile(y, (1, k // y.shape[1]))
    return y

  return chain


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="directory for l2_prefetch.jsonl")
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--n", type=int, default=2048, help="GEMV output rows (o_proj: 2048)")
  p.add_argument("--k", type=int, default=4096, help="GEMV input features (o_proj: 4096)")
  p.add_argument("--formats", default="xla,pallas,nvfp4")
  p.add_argument("--hosts", default="none,spin,gemv")
  p.add_argument("--programs", type=int, default=64)
  p.add_argument("--spin-us", type=float, default=6.0)
  a = p.parse_args(argv)
  emit = jsonl_emitter(a.out, "l2_prefetch.jsonl")

  gen = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(0), a.layers)
  bf = [(jax.random.normal(k, (a.n, a.k), jnp.float32) / a.k ** 0.5).astype(jnp.bfloat16)
        for k in keys]
  # the host GEMV maps x [1, K] -> [1, K] (so the chain keeps its width)
  hosts = [(jax.random.normal(k, (a.k, a.k), jnp.float32) / a.k ** 0.5).astype(jnp.bfloat16)
           for k in jax.random.split(jax.random.key(1), a.layers)]
  y0 = jax.random.normal(jax.random.key(2), (1, a.k), jnp.float32)
  for fmt in a.formats.split(","):
    ws = bf if fmt != "nvfp4" else [tuple(jnp.asarray(t) for t in random_nvfp4(gen, (a.n, a.k)))
                                    for _ in range(a.layers)]
    nbytes = sum(int(np.prod(t.shape)) * t.dtype.itemsize for t in weight_arrays(ws[0]))
    for host in a.hosts.split(","):
      for prefetch in ((False,) if host == "none" else (False, True)):
        try:
          fn = make_chain(fmt, host, prefetch, a.programs, a.spin_us)
          sec, _ = time_chain(lambda w, y: fn(w, hosts, y), ws, y0, windows=7)
          emit(dict(format=fmt, host=host, prefetch=prefetch, layers=a.layers,
                    us_per_layer=sec / a.layers * 1e6, weight_mb=nbytes / 1e6,
                    spin_us=a.spin_us if host == "spin" else None))
        except Exception as e:  # report and go on
          emit(dict(format=fmt, host=host, prefetch=prefetch, error=repr(e)[:600]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
