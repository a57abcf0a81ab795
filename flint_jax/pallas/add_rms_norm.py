"""Fused residual add + RMSNorm, and plain RMSNorm, Pallas Triton backend.

``add_rms_norm(h, y, w)``: ``s = h + y`` (bf16 add, as the reference model: one rounding of the
fp32 sum), ``out = bf16(w * (f32(s) * rsqrt(mean(f32(s)^2) + eps)))`` with the weight multiplied
in fp32 **before** the cast (Flint's RMSNorm, FLINT_SPEC section 3; not Llama's order). Returns
``(s, out)``: the new residual stream and the normalised input of the next block. The norm is
computed from the *rounded* ``s`` (what the reference's next layer sees).

``add_rms_norm(h, y_parts, w)`` with fp32 split-K partials ``y_parts [S, M, D]`` (a split-K
GEMV's unsummed output, e.g. ``nvfp4_gemv(..., sum_splits=False)``): also fuses the split-K sum,
``y = h.dtype(sum_s y_parts[s])`` in fp32 (s = 0, 1, ... in order), rounded to h's dtype before
the add exactly as ``jnp.sum(y_parts, axis=0).astype(h.dtype)`` then ``add_rms_norm(h, y, w)``
(the reference model rounds its projection outputs to bf16). One XLA reduce kernel less.

``rms_norm(x, w)``: the same without the add.

``moe.moe_combine_add_rms_norm`` fuses the MoE combine in front of the same add + norm (it uses
``_normalize`` and ``_num_warps`` from here: keep them in step).

One program per row; the row (D = 2048 for Flint) is one block, padded to a power of two with a
masked load when D is not one; the S partials (S small) are a static loop of row loads. Shapes:
h, y, x [M, D] (any M) bf16 or f32, or y fp32 [S, M, D]; w [D] (any float dtype, used in fp32);
outputs have h's / x's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import nvfp4_gemv as NV

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


def _normalize(s32, w32, d, eps):
  """w * (s * rsqrt(mean(s^2) + eps)) in fp32; s32 padded entries are zero."""
  ms = jnp.sum(s32 * s32, axis=0) / d
  return w32 * (s32 * jax.lax.rsqrt(ms + eps))


def _add_rms_norm_kernel(h_ref, y_ref, w_ref, s_ref, o_ref, *x16_refs, d, dp, eps):
  _add_rms_norm_row(h_ref, y_ref, w_ref, s_ref, o_ref, pl.program_id(0), d=d, dp=dp, eps=eps,
                    x16_refs=x16_refs)


def load_y_row(y_ref, row, cols, mask, dtype):
  """Row ``row`` of a projection output: ``y_ref`` [M, D], or fp32 split-K partials [S, M, D]
  summed in fp32 (s = 0, 1, ... in order, as ``jnp.sum(axis=0)``) and rounded to ``dtype`` (the
  projection's output rounding). Also used by ``add_rms_norm_router``."""
  if len(y_ref.shape) == 2:
    return plgpu.load(y_ref.at[row, cols], mask=mask, other=0)
  y = None
  for part in range(y_ref.shape[0]):   # S is 2..4
    p = plgpu.load(y_ref.at[part, row, cols], mask=mask, other=0)
    y = p if y is None else y + p
  return y.astype(dtype)


def _add_rms_norm_row(h_ref, y_ref, w_ref, s_ref, o_ref, row, *, d, dp, eps, x16_refs=()):
  """Row ``row`` of ``add_rms_norm``. ``y_ref`` [M, D], or
  fp32 split-K partials [S, M, D]: summed in fp32 and rounded to h's dtype first. x16_refs:
  (x16 [M, D] f16, inv [M] f32) outputs, the normalised row as ``x16_operand`` gives it."""
  cols = jnp.arange(dp, dtype=jnp.int32)
  mask = cols < d
  h = plgpu.load(h_ref.at[row, cols], mask=mask, other=0)           # [Dp]
  y = load_y_row(y_ref, row, cols, mask, h.dtype)
  w = plgpu.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
  s = (h.astype(jnp.float32) + y.astype(jnp.float32)).astype(s_ref.dtype)
  out = _normalize(s.astype(jnp.float32), w, d, eps)
  plgpu.store(s_ref.at[row, cols], s, mask=mask)
  out = out.astype(o_ref.dtype)
  plgpu.store(o_ref.at[row, cols], out, mask=mask)
  if x16_refs:
    _store_x16(*x16_refs, row, out, cols, mask)


def _store_x16(x16_ref, inv_ref, row, out, cols, mask):
  """Row ``row`` of ``nvfp4_gemv.x16_operand(out)`` (padded entries of out are zero)."""
  x16, inv = NV.to_x16(out.astype(jnp.float32), axis=0)
  plgpu.store(x16_ref.at[row, NV.x16_position(cols)], x16, mask=mask)
  inv_ref[row] = inv[0]


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, d, dp, eps):
  _rms_norm_row(x_ref, w_ref, o_ref, pl.program_id(0), d=d, dp=dp, eps=eps)


def _rms_norm_row(x_ref, w_ref, o_ref, row, *, d, dp, eps):
  """Row ``row`` of ``rms_norm``."""
  cols = jnp.arange(dp, dtype=jnp.int32)
  mask = cols < d
  x = plgpu.load(x_ref.at[row, cols], mask=mask, other=0).astype(jnp.float32)
  w = plgpu.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
  plgpu.store(o_ref.at[row, cols], _normalize(x, w, d, eps).astype(o_ref.dtype), mask=mask)


def _check(x, w, name):
  C.check(x.ndim == 2, f"{name} must be [M, D], got {x.shape=}")
  C.check(w.shape == (x.shape[1],), f"weight must be [D={x.shape[1]}], got {w.shape=}")


def check_parts(h, y):
  C.check(y.shape[1:] == h.shape and y.dtype == jnp.float32 and y.shape[0] >= 1,
          f"split-K partials y must be float32 [S, M, D] with [M, D] = {h.shape}, got "
          f"{y.shape=} {y.dtype=}")


def check_y(h, y, name="y"):
  """The projection output added to h: [M, D] in h's dtype, or fp32 split-K partials."""
  if y.ndim == 3:
    check_parts(h, y)
  else:
    C.check(y.shape == h.shape and y.dtype == h.dtype,
            f"{name} must match h (or be float32 [S, M, D] split-K partials), got "
            f"{y.shape=} {y.dtype=} vs {h.shape=} {h.dtype=}")


def round_trip(v32, dtype):
  """f32(dtype(v32)) that XLA cannot elide (reduce_precision; exact for bf16 / f16): under jit
  XLA may otherwise drop an f32 -> bf16 -> f32 round trip (``xla_allow_excess_precision``)."""
  if jnp.dtype(dtype) == jnp.float32:
    return v32
  fi = jnp.finfo(dtype)
  return jax.lax.reduce_precision(v32, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def sum_parts_reference(y, dtype):
  """Plain jnp: split-K partials [S, M, D] summed in fp32 and rounded to ``dtype`` (forced)."""
  return round_trip(jnp.sum(y, axis=0), dtype).astype(dtype)


def _num_warps(dp: int) -> int:
  # One warp per 512 elements, 1..8 warps (Triton's layer-norm tutorial heuristic).
  return max(1, min(8, dp // 512))


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "x16", "early_trigger",
                                             "interpret"))
def add_rms_norm(h, y, w, *, eps: float = 1e-6, num_warps: int | None = None,
                 x16: bool = False, early_trigger: bool = True, interpret: bool = False):
  """(s, out) = (h + y, RMSNorm(h + y) * w); h [M, D], w [D]; y [M, D] (h's dtype) or fp32
  split-K partials [S, M, D], summed in the kernel (module docstring). ``x16``: also returns
  ``nvfp4_gemv.x16_operand(out)`` (x16 [M, D] f16, inv [M] f32) from the same kernel, the
  operand of the MoE gate_up's f16 products (``moe.MoEPlan.gate_up_f16``): (s, out, x16, inv).
  ``early_trigger``: the kernel lets the next one launch first (``pdl``)."""
  _check(h, w, "h")
  check_y(h, y)
  m, d = h.shape
  C.check(not x16 or d % 4 == 0, f"x16 needs D % 4 == 0, got {d=}")
  dp = C.next_pow2(d)
  parts = f"_splits{y.shape[0]}" if y.ndim == 3 else ""
  kernel = functools.partial(_add_rms_norm_kernel, d=d, dp=dp, eps=eps)
  out_shape = (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, h.dtype))
  if x16:
    out_shape += (jax.ShapeDtypeStruct(h.shape, jnp.float16),
                  jax.ShapeDtypeStruct((m,), jnp.float32))
  return C.pallas_call(
      kernel, out_shape=out_shape, grid=(m,),
      compiler_params=C.compiler_params(num_warps or _num_warps(dp), 1),
      interpret=interpret, early_trigger=early_trigger,
      name=f"flint_add_rms_norm{parts}_d{d}" + ("_x16" if x16 else ""),
  )(h, y, w)


def add_rms_norm_reference(h, y, w, *, eps: float = 1e-6, **unused_tuning):
  """Plain jnp: s = h + y (rounded to h.dtype), then rms_norm_reference(s); fp32 partials
  y [S, M, D] are summed first: ``jnp.sum(y, axis=0).astype(h.dtype)`` (rounding forced)."""
  del unused_tuning
  if y.ndim == 3:
    check_parts(h, y)
  return _add_rms_norm_reference(h, y, w, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def _add_rms_norm_reference(h, y, w, *, eps):
  if y.ndim == 3:
    y = sum_parts_reference(y, h.dtype)
  s = h + y
  return s, _rms_norm_reference(s, w, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "early_trigger", "interpret"))
def rms_norm(x, w, *, eps: float = 1e-6, num_warps: int | None = None,
             early_trigger: bool = True, interpret: bool = False):
  """bf16(w * (x * rsqrt(mean(x^2) + eps))) row-wise, math in fp32; x [M, D], w [D]."""
  _check(x, w, "x")
  m, d = x.shape
  dp = C.next_pow2(d)
  kernel = functools.partial(_rms_norm_kernel, d=d, dp=dp, eps=eps)
  return C.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(m,),
      compiler_params=C.compiler_params(num_warps or _num_warps(dp), 1),
      interpret=interpret, early_trigger=early_trigger, name=f"flint_rms_norm_d{d}",
  )(x, w)


def rms_norm_reference(x, w, *, eps: float = 1e-6, **unused_tuning):
  """Plain jnp: x.dtype(w32 * (x32 * rsqrt(mean(x32^2) + eps)))."""
  del unused_tuning
  return _rms_norm_reference(x, w, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def _rms_norm_reference(x, w, *, eps):
  x32 = x.astype(jnp.float32)
  ms = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  return (w.astype(jnp.float32) * (x32 * jax.lax.rsqrt(ms + eps))).astype(x.dtype)
