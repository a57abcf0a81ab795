"""gemv_silu_mul vs its reference (interpret mode on CPU, compiled on a GPU).

Interpret mode starts every Pallas output as NaN, so an unwritten element fails the finiteness
check of ``assert_close`` (the poisoned-output check for non-aliased outputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.gemv import gemv_silu_mul, gemv_silu_mul_reference
from pallas_testing import assert_close, randn, rng

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize("m,n,k,method", [(1, 64, 256, None), (1, 64, 256, "dot"),
                                          (8, 1024, 256, None), (3, 32, 2048, "swap")])
def test_gemv_silu_mul(m, n, k, method):
  g = rng(m, n, k, method)
  x = randn(g, (m, k))
  wg, wu = randn(g, (n, k), scale=2 * k ** -0.5), randn(g, (n, k), scale=k ** -0.5)
  out = gemv_silu_mul(x, wg, wu, method=method, interpret=INTERPRET)
  assert_close(out, gemv_silu_mul_reference(x, wg, wu), what="gemv_silu_mul")


def test_gemv_silu_mul_rejects_bad_shapes():
  x = jnp.zeros((2, 128), jnp.bfloat16)
  w = jnp.zeros((40, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="block_n"):
    gemv_silu_mul(x, w, w, block_n=16, interpret=True)
  w = jnp.zeros((32, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="rows"):
    gemv_silu_mul(jnp.zeros((17, 128), jnp.bfloat16), w, w, interpret=True)
  w = jnp.zeros((32, 128), jnp.float32)
  with pytest.raises(ValueError, match="dtype"):
    gemv_silu_mul(x, w, w, interpret=True)


def test_silu_mul_rounds_where_the_model_does():
  """The kernels' gate|up epilogue rounds g and u to bf16 before silu * up, as the model's
  bf16 projections do (layers.silu_mul of two bf16 outputs): bit-identical on any fp32 inputs,
  and not the same as rounding only at the end (which the kernels' first versions did)."""
  from flint_jax import layers  # pylint: disable=g-import-not-at-top
  from flint_jax.pallas._common import silu_mul_f32  # pylint: disable=g-import-not-at-top
  g = rng("silu_round")
  a = jnp.asarray(g.standard_normal((4, 999)) * 3, jnp.float32)
  b = jnp.asarray(g.standard_normal((4, 999)), jnp.float32)
  ours = silu_mul_f32(a, b).astype(jnp.bfloat16)
  model = layers.silu_mul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(model, np.float32))
  once = (a * jax.nn.sigmoid(a) * b).astype(jnp.bfloat16)
  assert np.any(np.asarray(once, np.float32) != np.asarray(model, np.float32))
