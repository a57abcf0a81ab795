"""NVFP4 block scales given pre-scaled (bf16 ``scale * 2^119``, ``prescale_block_scales``).

Every NVFP4 kernel must give bit-identical results with the pre-scaled scales as with the e4m3
ones (the decode multiplies by the same bf16 value either way), on fresh random weights, for each
tile method / layout, batch 1 and > 1; the reference dequantization accepts both; the converter
of the scales is exact; a model whose state is converted (``nvfp4.prescale_state``) decodes the
same logits on the XLA and the Pallas paths. Interpret mode on the CPU (the ``fp8`` decode), compiled on the GPU
(the ``asm`` decode).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.moe import moe_combine_add_rms_norm, moe_decode_routed, moe_router_logits
from flint_jax.pallas.multi_gemv import multi_gemv
from flint_jax.pallas.nvfp4_gemv import (NVFP4Weight, PRESCALE, dequantize_nvfp4_reference,
                                         nvfp4_gemv, prescale_block_scales)
from pallas_testing import randn, random_moe_weights, random_nvfp4, rng

INTERPRET = jax.default_backend() == "cpu"
DECODE = "fp8" if INTERPRET else "asm"


def _pre(w: NVFP4Weight) -> NVFP4Weight:
  return w._replace(weight_scale=prescale_block_scales(w.weight_scale))


def _same(a, b, what):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                  err_msg=what)


def test_prescale_is_exact_for_every_e4m3_value():
  codes = np.arange(256, dtype=np.uint8)
  s = jnp.asarray(codes.view(jnp.float8_e4m3fn))
  finite = np.isfinite(np.asarray(s, np.float32))
  p = prescale_block_scales(s)
  assert p.dtype == jnp.bfloat16
  back = np.asarray(p, np.float64)[finite] / PRESCALE
  np.testing.assert_array_equal(back, np.asarray(s, np.float64)[finite])


def test_reference_dequantize_accepts_prescaled():
  w = random_nvfp4(rng("deq"), (24, 128))
  _same(dequantize_nvfp4_reference(w.qweight, prescale_block_scales(w.weight_scale)),
        dequantize_nvfp4_reference(w.qweight, w.weight_scale), "dequantize")


@pytest.mark.parametrize("m,n,k,kw", [
    (1, 96, 320, dict()), (3, 80, 192, dict()), (8, 64, 256, dict(method="dot")),
    (3, 64, 256, dict(method="swap")), (2, 32, 128, dict(method="rows"))])
def test_nvfp4_gemv(m, n, k, kw):
  gen = rng("gemv", m, n, k, tuple(kw.items()))
  x, w = randn(gen, (m, k)), random_nvfp4(gen, (n, k))
  args = dict(decode=DECODE, interpret=INTERPRET, **kw)
  _same(nvfp4_gemv(x, *_pre(w), **args), nvfp4_gemv(x, *w, **args), "nvfp4_gemv")


@pytest.mark.parametrize("m,kw", [(1, {}), (1, dict(post_scale=True)), (5, {})])
def test_multi_gemv(m, kw):
  gen = rng("multi", m, tuple(kw))
  k = 192
  ws = [random_nvfp4(gen, (n, k)) for n in (128, 32, 32)]
  x = randn(gen, (m, k))
  args = dict(decode=DECODE, interpret=INTERPRET, **kw)
  _same(multi_gemv(x, [_pre(w) for w in ws], **args), multi_gemv(x, ws, **args), "multi_gemv")


# M = 1: the blocks plan; M = 3: the prerouted rows-tile plan, which M = 8 runs with other tile
# sizes (the same scale decode): M = 8 compiled on the GPU only.
@pytest.mark.parametrize("m", [1, 3] + ([] if INTERPRET else [8]))
def test_moe_decode_routed(m):
  gen = rng("moe", m)
  e, d, inter, inter_s, top_k = 16, 128, 64, 128, 4
  experts, shared = random_moe_weights("nvfp4", e, d, inter, inter_s, gen)
  pre_experts = dict(experts,
                     gate_up_weight_scale=prescale_block_scales(experts["gate_up_weight_scale"]),
                     down_weight_scale=prescale_block_scales(experts["down_weight_scale"]))
  pre_shared = {k: _pre(v) for k, v in shared.items()}
  x, h, wn = randn(gen, (m, d)), randn(gen, (m, d)), randn(gen, (d,))
  logits = moe_router_logits(x, randn(gen, (e, d), jnp.float32))
  args = dict(top_k=top_k, decode=DECODE, interpret=INTERPRET)

  def combined(ex, sh):   # y's padding slots are never written: compare what is combined
    y, route = moe_decode_routed(x, logits, ex, sh, **args)
    return route, moe_combine_add_rms_norm(h, y, route.logits, wn, interpret=INTERPRET)

  _same(combined(pre_experts, pre_shared), combined(experts, shared), "moe_decode_routed")


def test_other_scale_dtypes_rejected():
  gen = rng("bad")
  x, w = randn(gen, (1, 64)), random_nvfp4(gen, (32, 64))
  with pytest.raises(ValueError, match="weight_scale"):
    nvfp4_gemv(x, w.qweight, w.weight_scale.astype(jnp.float16), w.weight_scale_2,
               interpret=True)


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_prescaled_state_decodes_the_same(kernels):
  from flax import nnx   # pylint: disable=g-import-not-at-top
  import flint_jax   # pylint: disable=g-import-not-at-top
  from flint_jax import fast_decode, nvfp4   # pylint: disable=g-import-not-at-top
  from flint_jax.cache import init_cache   # pylint: disable=g-import-not-at-top
  from flint_jax.model import FlintForCausalLM   # pylint: disable=g-import-not-at-top
  cfg = flint_jax.preset("tiny", num_hidden_layers=3, mlp_only_layers=(0,))
  graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(3)))
  pre = nvfp4.prescale_state(state)
  dtypes = {str(a.dtype) for a in jax.tree.leaves(pre)}
  assert "float8_e4m3fn" not in dtypes and "bfloat16" in dtypes
  if kernels == "xla":
    def xla_step(st, cache, tokens):
      n = jnp.ones(tokens.shape, jnp.int32)
      logits, cache, _ = nnx.merge(graphdef, st)(tokens[:, None], cache, n, logits="last")
      return logits, cache
    step = jax.jit(xla_step)
  else:
    step = jax.jit(fast_decode.make_decode_step(graphdef, cfg, interpret=INTERPRET))
  c1 = c2 = init_cache(cfg, 2, 64)
  for t in ([5, 9], [17, 2]):
    tokens = jnp.array(t, jnp.int32)
    l1, c1 = step(state, c1, tokens)
    l2, c2 = step(pre, c2, tokens)
    _same(l2, l1, f"logits ({kernels})")


def test_load_holds_prescaled_scales_for_the_gpu_pallas_path(monkeypatch):
  """`flint_jax.load` (its `make_handle`) converts an NVFP4 model's block scales for the Pallas
  path on a GPU only, into exactly `nvfp4.prescale_state`'s state (which decodes the same logits:
  test_prescaled_state_decodes_the_same)."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  import flint_jax   # pylint: disable=g-import-not-at-top
  from flint_jax import loading, nvfp4   # pylint: disable=g-import-not-at-top
  from flint_jax.model import FlintForCausalLM   # pylint: disable=g-import-not-at-top
  cfg = flint_jax.preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,))
  graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(5)))

  def handle(kernels, backend):
    with monkeypatch.context() as mp:
      mp.setattr(loading.jax, "default_backend", lambda: backend)
      return loading.make_handle(cfg, graphdef, state, dtype=jnp.bfloat16, quant=True,
                                 kernels=kernels, mesh=None, rules=None, max_length=128,
                                 meta_dir=None, source="<test>")

  def has_e4m3(h):
    return any(str(a.dtype) == "float8_e4m3fn" for a in jax.tree.leaves(h.state))

  assert has_e4m3(handle("pallas", "cpu")) and has_e4m3(handle("xla", "gpu"))
  pre, ref = handle("pallas", "gpu"), handle("pallas", "cpu")
  assert not has_e4m3(pre)
  # Bit for bit (a generate() on both handles would compile two Pallas steps to show the same).
  want = nvfp4.prescale_state(ref.state)
  assert jax.tree.structure(pre.state) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(pre.state), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                  np.atleast_1d(np.asarray(b)).view(np.uint8))


def test_f16_block_step_with_large_prescaled_scales_under_jit():
  """The f16 K step (``blocks_fma_f16``) with pre-scaled scales near e4m3's largest (448 x
  2^119 in bf16) and x block factors ~2^-19, compiled by XLA (interpret mode's compiler): the
  same sums as with the e4m3 scales. XLA moved the 2^-112 of the scale conversion onto the x
  factors, an f32 subnormal flushed to zero, until the conversion became exponent arithmetic."""
  from flint_jax.pallas.nvfp4_gemv import blocks_fma_f16
  gen = rng("f16-prescaled")
  q = jnp.asarray(gen.integers(0, 256, (4, 2, 2, 16)), jnp.uint8)
  s = jnp.asarray(gen.choice([448.0, 384.0, 2.0 ** -9, 0.0, 96.0], (4, 2, 2)),
                  jnp.float32).astype(jnp.float8_e4m3fn)
  x = jnp.asarray(gen.standard_normal((2, 2, 16)) * 2.0 ** 12, jnp.float16)
  xs = tuple(jnp.asarray(2.0 ** gen.integers(-24, -15, (2, 2)), jnp.float32) for _ in range(2))

  def step(scales, xs):
    return blocks_fma_f16(jnp.zeros((4, 2, 2)), (q, scales, scales), lambda h: x, "fp8", xs)

  want = np.asarray(jax.jit(step)(s, xs))
  assert np.abs(want).max() > 0
  _same(jax.jit(step)(prescale_block_scales(s), xs), want, "f16 step, pre-scaled")
