"""Prefill flash attention with sinks: interpret mode against the reference at odd sizes (chunk and
window edges, ring wrap, chunks longer than the ring, ragged rows, garbage in unwritten slots),
the model's own attention on the same data, and lowering for an H200 at Flint sizes."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.prefill_attention import prefill_attention, prefill_attention_reference
from pallas_testing import assert_close, lower_for_h200, randn, rng

S = jax.ShapeDtypeStruct
INTERPRET = jax.default_backend() == "cpu"   # compiled kernels on a GPU
BF, F32 = jnp.bfloat16, jnp.float32


def _valid_rows(out, n):
  """Rows (b, i < n[b]) of [B, T, H, Dh] as one [N, H, Dh] array."""
  return jnp.concatenate([out[b, :int(k)] for b, k in enumerate(n)], axis=0)


def _inputs(gen, b, t, h, kvh, dh, dtype):
  q = randn(gen, (b, t, h, dh), dtype)
  sinks = jnp.asarray(gen.standard_normal(h).astype(np.float32))
  return q, sinks


def _full_cache(gen, b, kvh, s_len, dh, lengths, n, dtype):
  """A cache whose slots >= lengths + n hold NaN keys and inf values (never attended)."""
  k = np.asarray(randn(gen, (b, kvh, s_len, dh), F32, scale=2.0))
  v = np.asarray(randn(gen, (b, kvh, s_len, dh), F32))
  dead = np.arange(s_len)[None, :] >= (np.asarray(lengths) + np.asarray(n))[:, None]
  k = np.where(dead[:, None, :, None], np.nan, k)
  v = np.where(dead[:, None, :, None], np.inf, v)
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _ring(gen, b, kvh, r, dh, lengths, dtype):
  """A ring holding positions lengths - R .. lengths - 1 at slot position % R; slots of negative
  positions (short rows) hold NaN / inf."""
  k = np.asarray(randn(gen, (b, kvh, r, dh), F32, scale=2.0))
  v = np.asarray(randn(gen, (b, kvh, r, dh), F32))
  last = np.asarray(lengths)[:, None] - 1
  pos = last - np.mod(last - np.arange(r)[None, :], r)
  dead = pos < 0
  k = np.where(dead[:, None, :, None], np.nan, k)
  v = np.where(dead[:, None, :, None], np.inf, v)
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _tol(dtype):
  return dict(atol=2e-6, rtol=2e-5) if dtype == F32 else {}


FULL_CASES = [  # (B, T, H, KVH, Dh, S, lengths, n, window, dtype, block_q)
    (3, 24, 8, 2, 32, 128, [0, 37, 90], [24, 11, 0], None, BF, None),
    (2, 40, 4, 4, 16, 128, [5, 64], [40, 33], None, F32, None),
    (1, 33, 3, 1, 14, 64, [7], [29], None, F32, 4),     # G = 3 (padded to 4), Dh = 14
    (2, 50, 8, 1, 32, 128, [0, 70], [50, 41], 9, BF, 2),  # a window on the full cache
    (1, 64, 8, 2, 32, 512, [300], [64], None, F32, 4),    # a long prefix: unmasked blocks
    (2, 48, 4, 2, 16, 256, [100, 3], [48, 30], 33, F32, 8),  # window + prefix
]


@pytest.mark.parametrize("b,t,h,kvh,dh,s_len,lengths,n,window,dtype,bq", FULL_CASES)
def test_full_matches_reference(b, t, h, kvh, dh, s_len, lengths, n, window, dtype, bq):
  gen = rng("full", b, t, h, kvh, dh, s_len, window)
  q, sinks = _inputs(gen, b, t, h, kvh, dh, dtype)
  kc, vc = _full_cache(gen, b, kvh, s_len, dh, lengths, n, dtype)
  lengths, n = jnp.asarray(lengths, jnp.int32), jnp.asarray(n, jnp.int32)
  kw = dict(ring=False, window=window)
  out = prefill_attention(q, kc, vc, lengths, n, sinks, block_q=bq, block_k=16,
                          interpret=INTERPRET, **kw)
  ref = prefill_attention_reference(q, kc, vc, lengths, n, sinks, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(_valid_rows(out, n), _valid_rows(ref, n), what="full", **_tol(dtype))
  assert np.isfinite(np.asarray(out, np.float32)).all()


def test_split_unmasked_blocks():
  # _split's unmasked range is exactly the blocks inside [lo_ok, hi_ok] (brute force).
  from flint_jax.pallas.prefill_attention import _split
  gen = np.random.default_rng(0)
  for _ in range(300):
    bk = int(gen.choice([16, 64]))
    start, n = int(gen.integers(0, 200)), int(gen.integers(0, 12))
    lo = None if gen.random() < 0.3 else int(gen.integers(-50, 400))
    hi = int(gen.integers(-50, 400))
    i_a, i_b = (int(v) for v in _split(jnp.int32(start), jnp.int32(n),
                                        None if lo is None else jnp.int32(lo), jnp.int32(hi), bk))
    inside = [(lo is None or start + i * bk >= lo) and start + i * bk + bk - 1 <= hi
              for i in range(n)]
    assert 0 <= i_a <= i_b <= n
    assert inside == [i_a <= i < i_b for i in range(n)], (start, n, lo, hi, bk, i_a, i_b)


RING_CASES = [  # (B, T, H, KVH, Dh, R, window, lengths, n, dtype)
    (3, 24, 8, 2, 32, 64, 7, [0, 5, 130], [24, 17, 9], BF),       # fresh, short, wrapped rows
    (2, 80, 4, 2, 16, 64, 50, [0, 100], [80, 71], F32),           # chunk longer than the ring
    (2, 19, 3, 3, 14, 64, 3, [61, 64], [19, 1], F32),             # odd T, Dh 14, G 1
    (3, 32, 8, 1, 32, 64, 64, [63, 200, 0], [32, 0, 5], BF),      # window = R, an empty row
]


@pytest.mark.parametrize("b,t,h,kvh,dh,r,window,lengths,n,dtype", RING_CASES)
@pytest.mark.parametrize("stacked", [False, True])
def test_ring_matches_reference(b, t, h, kvh, dh, r, window, lengths, n, dtype, stacked):
  gen = rng("ring", b, t, h, kvh, dh, r, window, stacked)
  q, sinks = _inputs(gen, b, t, h, kvh, dh, dtype)
  rk, rv = _ring(gen, b, kvh, r, dh, lengths, dtype)
  ck = randn(gen, (b, t, kvh, dh), dtype, scale=2.0)
  cv = randn(gen, (b, t, kvh, dh), dtype)
  lengths, n = jnp.asarray(lengths, jnp.int32), jnp.asarray(n, jnp.int32)
  layer = None
  if stacked:   # layer 1 of a 3-layer stack whose other layers are NaN
    nan = lambda a: jnp.full_like(a, jnp.nan)   # noqa: E731
    rk, rv, layer = jnp.stack([nan(rk), rk, nan(rk)]), jnp.stack([nan(rv), rv, nan(rv)]), 1
  kw = dict(ring=True, window=window)
  out = prefill_attention(q, rk, rv, lengths, n, sinks, layer, ck, cv, block_k=16,
                          interpret=INTERPRET, **kw)
  ref = prefill_attention_reference(q, rk, rv, lengths, n, sinks, layer, ck, cv, **kw)
  assert_close(_valid_rows(out, n), _valid_rows(ref, n), what="ring", **_tol(dtype))
  assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.fixture
def ieee_fp32():
  """f32 XLA dots in IEEE fp32: the model's attention_reference leaves P.V at the default
  precision, which on a GPU rounds f32 operands to TF32 (the kernel's f32 dots are IEEE)."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.usefixtures("ieee_fp32")
def test_equals_model_attention_across_chunks():
  # Two chunks of a sliding layer (ring update between them) and of a full layer, through the
  # model's own write + attention_reference: the kernel reads what the XLA path reads.
  from flint_jax import model as M
  b, t, h, kvh, dh, r, w, s_len = 2, 40, 4, 2, 16, 64, 9, 128
  gen = rng("model-chunks")
  ring_k = jnp.zeros((b, kvh, r, dh), F32)
  ring_v = jnp.zeros((b, kvh, r, dh), F32)
  full_k = jnp.zeros((b, kvh, s_len, dh), F32)
  full_v = jnp.zeros((b, kvh, s_len, dh), F32)
  sinks = jnp.asarray(gen.standard_normal(h).astype(np.float32))
  lengths = jnp.asarray([0, 3], jnp.int32)
  for n in ([40, 25], [17, 40]):
    n = jnp.asarray(n, jnp.int32)
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    info = M.ChunkInfo(positions=lengths[:, None] + offs, valid=offs < n[:, None],
                       lengths_before=lengths, lengths_after=lengths + n)
    q = randn(gen, (b, t, h, dh), F32)
    k = randn(gen, (b, t, kvh, dh), F32)
    v = randn(gen, (b, t, kvh, dh), F32)
    # sliding
    keys, vals, kpos, kok = M._ring_keys(ring_k, ring_v, k, v, info)
    want, _ = M.attention_reference(q, keys, vals, kpos, kok, info.positions, sinks, w)
    got = prefill_attention(q, ring_k, ring_v, lengths, n, sinks, None, k, v, ring=True,
                            window=w, block_k=16, interpret=INTERPRET)
    assert_close(_valid_rows(got, n), _valid_rows(want, n), atol=2e-6, rtol=2e-5, what="ring")
    ring_k, ring_v = M._ring_write(ring_k, ring_v, k, v, info)
    # full
    full_k, full_v = M._full_write(full_k, full_v, k, v, info)
    kpos = jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (b, s_len))
    want, _ = M.attention_reference(q, full_k, full_v, kpos, kpos < info.lengths_after[:, None],
                                    info.positions, sinks, None)
    got = prefill_attention(q, full_k, full_v, lengths, n, sinks, ring=False, block_k=16,
                            interpret=INTERPRET)
    assert_close(_valid_rows(got, n), _valid_rows(want, n), atol=2e-6, rtol=2e-5, what="full")
    lengths = lengths + n


# ------------------------------------------------------------------------------------------
# Lowering for an H200 at Flint sizes: 32 q / 4 kv heads of 128, ring of 576 slots, window 513

H, KVH, DH, R, W = 32, 4, 128, 576, 513


def _lower(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    text = lower_for_h200(fn, *args).as_text()
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("b,t,s_len", [(1, 8192, 8192), (8, 2048, 2048), (1, 4096, 32768)])
@pytest.mark.parametrize("bq,bk", [(None, None), (8, 128), (32, 64)])
def test_lowers_for_h200(b, t, s_len, bq, bk):
  i32 = jnp.int32
  common = (S((b,), i32), S((b,), i32), S((H,), F32))
  full = functools.partial(prefill_attention, ring=False, block_q=bq, block_k=bk)
  _lower(full, S((b, t, H, DH), BF), S((14, b, KVH, s_len, DH), BF),
         S((14, b, KVH, s_len, DH), BF), *common, S((), i32))
  ring = functools.partial(prefill_attention, ring=True, window=W, block_q=bq, block_k=bk)
  _lower(ring, S((b, t, H, DH), BF), S((35, b, KVH, R, DH), BF), S((35, b, KVH, R, DH), BF),
         *common, S((), i32), S((b, t, KVH, DH), BF), S((b, t, KVH, DH), BF))
