"""Every Pallas kernel of the decode step lowers for an H200 (Pallas -> Triton IR) at Flint
sizes, on a CPU host: the default step itself, lowered whole for each (format, batch) plan, and
a few kernels beyond it (other cache lengths, the rows that only the standalone kernels take).

A kernel that cannot lower for the GPU fails CI here (ptxas is not run: a few errors still show
only on the GPU, see tools/gpu_kernels.sh).
"""

import functools
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from flint_jax import fast_decode
from flint_jax.cache import cache_shapes
from flint_jax.config import preset
from flint_jax.model import FlintForCausalLM
from flint_jax.pallas.add_rms_norm import add_rms_norm, rms_norm
from flint_jax.pallas.add_rms_norm_router import add_rms_norm_router
from flint_jax.pallas.attention_block import qk_norm_rope_attention
from flint_jax.pallas.nvfp4_gemv import NVFP4Weight, nvfp4_gemv
from pallas_testing import lower_for_h200, triton_modules

S = jax.ShapeDtypeStruct
BF, F32, U8, I32 = jnp.bfloat16, jnp.float32, jnp.uint8, jnp.int32
D, H, KVH, DH, E, V = 2048, 32, 4, 128, 256, 150144

# Flint's sizes, 5 layers: two dense (full attention), then MoE on sliding (the first computes
# RoPE's cos / sin, the second loads them) and full layers, the last feeding the LM head
CFG = preset("flint").replace(num_hidden_layers=5, layer_types=())


def nv(n, k, lead=()):
  return NVFP4Weight(S((*lead, n, k // 2), U8), S((*lead, n, k // 16), BF), S(lead, F32))


def lower(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    lowered = lower_for_h200(fn, *args)
  assert "__gpu$xla.gpu.triton" in lowered.as_text()
  return lowered.as_text()


def step_kernels(quant: bool, batch: int, length: int = 1024):
  """The Triton modules of the default step at Flint sizes (the NVFP4 block scales pre-scaled
  to bf16, as ``flint_jax.load`` holds them on a GPU), in launch order."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: FlintForCausalLM(CFG, quant=quant)))
  state = jax.tree.map(lambda a: S(a.shape, BF) if a.dtype == jnp.float8_e4m3fn else a, state)
  step = fast_decode.make_decode_step(graphdef, CFG)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return triton_modules(lambda s, c, t: step(s, c, t), state, cache_shapes(CFG, batch, length),
                          S((batch,), I32))


def _prefixes(mods):
  """Kernel names without their tile suffixes, counted."""
  return Counter(m["name"].split("_bn")[0].split("_d2048")[0].split("_bk")[0] for m in mods)


TRIGGER = "griddepcontrol.launch_dependents"


@pytest.mark.parametrize("quant,batch", [(False, 1), (False, 3), (False, 8), (True, 1),
                                         (True, 3), (True, 8)])
def test_default_step_lowers(quant, batch):
  """The whole default step lowers; its kernels are the plan's (identical kernels lower once:
  the names here are the distinct kernels), and BF16 steps trigger early, NVFP4 steps do not."""
  plan = fast_decode.decode_plan(quant, batch)
  mods = step_kernels(quant, batch)
  names = [m["name"] for m in mods]
  kinds = _prefixes(mods)
  assert all((TRIGGER in m["asm"]) == plan.early_trigger for m in mods), names
  assert ("flint_norm_qkv3_moe_bf16_swap" in kinds) == (plan.layer_end == "qkv"), names
  assert any(n.startswith("flint_moe_down") and ("_combine" in n or "_residual" in n)
             for n in names) == (plan.layer_end == "down"), names
  assert any(n.startswith("flint_add_rms_norm_router") for n in names) == plan.router_in_norm
  assert any(n.startswith("flint_router_m") for n in names) == (not plan.router_in_norm)
  assert any(n.startswith("flint_moe_topk") for n in names) == plan.moe.prerouted
  qkv = [n for n in names if n.startswith("flint_multi_gemv3")]
  split = plan.qkv_split_k if plan.layer_end != "qkv" else 1
  assert all((f"_splitk{split}" in n) == (split > 1) for n in qkv), qkv
  if quant:
    assert any(n.startswith("flint_nvfp4_gemv") and n.endswith("_x16") for n in names) == (
        plan.lm_head_f16)
    gate_up = [m for m in mods if m["name"].startswith("flint_moe_gate_up")]
    assert gate_up and all("fma.rn.f16x2" in m["asm"] for m in gate_up)
  if quant and batch == 1:   # the post-scaled q|k|v decode: no bf16x2 scale multiply there
    qkv_mods = [m for m in mods if m["name"].startswith("flint_multi_gemv3")]
    assert {m["name"].endswith("_rms_bn16_bk1024") for m in qkv_mods} == {True, False}, names
    assert all("mul.lo.u32" in m["asm"] and "mul.rn.bf16x2" not in m["asm"] for m in qkv_mods)
  if not quant and batch == 1:
    assert any(n.startswith("flint_gemv_silu_mul") for n in names), names
    assert any("_splitk2_finish" in n for n in names), names     # the MoE gate_up's K slices


@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("ring,s_len", [(False, 131072), (True, 576), (False, 64)])
def test_attention_lowers(b, ring, s_len):
  """The fused attention at the longest cache, the ring and the shortest cache (one split: no
  merge kernel)."""
  kw = dict(rope=ring, ring=ring, window=513 if ring else None)
  cache = S((3, b, KVH, s_len, DH), BF)
  args = (S((b, H, DH), BF), S((b, KVH, DH), BF), S((b, KVH, DH), BF), S((DH,), BF),
          S((DH,), BF), S((b,), I32), cache, cache, S((H,), F32), S((), I32))
  text = lower(functools.partial(qk_norm_rope_attention, **kw), *args)
  assert ("flint_decode_attn_merge" in text) == (s_len > 64)


@pytest.mark.parametrize("m", [1, 8, 16])
def test_norms_lower(m):
  lower(add_rms_norm, S((m, D), BF), S((m, D), BF), S((D,), BF))
  lower(functools.partial(add_rms_norm, x16=True), S((m, D), BF), S((4, m, D), F32), S((D,), BF))
  lower(rms_norm, S((m, D), BF), S((D,), BF))
  lower(functools.partial(add_rms_norm_router, x16=True), S((m, D), BF), S((3, m, D), F32),
        S((D,), BF), S((E, D), F32))


@pytest.mark.parametrize("m", [1, 2, 16])
def test_nvfp4_gemv_lowers(m):
  """The o_proj, dense down and LM head shapes (blocks / rows / dot / swap tiles)."""
  for n, k in ((D, 4096), (D, 6144), (V, D)):
    lower(functools.partial(nvfp4_gemv, out_dtype=F32 if n == V else BF), S((m, k), BF),
          *nv(n, k))
