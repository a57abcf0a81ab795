"""Decode attention with attention sinks: the reference, the split-KV merge kernel, the masking.

The decode step's attention kernel is ``attention_block.qk_norm_rope_attention`` (the Q/K norm,
RoPE and cache write fused into the split-KV kernel); this module holds what it shares:

- ``decode_attention_reference(q, k_cache, v_cache, positions, sinks, layer=None, *, ring,
  window)``: the contract.

  q         [B, H, Dh] bf16, already normed / roped, for the token at ``positions[b]``
  k/v cache [B, KVH, S, Dh] (or layer-stacked [L, B, KVH, S, Dh] with ``layer``), the
            ``flint_jax.cache.KVCache`` layout (docs/design.md), already holding this token's k/v
  positions [B] int32: p, the query position (``cache.lengths`` before the step's increment)
  sinks     [H] f32: one logit per query head with no value vector
  returns   [B, H, Dh] q.dtype

  Math (FLINT_SPEC section 3): scores ``s = q.k * Dh^-0.5`` in fp32 (bf16 inputs, fp32
  accumulation), ``P_j = exp(s_j) / (exp(sink_h) + sum_j' exp(s_j'))``, P rounded to bf16 for
  P.V with fp32 accumulation, output rounded once. Attended keys (``valid_slots``):

  - full layer (``ring=False``): slots 0..p (slot = position);
  - sliding layer (``ring=True``, S = R = round_up(window, 64) ring slots): slot s holds position
    ``q(s) = p - ((p - s) mod R)``, attended iff ``q(s) >= 0`` and ``p - q(s) <= window - 1``.

  Stale or garbage cache contents never leak: scores of slots outside the attended set are
  replaced (``where``, not added) by a large finite negative before the max and exp, their
  probabilities are forced to exactly 0, and their V rows are zeroed before P.V (0 * NaN = NaN
  otherwise).
- ``merge_splits``: the flash-decoding merge kernel, ``grid (B, H)``, of the split programs'
  unnormalised ``o`` [G, Dh] and ``(m, l)`` [G] with the sink: ``M = max(max_j m_j, sink)``,
  ``out = sum_j o_j e^(m_j - M) / (sum_j l_j e^(m_j - M) + e^(sink - M))``.
- ``default_attention_blocks``: the split count (~2 programs per SM of the H200's 132) and key
  block.

(The split kernel of its own, ``decode_attention``, and the separate ``qk_norm_rope`` kernel
before it -- the session-2 step's three attention launches -- were retired after 35c0874: the
fused kernel takes 6.3 us per ring layer against 4.1 + 3.5.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C

__all__ = ["decode_attention_reference", "merge_splits", "default_attention_blocks",
           "valid_slots"]

_TARGET_PROGRAMS = 264   # 2 per SM on the H200's 132 SMs


def default_attention_blocks(b: int, kvh: int, s_len: int) -> tuple[int, int]:
  """(block_k, num_splits) for a cache of S slots: 128-key blocks (64 for the 576-slot ring),
  and the power-of-two split count that gives ~2 programs per SM without exceeding the blocks."""
  bk = C.pow2_divisor(s_len, 128)
  target = max(1, _TARGET_PROGRAMS // (b * kvh))
  floor_pow2 = 1 << (target.bit_length() - 1)
  return bk, max(1, min(C.next_pow2(s_len // bk), floor_pow2))


def valid_slots(idx, p, n, s_len, window, ring):
  """bool: slot idx (int32 [...]) is attended by a query at position p (n = min(p+1, S))."""
  if not ring:
    return idx < n
  d = (p - idx + s_len) % s_len             # (p - s) mod R, operands non-negative
  return (idx < n) & (d <= p) & (d <= window - 1)


def _merge_kernel(o_ref, m_ref, l_ref, sink_ref, out_ref, *, g, ns):
  b, h = pl.program_id(0), pl.program_id(1)
  kv, r = h // g, h % g
  m = m_ref[b, kv, pl.ds(0, ns), r]                                # [NS]
  l = l_ref[b, kv, pl.ds(0, ns), r]
  o = o_ref[b, kv, pl.ds(0, ns), r, :]                             # [NS, Dh]
  sink = sink_ref[h]
  mx = jnp.maximum(jnp.max(m, axis=0), sink)
  w = jnp.exp(m - mx)
  den = jnp.sum(l * w, axis=0) + jnp.exp(sink - mx)
  out = jnp.sum(o * w[:, None], axis=0) / den                      # [Dh]
  out_ref[b, h, :] = out.astype(out_ref.dtype)


def _validate(q, k_cache, v_cache, positions, sinks, layer):
  C.check(q.ndim == 3, f"q must be [B, H, Dh], got {q.shape=}")
  b, h, dh = q.shape
  want = 4 if layer is None else 5
  C.check(k_cache.ndim == want and k_cache.shape == v_cache.shape,
          f"caches must be {'[B, KVH, S, Dh]' if want == 4 else '[L, B, KVH, S, Dh]'}, got "
          f"{k_cache.shape=} {v_cache.shape=}")
  _, kvh, s_len, dhc = k_cache.shape[-4:]
  C.check(k_cache.shape[-4] == b and dhc == dh,
          f"cache {k_cache.shape=} does not match q {q.shape=}")
  C.check(h % kvh == 0, f"H={h} must be a multiple of KVH={kvh}")
  C.check(C.is_pow2(dh), f"Dh must be a power of two, got {dh=}")
  C.check(q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype")
  C.check(positions.shape == (b,), f"positions must be [B={b}], got {positions.shape=}")
  C.check(sinks.shape == (h,), f"sinks must be [H={h}], got {sinks.shape=}")
  return b, h, kvh, s_len, dh


def merge_splits(o, m, l, sinks, dtype, *, early_trigger: bool = True, interpret: bool = False):
  """The merge kernel: partials o [B, KVH, NS, G, Dh], m, l [B, KVH, NS, G] (f32) and sinks [H]
  -> [B, H, Dh] dtype (``attention_block``'s second kernel)."""
  b, kvh, ns, g, dh = o.shape
  merge = functools.partial(_merge_kernel, g=g, ns=ns)
  return C.pallas_call(
      merge, grid=(b, kvh * g), out_shape=jax.ShapeDtypeStruct((b, kvh * g, dh), dtype),
      compiler_params=C.compiler_params(4 if ns * dh >= 4096 else 1, 1),
      interpret=interpret, early_trigger=early_trigger, name=f"flint_decode_attn_merge_ns{ns}",
  )(o, m, l, sinks.astype(jnp.float32))


def decode_attention_reference(q, k_cache, v_cache, positions, sinks, layer=None, *,
                               ring: bool, window: int | None = None,
                               scale: float | None = None, **unused_tuning):
  """Plain jnp over the whole cache, same masking (garbage-safe) and rounding rules."""
  del unused_tuning
  return _decode_attention_reference(q, k_cache, v_cache, positions, sinks, layer, ring=ring,
                                     window=window, scale=scale)


@functools.partial(jax.jit, static_argnames=("ring", "window", "scale"))
def _decode_attention_reference(q, k_cache, v_cache, positions, sinks, layer, *, ring, window,
                                scale):
  if layer is not None:
    k_cache, v_cache = k_cache[layer], v_cache[layer]
  b, h, dh = q.shape
  _, kvh, s_len, _ = k_cache.shape
  g = h // kvh
  scale = 1.0 / math.sqrt(dh) if scale is None else scale
  p = positions.astype(jnp.int32)[:, None]
  n = jnp.minimum(p + 1, s_len)
  valid = valid_slots(jnp.arange(s_len, dtype=jnp.int32)[None, :], p, n, s_len,
                      window or s_len, ring)[:, None, None, :]     # [B, 1, 1, S]
  qg = q.reshape(b, kvh, g, dh)
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k_cache, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST) * scale
  s = jnp.where(valid, s, C.MASK_VALUE)
  sink = sinks.astype(jnp.float32).reshape(1, kvh, g, 1)
  mx = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
  e = jnp.where(valid, jnp.exp(s - mx), 0.0)
  den = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - mx)
  pr = (e / den).astype(v_cache.dtype)
  v = jnp.where(valid[:, 0, 0, :, None][:, None], v_cache, jnp.zeros_like(v_cache))
  o = jnp.einsum("bkgs,bksd->bkgd", pr, v, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST)
  return o.reshape(b, h, dh).astype(q.dtype)
