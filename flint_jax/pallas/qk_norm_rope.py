"""Per-head Q/K RMSNorm + NeoX RoPE + KV-cache write (decode, one token per row): the reference
and the row code ``attention_block.qk_norm_rope_attention`` runs in its split programs.

``qk_norm_rope_reference(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache)``:

1. ``q`` [B, H, Dh] and ``k`` [B, KVH, Dh]: per-head RMSNorm over Dh with one weight vector each
   (fp32 math, weight multiplied in fp32 before the cast), **rounded to bf16** (as the reference
   model, which feeds the rounded tensor to RoPE).
2. Sliding layers only (``rope=True``): NeoX "rotate_half" RoPE over all Dh dims at the row's
   position, angles in fp32 (``inv_freq[i] = theta^(-2i/Dh)``, ``rope_inv_freq``: the
   expression of ``flint_jax.layers.rope_angles``), cos/sin in fp32,
   ``[x1 cos - x2 sin, x2 cos + x1 sin]`` rounded once to bf16.
3. Writes the processed ``k`` and the raw ``v`` [B, KVH, Dh] into the row's cache slot:
   ``position`` for a full layer (dropped if position >= S), ``position % S`` for a ring.

Caches are ``[B, KVH, S, Dh]``, or the layer-stacked ``[L, B, KVH, S, Dh]`` of
``flint_jax.cache.KVCache`` with ``layer`` selecting the layer. Returns
``(q_out [B, H, Dh], k_cache, v_cache)``. (Its own one-program-per-row kernel, ``qk_norm_rope``,
was retired after 35c0874 with the split attention path.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flint_jax import layers
from flint_jax.pallas import _common as C

__all__ = ["qk_norm_rope_reference", "rope_inv_freq"]


def rope_inv_freq(head_dim: int, theta: float):
  """[Dh/2] f32 theta^(-2i/Dh): ``flint_jax.layers.rope_inv_freq``'s host constant (the values
  the XLA path uses; no XLA kernel per step)."""
  return jnp.asarray(layers.rope_inv_freq(head_dim, theta))


def load_rows(ref, b, rows, cols, dt):
  """ref[b, rows, cols] as f32; ``ref`` [B, N, Dh], or fp32 split-K partials [S, B, N, Dh]
  summed in fp32 (s = 0, 1, ... in order) and rounded to ``dt`` (the projection's output
  rounding: what the unsplit GEMV would have stored)."""
  if len(ref.shape) == 3:
    return ref[b, rows, cols].astype(jnp.float32)
  tot = ref[0, b, rows, cols]
  for part in range(1, ref.shape[0]):
    tot = tot + ref[part, b, rows, cols]
  return tot.astype(dt).astype(jnp.float32)


def _norm_rope_rows(ref, b, n, np_, half, w1, w2, eps, rope, cos, sin, offset=0, dt=None):
  """Loads rows offset..offset+n-1 of ref[b] (padded to np_ by repeating the last) as two halves
  (``load_rows``: split-K partials are summed and rounded to ``dt``), RMSNorm (rounded), optional
  RoPE -> halves in ``dt`` (default ref.dtype)."""
  dt = dt or ref.dtype
  x1, x2 = load_halves(ref, b, n, np_, half, offset, dt)
  return norm_rope_halves(x1, x2, w1, w2, eps, rope, cos, sin, dt)


def load_halves(ref, b, n, np_, half, offset, dt):
  """Rows offset..offset+n-1 of ref[b] (padded to np_ by repeating the last) as two f32
  halves [Np, Dh/2] (``load_rows``)."""
  rows = C.row_load_index(n, np_, offset)
  return (load_rows(ref, b, rows, pl.ds(0, half), dt),
          load_rows(ref, b, rows, pl.ds(half, half), dt))


def norm_rope_halves(x1, x2, w1, w2, eps, rope, cos, sin, dt):
  """``_norm_rope_rows``'s arithmetic on loaded halves: RMSNorm (rounded), optional RoPE ->
  halves in ``dt``."""
  half = x1.shape[-1]
  ms = (jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / (2 * half)
  r = jax.lax.rsqrt(ms + eps)[:, None]                          # [Np, 1]
  n1 = (w1[None, :] * (x1 * r)).astype(dt).astype(jnp.float32)
  n2 = (w2[None, :] * (x2 * r)).astype(dt).astype(jnp.float32)
  if rope:
    n1, n2 = n1 * cos - n2 * sin, n2 * cos + n1 * sin
  return n1.astype(dt), n2.astype(dt)


def _validate(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache, layer):
  C.check(q.ndim == 3, f"q must be [B, H, Dh], got {q.shape=}")
  b, h, dh = q.shape
  C.check(k.ndim == 3 and k.shape[0] == b and k.shape[2] == dh,
          f"k must be [B={b}, KVH, Dh={dh}], got {k.shape=}")
  C.check(v.shape == k.shape, f"v must match k, got {v.shape=} vs {k.shape=}")
  C.check(q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype,
          "q, k, v and the caches must share a dtype")
  C.check(dh % 2 == 0 and C.is_pow2(dh // 2), f"Dh/2 must be a power of two, got {dh=}")
  C.check(q_norm_w.shape == (dh,) and k_norm_w.shape == (dh,), "norm weights must be [Dh]")
  C.check(positions.shape == (b,), f"positions must be [B={b}], got {positions.shape=}")
  kvh = k.shape[1]
  want = 4 if layer is None else 5
  C.check(k_cache.ndim == want and k_cache.shape == v_cache.shape,
          f"caches must be {'[B, KVH, S, Dh]' if want == 4 else '[L, B, KVH, S, Dh]'} "
          f"(layer={'None' if layer is None else 'given'}), got {k_cache.shape=} "
          f"{v_cache.shape=}")
  C.check(k_cache.shape[-4:-2] == (b, kvh) and k_cache.shape[-1] == dh,
          f"cache {k_cache.shape=} does not match B={b}, KVH={kvh}, Dh={dh}")
  return b, h, kvh, dh


def qk_norm_rope_reference(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache,
                           layer=None, *, rope: bool, ring: bool, theta: float = 10000.0,
                           eps: float = 1e-6, **unused_tuning):
  """Plain jnp with the same rounding: norm -> bf16 -> RoPE in fp32 -> bf16; cache .at[].set."""
  del unused_tuning
  return _qk_norm_rope_reference(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache,
                                 layer, rope=rope, ring=ring, theta=theta, eps=eps)


@functools.partial(jax.jit, static_argnames=("rope", "ring", "theta", "eps"))
def _qk_norm_rope_reference(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache, layer, *,
                            rope, ring, theta, eps):

  def norm(x, w):
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (w.astype(jnp.float32) * (x32 * jax.lax.rsqrt(ms + eps))).astype(x.dtype)

  def apply_rope(x):
    dh = x.shape[-1]
    ang = positions.astype(jnp.float32)[:, None] * rope_inv_freq(dh, theta)[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : dh // 2], xf[..., dh // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

  qn, kn = norm(q, q_norm_w), norm(k, k_norm_w)
  if rope:
    qn, kn = apply_rope(qn), apply_rope(kn)
  s_len = k_cache.shape[-2]
  pos = positions.astype(jnp.int32)
  slot = pos % s_len if ring else pos
  bidx = jnp.arange(q.shape[0])
  # Out-of-range full-cache writes are dropped (mode="drop"), like the kernel's masked store.
  slot = jnp.where((slot >= 0) & (slot < s_len), slot, s_len)
  if layer is None:
    k_cache = k_cache.at[bidx, :, slot].set(kn, mode="drop")
    v_cache = v_cache.at[bidx, :, slot].set(v, mode="drop")
  else:
    k_cache = k_cache.at[layer, bidx, :, slot].set(kn, mode="drop")
    v_cache = v_cache.at[layer, bidx, :, slot].set(v, mode="drop")
  return qn, k_cache, v_cache
