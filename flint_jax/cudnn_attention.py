"""Prefill attention of the full (global) layers on cuDNN's flash attention, sinks folded in.

``full_attention(q, k_cache, v_cache, layer, lengths, n_tokens, sinks, chunk_k, chunk_v)``
computes what ``pallas.prefill_attention(..., ring=False)`` computes (same arguments, same
result up to bf16 rounding): the chunk's queries against every key at positions
``<= lengths + i``, GQA, the per-head sink in the softmax denominator. cuDNN's causal mask is
top-left aligned, right for a block of keys that starts where the queries start but not for a
chunk appended to a cache, so the keys are split in two calls merged by their log-sum-exps:

- the chunk's own keys (``chunk_k``/``chunk_v``, ``[B, T, KVH, Dh]``): causal, padded to
  ``n_tokens`` queries and keys;
- the keys already in the cache (``[B, KVH, S, Dh]`` of the layer stack, positions
  ``< lengths``): every query sees all of them; run only when some row has a prefix
  (``lax.cond``), so a prompt that fits one chunk pays one call.

With ``l_a``, ``l_b`` the two calls' log-sum-exps and ``o_a``, ``o_b`` their normalised outputs,
``o = (o_a e^{l_a} + o_b e^{l_b}) / (e^{l_a} + e^{l_b} + e^{sink})``: the sink-softmax of
FLINT_SPEC section 3, fp32 weights, one bf16 rounding of the output.

cuDNN is reached through ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, not
``jax.nn.dot_product_attention``: the public function casts the log-sum-exp to the output dtype
(bf16: up to ~1.5% error in the sink share) and has no BNSH layout, which the cache has (so its
keys are read where they lie, not transposed). jax is pinned (0.11.2); the test on the GPU
(tests/test_cudnn_attention.py) compares the result with the Pallas kernel's reference.

``implementation="xla"`` runs the same split and merge with a plain-JAX stand-in for the cuDNN
call (``_attend_reference``), so the merge is tested on the CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

F32 = jnp.float32
IMPLEMENTATIONS = ("cudnn", "xla")


def _attend_reference(q, k, v, q_len, kv_len, causal: bool, scale: float, layout: str):
  """Plain-JAX stand-in for one cuDNN call: (o [layout of q] q.dtype, lse f32 [B, H, T]).
  layout "BTNH" (q [B,T,H,Dh], k [B,S,KVH,Dh]) or "BNTH" (q [B,H,T,Dh], k [B,KVH,S,Dh]);
  query i of a row sees keys j < kv_len (and j <= i when causal); queries past q_len and
  queries with no key give o = 0, lse = -inf."""
  if layout == "BTNH":
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  b, h, t, dh = q.shape
  kvh, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, kvh, h // kvh, t, dh).astype(F32)
  sc = jnp.einsum("bkgtd,bksd->bkgts", qg, k.astype(F32),
                  precision=jax.lax.Precision.HIGHEST) * scale
  qi, kj = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  mask = (kj[None] < kv_len[:, None, None]) & (qi[None] < q_len[:, None, None])
  if causal:
    mask &= (kj <= qi)[None]
  mask = mask[:, None, None]
  sc = jnp.where(mask, sc, -jnp.inf)
  lse = jax.nn.logsumexp(sc, axis=-1)
  p = jnp.where(mask, jnp.exp(sc - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0.0)
  o = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype).astype(F32), v.astype(F32),
                 precision=jax.lax.Precision.HIGHEST).reshape(b, h, t, dh).astype(q.dtype)
  lse = lse.reshape(b, h, t)
  if layout == "BTNH":
    o = o.transpose(0, 2, 1, 3)
  return o, lse


def _attend_cudnn(q, k, v, q_len, kv_len, causal: bool, scale: float, layout: str):
  """One cuDNN flash-attention call: (o [layout of q] q.dtype, lse f32 [B, H, T])."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  o, lse = fa.dot_product_attention(q, k, v, q_seqlen=q_len, kv_seqlen=kv_len, scale=scale,
                                    mask_type=mask, qkv_layout=layout, return_residual=True)
  return o, lse.astype(F32)


def full_attention(q, k_cache, v_cache, layer, lengths, n_tokens, sinks, chunk_k, chunk_v, *,
                   scale: float | None = None, implementation: str = "cudnn"):
  """Sink-softmax attention of a prefill chunk on a full layer (module docstring).

  q [B, T, H, Dh] bf16 (normed; roped or not as the layer says); k_cache / v_cache
  [L, B, KVH, S, Dh] (the layer stack; positions < lengths are read, ``layer`` a Python int);
  lengths, n_tokens int32 [B]; sinks [H]; chunk_k / chunk_v [B, T, KVH, Dh] the chunk's own
  keys and values. Returns [B, T, H, Dh] q.dtype; queries i >= n_tokens[b] give 0."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"cuDNN attention takes bf16 or fp16 queries, got {q.dtype}: use "
                     f"attention='pallas' for this model")
  attend = _attend_cudnn if implementation == "cudnn" else _attend_reference
  b, t, h, dh = q.shape
  scale = 1.0 / math.sqrt(dh) if scale is None else scale
  n_tokens = n_tokens.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  # Queries past n_tokens may come back as garbage from either call: only the final select
  # below reads them, so they are never masked before it.
  o_a, l_a = attend(q, chunk_k, chunk_v, n_tokens, n_tokens, True, scale, "BTNH")
  o_a = o_a.astype(F32).transpose(0, 2, 1, 3)                                  # [B, H, T, Dh]

  def with_prefix(_):
    o_b, l_b = attend(q.transpose(0, 2, 1, 3), k_cache[layer], v_cache[layer], n_tokens,
                      lengths, False, scale, "BNTH")
    has = (lengths > 0)[:, None, None]         # a row without a prefix: its call saw no keys
    return jnp.where(has[..., None], o_b.astype(F32), 0.0), jnp.where(has, l_b, -jnp.inf)

  def without(_):
    return jnp.zeros_like(o_a), jnp.full_like(l_a, -jnp.inf)

  o_b, l_b = jax.lax.cond(jnp.any(lengths > 0), with_prefix, without, None)
  sink = sinks.astype(F32)[None, :, None]
  m = jnp.maximum(jnp.maximum(l_a, l_b), sink)
  w_a, w_b, w_s = jnp.exp(l_a - m), jnp.exp(l_b - m), jnp.exp(sink - m)
  o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / (w_a + w_b + w_s)[..., None]
  valid = jnp.arange(t)[None, None, :] < n_tokens[:, None, None]              # [B, 1, T]
  o = jnp.where(valid[..., None], o, 0.0)
  return o.transpose(0, 2, 1, 3).astype(q.dtype)
