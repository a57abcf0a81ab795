"""Fused q/k RMSNorm + RoPE + KV-cache write + split-KV decode attention (one token per row).

``qk_norm_rope_attention(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache, sinks, layer)``
computes exactly the composition

  q2, kc, vc = qk_norm_rope(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache, layer, ...)
  out = decode_attention(q2, kc, vc, positions, sinks, layer, ring=ring, window=window)

and returns ``(out [B, H, Dh], k_cache, v_cache)``. Why: a separate Q/K norm + RoPE kernel is
latency-bound (~4 us on the H200) and its only consumer is the attention split kernel, launched
right after it for every one of the 49 layers. Folding the norm / RoPE / cache write into the
split kernel removes one launch per layer (H200: a ring layer 6.3 us against 4.1 + 3.5 for the
two kernels; both separate kernels were retired after 35c0874).

Grid ``(B, KVH, NS)``. Program (b, kv, j), p = ``positions[b]``:

1. Loads the *raw* q rows of its GQA group (heads kv*G .. kv*G+G-1, padded to Gp = 16 rows by
   repeating the last; fp32 split-K partials of q / k / v, ``multi_gemv(split_k=S,
   sum_splits=False)``, are summed and rounded to the cache dtype on the way) and applies
   per-head RMSNorm (rounded to bf16) and, for ``rope=True``, NeoX RoPE at p (rounded to bf16):
   ``qk_norm_rope``'s row code (``_norm_rope_rows``), in two halves of Dh/2 (cos / sin
   computed in the kernel, or loaded: ``rope_cos_sin`` / ``return_cos_sin``). QK^T is two
   K = Dh/2 dots against half-width loads of the K block (no concat).
2. Computes this KV head's new k the same way (every one of the Gp rows holds it) and loads the
   raw v.
3. Program j == 0 writes the new k / v into the cache slot (``p % S`` for a ring, ``p`` for a full
   layer, where the write is dropped if p >= S) with a masked store. The caches are aliased
   inputs -> outputs, ``[B, KVH, S, Dh]`` or the layer-stacked ``[L, B, KVH, S, Dh]`` with
   ``layer`` selecting the layer inside the kernel.
4. Online softmax (fp32) over the cached keys of this split's chunk, with run-time chunking
   (n = min(p+1, S) live slots cut into NS chunks of whole ``block_k`` blocks, so every split
   has work whatever the context length) and garbage-safe masking (``valid_slots``), but
   **excluding the current slot**:
   program 0 may be writing it while the others read it (whatever they read is masked out by a
   ``where``). The current token enters once, in program j == 0, whose carry starts at
   ``m = q.k_new * scale, l = 1, o = v_new`` (p = exp(0) = 1, exact in bf16), when its slot is in
   range (ring: always; full: p < S).
5. Merge of the NS partials with the sinks (``M = max(max_j m_j, sink)``,
   ``out = sum_j o_j e^(m_j - M) / (sum_j l_j e^(m_j - M) + e^(sink - M))``):

   - ``num_splits == 1``: the program normalises directly (one launch, no partials);
   - otherwise: partials (o, m, l) in fp32 + ``decode_attention.merge_splits`` (2 launches).
     (A merge by the last program of each KV head on an atomic counter, ``merge="atomic"``,
     measured no faster and was retired after 35c0874: H200 runs 40-42, its tail costs about
     the launch it saves.)

Numerics: the caches hold the values ``qk_norm_rope_reference`` writes; the attention output
matches ``decode_attention_reference`` up to fp32 summation order and where P is rounded (the current
token's p = 1 is not rounded relative to the running max until the end).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.layers import rope_angles
from flint_jax.pallas import _common as C
from flint_jax.pallas.decode_attention import _validate as _attn_validate
from flint_jax.pallas.decode_attention import (decode_attention_reference,
                                               default_attention_blocks, merge_splits,
                                               valid_slots)
from flint_jax.pallas.qk_norm_rope import _norm_rope_rows, load_rows
from flint_jax.pallas.qk_norm_rope import _validate as _norm_validate
from flint_jax.pallas.qk_norm_rope import qk_norm_rope_reference, rope_inv_freq

__all__ = ["qk_norm_rope_attention", "qk_norm_rope_attention_reference",
           "rope_cos_sin_table"]


def _kernel(*refs, g, gp, bk, ns, dh, window, ring, rope, eps, scale, stacked, mode,
            cs_mode):
  refs = list(refs)
  take = lambda k: [refs.pop(0) for _ in range(k)]  # noqa: E731
  q_ref, k_ref, v_ref, wq_ref, wk_ref, pos_ref, sink_ref = take(7)
  rope_ref = take(1)[0] if rope else None     # cos / sin [B, 2, Dh/2] ("load"), else inv_freq
  cs_out = refs.pop() if cs_mode == "store" else None
  lead = (take(1)[0][0],) if stacked else ()
  kc_in, vc_in = take(2)
  if mode == "kernel":
    o_ref, m_ref, l_ref, kc_ref, vc_ref = refs
  else:
    out_ref, kc_ref, vc_ref = refs
  f32 = jnp.float32
  b, kv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s_len, half = kc_in.shape[-2], dh // 2
  p = pos_ref[b]
  # This split's chunk of the live slots (step 4), known from p alone.
  n = jnp.minimum(p + 1, s_len)
  chunk = ((n + ns - 1) // ns + bk - 1) // bk * bk
  start = j * chunk

  # 1-2. q rows of the group and the new k (norm + RoPE, rounded), raw v: [Gp, Dh/2] / [Gp, Dh].
  cos = sin = None
  if rope and cs_mode == "load":   # another kernel's, or XLA's (``rope_cos_sin_table``)
    cos, sin = rope_ref[b, 0, :][None, :], rope_ref[b, 1, :][None, :]   # [1, Dh/2] f32
  elif rope:
    ang = p.astype(f32) * rope_ref[...]                               # [Dh/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if cs_out is not None:    # one program per row hands them to the later sliding layers
      @pl.when((kv == 0) & (j == 0))
      def _():
        cs_out[b, 0, :] = cos
        cs_out[b, 1, :] = sin
    cos, sin = cos[None, :], sin[None, :]
  ld = lambda ref, c: ref[pl.ds(c, half)].astype(f32)               # noqa: E731
  dt = kc_in.dtype                  # q / k / v (or their summed split-K partials) dtype
  if len(v_ref.shape) == 3:
    v_new = v_ref[b, C.row_load_index(1, gp, kv), :]                  # [Gp, Dh], rows equal
  else:
    v_new = load_rows(v_ref, b, C.row_load_index(1, gp, kv), slice(None), dt).astype(dt)
  q1, q2 = _norm_rope_rows(q_ref, b, g, gp, half, ld(wq_ref, 0), ld(wq_ref, half), eps,
                           rope, cos, sin, offset=kv * g, dt=dt)
  k1, k2 = _norm_rope_rows(k_ref, b, 1, gp, half, ld(wk_ref, 0), ld(wk_ref, half), eps,
                           rope, cos, sin, offset=kv, dt=dt)

  # 3. Program 0 writes the new k / v (one real row) into the slot.
  slot = p % s_len if ring else p
  cur_ok = (slot >= 0) & (slot < s_len)
  lo = jnp.arange(half, dtype=jnp.int32)
  hi, cols = half + lo, jnp.arange(dh, dtype=jnp.int32)
  i = jnp.arange(gp, dtype=jnp.int32)
  rk, wmask = kv + i, ((i == 0) & cur_ok & (j == 0))[:, None]
  sc = jnp.clip(slot, 0, s_len - 1)
  plgpu.store(kc_ref.at[(*lead, b, rk[:, None], sc, lo[None, :])], k1, mask=wmask)
  plgpu.store(kc_ref.at[(*lead, b, rk[:, None], sc, hi[None, :])], k2, mask=wmask)
  plgpu.store(vc_ref.at[(*lead, b, rk[:, None], sc, cols[None, :])], v_new, mask=wmask)

  # 4. This split's chunk of the live slots, without the current slot; program 0 starts with the
  # current token.
  nblk = jnp.minimum((jnp.maximum(n - start, 0) + bk - 1) // bk, chunk // bk)
  s_cur = (jnp.sum(q1.astype(f32) * k1.astype(f32), axis=1)
           + jnp.sum(q2.astype(f32) * k2.astype(f32), axis=1)) * scale      # [Gp]
  with_cur = (j == 0) & cur_ok

  def body(it, carry):
    o, m, l = carry
    k0 = pl.multiple_of(start + it * bk, bk)
    kb1 = kc_in[(*lead, b, kv, pl.ds(k0, bk), pl.ds(0, half))]        # [BK, Dh/2]
    kb2 = kc_in[(*lead, b, kv, pl.ds(k0, bk), pl.ds(half, half))]
    s = (C.dot_nt(q1, kb1) + C.dot_nt(q2, kb2)) * scale                # [Gp, BK] f32
    idx = k0 + jnp.arange(bk, dtype=jnp.int32)
    valid = valid_slots(idx, p, n, s_len, window, ring) & (idx != slot)
    s = jnp.where(valid[None, :], s, C.MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    pr = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(pr, axis=1)
    vb = vc_in[(*lead, b, kv, pl.ds(k0, bk), slice(None))]            # [BK, Dh]
    vb = jnp.where(valid[:, None], vb, jnp.zeros_like(vb))
    o = o * alpha[:, None] + C.dot_nn(pr.astype(vb.dtype), vb)
    return o, m_new, l

  init = (jnp.where(with_cur, v_new.astype(f32), 0.0),
          jnp.where(with_cur, s_cur, C.MASK_VALUE),
          jnp.where(with_cur, jnp.ones((gp,), f32), 0.0))
  o, m, l = lax.fori_loop(0, nblk, body, init)

  # 5. Normalise (NS == 1) or store the partials (merged by the next kernel).
  if mode == "direct":
    sink = sink_ref[C.row_load_index(g, gp, kv * g)]                  # [Gp] f32
    mx = jnp.maximum(m, sink)
    w = jnp.exp(m - mx)
    den = l * w + jnp.exp(sink - mx)
    out = o * w[:, None] / den[:, None]
    r, rmask = C.row_store_index(g, gp, kv * g)
    plgpu.store(out_ref.at[b, r[:, None], cols[None, :]], out.astype(out_ref.dtype),
                mask=rmask[:, None])
    return
  r, rmask = C.row_store_index(g, gp)
  plgpu.store(o_ref.at[b, kv, j, r[:, None], cols[None, :]], o, mask=rmask[:, None])
  plgpu.store(m_ref.at[b, kv, j, r], m, mask=rmask)
  plgpu.store(l_ref.at[b, kv, j, r], l, mask=rmask)


def rope_cos_sin_table(positions, head_dim: int, theta: float):
  """[B, 2, Dh/2] f32: cos and sin of each row's RoPE angles, ``layers.rope_angles`` (the XLA
  path's values), in the layout ``qk_norm_rope_attention(rope_cos_sin=)`` takes (an XLA op:
  one more kernel where it runs on a GPU)."""
  cos, sin = rope_angles(positions.astype(jnp.int32), head_dim, theta)
  return jnp.stack([cos, sin], axis=1)


def _logical_qkv(q, k, v, dtype):
  """(q, k, v) as the kernel sees them: the arrays, or for fp32 split-K partials [S, ...] the
  [...]-shaped ``dtype`` values they sum to (ShapeDtypeStructs, for validation)."""
  if q.ndim != 4:
    return q, k, v
  n = q.shape[0]
  for name, a in (("q", q), ("k", k), ("v", v)):
    C.check(a.ndim == 4 and a.shape[0] == n and a.dtype == jnp.float32,
            f"split-K partials: q, k and v must all be f32 [S={n}, B, N, Dh], got {name} "
            f"{a.shape} {a.dtype}")
  return tuple(jax.ShapeDtypeStruct(a.shape[1:], dtype) for a in (q, k, v))


def _sum_partials(a, dtype):
  return jnp.sum(a, axis=0).astype(dtype) if a.ndim == 4 else a


def _blocks(b, kvh, s_len, block_k, num_splits):
  dbk, dns = default_attention_blocks(b, kvh, s_len)
  return block_k or dbk, num_splits or dns


@functools.partial(jax.jit, static_argnames=(
    "rope", "ring", "window", "theta", "eps", "scale", "block_k", "num_splits", "num_warps",
    "num_stages", "return_cos_sin", "early_trigger", "interpret"))
def qk_norm_rope_attention(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache, sinks,
                           layer=None, *, rope: bool, ring: bool, window: int | None = None,
                           theta: float = 10000.0, eps: float = 1e-6,
                           scale: float | None = None, block_k: int | None = None,
                           num_splits: int | None = None, num_warps: int = 4,
                           num_stages: int = 2, rope_cos_sin=None,
                           return_cos_sin: bool = False, early_trigger: bool = True,
                           interpret: bool = False):
  """The Q/K norm + RoPE + cache write and the split-KV attention in one kernel, then the merge
  kernel (none when ``num_splits`` is 1); see the module docstring.

  RoPE's cos / sin (``rope=True``): by default every program computes them (libdevice sincos,
  ~30% of a ring program's instructions in its SASS, H200 runs 115-118, docs at 35c0874).
  ``return_cos_sin=True`` appends them
  to the returned tuple ([B, 2, Dh/2] f32, stored by one program per row), and a later call
  given them as ``rope_cos_sin`` (same positions and theta) loads them instead: the decode step
  computes them in its first sliding layer only, with no extra kernel.

  q / k / v may also be fp32 split-K partials [S, B, H, Dh] / [S, B, KVH, Dh] (``multi_gemv(...,
  split_k=S, sum_splits=False)``): every program sums them in fp32 and rounds to the caches'
  dtype, what the unsplit projection would have stored. ``early_trigger``: both kernels let the
  next one launch first (``pdl``).

  Returns ``(out [B, H, Dh], k_cache, v_cache)`` (+ cos / sin with ``return_cos_sin``).
  """
  qs, ks, vs = _logical_qkv(q, k, v, k_cache.dtype)
  b, h, kvh, dh = _norm_validate(qs, ks, vs, q_norm_w, k_norm_w, positions, k_cache, v_cache,
                                 layer)
  _, _, _, s_len, _ = _attn_validate(qs, k_cache, v_cache, positions, sinks, layer)
  if ring:
    C.check(window is not None and 1 <= window <= s_len,
            f"ring attention needs 1 <= window <= R={s_len}, got {window=}")
  C.check(dh // 2 >= 16, f"Dh/2 must be >= 16 (dot K dimension), got {dh=}")
  block_k, num_splits = _blocks(b, kvh, s_len, block_k, num_splits)
  C.check(C.is_pow2(block_k) and block_k >= 16 and s_len % block_k == 0,
          f"block_k must be a power of two >= 16 dividing S: {block_k=} S={s_len}")
  C.check(C.is_pow2(num_splits), f"num_splits must be a power of two, got {num_splits=}")
  C.check(rope or (rope_cos_sin is None and not return_cos_sin),
          "rope_cos_sin / return_cos_sin are only for rope=True")
  C.check(rope_cos_sin is None or not return_cos_sin,
          "give rope_cos_sin or ask for return_cos_sin, not both")
  if rope_cos_sin is not None:
    C.check(rope_cos_sin.shape == (b, 2, dh // 2) and rope_cos_sin.dtype == jnp.float32,
            f"rope_cos_sin must be f32 [B, 2, Dh/2] = [{b}, 2, {dh // 2}], got "
            f"{rope_cos_sin.dtype} {rope_cos_sin.shape}")
  cs_mode = "load" if rope_cos_sin is not None else "store" if return_cos_sin else "compute"
  mode = "direct" if num_splits == 1 else "kernel"
  g = h // kvh
  gp = C.pad_rows(g)
  scale = 1.0 / math.sqrt(dh) if scale is None else scale
  f32 = jnp.float32

  args = [q, k, v, q_norm_w, k_norm_w, positions.astype(jnp.int32), sinks.astype(f32)]
  if rope:
    args.append(rope_cos_sin if cs_mode == "load" else rope_inv_freq(dh, theta))
  if layer is not None:
    args.append(C.as_index_array(layer, "layer"))
  n_in = len(args)
  args += [k_cache, v_cache]
  out_t = jax.ShapeDtypeStruct((b, h, dh), qs.dtype)
  parts = (jax.ShapeDtypeStruct((b, kvh, num_splits, g, dh), f32),
           jax.ShapeDtypeStruct((b, kvh, num_splits, g), f32),
           jax.ShapeDtypeStruct((b, kvh, num_splits, g), f32))
  caches = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
  if mode == "direct":
    out_shape, aliases = (out_t, *caches), {n_in: 1, n_in + 1: 2}
  else:
    out_shape, aliases = (*parts, *caches), {n_in: 3, n_in + 1: 4}
  kernel = functools.partial(
      _kernel, g=g, gp=gp, bk=block_k, ns=num_splits, dh=dh, window=window or s_len, ring=ring,
      rope=rope, eps=eps, scale=scale, stacked=layer is not None, mode=mode, cs_mode=cs_mode)
  if cs_mode == "store":
    out_shape = (*out_shape, jax.ShapeDtypeStruct((b, 2, dh // 2), f32))
  res = C.pallas_call(
      kernel, out_shape=out_shape, grid=(b, kvh, num_splits), input_output_aliases=aliases,
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger,
      name=(f"flint_qk_norm{'_rope' if rope else ''}_attn_{'ring' if ring else 'full'}"
            f"_bk{block_k}_ns{num_splits}{'' if mode == 'kernel' else '_' + mode}"),
  )(*args)
  extra = ()
  if cs_mode == "store":
    res, extra = res[:-1], res[-1:]
  if mode == "direct":
    out, kc, vc = res
  else:
    o, m, l, kc, vc = res
    out = merge_splits(o, m, l, sinks, qs.dtype, early_trigger=early_trigger,
                       interpret=interpret)
  return (out, kc, vc) + extra


def qk_norm_rope_attention_reference(q, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache,
                                     sinks, layer=None, *, rope: bool, ring: bool,
                                     window: int | None = None, theta: float = 10000.0,
                                     eps: float = 1e-6, scale: float | None = None,
                                     **unused_tuning):
  """qk_norm_rope_reference then decode_attention_reference. Split-K partials (4-D f32 q / k /
  v) are summed and rounded to the caches' dtype first."""
  del unused_tuning
  q, k, v = (_sum_partials(a, k_cache.dtype) for a in (q, k, v))
  q2, kc, vc = qk_norm_rope_reference(q, k, v, q_norm_w, k_norm_w, positions, k_cache,
                                      v_cache, layer, rope=rope, ring=ring, theta=theta, eps=eps)
  out = decode_attention_reference(q2, kc, vc, positions, sinks, layer, ring=ring,
                                   window=window, scale=scale)
  return out, kc, vc
