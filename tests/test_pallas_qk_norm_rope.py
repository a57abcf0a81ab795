"""qk_norm_rope vs reference: q, the cache slot written, and every other slot untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import qk_norm_rope, qk_norm_rope_reference
from flint_jax.pallas.testing import assert_close, randn, rng

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize("b,h,kvh,dh,s_len,positions,rope,ring,stacked", [
    (3, 32, 4, 128, 576, [0, 575, 1000], True, True, False),        # ring wrap, RoPE, Flint
    (8, 8, 1, 64, 64, [0, 1, 2, 31, 63, 64, 100, 5], False, False, True),  # full; p >= S dropped
    (2, 24, 3, 128, 128, [7, 70000], True, True, True),             # non-power-of-two heads
])
def test_qk_norm_rope(b, h, kvh, dh, s_len, positions, rope, ring, stacked):
  gen = rng(b, h, kvh, positions)
  q, k, v = randn(gen, (b, h, dh), scale=3.0), randn(gen, (b, kvh, dh)), randn(gen, (b, kvh, dh))
  wq = randn(gen, (dh,), scale=0.2) + 1
  wk = randn(gen, (dh,), scale=0.2) + 1
  shape = (b, kvh, s_len, dh) if not stacked else (2, b, kvh, s_len, dh)
  # Poison: the caches are NaN everywhere; only the written slots may change.
  kc = jnp.full(shape, jnp.nan, jnp.bfloat16)
  vc = jnp.full(shape, jnp.nan, jnp.bfloat16)
  pos = jnp.asarray(positions, jnp.int32)
  layer = 1 if stacked else None
  out = qk_norm_rope(q, k, v, wq, wk, pos, kc, vc, layer, rope=rope, ring=ring,
                     interpret=INTERPRET)
  ref = qk_norm_rope_reference(q, k, v, wq, wk, pos, kc, vc, layer, rope=rope, ring=ring)
  assert_close(out[0], ref[0], what="q")
  for got, want, name in [(out[1], ref[1], "k_cache"), (out[2], ref[2], "v_cache")]:
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{name}: slots written")
    fin = ~np.isnan(w)
    assert fin.sum() == kvh * dh * sum(ring or p < s_len for p in positions)
    assert_close(jnp.asarray(np.where(fin, g, 0), jnp.bfloat16),
                 jnp.asarray(np.where(fin, w, 0), jnp.bfloat16), what=name)
