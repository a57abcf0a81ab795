"""nvfp4_gemv.x16_loads "words": the f16 K step's operand loaded per code word.

The same products in the same order as the "tile" loads, so the same bits: checked for the
dense GEMV (the LM head's f16 path) and the MoE kernels (gate_up on x16, down on h16 with its
block factors) -- compiled on a GPU, interpreted on the CPU -- and in the Triton IR, where the
x loads are [nb, 2, 4] pieces.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.fast_decode import DecodeOptions
from flint_jax.pallas import moe_decode_routed, nvfp4_gemv
from flint_jax.pallas.nvfp4_gemv import x16_loads, x16_operand
from flint_jax.pallas.testing import randn, random_moe_weights, random_nvfp4, rng, triton_modules
from test_fast_decode import paired_steps
from test_pallas_moe import used_rows

INTERPRET = jax.default_backend() == "cpu"
# a kernel's f16 load of x16 pieces [nb, 2, 4] in its Triton IR ("words")
WORD_LOAD = re.compile(r"tt.load %\S+ : tensor<\d+x2x4x!tt.ptr<f16>>")


@pytest.mark.parametrize("n,k,kw", [(48, 384, dict(block_n=16, block_k=128, num_warps=4)),
                                    (96, 2048, {})])
def test_gemv_words_equal_tile(n, k, kw):
  g = rng("x16w", n, k)
  x = randn(g, (1, k)).astype(jnp.bfloat16)
  w = random_nvfp4(g, (n, k))
  x16, inv = x16_operand(x)
  outs = {}
  for mode in ("tile", "words"):
    with x16_loads(mode):
      outs[mode] = np.asarray(nvfp4_gemv(x16, *w, x_inv=inv, out_dtype=jnp.float32,
                                         interpret=INTERPRET, **kw))
  np.testing.assert_array_equal(outs["words"], outs["tile"])


@pytest.mark.parametrize("m", [1, 3])
def test_moe_words_equal_tile(m):
  """The f16 gate_up and down kernels (per-token slots; at M = 1 the one-token slots), at
  sizes whose tiles take the block sums (so "words" applies: checked in their Triton IR)."""
  g = rng("x16wmoe", m)
  d, inter, inter_s = 512, 128, 256
  experts, shared = random_moe_weights("nvfp4", 16, d, inter, inter_s, g)
  x = randn(g, (m, d)).astype(jnp.bfloat16)
  logits = randn(g, (m, 16)).astype(jnp.float32)
  kw = dict(top_k=4, slot_rows="token", shared_rows="token", gate_up_f16=True, down_f16=True)
  ys = {}
  for mode in ("tile", "words"):
    with x16_loads(mode):
      y, _ = moe_decode_routed(x, logits, experts, shared, interpret=INTERPRET, **kw)
    ys[mode] = np.asarray(used_rows(y, 4))   # the rows per-token slots define
  np.testing.assert_array_equal(ys["words"], ys["tile"])
  with x16_loads("words"):
    mods = triton_modules(lambda a, b: moe_decode_routed(a, b, experts, shared, **kw)[0],
                          x, logits)
  gate_up = [mod for mod in mods if mod["name"].startswith("flint_moe_gate_up")]
  assert gate_up and all(WORD_LOAD.search(mod["asm"])
                         for mod in gate_up), [mod["name"] for mod in mods]


def test_words_load_pieces_in_the_triton_ir():
  """Lowered for an H200: the GEMV's x loads are [nb, 2, 4] f16 pieces under "words" (eight per
  K step), one [nb, 2, 16] tile per half otherwise."""
  w = random_nvfp4(rng("x16wir"), (64, 1024))
  x16, inv = x16_operand(randn(rng("x16wir", 1), (1, 1024)).astype(jnp.bfloat16))
  shapes = {}
  for mode in ("tile", "words"):
    with x16_loads(mode):
      (mod,) = triton_modules(lambda a, b: nvfp4_gemv(a, *w, x_inv=b, block_n=16,
                                                      block_k=512, num_warps=4), x16, inv)
    shapes[mode] = re.findall(r"tt.load %\S+ : tensor<([0-9x]+)x!tt.ptr<f16>>", mod["asm"])
  assert shapes["tile"].count("8x2x16") == 2 and "8x2x4" not in shapes["tile"], shapes
  assert shapes["words"].count("8x2x4") == 8 and "8x2x16" not in shapes["words"], shapes


def test_option_is_checked():
  with pytest.raises(ValueError, match="x16_loads"):
    DecodeOptions(x16_loads="rows")


def test_decode_step_loads_words():
  """DecodeOptions(x16_loads="words") reaches the step's kernels: lowered for an H200 at batch
  1, the MoE gate_up kernel loads x16 in [nb, 2, 4] pieces (the default step in whole tiles)."""
  from flax import nnx

  from flint_jax import fast_decode
  from flint_jax.cache import cache_shapes
  import flint_jax
  from flint_jax.model import FlintForCausalLM
  # hidden 512: the gate_up's tiles take the block sums (the tiny preset's 128 takes the pair
  # sums, where "words" does not apply)
  cfg = flint_jax.preset("tiny", hidden_size=512, num_hidden_layers=2, mlp_only_layers=(0,))
  graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
  found = {}
  for mode in ("tile", "words"):
    step = fast_decode.make_decode_step(graphdef, cfg, options=DecodeOptions(x16_loads=mode))
    mods = triton_modules(lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
                          jax.ShapeDtypeStruct((1,), jnp.int32))
    found[mode] = [bool(WORD_LOAD.search(m["asm"]))
                   for m in mods if m["name"].startswith("flint_moe_gate_up")]
  assert found["words"] and all(found["words"]) and not any(found["tile"]), found


@pytest.mark.parametrize("rows", [1, 3])
def test_words_step_equals_the_default_step(rows):
  """The NVFP4 decode step with the per-word loads gives the default step's logits bit for bit
  (compiled: H200 run 177)."""
  if INTERPRET:
    pytest.skip("compiled only: interpreted, both loads feed the same jnp form "
                "(test_decode_step_loads_words checks that the option reaches the kernels)")
  for l1, _, l2 in paired_steps(True, 19, DecodeOptions(x16_loads="words"), DecodeOptions(),
                                rows, (7, 33, 2)):
    np.testing.assert_array_equal(l1, l2)
