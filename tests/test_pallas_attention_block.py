"""qk_norm_rope_attention (norm + RoPE + cache write + split-KV attention, fused) vs the reference
composition qk_norm_rope_reference -> decode_attention_reference.

The caches after the call must be bit-identical to the reference's; the attention output close.
Unattended slots and the slot being written hold NaN keys / inf values (stale memory): the kernel
must never read the old contents of the current slot, and must mask everything else like the
reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.attention_block import (qk_norm_rope_attention,
                                              qk_norm_rope_attention_reference)
from pallas_testing import assert_close, randn, random_kv_caches, rng

INTERPRET = jax.default_backend() == "cpu"
DH = 128


def dead_slots(pos, s_len, ring, window):
  """[B, S] slots neither attended after this step's write nor written by it (+ the slot being
  written: its old contents must not matter either)."""
  slot = np.arange(s_len)[None, :]
  p = np.asarray(pos)[:, None]
  if ring:
    d = (p - slot) % s_len
    dead = (d > p) | (d > window - 1)
    return dead | (slot == p % s_len)
  return (slot >= p)


def inputs(b, h, kvh, s_len, positions, *, ring, window, garbage, stacked, dh=DH, seed=()):
  gen = rng(b, h, kvh, s_len, positions, ring, window, garbage, stacked, dh, seed)
  q, k, v = randn(gen, (b, h, dh), scale=3.0), randn(gen, (b, kvh, dh)), randn(gen, (b, kvh, dh))
  wq = randn(gen, (dh,), scale=0.2) + 1
  wk = randn(gen, (dh,), scale=0.2) + 1
  shape = (b, kvh, s_len, dh)
  dead = dead_slots(positions, s_len, ring, window) if garbage else None
  kc, vc, layer = random_kv_caches(gen, shape, dead=dead, stacked=stacked)
  pos = jnp.asarray(positions, jnp.int32)
  sinks = jnp.asarray(gen.standard_normal(h), jnp.float32)
  return q, k, v, wq, wk, pos, kc, vc, sinks, layer


def check(got, ref, exact=INTERPRET):
  """out close; caches bit-identical. On a GPU the norm's rsqrt is not XLA's, so there cache
  values are only close, with the same non-finite (garbage) slots."""
  assert len(got) == len(ref) == 3
  assert_close(got[0], ref[0], what="attention out")
  for g, w, name in zip(got[1:], ref[1:], ("k_cache", "v_cache")):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g), np.asarray(w)
    if g.dtype != jnp.bfloat16:
      np.testing.assert_array_equal(g, w, err_msg=name)
      continue
    if not exact:
      g32, w32 = g.astype(np.float32), w.astype(np.float32)
      fin = np.isfinite(w32)
      np.testing.assert_array_equal(np.isfinite(g32), fin, err_msg=f"{name}: non-finite slots")
      assert_close(jnp.asarray(np.where(fin, g32, 0), jnp.bfloat16),
                   jnp.asarray(np.where(fin, w32, 0), jnp.bfloat16), what=name)
      g, w = np.where(fin, 0, g), np.where(fin, 0, w)
    np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16), err_msg=name)


def run(b, h, kvh, s_len, positions, *, ring, rope, window=None, garbage=True, stacked=False,
        **kw):
  args = inputs(b, h, kvh, s_len, positions, ring=ring, window=window, garbage=garbage,
                stacked=stacked)
  opts = dict(rope=rope, ring=ring, window=window, **kw)
  got = qk_norm_rope_attention(*args, interpret=INTERPRET, **opts)
  ref = qk_norm_rope_attention_reference(*args, **opts)
  check(got[:-1] if kw.get("return_cos_sin") else got, ref)
  return got


def test_full():
  """G=4, B=8: first token, position 1, around 512, the last slot and p >= S (write dropped)."""
  run(8, 32, 8, 768, [0, 1, 511, 512, 513, 700, 767, 800], ring=False, rope=False, block_k=64)


def test_ring():
  """Sliding layer, B=8, layer-stacked: ring not yet full, exactly the window (512), the oldest
  slot dropping out (513), wrapped rings (p > R, p >> R)."""
  run(8, 32, 4, 576, [0, 1, 511, 512, 513, 1000, 5000, 70000], ring=True, rope=True,
      window=513, stacked=True)


@pytest.mark.parametrize("num_warps", [2, 8, 16])
def test_num_warps(num_warps):
  """Other warp counts per program than the step's 4, on the step's shapes: a layer-stacked 576-slot ring (B=2, one ring wrapped, cos / sin returned) and a
  full cache (B=3, around position 512); compiled on a GPU, where the warps change the
  layouts and reductions."""
  run(2, 32, 4, 576, [300, 9000], ring=True, rope=True, window=513, stacked=True,
      return_cos_sin=True, num_warps=num_warps)
  run(3, 32, 4, 1024, [0, 511, 700], ring=False, rope=False, stacked=True,
      num_warps=num_warps)


def test_rope_cos_sin_handed_on():
  """return_cos_sin: the kernel also returns RoPE's cos / sin [B, 2, Dh/2] (those of
  ``rope_cos_sin_table``: XLA's on the CPU, libdevice's within a few ulps on the GPU); a second layer
  given them (rope_cos_sin=) computes what it computes without them. B=3, layer-stacked ring."""
  from flint_jax.pallas.attention_block import rope_cos_sin_table  # pylint: disable=g-import-not-at-top
  pos = [40, 513, 9000]
  got = run(3, 32, 4, 576, pos, ring=True, rope=True, window=513, stacked=True,
            return_cos_sin=True)
  cs = got[-1]
  want = rope_cos_sin_table(jnp.asarray(pos, jnp.int32), DH, 10000.0)
  assert cs.shape == (3, 2, DH // 2) and cs.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(cs), np.asarray(want), rtol=0, atol=2e-6)
  again = run(3, 32, 4, 576, pos, ring=True, rope=True, window=513, stacked=True,
              rope_cos_sin=cs)
  for a, b in zip(got[:-1], again):   # bit for bit (the caches' dead slots hold NaN garbage)
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_rope_cos_sin_checked():
  """Clear errors: cos / sin of the wrong shape, both options at once, or on a layer without
  RoPE."""
  args = inputs(2, 32, 4, 576, [3, 700], ring=True, window=513, garbage=False, stacked=False)
  kw = dict(ring=True, window=513, interpret=INTERPRET)
  with pytest.raises(ValueError, match="rope_cos_sin must be f32"):
    qk_norm_rope_attention(*args, rope=True, rope_cos_sin=jnp.zeros((2, 2, 32)), **kw)
  with pytest.raises(ValueError, match="not both"):
    qk_norm_rope_attention(*args, rope=True, rope_cos_sin=jnp.zeros((2, 2, 64)),
                           return_cos_sin=True, **kw)
  with pytest.raises(ValueError, match="only for rope=True"):
    qk_norm_rope_attention(*args, rope=False, return_cos_sin=True, **kw)


def test_single_split_ring():
  """num_splits=1: the program normalises with the sink itself (one launch)."""
  run(1, 32, 4, 576, [511], ring=True, rope=True, window=513, num_splits=1)


def test_single_split_full():
  """num_splits=1 on a full layer: G=1, B=3, RoPE, layer-stacked, one row past the cache (write
  dropped)."""
  run(3, 8, 8, 256, [1, 255, 300], ring=False, rope=True, num_splits=1, stacked=True)


def test_full_long_context():
  """A few thousand keys over 32 splits (run-time chunking), clean cache."""
  run(1, 32, 4, 4096, [3999], ring=False, rope=False, garbage=False, num_splits=32)


def test_layers_of_a_stacked_cache():
  """Three layers of one stacked cache, in another order, each call on the caches the last
  returned. G=3 (heads not a power of two: padded q and merge rows), B=3, 4 splits of 16-key
  blocks."""
  b, kvh, h, s_len, positions = 3, 8, 24, 64, [0, 40, 63]
  q, k, v, wq, wk, pos, _, _, sinks, _ = inputs(b, h, kvh, s_len, positions, ring=False,
                                                window=None, garbage=False, stacked=False)
  gen = rng("counter")
  dead = jnp.asarray(dead_slots(positions, s_len, False, None))[None, :, None, :, None]
  kc = jnp.where(dead, jnp.nan, randn(gen, (3, b, kvh, s_len, DH), scale=2.0))
  vc = jnp.where(dead, jnp.inf, randn(gen, (3, b, kvh, s_len, DH)))
  kc, vc = kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16)
  kw = dict(rope=True, ring=False, num_splits=4, block_k=16)
  for layer in (0, 2, 1):
    got = qk_norm_rope_attention(q, k, v, wq, wk, pos, kc, vc, sinks, layer, interpret=INTERPRET,
                                 **kw)
    ref = qk_norm_rope_attention_reference(q, k, v, wq, wk, pos, kc, vc, sinks, layer, **kw)
    check(got, ref)
    _, kc, vc = got


@pytest.mark.parametrize("ring,splits", [(True, 2), (False, 3)])
def test_split_k_partials(ring, splits):
  """q / k / v as fp32 split-K partials [S, ...] (multi_gemv(split_k=S, sum_splits=False)): the
  kernel sums and rounds them to the caches' dtype itself. Bit-identical (out and caches) to
  the kernel given the summed bf16 q / k / v, and close to the reference."""
  b, h, kvh, s_len = 2, 32, 4, 576
  positions, window = ([511, 1000], 513) if ring else ([0, 575], None)
  args = list(inputs(b, h, kvh, s_len, positions, ring=ring, window=window, garbage=True,
                     stacked=True))
  gen = rng("partials", ring, splits)
  parts = [jnp.asarray(gen.standard_normal((splits, *a.shape)) * (1.5 / splits), jnp.float32)
           for a in args[:3]]
  summed = [jnp.sum(p, axis=0).astype(jnp.bfloat16) for p in parts]
  opts = dict(rope=ring, ring=ring, window=window)
  got = qk_norm_rope_attention(*parts, *args[3:], interpret=INTERPRET, **opts)
  want = qk_norm_rope_attention(*summed, *args[3:], interpret=INTERPRET, **opts)
  for g, w, name in zip(got, want, ("out", "k_cache", "v_cache")):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g), np.asarray(w)
    if g.dtype == jnp.bfloat16:
      g, w = g.view(np.uint16), w.view(np.uint16)
    np.testing.assert_array_equal(g, w, err_msg=f"{name}: partials vs summed bf16 inputs")
  check(got, qk_norm_rope_attention_reference(*parts, *args[3:], **opts))
  with pytest.raises(ValueError, match="split-K partials"):
    qk_norm_rope_attention(parts[0], *summed[1:], *args[3:], interpret=True, **opts)


def test_validation():
  q, k, v, wq, wk, pos, kc, vc, sinks, layer = inputs(1, 8, 2, 64, [3], ring=False, window=None,
                                                      garbage=False, stacked=False)
  args = (q, k, v, wq, wk, pos, kc, vc, sinks)
  with pytest.raises(ValueError, match="num_splits"):
    qk_norm_rope_attention(*args, rope=False, ring=False, num_splits=3, interpret=True)
  with pytest.raises(ValueError, match="window"):
    qk_norm_rope_attention(*args, rope=True, ring=True, interpret=True)


@pytest.mark.skipif(INTERPRET, reason="128K-key context is slow in interpret mode")
@pytest.mark.parametrize("b", [1, 8])
def test_flint_size(b):
  s_len = 131072 if b == 1 else 32768
  run(b, 32, 4, s_len, [s_len - 1 - 3001 * i for i in range(b)], ring=False, rope=False,
      garbage=False, stacked=True)
  run(b, 32, 4, 576, [100 + 7919 * i for i in range(b)], ring=True, rope=True, window=513,
      stacked=True)
