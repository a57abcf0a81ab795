"""L2 prefetch lanes (pallas/l2_prefetch.py).

- ``l2_prefetch`` alone: every program's sink equals the reference's sum of the tiles it owns
  (so every element is loaded by exactly one program), for odd shapes, several dtypes and
  program counts above and below the tile count.
- Every host kernel with prefetch lanes returns exactly what it returns without them (the lanes
  touch nothing but their sink), including aliased caches and the routed MoE with the down
  weights prefetched per slot.
- Each lowers for an H200 with the lanes (one Triton kernel per host, as without; the MoE's
  in test_pallas_lowering.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import (add_rms_norm, l2_prefetch, l2_prefetch_reference,
                              moe_combine_add_rms_norm, moe_decode_routed,
                              qk_norm_rope_attention, rms_norm)
from flint_jax.pallas.testing import (lower_for_h200, randn, random_kv_caches,
                                      random_moe_weights, random_nvfp4, rng, tie_logits)

INTERPRET = jax.default_backend() == "cpu"
S = jax.ShapeDtypeStruct


def some_arrays(gen):
  """Odd sizes; bf16, uint8 codes, e4m3 scales, a 3-D expert stack and a 1-D vector."""
  q, s, _ = random_nvfp4(gen, (37, 128))
  return [randn(gen, (301, 96)), q, s, randn(gen, (3, 50, 64)),
          randn(gen, (1000,), dtype=jnp.float32)]


@pytest.mark.parametrize("programs", [1, 5, 64, 300])
def test_l2_prefetch_sinks_equal_reference(programs):
  arrays = some_arrays(rng("pf", programs))
  got = np.asarray(l2_prefetch(arrays, num_programs=programs, interpret=INTERPRET))
  want = np.asarray(l2_prefetch_reference(arrays, num_programs=programs))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2)
  total = sum(float(jnp.sum(a.astype(jnp.float32))) for a in arrays)
  assert abs(got.sum() - total) <= 1e-5 * sum(float(jnp.sum(jnp.abs(a.astype(jnp.float32))))
                                              for a in arrays)


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("m", [1, 3])
def test_norm_hosts_unchanged_by_prefetch(m):
  gen = rng("norms", m)
  h, y, w = randn(gen, (m, 80)), randn(gen, (m, 80)), randn(gen, (80,))
  pf = some_arrays(gen)
  kw = dict(interpret=INTERPRET, prefetch_programs=7)
  assert_same(add_rms_norm(h, y, w, prefetch=pf, **kw), add_rms_norm(h, y, w, interpret=INTERPRET))
  assert_same(rms_norm(h, w, prefetch=pf, **kw), rms_norm(h, w, interpret=INTERPRET))
  top_k = 3
  yy = randn(gen, (m * top_k + 1, m, 80))
  tl = jnp.asarray(gen.standard_normal((m, top_k)), jnp.float32)
  assert_same(moe_combine_add_rms_norm(h, yy, tl, w, prefetch=pf, **kw),
              moe_combine_add_rms_norm(h, yy, tl, w, interpret=INTERPRET))


@pytest.mark.parametrize("b,ring,merge", [(1, True, "kernel"), (2, False, "kernel"),
                                          (3, True, "atomic")])
def test_attention_host_unchanged_by_prefetch(b, ring, merge):
  gen = rng("attn", b, ring, merge)
  h, kvh, dh, s_len = 8, 2, 64, 64
  q, k, v = randn(gen, (b, h, dh)), randn(gen, (b, kvh, dh)), randn(gen, (b, kvh, dh))
  wq, wk = randn(gen, (dh,)) + 1, randn(gen, (dh,)) + 1
  kc, vc, _ = random_kv_caches(gen, (b, kvh, s_len, dh))
  pos = jnp.asarray(gen.integers(0, 150 if ring else s_len, b), jnp.int32)
  sinks = jnp.asarray(gen.standard_normal(h), jnp.float32)
  kw = dict(rope=ring, ring=ring, window=9 if ring else None, merge=merge, num_splits=4,
            interpret=INTERPRET)
  extra = lambda: (jnp.zeros((b, kvh), jnp.int32),) if merge == "atomic" else ()  # noqa: E731
  want = qk_norm_rope_attention(q, k, v, wq, wk, pos, kc, vc, sinks, None, *extra(), **kw)
  got = qk_norm_rope_attention(q, k, v, wq, wk, pos, kc, vc, sinks, None, *extra(),
                               prefetch=some_arrays(gen), prefetch_programs=5, **kw)
  assert_same(got, want)


@pytest.mark.parametrize("fmt,m", [("bf16", 1), ("nvfp4", 1), ("bf16", 2)])
def test_moe_down_prefetch_unchanged(fmt, m):
  gen = rng("moe_pf", fmt, m)
  e, d, inter, inter_s, top_k = 12, 128, 64, 128, 3
  experts, shared = random_moe_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  logits = tie_logits(gen, m, e)
  want = moe_decode_routed(x, logits, experts, shared, top_k=top_k, interpret=INTERPRET)
  for parts in (1, 3):
    got = moe_decode_routed(x, logits, experts, shared, top_k=top_k, prefetch_down=parts,
                            interpret=INTERPRET)
    assert_same(got, want)


def test_hosts_lower_with_prefetch():
  bf = jnp.bfloat16
  o_proj = (S((2048, 4096), bf),)
  qkv = (S((4096, 1024), jnp.uint8), S((4096, 128), jnp.float8_e4m3fn),
         S((512, 1024), jnp.uint8), S((512, 128), jnp.float8_e4m3fn))
  for pf in (o_proj, qkv):
    n = len(pf)
    text = lower_for_h200(lambda h, y, w, *p: add_rms_norm(h, y, w, prefetch=p),
                          S((1, 2048), bf), S((1, 2048), bf), S((2048,), bf), *pf).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "_l2pf" in text, n
    text = lower_for_h200(lambda x, w, *p: rms_norm(x, w, prefetch=p),
                          S((8, 2048), bf), S((2048,), bf), *pf).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    text = lower_for_h200(
        lambda h, y, t, w, *p: moe_combine_add_rms_norm(h, y, t, w, prefetch=p),
        S((1, 2048), bf), S((7, 1, 2048), bf), S((1, 6), jnp.float32), S((2048,), bf),
        *pf).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
  cache = S((35, 1, 4, 576, 128), bf)
  fn = functools.partial(qk_norm_rope_attention, rope=True, ring=True, window=513)
  text = lower_for_h200(
      lambda *a: fn(*a[:10], prefetch=a[10:]),
      S((1, 32, 128), bf), S((1, 4, 128), bf), S((1, 4, 128), bf), S((128,), bf), S((128,), bf),
      S((1,), jnp.int32), cache, cache, S((32,), jnp.float32), S((), jnp.int32),
      *o_proj).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2 and "_l2pf" in text
