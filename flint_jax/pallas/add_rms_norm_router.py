"""Residual add + RMSNorm + fp32 MoE router GEMV in one Pallas (Triton backend) kernel.

``add_rms_norm_router(h, a, w_norm, router_w)`` fuses the two launches that sit between the
attention output projection and the routed MoE kernels of every MoE layer's decode step:

  s      = bf16(h + a)                                     (``add_rms_norm``: one rounding)
  x      = bf16(w_norm * (f32(s) * rsqrt(mean(f32(s)^2) + eps)))   (weight in fp32, FLINT_SPEC 3)
  logits = f32(x) . f32(router_w)^T                        (fp32 [M, E], ``moe_router_logits``)

Returns ``(s, x, logits)``. s and x follow ``add_rms_norm``'s formula op for op (``_normalize``:
same fp32 row sum over the power-of-two padded row, same rsqrt), so they are bit-identical to
``add_rms_norm``'s outputs (on the GPU as long as both kernels reduce the row with the same
number of warps: the default ``num_warps`` here is ``add_rms_norm``'s). The logits are computed
from the *bf16-rounded* x upcast to fp32, as ``moe_router_logits(x, router_w)`` does; they differ
from XLA's ``Precision.HIGHEST`` dot only in the fp32 summation order (measured on CPU: up to
~7e-7 of max|logit|).

Kernel: grid ``(cdiv(E, block_e),)``. Every program loads the M rows of h and a (tiny: 8 KB per
row at D = 2048), recomputes s and x itself (redundantly: the row work is negligible next to the
weight stream), and multiplies them with its ``block_e`` router rows on the CUDA cores (broadcast
multiply + row sum in fp32; no ``tl.dot``, whose fp32 inputs would be rounded to TF32). The fp32
router weight (2 MB at E = 256, D = 2048) is thus streamed by E / block_e programs at once
(block_e = 4: 64 programs). Program 0 alone stores s and x (``pl.when``). ``a`` may also be a
split-K GEMV's fp32 partials [S, M, D] (``nvfp4_gemv(..., sum_splits=False)``): each program sums
them as ``add_rms_norm`` does (``load_y_row``), so no XLA reduce runs in between.

D is covered in ``block_d`` column chunks (a power of two dividing the padded row ``Dp``): with
``block_d == Dp`` the router tile ``[block_e, Dp]`` is loaded once per program and reused by all
rows; with ``block_d < Dp`` (fewer registers) each row first computes its mean square from the
full row, then, per chunk, reloads its h/a chunk, renormalises it with that statistic
(elementwise, so bit-identical to the full-row x) and the router chunk (an L1/L2 hit after the
first row). Default tiles: block_e = 4, block_d = Dp ([4, 2048] fp32 = 64 registers per thread
at 4 warps, loaded before the norm so the 32 KB per program stream under it). An H200 sweep measured
the old default (block_e = 8, block_d = 1024: the router chunks loaded after the norm): 4.7 us
at M = 1 against 1.8 + 2.5 for ``add_rms_norm`` and XLA's router dot (run 9; the sweep of ``block_e``, ``block_d``
and ``num_warps`` was ``benchmarks/kernels.py --groups arnr`` at 35c0874). Rows (M <= 16)
are a ``fori_loop`` inside the program. E need not be a multiple of ``block_e`` or a power of
two, nor D a power of two (masked loads and stores).

Shapes: h, a [M, D] (bf16, or f32), 1 <= M <= 16; w_norm [D] (any float dtype, used in fp32);
router_w [E, D] fp32 (bf16 accepted, upcast). Outputs s, x [M, D] h.dtype; logits [M, E] f32.

The decode step runs it at batch 1 (``DecodePlan.router_in_norm``; H200 run 34: 1.89 us against
2.78 for ``add_rms_norm`` + XLA's router dot; slower at batch 8: 7.33 against 6.35).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import add_rms_norm as ARN
from flint_jax.pallas.moe.routing import moe_router_logits

__all__ = ["add_rms_norm_router", "add_rms_norm_router_reference"]

MAX_ROWS = 16
_TILE_ELEMS = 8192   # default block_e * block_d: 64 fp32 registers per thread with 4 warps


def _kernel(h_ref, a_ref, wn_ref, rw_ref, s_ref, x_ref, l_ref, *x16_refs, m, d, dp, n_exp,
            block_e, block_d, eps):
  pid = pl.program_id(0)
  cols = jnp.arange(dp, dtype=jnp.int32)
  cmask = cols < d
  e_idx = pid * block_e + jnp.arange(block_e, dtype=jnp.int32)
  emask = e_idx < n_exp
  w_norm = plgpu.load(wn_ref.at[cols], mask=cmask, other=0).astype(jnp.float32)
  n_chunks = dp // block_d

  def load_router(c):
    cc = c * block_d + jnp.arange(block_d, dtype=jnp.int32)
    return plgpu.load(rw_ref.at[e_idx[:, None], cc[None, :]],
                      mask=emask[:, None] & (cc < d)[None, :], other=0).astype(jnp.float32)

  def logits_part(wt, xb):
    """[block_e] fp32 partial logits of one chunk: sum_j W[e, j] * f32(x[j])."""
    return jnp.sum(wt * xb.astype(jnp.float32)[None, :], axis=1)

  w_full = load_router(0) if n_chunks == 1 else None   # loaded once, reused by every row

  def row(t, carry):
    h = plgpu.load(h_ref.at[t, cols], mask=cmask, other=0)
    a = ARN.load_y_row(a_ref, t, cols, cmask, h.dtype)
    s = (h.astype(jnp.float32) + a.astype(jnp.float32)).astype(s_ref.dtype)
    s32 = s.astype(jnp.float32)
    x = ARN._normalize(s32, w_norm, d, eps).astype(x_ref.dtype)   # add_rms_norm, op for op

    @pl.when(pid == 0)
    def _():
      plgpu.store(s_ref.at[t, cols], s, mask=cmask)
      plgpu.store(x_ref.at[t, cols], x, mask=cmask)
      if x16_refs:   # the MoE gate_up's f16 operand, as add_rms_norm(x16=True) writes it
        ARN._store_x16(*x16_refs, t, x, cols, cmask)

    if n_chunks == 1:
      acc = logits_part(w_full, x)
    else:
      # the same elementwise formula per chunk, with the full row's mean square
      ms = jnp.sum(s32 * s32, axis=0) / d
      rstd = lax.rsqrt(ms + eps)
      acc = jnp.zeros((block_e,), jnp.float32)
      for c in range(n_chunks):
        cc = c * block_d + jnp.arange(block_d, dtype=jnp.int32)
        ccm = cc < d
        hc = plgpu.load(h_ref.at[t, cc], mask=ccm, other=0)
        ac = ARN.load_y_row(a_ref, t, cc, ccm, hc.dtype)
        wc = plgpu.load(wn_ref.at[cc], mask=ccm, other=0).astype(jnp.float32)
        sc = (hc.astype(jnp.float32) + ac.astype(jnp.float32)).astype(s_ref.dtype)
        xc = (wc * (sc.astype(jnp.float32) * rstd)).astype(x_ref.dtype)
        acc = acc + logits_part(load_router(c), xc)
    plgpu.store(l_ref.at[t, e_idx], acc, mask=emask)
    return carry

  lax.fori_loop(0, m, row, 0)


def _check(h, a, w_norm, router_w):
  C.check(h.ndim == 2, f"h must be [M, D], got {h.shape=}")
  m, d = h.shape
  C.check(1 <= m <= MAX_ROWS, f"add_rms_norm_router handles 1..{MAX_ROWS} rows, got M={m}")
  ARN.check_y(h, a, "a")
  C.check(w_norm.shape == (d,), f"w_norm must be [D={d}], got {w_norm.shape=}")
  C.check(router_w.ndim == 2 and router_w.shape[1] == d,
          f"router_w must be [E, D={d}], got {router_w.shape=}")
  C.check(jnp.issubdtype(router_w.dtype, jnp.floating),
          f"router_w must be a float array (fp32), got {router_w.dtype=}")


def _tuning(d, n_exp, block_e, block_d, num_warps):
  dp = C.next_pow2(d)
  # 4 router rows per program: with the default block_d the whole [4, Dp] fp32 tile (64
  # registers per thread at 4 warps) is loaded before the norm, not after it as with 8 rows in
  # two column chunks
  block_e = block_e or min(4, C.next_pow2(n_exp))
  C.check(C.is_pow2(block_e), f"block_e must be a power of two, got {block_e=}")
  block_d = block_d or min(dp, max(16, _TILE_ELEMS // block_e))
  C.check(C.is_pow2(block_d) and block_d <= dp,
          f"block_d must be a power of two <= {dp} (D={d} padded), got {block_d=}")
  return dp, block_e, block_d, num_warps or ARN._num_warps(dp)


@functools.partial(jax.jit, static_argnames=("eps", "block_e", "block_d", "num_warps", "x16",
                                             "early_trigger", "interpret"))
def add_rms_norm_router(h, a, w_norm, router_w, *, eps: float = 1e-6, block_e: int | None = None,
                        block_d: int | None = None, num_warps: int | None = None,
                        x16: bool = False, early_trigger: bool = True, interpret: bool = False):
  """(s, x, logits) = (bf16(h + a), RMSNorm(s) * w_norm, f32(x) . f32(router_w)^T); one launch.

  h [M, D] (M <= 16), a [M, D] (h's dtype) or fp32 split-K partials [S, M, D] (summed in the
  kernel, as ``add_rms_norm``), w_norm [D], router_w [E, D] fp32. Tuning: ``block_e`` router rows
  per program (power of two; default 4 -> E / 4 programs), ``block_d`` columns per router tile
  (power of two dividing next_pow2(D); default 8192 / block_e), ``num_warps`` (default
  ``add_rms_norm``'s, which keeps its row reduction order). ``x16``: also returns
  ``nvfp4_gemv.x16_operand(x)`` (x16 [M, D] f16, inv [M] f32), written by program 0 as
  ``add_rms_norm(x16=True)`` does (the f16 MoE gate_up's operand): (s, x, logits, x16, inv).
  ``early_trigger``: the kernel lets the next one launch first (``pdl``).
  """
  _check(h, a, w_norm, router_w)
  m, d = h.shape
  n_exp = router_w.shape[0]
  dp, block_e, block_d, num_warps = _tuning(d, n_exp, block_e, block_d, num_warps)
  kernel = functools.partial(_kernel, m=m, d=d, dp=dp, n_exp=n_exp, block_e=block_e,
                             block_d=block_d, eps=eps)
  out_shape = (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, h.dtype),
               jax.ShapeDtypeStruct((m, n_exp), jnp.float32))
  if x16:
    C.check(d % 4 == 0, f"x16 needs D % 4 == 0, got {d=}")
    out_shape += (jax.ShapeDtypeStruct(h.shape, jnp.float16),
                  jax.ShapeDtypeStruct((m,), jnp.float32))
  parts = f"_splits{a.shape[0]}" if a.ndim == 3 else ""
  return C.pallas_call(
      kernel, out_shape=out_shape, grid=(C.cdiv(n_exp, block_e),),
      compiler_params=C.compiler_params(num_warps, 1), interpret=interpret,
      early_trigger=early_trigger,
      name=(f"flint_add_rms_norm_router{parts}_d{d}_e{n_exp}_be{block_e}_bd{block_d}"
            f"{'_x16' if x16 else ''}"),
  )(h, a, w_norm, router_w)


def add_rms_norm_router_reference(h, a, w_norm, router_w, *, eps: float = 1e-6,
                                  **unused_tuning):
  """Plain jnp: ``add_rms_norm_reference``'s formula, then ``moe_router_logits`` of the rounded x.

  The two roundings (s and x to h.dtype) are forced with ``lax.reduce_precision``: under jit, XLA
  (``xla_allow_excess_precision``, on by default) may otherwise drop a bf16 round trip
  ``f32(bf16(v))`` and normalise the *unrounded* fp32 sum h + a (``add_rms_norm_reference``
  does, on CPU: ~25% of its x differ from the contract by one bf16 ulp) or multiply the router
  with the unrounded x.
  """
  del unused_tuning
  if a.ndim == 3:
    ARN.check_parts(h, a)
  return _add_rms_norm_router_reference(h, a, w_norm, router_w, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def _add_rms_norm_router_reference(h, a, w_norm, router_w, *, eps):
  dt = h.dtype
  if a.ndim == 3:   # split-K partials: the projection's sum and output rounding first
    a = ARN.sum_parts_reference(a, dt)
  s32 = ARN.round_trip(h.astype(jnp.float32) + a.astype(jnp.float32), dt)
  ms = jnp.mean(s32 * s32, axis=-1, keepdims=True)
  x32 = ARN.round_trip(w_norm.astype(jnp.float32) * (s32 * lax.rsqrt(ms + eps)), dt)
  return s32.astype(dt), x32.astype(dt), moe_router_logits(x32, router_w)

