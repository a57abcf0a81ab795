"""The fp32 MoE router GEMV kernel (``pallas.router``) against its reference, interpret mode on
CPU (and compiled on the GPU with ``JAX_PLATFORMS=cuda``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.moe import moe_topk_route
from flint_jax.pallas.router import (router_logits, router_logits_reference, router_logits_topk,
                                     router_logits_topk_reference)
from flint_jax.pallas.testing import lower_for_h200

INTERPRET = jax.default_backend() in ("cpu", "tpu")


@pytest.mark.parametrize("m,e,d,dtype", [
    (1, 256, 2048, jnp.bfloat16), (3, 256, 2048, jnp.bfloat16), (8, 256, 2048, jnp.bfloat16),
    (16, 64, 512, jnp.float32), (5, 8, 128, jnp.bfloat16), (2, 24, 96, jnp.float32)])
def test_router_logits_matches_reference(m, e, d, dtype):
  gen = np.random.default_rng(m * 1000 + e + d)
  x = jnp.asarray(gen.standard_normal((m, d)), dtype)
  w = jnp.asarray(gen.standard_normal((e, d)) / np.sqrt(d), jnp.float32)
  got = router_logits(x, w, interpret=INTERPRET)
  want = router_logits_reference(x, w)
  assert got.shape == (m, e) and got.dtype == jnp.float32
  # only the fp32 summation order differs
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_e,block_k", [(1, 64), (8, 128), (2, 2048)])
def test_router_logits_tilings(block_e, block_k):
  gen = np.random.default_rng(7)
  x = jnp.asarray(gen.standard_normal((8, 2048)), jnp.bfloat16)
  w = jnp.asarray(gen.standard_normal((64, 2048)) / 45.0, jnp.float32)
  got = router_logits(x, w, block_e=block_e, block_k=block_k, interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(got), np.asarray(router_logits_reference(x, w)),
                             rtol=1e-5, atol=1e-5)


def test_router_logits_bad_input():
  x = jnp.zeros((2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="router_w must be"):
    router_logits(x, jnp.zeros((8, 32), jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="1..16 rows"):
    router_logits(jnp.zeros((17, 64)), jnp.zeros((8, 64), jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="block_e"):
    router_logits(x, jnp.zeros((8, 64), jnp.float32), block_e=16, interpret=True)


@pytest.mark.parametrize("m", [1, 8])
def test_router_logits_lowers_for_h200(m):
  s = jax.ShapeDtypeStruct
  text = lower_for_h200(router_logits, s((m, 2048), jnp.bfloat16),
                        s((256, 2048), jnp.float32)).as_text()
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("m,e,d,top_k,dup", [
    (8, 256, 2048, 6, True), (1, 256, 2048, 6, False), (5, 200, 256, 4, True),
    (3, 24, 96, 24, False), (16, 64, 512, 8, True), (2, 8, 128, 1, False)])
def test_router_logits_topk(m, e, d, top_k, dup):
  """The router GEMV with the top-k in its last program: the logits as ``router_logits``'s
  (bit for bit) and the reference's (fp32 order), the routing equal to ``lax.top_k`` of those
  logits bit for bit (``dup``: duplicated router rows, so equal logits, lowest index first; E
  not a power of two; top_k = E), the counter entry back at zero and the others untouched, and
  a second call on the returned counter the same."""
  gen = np.random.default_rng(m * 7 + e + top_k)
  x = jnp.asarray(gen.standard_normal((m, d)), jnp.bfloat16)
  w = gen.standard_normal((e, d)) / np.sqrt(d)
  if dup:   # rows 2k + 1 = rows 2k: every logit tied with a neighbour
    w[1::2] = w[0::2]
  w = jnp.asarray(w, jnp.float32)
  base = 37
  counter = jnp.zeros((64,), jnp.int32).at[base + 1].set(5).at[base - 1].set(-3)
  for call in range(2):
    logits, route, counter = router_logits_topk(x, w, counter, top_k=top_k, counter_base=base,
                                                interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(logits),
                                  np.asarray(router_logits(x, w, interpret=INTERPRET)))
    want_logits, _, _ = router_logits_topk_reference(x, w, counter, top_k=top_k)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5,
                               atol=1e-5)
    want = moe_topk_route(logits, top_k=top_k)
    assert route.ids.shape == (m, top_k) and route.ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(want.ids),
                                  err_msg=f"call {call}")
    np.testing.assert_array_equal(np.asarray(route.logits), np.asarray(want.logits))
    c = np.asarray(counter)
    assert c[base] == 0 and c[base + 1] == 5 and c[base - 1] == -3 and not c[:base - 1].any()


def test_router_logits_topk_bad_input():
  x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((8, 64), jnp.float32)
  with pytest.raises(ValueError, match="counter must be int32"):
    router_logits_topk(x, w, jnp.zeros((4,), jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="counter_base=4"):
    router_logits_topk(x, w, jnp.zeros((4,), jnp.int32), counter_base=4, interpret=True)
  with pytest.raises(ValueError, match="top_k <= E"):
    router_logits_topk(x, w, jnp.zeros((4,), jnp.int32), top_k=9, interpret=True)


@pytest.mark.parametrize("m", [2, 8])
def test_router_logits_topk_lowers_for_h200(m):
  s = jax.ShapeDtypeStruct
  text = lower_for_h200(router_logits_topk, s((m, 2048), jnp.bfloat16),
                        s((256, 2048), jnp.float32), s((4096,), jnp.int32)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1

