"""layer_end_qkv (the layer end by producer programs, the next q|k|v GEMVs by consumer programs
that load their weights first and wait on a device-side counter) vs norm_qkv_reference.

s must be bit-identical to the unfused kernels' (same elementwise code); the GEMV outputs close
to the reference (fp32 sums in another order). The counter row must end at
(programs, producers) and the other rows stay untouched. Interpret mode runs the programs in
grid order, so this checks the arithmetic and the ticket bookkeeping; the waiting itself is
exercised by the compiled tests on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.layer_end_qkv import layer_end_qkv, layer_end_qkv_reference
from flint_jax.pallas.testing import assert_close, randn, random_nvfp4, rng

INTERPRET = jax.default_backend() == "cpu"


def make(fmt, m, mode, d, ns, top_k=6, seed=()):
  gen = rng("layer_end_qkv", fmt, m, mode, d, ns, top_k, seed)
  if fmt == "bf16":
    ws = tuple(randn(gen, (n, d), scale=d ** -0.5) for n in ns)
  else:
    ws = tuple(random_nvfp4(gen, (n, d)) for n in ns)
  h, w = randn(gen, (m, d), scale=2.0), randn(gen, (d,), scale=0.2) + 1
  kw = {}
  if mode == "moe":
    kw = dict(y=randn(gen, (m * top_k + 1, m, d)),
              top_logits=jnp.asarray(gen.standard_normal((m, top_k)), jnp.float32))
  elif mode == "dense":
    kw = dict(y=randn(gen, (m, d)))
  return h, ws, w, kw


@pytest.mark.parametrize("fmt,m,mode,d,ns", [
    ("bf16", 1, "moe", 128, (64, 32, 32)),
    ("bf16", 3, "moe", 96, (48, 16, 16)),        # odd D (block_k 32), M padded to 16
    ("bf16", 8, "dense", 128, (32, 16, 16)),
    ("bf16", 1, "norm", 256, (64, 16, 16)),
    ("nvfp4", 1, "moe", 128, (64, 32, 32)),
    ("nvfp4", 5, "moe", 192, (32, 16, 16)),
    ("nvfp4", 2, "dense", 128, (16, 16)),
    ("nvfp4", 1, "norm", 128, (32,)),
])
def test_layer_end_qkv_matches_reference(fmt, m, mode, d, ns):
  h, ws, w, kw = make(fmt, m, mode, d, ns)
  block_k = 64 if d % 64 == 0 else 32
  counter = jnp.asarray(np.arange(10, dtype=np.int32).reshape(5, 2) * (np.arange(5) != 2)[:, None])
  s, outs, c2 = layer_end_qkv(h, ws, w, counter, counter_index=2, block_k=block_k,
                              interpret=INTERPRET, **kw)
  rs, routs = layer_end_qkv_reference(h, ws, w, **kw)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rs, np.float32))
  assert len(outs) == len(ns)
  for o, ro, n in zip(outs, routs, ns):
    assert o.shape == (m, n) and o.dtype == jnp.bfloat16
    assert_close(o, ro, what=f"{fmt} {mode} out")
  want = np.asarray(counter).copy()
  want[2] = (m + sum(ns) // 16, m)
  np.testing.assert_array_equal(np.asarray(c2), want)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("preload", [0, 1])
def test_layer_end_qkv_partial_preload(fmt, preload):
  """Weights of the first `preload` K steps before the wait, the rest after: same results."""
  h, ws, w, kw = make(fmt, 2, "moe", 192, (32, 16), top_k=3, seed=2)
  s, outs, _ = layer_end_qkv(h, ws, w, jnp.zeros((2,), jnp.int32), block_k=64, preload=preload,
                             interpret=INTERPRET, **kw)
  rs, routs = layer_end_qkv_reference(h, ws, w, **kw)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rs, np.float32))
  for o, ro in zip(outs, routs):
    assert_close(o, ro)


def test_layer_end_qkv_unstacked_counter_and_dot_at_m1():
  h, ws, w, kw = make("bf16", 1, "moe", 128, (32, 16, 16), top_k=4, seed=1)
  s, outs, c2 = layer_end_qkv(h, ws, w, jnp.zeros((2,), jnp.int32), method="dot",
                              interpret=INTERPRET, **kw)
  rs, routs = layer_end_qkv_reference(h, ws, w, **kw)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rs, np.float32))
  for o, ro in zip(outs, routs):
    assert_close(o, ro)
  assert np.asarray(c2).tolist() == [1 + 4, 1]


@pytest.mark.parametrize("bad,match", [
    (dict(counter=jnp.zeros((2,), jnp.float32)), "counter must be int32"),
    (dict(counter=jnp.zeros((3, 2), jnp.int32)), r"counter must be int32 zeros \[2\]"),
    (dict(method="swap"), "reduce .* or dot"),
    (dict(block_n=24), "block_n"),
    (dict(preload=5), r"preload must be 0\.\.1 K steps"),
])
def test_layer_end_qkv_rejects_bad_arguments(bad, match):
  h, ws, w, kw = make("bf16", 1, "dense", 64, (32, 16))
  counter = bad.pop("counter", jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=match):
    layer_end_qkv(h, ws, w, counter, interpret=INTERPRET, **kw, **bad)
