"""Full-layer prefill attention on cuDNN (flint_jax.cudnn_attention) against the Pallas kernel's
reference: chunks from position 0 and appended to a cache, ragged rows (a row with no tokens),
GQA. On the CPU the split-and-merge runs with its plain-JAX stand-in for the cuDNN call; on a
GPU with cuDNN itself, plus a Flint-sized case."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.cudnn_attention import full_attention
from flint_jax.pallas.prefill_attention import prefill_attention_reference
from pallas_testing import assert_close, randn, rng

ON_GPU = jax.default_backend() == "gpu"
IMPL = "cudnn" if ON_GPU else "xla"
BF, F32 = jnp.bfloat16, jnp.float32

CASES = [  # (B, T, H, KVH, Dh, S, lengths, n_tokens)
    (1, 40, 8, 2, 64, 64, [0], [40]),                        # one chunk from position 0
    (3, 24, 8, 2, 64, 128, [0, 37, 90], [24, 11, 0]),         # ragged, a row with no tokens
    (2, 33, 4, 1, 64, 96, [17, 63], [33, 5]),                 # MQA, every row with a prefix
]
if ON_GPU:
  CASES.append((2, 1024, 32, 4, 128, 4096, [0, 2048], [1024, 700]))   # Flint heads


def _inputs(params):
  b, t, h, kvh, dh, s_len, lengths, n = params
  gen = rng("cudnn_attention", *[repr(x) for x in params])
  q = randn(gen, (b, t, h, dh), BF)
  chunk_k = randn(gen, (b, t, kvh, dh), BF, scale=2.0)
  chunk_v = randn(gen, (b, t, kvh, dh), BF)
  sinks = jnp.asarray(gen.standard_normal(h).astype(np.float32))
  # The cache after the chunk was written (slot = position): a prefix of random keys, the
  # chunk's own keys at lengths + i, finite garbage beyond (never attended).
  k = np.array(randn(gen, (b, kvh, s_len, dh), F32, scale=2.0))
  v = np.array(randn(gen, (b, kvh, s_len, dh), F32))
  garbage = np.asarray(randn(gen, (b, kvh, s_len, dh), F32, scale=50.0))
  ck, cv = np.asarray(chunk_k, np.float32), np.asarray(chunk_v, np.float32)
  for r in range(b):
    end = lengths[r] + n[r]
    k[r, :, lengths[r]:end] = ck[r, :n[r]].transpose(1, 0, 2)
    v[r, :, lengths[r]:end] = cv[r, :n[r]].transpose(1, 0, 2)
    k[r, :, end:] = garbage[r, :, end:]
    v[r, :, end:] = garbage[r, :, end:]
  # A layer stack of two layers, layer 1 the one attended (layer 0 garbage).
  k_cache = jnp.asarray(np.stack([garbage, k]), BF)
  v_cache = jnp.asarray(np.stack([garbage, v]), BF)
  return (q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), jnp.asarray(n, jnp.int32),
          sinks, chunk_k, chunk_v)


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"b{p[0]}_t{p[1]}_h{p[2]}_kv{p[3]}")
def test_full_attention_matches_reference(params):
  q, k_cache, v_cache, lengths, n, sinks, chunk_k, chunk_v = _inputs(params)
  fn = jax.jit(full_attention, static_argnames=("layer", "implementation"))
  out = fn(q, k_cache, v_cache, 1, lengths, n, sinks, chunk_k, chunk_v, implementation=IMPL)
  ref = prefill_attention_reference(q, k_cache, v_cache, lengths, n, sinks, 1, ring=False)
  assert out.shape == q.shape and out.dtype == q.dtype
  for r, k in enumerate(params[7]):
    if k:
      assert_close(out[r, :k], ref[r, :k], what=f"row {r} ({IMPL})")
    np.testing.assert_array_equal(np.asarray(out[r, k:], np.float32), 0.0)


def test_sinks_take_their_share():
  """One key per query (T = 1 from position 0): o = v * sigmoid(s - sink) exactly as the
  reference computes it; a huge sink drives the output to zero, a very negative one to v."""
  params = (1, 1, 4, 1, 64, 64, [0], [1])
  q, k_cache, v_cache, lengths, n, _, chunk_k, chunk_v = _inputs(params)
  for sink, want in ((60.0, 0.0), (-60.0, 1.0)):
    sinks = jnp.full((4,), sink, F32)
    out = full_attention(q, k_cache, v_cache, 1, lengths, n, sinks, chunk_k, chunk_v,
                         implementation=IMPL)
    expect = jnp.broadcast_to(chunk_v[:, :, :1].astype(F32) * want, out.shape)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expect), atol=1e-6)


def test_bad_implementation_is_named():
  params = CASES[0]
  args = _inputs(params)
  with pytest.raises(ValueError, match="implementation must be one of"):
    full_attention(*args[:3], 1, *args[3:], implementation="flash")
