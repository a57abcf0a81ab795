"""decode_attention (full and ring caches, sinks, GQA) vs the plain-jnp reference.

Unattended slots hold NaN keys and inf values in most cases (stale / unwritten cache memory):
the kernel must mask before the exp and zero V rows outside the range.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import decode_attention, decode_attention_reference
from flint_jax.pallas.testing import assert_close, randn, random_kv_caches, rng

INTERPRET = jax.default_backend() == "cpu"
DH = 128


def dead_slots(pos, s_len, ring, window):
  slot = np.arange(s_len)[None, :]
  p = np.asarray(pos)[:, None]
  if ring:
    d = (p - slot) % s_len
    return (d > p) | (d > window - 1)
  return slot > p


def run(b, h, kvh, s_len, positions, *, ring, window=None, garbage=True, stacked=False, **kw):
  gen = rng(b, h, kvh, s_len, positions, ring, garbage, stacked, kw)
  shape = (b, kvh, s_len, DH)
  q = randn(gen, (b, h, DH))
  dead = dead_slots(positions, s_len, ring, window) if garbage else None
  kc, vc, layer = random_kv_caches(gen, shape, dead=dead, stacked=stacked)
  pos = jnp.asarray(positions, jnp.int32)
  sinks = jnp.asarray(gen.standard_normal(h), jnp.float32)
  out = decode_attention(q, kc, vc, pos, sinks, layer, ring=ring, window=window,
                         interpret=INTERPRET, **kw)
  ref = decode_attention_reference(q, kc, vc, pos, sinks, layer, ring=ring, window=window)
  assert_close(out, ref, what="decode_attention")


@pytest.mark.parametrize("b,h,kvh,s_len,positions,kw", [
    (1, 32, 4, 512, [0], {}),                                      # first token, G=8
    (8, 32, 8, 1024, [0, 1, 511, 512, 513, 700, 1000, 1023], dict(block_k=64)),  # G=4, B=8
    (3, 8, 8, 256, [1, 128, 255], dict(num_splits=1)),             # G=1, no split, stacked
])
def test_full(b, h, kvh, s_len, positions, kw):
  run(b, h, kvh, s_len, positions, ring=False, stacked=(b == 3), **kw)


def test_full_long_context():
  """A few thousand keys over 32 splits (the kernel's run-time chunking), clean cache."""
  run(1, 32, 4, 4096, [3999], ring=False, garbage=False, num_splits=32)


@pytest.mark.parametrize("b,positions", [
    (3, [0, 512, 513]),           # ring not yet full / exactly the window / oldest slot drops
    (3, [576, 1000, 5000]),       # wrapped ring (p > R)
])
def test_ring(b, positions):
  run(b, 32, 4, 576, positions, ring=True, window=513, stacked=(positions[0] == 576))


def test_ring_gqa1_small_window():
  run(2, 4, 4, 128, [70, 300], ring=True, window=100, block_k=32, num_splits=2)


def test_garbage_makes_no_difference():
  """NaN in unattended slots gives the bit-identical result of a clean cache."""
  b, h, kvh, s_len = 2, 16, 2, 256
  gen = rng("garbage")
  q = randn(gen, (b, h, DH))
  kc, vc = randn(gen, (b, kvh, s_len, DH)), randn(gen, (b, kvh, s_len, DH))
  pos = jnp.array([10, 130], jnp.int32)
  sinks = jnp.asarray(gen.standard_normal(h), jnp.float32)
  dead = jnp.asarray(dead_slots(pos, s_len, False, None))[:, None, :, None]
  kg = jnp.where(dead, jnp.nan, kc).astype(kc.dtype)
  vg = jnp.where(dead, jnp.nan, vc).astype(vc.dtype)
  clean = decode_attention(q, kc, vc, pos, sinks, ring=False, interpret=INTERPRET)
  dirty = decode_attention(q, kg, vg, pos, sinks, ring=False, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(clean, np.float32), np.asarray(dirty, np.float32))


@pytest.mark.skipif(INTERPRET, reason="128K-key context is slow in interpret mode")
@pytest.mark.parametrize("b", [1, 8])
def test_full_flint_size(b):
  s_len = 131072 if b == 1 else 32768
  run(b, 32, 4, s_len, [s_len - 1 - 3001 * i for i in range(b)], ring=False, garbage=False)
