"""The Pallas prefill path (flint_jax.prefill, interpret mode on the CPU) equals the XLA path:
last-token logits and every cache entry, on the tiny goldens in fp32 (1e-4) with ragged rows,
several chunks, window and ring wrap; greedy continuations from its cache equal the oracle's;
NVFP4 and bf16 models."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

import flint_jax
from conftest import CONFIGS, golden
from flint_jax import decode, prefill
from flint_jax.config import preset
from flint_jax.loading import from_module
from flint_jax.model import FlintForCausalLM


@pytest.fixture
def ieee_fp32():
  """The fp32 comparisons run every f32 XLA dot in IEEE fp32: at the default precision a GPU
  rounds f32 operands to TF32 (~5e-4 relative), in both paths but in different places (the
  kernels' own f32 dots are IEEE), far above the 1e-4 these tests hold them to. (On the CPU
  this changes nothing.)"""
  with jax.default_matmul_precision("highest"):
    yield


def rel_max_err(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _rows(g, vocab, lengths, seed=0):
  """Ragged prompt rows: the golden ids, continued with random ids past their length."""
  gen = np.random.default_rng(seed)
  base = np.asarray(g["input_ids"])
  rows = []
  for i, n in enumerate(lengths):
    r = list(base[i % base.shape[0]])
    r += gen.integers(0, vocab, max(0, n - len(r))).tolist()
    rows.append([int(x) for x in r[:n]])
  return rows


def _live_cache(cache, cfg, lengths):
  """The cache entries the decode step may read: full slots < length, ring slots holding a
  position >= 0 (np arrays)."""
  out = {"lengths": np.asarray(cache.lengths)}
  fk, fv = np.asarray(cache.full_k), np.asarray(cache.full_v)
  rk, rv = np.asarray(cache.ring_k), np.asarray(cache.ring_v)
  r = rk.shape[3]
  for b, n in enumerate(lengths):
    out[f"full{b}"] = np.concatenate([fk[:, b, :, :n], fv[:, b, :, :n]])
    live = [s for s in range(r) if (n - 1) - ((n - 1 - s) % r) >= 0]
    out[f"ring{b}"] = np.concatenate([rk[:, b, :, live], rv[:, b, :, live]])
  return out


def _compare(model, rows, cache_len, chunk, tol, options=prefill.PrefillOptions()):
  lengths = [len(r) for r in rows]
  want_logits, want_cache = decode.prefill(model, rows, cache_len, chunk)
  got_logits, got_cache = prefill.prefill(model, rows, cache_len, chunk, options=options)
  err = rel_max_err(got_logits, want_logits)
  print(f"logits rel err {err:.2e}")
  assert err <= tol
  want = _live_cache(want_cache, model.config, lengths)
  got = _live_cache(got_cache, model.config, lengths)
  np.testing.assert_array_equal(got["lengths"], want["lengths"])
  for k in want:
    if k != "lengths":
      assert rel_max_err(got[k], want[k]) <= tol, k
  return got_logits, got_cache


@pytest.mark.usefixtures("ieee_fp32")
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_equals_xla_path(fp32_models, name):
  # Three ragged rows, chunks of 32: window edges, chunk boundaries and (row 0, 100 > R = 64)
  # the ring wrap; row 2 ends inside the first chunk (n = 0 afterwards).
  m = fp32_models[name]
  rows = _rows(golden(name), m.config.vocab_size, [100, 45, 7])
  _compare(m, rows, 128, 32, 1e-4)


@pytest.mark.usefixtures("ieee_fp32")
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_logits_equal_goldens_and_greedy_continues(fp32_models, name):
  # One prefill of the golden rows and the greedy prompt, in test_prefill_equals_xla_path's
  # shapes (3 rows, chunks of 32, a 128-slot cache: its compiled chunk step is reused).
  m = fp32_models[name]
  g = golden(name)
  ids = np.asarray(g["input_ids"])
  prompt = [int(t) for t in g["greedy_prompt"]]
  logits, cache = prefill.prefill(m, [list(r) for r in ids] + [prompt], 128, 32)
  assert rel_max_err(logits[:2], g["logits"][:, -1]) <= 1e-4
  # Greedy continuation of the prompt (row 2): the Pallas prefill's cache, then the XLA decode
  # step.
  step = m.decode_logits_fn()
  toks = []
  tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  for _ in range(len(g["greedy_tokens"])):
    toks.append(int(tok[2]))
    logits, cache = step(m.leaves, cache, tok)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  np.testing.assert_array_equal(np.array(toks), g["greedy_tokens"])


def _random_model(quant, dtype, **cfg_over):
  cfg = preset("tiny", **cfg_over)
  module = FlintForCausalLM(cfg, dtype=dtype, quant=quant, rngs=nnx.Rngs(3))
  return from_module(module, kernels="xla")


@pytest.mark.usefixtures("ieee_fp32")
@pytest.mark.parametrize("experts", ["fused", "dequant"])
def test_prefill_nvfp4_model_equals_xla_path(experts):
  # NVFP4 experts decoded in the grouped GEMMs' K loop, or dequantized first (large chunks).
  m = _random_model(True, jnp.float32)
  rows = _rows({"input_ids": np.zeros((1, 0), np.int64)}, m.config.vocab_size, [70, 23])
  options = prefill.PrefillOptions(nvfp4_experts=experts)
  a, _ = _compare(m, rows, 128, 32, 1e-4, options)
  if experts == "fused":
    # The block scales pre-scaled into bf16 (nvfp4.prescale_state, how a GPU holds them): the
    # same logits (this run's first prefill is the compiled step above).
    from flint_jax.nvfp4 import prescale_state
    m.state = prescale_state(m.state)
    b, _ = prefill.prefill(m, rows, 128, 32, options=options)
    assert rel_max_err(b, a) <= 1e-6


@pytest.mark.usefixtures("ieee_fp32")
def test_prefill_router_highest_equals_xla_path(fp32_models):
  # The default router dot is BF16_BF16_F32_X6 (for bf16 activations its products are exact; for
  # these fp32 models it drops only the products of the operands' smallest bf16 parts, ~2^-24
  # relative); "highest" is the XLA path's own dot: both give its routing and logits.
  m = fp32_models["tiny_a"]
  rows = _rows(golden("tiny_a"), m.config.vocab_size, [60, 31])
  _compare(m, rows, 128, 32, 1e-4, prefill.PrefillOptions(router="highest"))
  with pytest.raises(ValueError, match="router must be one of"):
    prefill.PrefillOptions(router="tf32")


@pytest.mark.usefixtures("ieee_fp32")
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN attention takes bf16 only")
def test_prefill_cudnn_split_equals_xla_path(fp32_models):
  # The full layers' attention split into the chunk's own keys and the cache prefix, merged by
  # log-sum-exp with the sinks (cudnn_attention, plain-JAX stand-in): fp32, the XLA path's
  # logits and cache; ragged rows over three chunks.
  m = fp32_models["tiny_a"]
  rows = _rows(golden("tiny_a"), m.config.vocab_size, [75, 40, 9])
  _compare(m, rows, 128, 32, 1e-4, prefill.PrefillOptions(attention="cudnn"))
  with pytest.raises(ValueError, match="attention must be one of"):
    prefill.PrefillOptions(attention="flash")


@pytest.mark.parametrize("attention", ["pallas", "cudnn"])
def test_prefill_bf16_model_close_to_xla_path(attention):
  # bf16: the same roundings up to summation order and one P rounding point in attention.
  # attention="cudnn" runs cuDNN on a GPU (its plain-JAX stand-in on the CPU); rows of 90 and
  # 33 tokens in chunks of 64: the second chunk of row 0 reads its prefix from the cache.
  m = _random_model(False, jnp.bfloat16, sliding_window=17)
  rows = _rows({"input_ids": np.zeros((1, 0), np.int64)}, m.config.vocab_size, [90, 33])
  want, wc = decode.prefill(m, rows, 128, 64)
  got, gc = prefill.prefill(m, rows, 128, 64,
                            options=prefill.PrefillOptions(attention=attention))
  per_row = (np.linalg.norm(np.asarray(got) - np.asarray(want), axis=-1)
             / np.linalg.norm(np.asarray(want), axis=-1))
  print("bf16 per-row rel err", per_row)
  assert per_row.max() < 0.02


def test_chunk_length_policy():
  assert prefill.chunk_length(1, 8192) == 8192
  assert prefill.chunk_length(1, 32768) == 16384
  assert prefill.chunk_length(8, 2048) == 2048
  assert prefill.chunk_length(8, 2048, max_tokens=8192) == 1024
  assert prefill.chunk_length(3, 5) == 16
  assert prefill.chunk_length(64, 4000, max_tokens=512) == 16


@pytest.mark.parametrize("quant", [False, True])
def test_chunk_lowers_for_h200_at_flint_sizes(quant):
  # Flint's sizes with 4 layers (full 0, 1, 3; sliding 2; dense 0, 1; MoE 2, 3): an 8K chunk of
  # one row into a 16K cache and 2K chunks of 8 rows lower for an H200 (every kernel and shape).
  import functools
  import warnings
  from flint_jax.cache import cache_shapes
  from pallas_testing import lower_for_h200
  S = jax.ShapeDtypeStruct
  cfg = preset("flint", num_hidden_layers=4)
  abstract = nnx.eval_shape(lambda: FlintForCausalLM(cfg, dtype=jnp.bfloat16, quant=quant,
                                                     rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  if quant:   # the GPU holds the block scales pre-scaled in bf16 (nvfp4.prescale_state)
    state = jax.tree.map(lambda a: S(a.shape, jnp.bfloat16) if a.dtype == jnp.float8_e4m3fn
                         else a, state)
  # The Pallas full-layer attention: lowering cuDNN's (the GPU default) needs the cuDNN library,
  # so that path is checked compiled on the GPU only (test_cudnn_attention, the bf16 model test).
  opts = prefill.PrefillOptions(interpret=False, attention="pallas")

  def run(state, tokens, cache, n):
    return prefill.chunk_forward(nnx.merge(graphdef, state), tokens, cache, n, options=opts)

  for b, t, s_len in ((1, 8192, 16384), (8, 2048, 4096)):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      text = lower_for_h200(run, state, S((b, t), jnp.int32), cache_shapes(cfg, b, s_len),
                            S((b,), jnp.int32)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 4


def test_generate_and_forward_use_the_prefill_kernels(fp32_models, ieee_fp32):
  """`generate`, `forward` and `decode.prefill` run the prompt through the Pallas prefill kernels
  when the handle says so (`prefill_kernels="pallas"`; "auto" picks them with the Pallas decode
  step on a GPU): the same greedy tokens and logits as the XLA path, one compiled chunk step."""
  import dataclasses
  xla = fp32_models["tiny_a"]
  pal = dataclasses.replace(xla, prefill_kernels="pallas")
  assert pal.pallas_prefill and not xla.pallas_prefill
  rows = [list(range(5, 60)), list(range(9, 30))]
  kw = dict(max_new_tokens=5, temperature=0, stop_token_ids=[])
  for a, b in zip(flint_jax.generate(xla, rows, **kw), flint_jax.generate(pal, rows, **kw)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(k[0] == "prefill_chunk" for k in pal.steps) and not any(k[0] == "chunk" for k in pal.steps)
  ids = np.asarray(rows[0][:40])[None]
  assert rel_max_err(flint_jax.forward(pal, ids), flint_jax.forward(xla, ids)) < 1e-4
  with pytest.raises(ValueError, match="prefill_kernels"):
    dataclasses.replace(xla, prefill_kernels="cudnn").pallas_prefill
