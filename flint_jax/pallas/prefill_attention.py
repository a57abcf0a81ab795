"""Flash attention with attention sinks for prefill chunks (many queries per row), Pallas Triton.

``prefill_attention(q, k_src, v_src, lengths, n_tokens, sinks, layer, chunk_k, chunk_v, *, ring,
window)``: the queries of one chunk against the KV cache, bottom-right causal (query i of row b
sits at position ``p = lengths[b] + i`` and sees keys at positions <= p), GQA, sliding window,
per-head sinks, fp32 online softmax, no ``[T, S]`` buffer.

  q          [B, T, H, Dh]  the chunk's queries, already normed / roped (row b: n_tokens[b] valid)
  lengths    [B] int32      positions before the chunk (``KVCache.lengths``)
  n_tokens   [B] int32      valid tokens of each row in this chunk (0 allowed)
  sinks      [H] f32        one logit per query head with no value vector
  returns    [B, T, H, Dh]  q.dtype; queries i >= n_tokens[b] give finite values nobody reads

Key sources (``flint_jax.cache.KVCache`` layout, ``[B, KVH, S, Dh]`` per layer, or the layer
stack ``[L, B, KVH, S, Dh]`` with ``layer``):

- ``ring=False`` (full layers): ``k_src``/``v_src`` is the cache *after* the chunk's K/V were
  written (slot = position); keys at positions ``< lengths + n_tokens``. ``window`` optional.
- ``ring=True`` (sliding layers): ``k_src``/``v_src`` is the ring *before* the chunk is written
  (R slots, slot = position % R, holding positions ``lengths - R .. lengths - 1``), and
  ``chunk_k``/``chunk_v`` ``[B, T, KVH, Dh]`` are the chunk's own keys/values (valid for
  ``i < n_tokens``): a chunk longer than the ring needs both, since writing it first would
  overwrite keys its first queries see. ``window`` (<= R) is required.

Math (FLINT_SPEC section 3): ``s = q.k * Dh^-0.5`` in fp32, ``P = exp(s) / (exp(sink_h) +
sum exp(s))``, P rounded to the value dtype for P.V with fp32 accumulation, output rounded once.
(The model's reference rounds the *normalised* P; here the running-max P is rounded and the
division comes last: the same math, one bf16 rounding apart.)

Kernel: one program per (KV head, row, block of ``block_q`` queries); its tile stacks the
``G = H / KVH`` query heads of each query (rows ``block_q * G``, G padded to a power of two), so
one K/V block feeds 8 heads on the tensor cores. The key loop runs over *positions*, block by
block: ``[max(0, p_lo - window + 1), p_hi]`` for the block's first / last valid query
``p_lo`` / ``p_hi`` -- blocks entirely outside the window or in the causal future are never
visited, not just masked. Ring keys are gathered by slot (``position % R``: each row contiguous,
the wrap inside a block costs nothing); cache and chunk keys are contiguous ``pl.ds`` blocks.
Key blocks every valid query of the block sees in full (positions in ``[p_hi - window + 1,
p_lo]``: on a full layer all but the last one or two) take an unmasked step; only the blocks at
the edges compute masks: scores of keys outside ``[p - window + 1, p]`` or not yet written are
replaced by a large finite negative, their probabilities forced to 0 and their V rows zeroed
(garbage-safe, as ``decode_attention``). Scores are kept in log2 units (``scale * log2 e``
folded into the score scale, ``exp2``, the sinks multiplied by ``log2 e``). The query-block axis
is the grid's slowest and runs heaviest (latest) blocks first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C

__all__ = ["prefill_attention", "prefill_attention_reference", "default_blocks"]

F32 = jnp.float32


#: Tuning defaults (block_q, block_k, num_warps, num_stages), measured on the H200 at an 8K-token
#: chunk of Flint (run "prefill-1", docs/gpu_runs/prefill1): full layers 2.33 ms with 32 queries (x 8
#: heads = 256 rows), 64 keys, 8 warps, 3 stages against 2.46-2.66 ms for (16, 128), (8, 64) and
#: (16, 64, 2 stages); sliding layers 0.47 ms with (16, 64, 8 warps, 2 stages), the others
#: 0.47-0.50 ms. block_q is given here as tile rows (block_q x the padded group size).
FULL_ROWS, FULL_BLOCK_K, FULL_WARPS, FULL_STAGES = 256, 64, 8, 3
RING_ROWS, RING_BLOCK_K, RING_WARPS, RING_STAGES = 128, 64, 8, 2


def default_blocks(t: int, g: int, ring: bool = False) -> tuple[int, int]:
  """(block_q, block_k): tiles of ``FULL_ROWS`` / ``RING_ROWS`` rows (block_q queries x G heads:
  32 / 16 queries of Flint's 8 heads) against 64-key blocks (the ring's 576 slots are 9 of them);
  fewer queries for short chunks, at least 16 rows for the tensor cores."""
  gp = C.next_pow2(g)
  bq = max(1, (RING_ROWS if ring else FULL_ROWS) // gp)
  bq = min(bq, C.next_pow2(t))
  bq = max(bq, C.cdiv(16, gp))
  return bq, RING_BLOCK_K if ring else FULL_BLOCK_K


def _dot(a, b, contract_b: int):
  prec = lax.Precision.HIGHEST if a.dtype == F32 else None
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=prec,
                         preferred_element_type=F32)


LOG2E = math.log2(math.e)


def _split(start, n_blocks, lo_ok, hi_ok, bk):
  """(i_a, i_b): of the key blocks ``i < n_blocks`` at positions ``start + i * bk ..``, those in
  ``[i_a, i_b)`` lie entirely in ``[lo_ok, hi_ok]`` (no mask needed); the others are masked.
  ``lo_ok`` None: no lower bound."""
  i_a = jnp.int32(0) if lo_ok is None else (jnp.maximum(lo_ok - start, 0) + bk - 1) // bk
  i_a = jnp.minimum(i_a, n_blocks)
  i_b = jnp.clip(jnp.maximum(hi_ok + 1 - start, 0) // bk, i_a, n_blocks)
  return i_a, i_b


def _blocks(body, n_blocks, i_a, i_b, carry):
  """``body(masked)(i, carry)`` over blocks ``[0, i_a)`` masked, ``[i_a, i_b)`` not, ``[i_b,
  n_blocks)`` masked."""
  carry = lax.fori_loop(0, i_a, body(True), carry)
  carry = lax.fori_loop(i_a, i_b, body(False), carry)
  return lax.fori_loop(i_b, n_blocks, body(True), carry)


def _kernel(*refs, g, gp, bq, bk, t_len, dh, dp, window, ring, stacked, scale, n_q):
  if stacked:
    q_ref, k_ref, v_ref, len_ref, n_ref, sink_ref, layer_ref, *rest = refs
    lead = (layer_ref[0],)
  else:
    q_ref, k_ref, v_ref, len_ref, n_ref, sink_ref, *rest = refs
    lead = ()
  if ring:
    ck_ref, cv_ref, o_ref = rest
  else:
    (o_ref,) = rest
  kv, b = pl.program_id(0), pl.program_id(1)
  qb = n_q - 1 - pl.program_id(2)           # latest (heaviest) query blocks first
  s_len = k_ref.shape[-2]
  p0, n = len_ref[b], n_ref[b]
  rows = bq * gp
  r = jnp.arange(rows, dtype=jnp.int32)
  qi = qb * bq + r // gp                    # query index in the chunk
  gi = r % gp
  h = kv * g + jnp.minimum(gi, g - 1)
  qpos = p0 + qi
  d = jnp.arange(dp, dtype=jnp.int32)
  dmask = d < dh
  dcl = jnp.minimum(d, dh - 1)
  q = plgpu.load(q_ref.at[b, jnp.minimum(qi, t_len - 1)[:, None], h[:, None], dcl[None, :]],
                 mask=dmask[None, :], other=0)                               # [rows, Dp]
  # The block's valid queries: positions p_lo .. p_hi (none when qb * bq >= n).
  p_lo = p0 + qb * bq
  p_hi = p0 + jnp.minimum(qb * bq + bq, n) - 1
  live = p_hi >= p_lo
  k_lo = jnp.maximum(p_lo - window + 1, 0) if window else jnp.int32(0)
  # Keys every valid query of the block sees (no mask): positions [w_lo, p_lo].
  w_lo = p_hi - window + 1 if window else None
  c = scale * LOG2E          # scores in log2 units: exp2 (one MUFU op) instead of exp

  def step(carry, kpos, kvalid, kb, vb, masked):
    """One key block: kpos / kvalid [BK], kb / vb [BK, Dp]; ``masked`` False: a block of keys
    inside every valid query's window, all valid (no masks, no garbage: ``_split``)."""
    acc, m, l = carry
    s = _dot(q, kb, 1) * c                                                   # [rows, BK]
    if masked:
      ok = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
      if window:
        ok &= kpos[None, :] > qpos[:, None] - window
      s = jnp.where(ok, s, C.MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if masked:
      p = jnp.where(ok, p, 0.0)
      vb = jnp.where(kvalid[:, None], vb, jnp.zeros_like(vb))
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb, 0)
    return acc, m_new, l

  def load_kv(ref, idx):
    """[BK, Dp] key rows at ``idx`` (``src_idx``; indices always in range)."""
    if dp == dh:
      return ref[idx]
    return plgpu.load(ref.at[idx], mask=dmask[None, :], other=0)

  def src_idx(slots, *, chunk):
    """Full index of key rows ``slots`` (pl.ds or [BK] int32) in a cache/ring or the chunk."""
    if dp == dh:
      if chunk:
        return (b, slots, kv, slice(None))
      return (*lead, b, kv, slots, slice(None))
    sl = slots if not isinstance(slots, pl.Slice) else slots.start + jnp.arange(
        bk, dtype=jnp.int32)
    if chunk:
      return (b, sl[:, None], kv, dcl[None, :])
    return (*lead, b, kv, sl[:, None], dcl[None, :])

  init = (jnp.zeros((rows, dp), F32), jnp.full((rows,), C.MASK_VALUE, F32),
          jnp.zeros((rows,), F32))
  ar = jnp.arange(bk, dtype=jnp.int32)
  if ring:
    # 1. Ring keys at positions [max(k_lo, p0 - R), p0): slot = position % R.
    r_start = jnp.maximum(k_lo, jnp.maximum(p0 - s_len, 0))
    n_ring = jnp.where(live, (jnp.maximum(p0 - r_start, 0) + bk - 1) // bk, 0)

    def ring_body(masked):
      def body(i, carry):
        kpos = r_start + i * bk + ar
        slots = kpos % s_len
        kb = load_kv(k_ref, src_idx(slots, chunk=False))
        vb = load_kv(v_ref, src_idx(slots, chunk=False))
        return step(carry, kpos, kpos < p0, kb, vb, masked)
      return body

    carry = _blocks(ring_body, n_ring, *_split(r_start, n_ring, w_lo, p0 - 1, bk), init)
    # 2. The chunk's own keys, chunk index ci = position - p0, aligned blocks up to p_hi.
    c_lo = jnp.maximum(k_lo - p0, 0) // bk * bk
    n_chunk = jnp.where(live, jnp.maximum(p_hi - p0 - c_lo + bk, 0) // bk, 0)
    even = t_len % bk == 0

    def chunk_body(masked):
      def body(i, carry):
        c0 = c_lo + i * bk
        ci = c0 + ar
        sl = pl.ds(pl.multiple_of(c0, bk), bk) if even else jnp.minimum(ci, t_len - 1)
        kb = load_kv(ck_ref, src_idx(sl, chunk=True))
        vb = load_kv(cv_ref, src_idx(sl, chunk=True))
        return step(carry, p0 + ci, ci < n, kb, vb, masked)
      return body

    acc, m, l = _blocks(chunk_body, n_chunk, *_split(p0 + c_lo, n_chunk, w_lo, p_lo, bk),
                        carry)
  else:
    # Cache keys at positions [k_lo (aligned), p_hi]; slot = position (S % block_k == 0).
    k_start = k_lo // bk * bk
    n_blk = jnp.where(live, jnp.maximum(p_hi - k_start + bk, 0) // bk, 0)
    end = p0 + n

    def full_body(masked):
      def body(i, carry):
        k0 = pl.multiple_of(k_start + i * bk, bk)
        idx = src_idx(pl.ds(k0, bk), chunk=False)
        kb, vb = load_kv(k_ref, idx), load_kv(v_ref, idx)
        kpos = k0 + ar
        return step(carry, kpos, kpos < end, kb, vb, masked)
      return body

    acc, m, l = _blocks(full_body, n_blk, *_split(k_start, n_blk, w_lo, p_lo, bk), init)
  sink = sink_ref[h] * LOG2E                                                 # [rows] f32
  mx = jnp.maximum(m, sink)
  a = jnp.exp2(m - mx)
  den = l * a + jnp.exp2(sink - mx)
  out = acc * (a / den)[:, None]
  hs = kv * g + gi                          # unclamped: padded heads are masked, not duplicated
  omask = ((gi < g) & (qi < t_len))[:, None] & dmask[None, :]
  plgpu.store(o_ref.at[b, qi[:, None], hs[:, None], d[None, :]], out.astype(o_ref.dtype),
              mask=omask)


def _validate(q, k_src, v_src, lengths, n_tokens, sinks, layer, chunk_k, chunk_v, ring, window):
  C.check(q.ndim == 4, f"q must be [B, T, H, Dh], got {q.shape=}")
  b, t, h, dh = q.shape
  want = 4 if layer is None else 5
  C.check(k_src.ndim == want and k_src.shape == v_src.shape,
          f"K/V sources must be {'[B, KVH, S, Dh]' if want == 4 else '[L, B, KVH, S, Dh]'}, "
          f"got {k_src.shape=} {v_src.shape=}")
  _, kvh, s_len, dhc = k_src.shape[-4:]
  C.check(k_src.shape[-4] == b and dhc == dh, f"K/V {k_src.shape=} do not match q {q.shape=}")
  C.check(h % kvh == 0, f"H={h} must be a multiple of KVH={kvh}")
  C.check(q.dtype == k_src.dtype == v_src.dtype, "q and the K/V sources must share a dtype")
  C.check(lengths.shape == (b,) and n_tokens.shape == (b,),
          f"lengths / n_tokens must be [B={b}], got {lengths.shape} {n_tokens.shape}")
  C.check(sinks.shape == (h,), f"sinks must be [H={h}], got {sinks.shape=}")
  if ring:
    C.check(chunk_k is not None and chunk_v is not None,
            "ring attention needs the chunk's own keys/values (chunk_k, chunk_v)")
    C.check(chunk_k.shape == chunk_v.shape == (b, t, kvh, dh),
            f"chunk_k/v must be [B, T, KVH, Dh] = {(b, t, kvh, dh)}, got {chunk_k.shape}")
    C.check(chunk_k.dtype == q.dtype, "chunk_k/v must have q's dtype")
    C.check(window is not None and 1 <= window <= s_len,
            f"ring attention needs 1 <= window <= R={s_len}, got {window=}")
  else:
    C.check(chunk_k is None and chunk_v is None, "chunk_k/v are for ring=True only")
  return b, t, h, kvh, s_len, dh


@functools.partial(jax.jit, static_argnames=(
    "ring", "window", "scale", "block_q", "block_k", "num_warps", "num_stages", "interpret"))
def prefill_attention(q, k_src, v_src, lengths, n_tokens, sinks, layer=None, chunk_k=None,
                      chunk_v=None, *, ring: bool, window: int | None = None,
                      scale: float | None = None, block_q: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, interpret: bool = False):
  """Sink-softmax flash attention of a chunk of queries; see the module docstring. Tuning knobs
  left None take the measured defaults (``FULL_*`` / ``RING_*``)."""
  b, t, h, kvh, s_len, dh = _validate(q, k_src, v_src, lengths, n_tokens, sinks, layer, chunk_k,
                                      chunk_v, ring, window)
  g = h // kvh
  gp = C.next_pow2(g)
  dbq, dbk = default_blocks(t, g, ring)
  num_warps = num_warps or (RING_WARPS if ring else FULL_WARPS)
  num_stages = num_stages or (RING_STAGES if ring else FULL_STAGES)
  bq, bk = block_q or dbq, block_k or dbk
  C.check(C.is_pow2(bq) and bq * gp >= 16, f"block_q must be a power of two with block_q * "
                                           f"G >= 16 (G padded to {gp}), got {bq=}")
  C.check(C.is_pow2(bk) and bk >= 16, f"block_k must be a power of two >= 16, got {bk=}")
  if not ring:
    C.check(s_len % bk == 0, f"the cache length S={s_len} must be a multiple of {bk=}")
  n_q = C.cdiv(t, bq)
  stacked = layer is not None
  args = [q, k_src, v_src, lengths.astype(jnp.int32), n_tokens.astype(jnp.int32),
          sinks.astype(F32)]
  if stacked:
    args.append(C.as_index_array(layer, "layer"))
  if ring:
    args += [chunk_k, chunk_v]
  kernel = functools.partial(
      _kernel, g=g, gp=gp, bq=bq, bk=bk, t_len=t, dh=dh, dp=C.next_pow2(dh),
      window=window, ring=ring, stacked=stacked,
      scale=1.0 / math.sqrt(dh) if scale is None else scale, n_q=n_q)
  return C.pallas_call(
      kernel, early_trigger=False, grid=(kvh, b, n_q), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      name=f"flint_prefill_attn_{'ring' if ring else 'full'}_bq{bq}_bk{bk}",
  )(*args)


def prefill_attention_reference(q, k_src, v_src, lengths, n_tokens, sinks, layer=None,
                                chunk_k=None, chunk_v=None, *, ring: bool,
                                window: int | None = None, scale: float | None = None,
                                **unused_tuning):
  """Plain jnp: every key of the sources with positions and masks, a masked softmax with the
  sink in the denominator (fp32), P normalised and rounded to the value dtype before P.V."""
  del unused_tuning
  if layer is not None:
    k_src, v_src = k_src[layer], v_src[layer]
  b, t, h, dh = q.shape
  _, kvh, s_len, _ = k_src.shape
  g = h // kvh
  scale = 1.0 / math.sqrt(dh) if scale is None else scale
  lengths = lengths.astype(jnp.int32)[:, None]
  n_tokens = n_tokens.astype(jnp.int32)[:, None]
  qpos = lengths + jnp.arange(t, dtype=jnp.int32)[None, :]                    # [B, T]
  if ring:
    s = jnp.arange(s_len, dtype=jnp.int32)[None, :]
    last = lengths - 1
    ring_pos = last - jnp.mod(last - s, s_len)                               # [B, R]
    keys = jnp.concatenate([k_src, chunk_k.transpose(0, 2, 1, 3)], axis=2)
    vals = jnp.concatenate([v_src, chunk_v.transpose(0, 2, 1, 3)], axis=2)
    kpos = jnp.concatenate([ring_pos, qpos], axis=1)
    kok = jnp.concatenate([ring_pos >= 0, jnp.arange(t)[None, :] < n_tokens], axis=1)
  else:
    keys, vals = k_src, v_src
    kpos = jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32)[None, :], (b, s_len))
    kok = kpos < lengths + n_tokens
  mask = kok[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])           # [B, T, S']
  if window:
    mask &= kpos[:, None, :] > qpos[:, :, None] - window
  qg = q.reshape(b, t, kvh, g, dh)
  sc = jnp.einsum("btkgd,bksd->bkgts", qg.astype(F32), keys.astype(F32),
                  precision=lax.Precision.HIGHEST) * scale
  mask = mask[:, None, None]
  sc = jnp.where(mask, sc, C.MASK_VALUE)
  sink = sinks.astype(F32).reshape(1, kvh, g, 1)
  mx = jnp.maximum(jnp.max(sc, axis=-1), sink)
  e = jnp.where(mask, jnp.exp(sc - mx[..., None]), 0.0)
  den = jnp.sum(e, axis=-1) + jnp.exp(sink - mx)
  pr = (e / den[..., None]).astype(vals.dtype).astype(F32)   # (exact upcasts: XLA:CPU has
  vals = jnp.where(kok[:, None, :, None], vals, jnp.zeros_like(vals)).astype(F32)  # no bf16 dot)
  o = jnp.einsum("bkgts,bksd->btkgd", pr, vals, precision=lax.Precision.HIGHEST)
  return o.reshape(b, t, h, dh).astype(q.dtype)
