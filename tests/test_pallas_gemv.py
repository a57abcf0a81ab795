"""gemv / gemv_silu_mul vs their references (interpret mode on CPU, compiled on a GPU).

Interpret mode starts every Pallas output as NaN, so an unwritten element fails the finiteness
check of ``assert_close`` (the poisoned-output check for non-aliased outputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import gemv, gemv_reference, gemv_silu_mul, gemv_silu_mul_reference
from flint_jax.pallas.testing import assert_close, randn, rng

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize("m,n,k,out_dtype,kw", [
    (1, 64, 256, jnp.bfloat16, {}),                                 # default: swap-AB
    (1, 64, 256, jnp.bfloat16, dict(method="dot")),
    (1, 96, 512, jnp.bfloat16, dict(method="reduce", block_n=32, split_k=2)),
    (3, 48, 128, jnp.bfloat16, dict(block_n=16, block_k=64)),       # odd M, N = 3 blocks
    (3, 64, 256, jnp.bfloat16, dict(method="swap")),
    (3, 48, 256, jnp.bfloat16, dict(method="rows", block_n=16)),    # CUDA-core rows, Mp = 4
    (8, 512, 2048, jnp.bfloat16, {}),                               # default split-K (k_proj)
    (5, 256, 512, jnp.float32, dict(block_n=32, block_k=128, split_k=1)),  # fp32 out
    (1, 2048, 2048, jnp.bfloat16, {}),                              # Flint o_proj-ish size
    (4, 64, 256, jnp.bfloat16, dict(split_k=4)),    # a given split: K steps shrink to fit it
])
def test_gemv(m, n, k, out_dtype, kw):
  g = rng(m, n, k, str(out_dtype), kw)
  x = randn(g, (m, k))
  w = randn(g, (n, k), scale=k ** -0.5)
  out = gemv(x, w, out_dtype=out_dtype, interpret=INTERPRET, **kw)
  assert_close(out, gemv_reference(x, w, out_dtype=out_dtype), what="gemv")


@pytest.mark.parametrize("m,n,k,method", [(1, 64, 256, None), (1, 64, 256, "reduce"),
                                          (8, 1024, 256, None), (3, 32, 2048, "swap")])
def test_gemv_silu_mul(m, n, k, method):
  g = rng(m, n, k, method)
  x = randn(g, (m, k))
  wg, wu = randn(g, (n, k), scale=2 * k ** -0.5), randn(g, (n, k), scale=k ** -0.5)
  out = gemv_silu_mul(x, wg, wu, method=method, interpret=INTERPRET)
  assert_close(out, gemv_silu_mul_reference(x, wg, wu), what="gemv_silu_mul")


def test_gemv_rejects_bad_shapes():
  x = jnp.zeros((2, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="block_n"):
    gemv(x, jnp.zeros((40, 128), jnp.bfloat16), block_n=16, interpret=True)
  with pytest.raises(ValueError, match="rows"):
    gemv(jnp.zeros((17, 128), jnp.bfloat16), jnp.zeros((32, 128), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    gemv(x, jnp.zeros((32, 128), jnp.float32), interpret=True)


def test_silu_mul_rounds_where_the_model_does():
  """The kernels' gate|up epilogue rounds g and u to bf16 before silu * up, as the model's
  bf16 projections do (layers.silu_mul of two bf16 outputs): bit-identical on any fp32 inputs,
  and not the same as rounding only at the end (which the kernels did before session 5)."""
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
