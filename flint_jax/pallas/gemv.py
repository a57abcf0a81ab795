"""Small-batch BF16 GEMVs (decode-time linear layers), Pallas Triton backend.

``gemv_silu_mul``: the dense-MLP ``gate|up`` step, ``h = bf16(silu(x @ Wg^T) * (x @ Wu^T))``
for M = 1..16 tokens with the two fp32 accumulators, each rounded to bf16 (the model's
projections), combined in fp32 and rounded once (HF keeps separate ``gate_proj`` / ``up_proj``
``[I, K]`` weights; both are read by the same program for the same ``I`` rows). The decode step
runs it for the BF16 dense layers at batch 1 (one kernel where XLA takes a dot and an
elementwise kernel; H200 run 35: 16.3 us per dense layer against 18.9 + 1.4).

Grid: one program per ``block_n`` output columns; each loops over K in ``block_k`` steps with
one of two tensor-core tile methods (``method``, ``_common.mm_tile``): ``dot``
(``acc[16, BN] += x[16, BK] . w[BN, BK]^T``, default for M > 1) or ``swap`` (swap-AB,
``w . x^T``, default for M = 1). The kernel pads M to 16 rows internally (duplicated loads of
the last row, masked stores).

``gemv_reference`` (``x @ w^T`` in fp32, rounded once) is the contract of ``multi_gemv``'s BF16
path; ``default_gemv_blocks`` its tiles. (The BF16 Pallas ``gemv`` itself was retired after
35c0874: XLA's dot is as fast for the step's BF16 o_proj, dense down and LM head.)

Shapes / dtypes: x [M, K] bf16 (or f32), M <= 16; w_gate, w_up [N, K] same dtype as x;
returns [M, N] x.dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C

__all__ = ["gemv_reference", "gemv_silu_mul", "gemv_silu_mul_reference", "default_gemv_blocks",
           "default_method"]

MAX_ROWS = 16


def default_gemv_blocks(n: int, k: int, *, m: int = 1, n_mats: int = 1):
  """(block_n, block_k, split_k, num_warps) for an [n, k] bf16 weight on an H200.

  From the H200 kernel-bench sweeps (runs 1-2, docs/kernels.md at 35c0874; device time per call):
  q_proj 4096x2048: bn64 bk256 best at M=1 (swap, 8.6 us) and M=8 (7.5 us); N=2048 layers
  (o_proj, dense down): bn64 + split-K 2 (9.1 / 11.2 us, vs 17.6 / 22.6 us at bn16); k_proj
  (N=512): bn16 + split-K 4 (3.4-3.7 us); LM head: bn128 (139-142 us, 4.3-4.4 TB/s).
  Split-K (fp32 partials summed by XLA) only for single-matrix GEMVs.
  """
  bk = C.pow2_divisor(k, 256)
  if n >= 65536:
    bn = C.pow2_divisor(n, 128)
  elif n >= 1024:
    bn = C.pow2_divisor(n, 64)
  else:
    bn = C.pow2_divisor(n, 16)
  split = 1
  target = 128 if bn == 16 else 64
  if n_mats == 1:
    while (n // bn) * split < target and k // (bk * split * 2) >= 2:
      split *= 2
  warps = 8 if (bn >= 128 and m == 1) else 4
  return bn, bk, split, warps


def default_method(m: int) -> str:
  """swap-AB at M = 1 (8.6 vs 11.1 us on q_proj), the plain dot for M > 1 (docs/kernels.md)."""
  return "swap" if m == 1 else "dot"


def _validate(x, ws, block_n, block_k):
  C.check(x.ndim == 2, f"x must be [M, K], got {x.shape=}")
  m, k = x.shape
  C.check(1 <= m <= MAX_ROWS, f"gemv handles 1..{MAX_ROWS} rows, got {m=}")
  for w in ws:
    C.check(w.ndim == 2 and w.shape[1] == k, f"weight must be [N, K={k}], got {w.shape=}")
    C.check(w.dtype == x.dtype, f"x and weight must share a dtype, got {x.dtype=} {w.dtype=}")
    C.check(w.shape == ws[0].shape, f"gate/up weights differ: {ws[0].shape} vs {w.shape}")
  n = ws[0].shape[0]
  C.check(C.is_pow2(block_n) and block_n >= 16 and n % block_n == 0,
          f"block_n must be a power of two >= 16 dividing N: {block_n=} {n=}")
  C.check(C.is_pow2(block_k) and block_k >= 16 and k % block_k == 0,
          f"block_k must be a power of two >= 16 dividing K: {block_k=} {k=}")
  return m, n, k


def gemv_reference(x, w, *, out_dtype=jnp.bfloat16, **unused_tuning):
  """Plain jnp: (x @ w^T in fp32).astype(out_dtype)."""
  del unused_tuning
  return _gemv_reference(x, w, out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _gemv_reference(x, w, *, out_dtype):
  y = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST)
  return y.astype(out_dtype)


def _gemv_silu_mul_kernel(x_ref, wg_ref, wu_ref, o_ref, *, m, mp, bn, bk, k_len, method):
  """h = silu(x Wg^T) * (x Wu^T) for one BN slice of the intermediate dim."""
  n0 = pl.multiple_of(pl.program_id(0) * bn, bn)

  def body(i, carry):
    acc_g, acc_u = carry
    k0 = pl.multiple_of(i * bk, bk)
    x = C.load_x(x_ref, (), m, mp, pl.ds(k0, bk))          # [Mp, BK]
    wg = wg_ref[pl.ds(n0, bn), pl.ds(k0, bk)]             # [BN, BK]
    wu = wu_ref[pl.ds(n0, bn), pl.ds(k0, bk)]             # [BN, BK]
    return acc_g + C.mm_tile(x, wg, method), acc_u + C.mm_tile(x, wu, method)

  z = jnp.zeros(C.acc_shape(mp, bn, method), jnp.float32)
  acc_g, acc_u = lax.fori_loop(0, k_len // bk, body, (z, z))
  C.store_tile(o_ref, (), C.silu_mul_f32(acc_g, acc_u), n0, bn, m, mp, method)


@functools.partial(jax.jit, static_argnames=(
    "block_n", "block_k", "method", "num_warps", "num_stages", "early_trigger", "interpret"))
def gemv_silu_mul(x, w_gate, w_up, *, block_n: int | None = None, block_k: int | None = None,
                  method: str | None = None, num_warps: int | None = None, num_stages: int = 3,
                  early_trigger: bool = True, interpret: bool = False):
  """h[M, I] = x.dtype(silu(g) * u): g, u the fp32 products x @ w_gate^T, x @ w_up^T rounded
  to bf16 (the model's rule), silu and the product in fp32, rounded once more.
  ``early_trigger``: the kernel lets the next one launch first (``pdl``)."""
  n, k = w_gate.shape
  dbn, dbk, _, dwarps = default_gemv_blocks(n, k, m=x.shape[0], n_mats=2)
  block_n = block_n or dbn
  block_k = block_k or dbk
  num_warps = num_warps or dwarps
  m, n, k = _validate(x, [w_gate, w_up], block_n, block_k)
  method = method or default_method(m)
  C.check_method(method, m, allowed=("dot", "swap"))
  mp = C.pad_rows(m, method)
  kernel = functools.partial(_gemv_silu_mul_kernel, m=m, mp=mp, bn=block_n, bk=block_k,
                             k_len=k, method=method)
  return C.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(n // block_n,),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger, name=f"flint_gemv_silu_mul_{method}_bn{block_n}_bk{block_k}",
  )(x, w_gate, w_up)


def gemv_silu_mul_reference(x, w_gate, w_up, **unused_tuning):
  """Plain jnp: bf16(silu(g) * u) with g, u the fp32 products rounded to bf16 first."""
  del unused_tuning
  return _gemv_silu_mul_reference(x, w_gate, w_up)


@jax.jit
def _gemv_silu_mul_reference(x, w_gate, w_up):
  g = _gemv_reference(x, w_gate, out_dtype=jnp.float32)
  u = _gemv_reference(x, w_up, out_dtype=jnp.float32)
  return C.silu_mul_f32(g, u).astype(x.dtype)
