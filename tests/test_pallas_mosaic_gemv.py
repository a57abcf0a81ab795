"""mosaic_gemv (Mosaic GPU: TMA ring + wgmma, optional PDL wait) against its reference.

On CPU the kernel runs in Mosaic GPU interpret mode (TMA, barriers and wgmma simulated); on a GPU
compiled. ``pdl=True`` adds ``griddepcontrol.wait`` on the GPU (a no-op without a PDL launch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.mosaic_gemv import mosaic_gemv, mosaic_gemv_reference, x_tiles_from_rows
from flint_jax.pallas.testing import randn, rng

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize("m,n,k,split_k,stages,pdl", [
    (1, 64, 128, 1, 4, False),      # fewer K steps (2) than stages: the ring is clamped
    (3, 192, 256, 2, 1, True),      # one stage: every step waits for its own load
    (8, 128, 512, 1, 3, False),     # 8 steps through a 3-slot ring (slots reused)
    (5, 64, 384, 3, 2, True),       # odd split count and M
])
def test_mosaic_gemv(m, n, k, split_k, stages, pdl):
  gen = rng("mosaic_gemv", m, n, k, split_k, stages)
  x = randn(gen, (m, k))
  w = randn(gen, (n, k), scale=k ** -0.5)
  xt = x_tiles_from_rows(x)
  out = mosaic_gemv(xt, w, split_k=split_k, stages=stages, pdl=pdl, interpret=INTERPRET)
  ref = mosaic_gemv_reference(xt, w, split_k=split_k)
  assert out.shape == (split_k, n, 8) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
  # the padded token rows stay zero, and the partials sum to the product
  assert not np.asarray(out[:, :, m:]).any()
  y = jnp.sum(out, axis=0)[:, :m].T
  want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T,
                 precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_mosaic_gemv_bad_inputs():
  w = jnp.zeros((64, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="at most 8 rows"):
    x_tiles_from_rows(jnp.zeros((9, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match="multiple of block_k"):
    x_tiles_from_rows(jnp.zeros((1, 100), jnp.bfloat16))
  xt = x_tiles_from_rows(jnp.zeros((1, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match="block_n"):
    mosaic_gemv(xt, jnp.zeros((96, 128), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="x_tiles must be"):
    mosaic_gemv(xt, jnp.zeros((64, 256), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="split_k"):
    mosaic_gemv(xt, w, split_k=3, interpret=True)
