"""moe_decode (and routing / slot building) vs the token-by-token reference, BF16 and NVFP4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import moe_block, moe_block_reference, moe_decode, moe_decode_reference
from flint_jax.pallas.moe import moe_route, moe_slots
from flint_jax.pallas.testing import assert_close, randn, random_nvfp4, rng

INTERPRET = jax.default_backend() == "cpu"
DECODE = "fp8" if INTERPRET else "asm"


def make_weights(fmt, e, d, inter, inter_s, gen):
  """fmt: 'bf16' (all bf16), 'nvfp4' (all NVFP4), 'mixed' (bf16 experts, NVFP4 shared)."""
  if fmt in ("bf16", "mixed"):
    experts = dict(gate_up_proj=randn(gen, (e, 2 * inter, d), scale=2 * d ** -0.5),
                   down_proj=randn(gen, (e, d, inter), scale=inter ** -0.5))
  else:
    g = random_nvfp4(gen, (e, 2 * inter, d), scale_2=np.ones((e, 2)))
    s2 = gen.uniform(0.5, 2.0, (e, 2)).astype(np.float32) * 2 * d ** -0.5
    dn = random_nvfp4(gen, (e, d, inter))
    experts = dict(gate_up_qweight=g.qweight, gate_up_weight_scale=g.weight_scale,
                   gate_up_weight_scale_2=jnp.asarray(s2), down_qweight=dn.qweight,
                   down_weight_scale=dn.weight_scale, down_weight_scale_2=dn.weight_scale_2)
  if fmt == "bf16":
    shared = dict(gate_proj=randn(gen, (inter_s, d), scale=2 * d ** -0.5),
                  up_proj=randn(gen, (inter_s, d), scale=d ** -0.5),
                  down_proj=randn(gen, (d, inter_s), scale=inter_s ** -0.5))
  else:
    shared = dict(gate_proj=random_nvfp4(gen, (inter_s, d)),
                  up_proj=random_nvfp4(gen, (inter_s, d)),
                  down_proj=random_nvfp4(gen, (d, inter_s)))
  return experts, shared


def test_route_and_slots():
  m, e, d = 5, 32, 64
  gen = rng("route")
  x = randn(gen, (m, d))
  router = randn(gen, (e, d), jnp.float32)
  ids, w = moe_route(x, router, top_k=6)
  assert ids.shape == (m, 6) and ids.dtype == jnp.int32
  np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
  s = np.asarray(x, np.float32) @ np.asarray(router).T          # sigmoid is monotonic
  np.testing.assert_array_equal(np.sort(np.asarray(ids), -1),
                                np.sort(np.argsort(-s, -1)[:, :6], -1))
  ids = jnp.array([[3, 1, 7], [7, 2, 3]], jnp.int32)
  w = jnp.array([[.5, .3, .2], [.6, .3, .1]], jnp.float32)
  se, coef, n = moe_slots(ids, w, dedupe=True)
  assert int(n[0]) == 4 and list(np.asarray(se)[:4]) == [1, 2, 3, 7]
  np.testing.assert_allclose(np.asarray(coef)[:4], [[.3, 0], [0, .3], [.5, .1], [.2, .6]])
  assert np.all(np.asarray(coef)[4:] == 0)
  se, coef, n = moe_slots(ids, w, dedupe=False)
  assert int(n[0]) == 6 and list(np.asarray(se)) == [3, 1, 7, 7, 2, 3]
  np.testing.assert_allclose(np.asarray(coef)[:, 0], [.5, .3, .2, 0, 0, 0])


@pytest.mark.parametrize("fmt,m,dedupe,unroll,kw", [
    ("bf16", 1, None, True, dict(down_split=False)),    # fused combine, unrolled slot loop
    ("bf16", 3, True, False, dict(down_split=False, method="swap")),  # dedupe, fori_loop
    ("nvfp4", 1, None, None, {}),                       # defaults: reduce tiles, split down
    ("nvfp4", 8, True, None, {}),                       # 48 slots, tokens share experts
    ("mixed", 2, False, None, dict(method="swap", method_down="dot")),
])
def test_moe_decode(fmt, m, dedupe, unroll, kw):
  e, d, inter, inter_s = 16, 256, 64, 128
  gen = rng(fmt, m, dedupe)
  experts, shared = make_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  ids, w = moe_route(x, randn(gen, (e, d), jnp.float32))
  if dedupe:   # force experts shared across tokens: de-duplication must merge them
    ids = ids.at[1:, 0].set(ids[0, 0])
  out = moe_decode(x, ids, w, experts, shared, dedupe=dedupe, decode=DECODE,
                   unroll_slots=unroll, interpret=INTERPRET, **kw)
  ref = moe_decode_reference(x, ids, w, experts, shared)
  assert_close(out, ref, what=f"moe {fmt}")


@pytest.mark.skipif(INTERPRET, reason="Flint-sized MoE (256 experts) is slow in interpret mode")
@pytest.mark.parametrize("fmt,m", [("bf16", 1), ("nvfp4", 1), ("bf16", 8), ("nvfp4", 8)])
def test_moe_block_flint_size(fmt, m):
  e, d, inter, inter_s = 256, 2048, 512, 1024
  gen = rng("flint", fmt, m)
  experts, shared = make_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  router = randn(gen, (e, d), jnp.float32, d ** -0.5)
  out = moe_block(x, router, experts, shared, decode=DECODE, interpret=INTERPRET)
  assert_close(out, moe_block_reference(x, router, experts, shared), what=f"moe {fmt}")
