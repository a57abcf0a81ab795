"""The routed MoE's combine: the expert outputs weighted by their routing, plus the shared
expert, added to the residual and normalised for the next block.

``moe_combine_add_rms_norm(h, y, top_logits, w_norm)``: one program per token (its own kernel:
the decode step's at batch > 1). Per token t, with l_j its selected router logits in top-k order
and w_j = sigmoid(l_j) / sum_j sigmoid(l_j) in fp32 (the sigmoids added in top-k order):

  moe    = bf16(sum_j w_j f32(y[t * top_k + j, t]) + f32(y[-1, t]))   (fp32, top-k order)
  s      = bf16(h + moe)                          (``add_rms_norm``'s rules from here on)
  x_next = bf16(w_norm * (f32(s) * rsqrt(mean(f32(s)^2) + eps)))

``down_combine_finish``: the same combine done by the MoE down kernel's last program(s) instead
(``moe_decode_routed_combine``: the decode step's at batch 1, H200 run 59: the down kernel 9.6
us against 6.4 + 3.1 for the pair; slower at batch 8, where one program's serial combine of 8
rows makes the down kernel 31 us longer), on two levels of arrival counters in the cache's
``KVCache.counters``; with ``norm=False`` it stops at s and per-column-block sums of squares,
normalised by the next q|k|v kernel as it loads s (``multi_gemv(rms_sumsq=)``, H200 runs
125-126). (The same at batch > 1 with per-token counters, measured slower in runs 133-134, was
retired after 35c0874.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import add_rms_norm as ARN
from flint_jax.pallas.moe.routing import moe_route_weights

__all__ = ["moe_combine_add_rms_norm", "moe_combine_add_rms_norm_reference",
           "down_combine_finish"]


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "early_trigger", "interpret"))
def moe_combine_add_rms_norm(h, y, top_logits, w_norm, *, eps: float = 1e-6,
                             num_warps: int | None = None, early_trigger: bool = True,
                             interpret: bool = False):
  """(s, x_next): MoE combine + residual add + RMSNorm in one pallas_call (grid (M,)).

  h [M, D] residual (bf16), y [M * top_k + 1, M, D] and top_logits [M, top_k] f32 (its
  ``route.logits``: the selected router logits in top-k order) from ``moe_decode_routed``,
  w_norm [D] (the next block's norm weight); top_k is top_logits.shape[1]. Per token t, with
  l_j = top_logits[t, j] and w_j = sigmoid(l_j) / sum_j sigmoid(l_j) in fp32 (the sigmoids added
  in top-k order):
    moe  = bf16(sum_j w_j f32(y[t * top_k + j, t]) + f32(y[-1, t]))   (fp32, top-k order)
    s    = bf16(h + moe)                         (``add_rms_norm``'s rules from here on)
    x_next = bf16(w_norm * (f32(s) * rsqrt(mean(f32(s)^2) + eps)))
  """
  C.check(h.ndim == 2, f"h must be [M, D], got {h.shape=}")
  m, d = h.shape
  top_k = check_top_logits(top_logits, m)
  u = m * top_k
  C.check(y.shape == (u + 1, m, d) and y.dtype == h.dtype,
          f"y must be [{u + 1}, {m}, {d}] {h.dtype}, got {y.shape=} {y.dtype=}")
  C.check(w_norm.shape == (d,), f"w_norm must be [D={d}], got {w_norm.shape=}")
  dp = C.next_pow2(d)
  kernel = functools.partial(_combine_add_rms_norm_kernel, top_k=top_k, u=u, d=d, dp=dp, eps=eps)
  out_shape = (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, h.dtype))
  return C.pallas_call(
      kernel, out_shape=out_shape, grid=(m,),
      compiler_params=C.compiler_params(num_warps or ARN._num_warps(dp), 1),
      interpret=interpret, early_trigger=early_trigger,
      name=f"flint_moe_combine_add_rms_norm_d{d}_k{top_k}",
  )(y, top_logits, h, w_norm)


def moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, *, eps: float = 1e-6,
                                       **unused_tuning):
  """Plain jnp: moe = bf16(sum_j w_j y[t*k+j, t] + y[-1, t]) (fp32, top-k order, weights
  ``moe_route_weights(top_logits)``), then ``add_rms_norm_reference(h, moe, w_norm)``."""
  del unused_tuning
  return _moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def _moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, *, eps):
  m, d = h.shape
  top_k = check_top_logits(top_logits, m)
  w = moe_route_weights(top_logits)
  yk = y[:m * top_k].reshape(m, top_k, m, d)[jnp.arange(m), :, jnp.arange(m)]   # [M, k, D]
  tot = jnp.zeros((m, d), jnp.float32)
  for j in range(top_k):                                               # top-k order
    tot = tot + w[:, j:j + 1] * yk[:, j].astype(jnp.float32)
  moe = (tot + y[m * top_k].astype(jnp.float32)).astype(y.dtype)
  return ARN.add_rms_norm_reference(h, moe, w_norm, eps=eps)


def check_top_logits(top_logits, m) -> int:
  """Checks the selected logits [M, top_k] f32 (``MoERoute.logits``); returns top_k."""
  C.check(top_logits.ndim == 2 and top_logits.shape[0] == m and top_logits.shape[1] >= 1
          and top_logits.dtype == jnp.float32,
          f"top_logits must be the selected router logits f32 [M={m}, top_k] (MoERoute.logits), "
          f"got {top_logits.shape=} {top_logits.dtype=}")
  return top_logits.shape[1]


def _combine_add_rms_norm_kernel(y_ref, l_ref, h_ref, w_ref, s_ref, o_ref, *, top_k, u, d, dp,
                                 eps):
  _combine_add_rms_norm_row(y_ref, l_ref, h_ref, w_ref, s_ref, o_ref, pl.program_id(0),
                            top_k=top_k, u=u, d=d, dp=dp, eps=eps)


def _combine_add_rms_norm_row(y_ref, l_ref, h_ref, w_ref, s_ref, o_ref, t, *, top_k, u, d, dp,
                              eps):
  """Token t of ``moe_combine_add_rms_norm``."""
  def y_row(slot, cols, mask):
    return plgpu.load(y_ref.at[slot, t, cols], mask=mask, other=0)

  _combine_row(y_row, l_ref, h_ref, w_ref, s_ref, o_ref, t, top_k=top_k, u=u, d=d, dp=dp,
               eps=eps)


def _combine_s(y_row, l_ref, h_ref, t, cols, mask, *, top_k, u, dtype):
  """s = bf16(h + moe) of token t at columns ``cols`` (``mask``: the real ones, the others 0;
  None: all real);
  ``y_row(slot, cols, mask)`` loads y[slot, t] (slot t * top_k + j: the token's j-th expert;
  slot u: the shared expert)."""
  # the selected logits, top-k order (scalar loads: stored by the gate_up kernel)
  sig = [jax.nn.sigmoid(l_ref[t, j]) for j in range(top_k)]
  den = sig[0]
  for sj in sig[1:]:
    den = den + sj
  tot = jnp.zeros(cols.shape, jnp.float32)
  for j, sj in enumerate(sig):                                          # top-k order
    tot = tot + (sj / den) * y_row(t * top_k + j, cols, mask).astype(jnp.float32)
  ys = y_row(u, cols, mask)
  moe = (tot + ys.astype(jnp.float32)).astype(ys.dtype)                 # rounded as y is
  h = plgpu.load(h_ref.at[t, cols], mask=mask, other=None if mask is None else 0)
  return (h.astype(jnp.float32) + moe.astype(jnp.float32)).astype(dtype)


def _combine_row(y_row, l_ref, h_ref, w_ref, s_ref, o_ref, t, *, top_k, u, d, dp, eps,
                 x16_refs=()):
  """The combine + residual add + RMSNorm of token t (``_combine_s``, then ``add_rms_norm``'s
  normalisation); ``x16_refs``: (x16 [M, D] f16, inv [M] f32), the normalised row's
  ``x16_operand`` (as ``add_rms_norm(x16=True)`` writes it)."""
  cols = jnp.arange(dp, dtype=jnp.int32)
  mask = cols < d
  s = _combine_s(y_row, l_ref, h_ref, t, cols, mask, top_k=top_k, u=u, dtype=s_ref.dtype)
  w = plgpu.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
  out = ARN._normalize(s.astype(jnp.float32), w, d, eps)
  plgpu.store(s_ref.at[t, cols], s, mask=mask)
  out = out.astype(o_ref.dtype)
  plgpu.store(o_ref.at[t, cols], out, mask=mask)
  if x16_refs:
    ARN._store_x16(*x16_refs, t, out, cols, mask)


# ------------------------------------------------------------------------------------------
# The combine in the down kernel's last program(s)


def down_combine_finish(r, *, m, d, n_slots, progs_per_block, top_k, base, eps, dp,
                        interpret, bn=None, norm=True, x16=False):
  """The tail of the down kernel with ``combine`` (``down._down_kernel``): every program counts
  itself done on its column block's counter entry (``base + 1 + block``); the last of a block
  writes that block's s and its sum of squares (``norm=False``), or counts the block done on
  entry ``base``, and the last block's program combines and normalises every token's row. Each
  entry returns to zero."""
  cnt = r["cmb_counter_out"]
  n_blocks = pl.num_programs(0)
  jb = pl.program_id(0)
  if not interpret:   # every thread's stores precede the atomic (no CPU lowering)
    plgpu.debug_barrier()
  old = plgpu.atomic_add(cnt, (base + 1 + jb,), jnp.int32(1))

  @pl.when(old == progs_per_block - 1)
  def _():
    plgpu.store(cnt.at[base + 1 + jb], jnp.int32(0))
    if not norm:   # this block's columns of s and their sum of squares; no second level
      for t in range(m):
        _combine_block(r, jnp.int32(t), jb, m=m, top_k=top_k, n_slots=n_slots, bn=bn)
      return
    old2 = plgpu.atomic_add(cnt, (jnp.int32(base),), jnp.int32(1))

    @pl.when(old2 == n_blocks - 1)
    def _():
      plgpu.store(cnt.at[jnp.int32(base)], jnp.int32(0))
      for t in range(m):
        _combine_row_flat(r, t, m=m, top_k=top_k, n_slots=n_slots, d=d, dp=dp, eps=eps,
                          x16=x16)


def _combine_block(r, t, jb, *, m, top_k, n_slots, bn):
  """Token t's s = bf16(h + moe) at the columns of block jb, stored with its fp32 sum of
  squares ``cmb_ss[t, jb]`` (the combine with ``norm=False``; y read back volatile)."""
  y_ref = r["out"]
  cols = pl.multiple_of(jb * bn, bn) + jnp.arange(bn, dtype=jnp.int32)

  def y_row(u, cols, mask):   # y[u, t] of the [U + 1, M, D] view
    return plgpu.load(y_ref.at[u * m + t, cols], mask=mask, volatile=True)

  # every column of a block is real (D % bn == 0): no mask
  s = _combine_s(y_row, r["cmb_logits"], r["cmb_h"], t, cols, None, top_k=top_k, u=n_slots,
                 dtype=r["cmb_s"].dtype)
  plgpu.store(r["cmb_s"].at[t, cols], s)
  s32 = s.astype(jnp.float32)
  r["cmb_ss"][t, jb] = jnp.sum(s32 * s32)


def _combine_row_flat(r, t, *, m, top_k, n_slots, d, dp, eps, x16=False):
  """``moe_combine_add_rms_norm``'s row code for token t, reading y from the down kernel's own
  output [(U + 1) * M, D] (volatile: other programs wrote it during this kernel); ``x16``: also
  x_next's f16 operand (``cmb_x16`` / ``cmb_xinv``, ``nvfp4_gemv.x16_operand``)."""
  y_ref = r["out"]
  t = jnp.int32(t)

  def y_row(u, cols, mask):   # y[u, t] of the [U + 1, M, D] view
    return plgpu.load(y_ref.at[u * m + t, cols], mask=mask, other=0, volatile=True)

  _combine_row(y_row, r["cmb_logits"], r["cmb_h"], r["cmb_w"], r["cmb_s"], r["cmb_x"], t,
               top_k=top_k, u=n_slots, d=d, dp=dp, eps=eps,
               x16_refs=(r["cmb_x16"], r["cmb_xinv"]) if x16 else ())
