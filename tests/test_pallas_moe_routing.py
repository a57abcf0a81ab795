"""The fp32 MoE router GEMV kernel (``pallas.moe.routing``) against its reference, interpret mode on
CPU (and compiled on the GPU with ``JAX_PLATFORMS=cuda``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.moe.routing import moe_topk_route
from flint_jax.pallas.moe.routing import router_logits, router_logits_reference
from pallas_testing import lower_for_h200

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
