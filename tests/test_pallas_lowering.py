"""Every Pallas kernel lowers for an H200 (Pallas -> Triton IR) at Flint sizes, on a CPU host.

A kernel that cannot lower for the GPU fails CI here (ptxas is not run: a few errors still show
only on the GPU, see tools/gpu_kernels.sh).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

from flint_jax.pallas import (add_rms_norm, decode_attention, gemv, gemv_silu_mul,
                              moe_block_add_rms_norm, moe_combine_add_rms_norm, moe_decode,
                              moe_decode_routed, multi_gemv, nvfp4_gemv, nvfp4_gemv_silu_mul,
                              qk_norm_rope, qk_norm_rope_attention, rms_norm)
from flint_jax.pallas.nvfp4_gemv import NVFP4Weight
from flint_jax.pallas.testing import lower_for_h200

S = jax.ShapeDtypeStruct
BF, F32, U8, F8, I32 = jnp.bfloat16, jnp.float32, jnp.uint8, jnp.float8_e4m3fn, jnp.int32
D, H, KVH, DH, E, I, IS, DENSE, V = 2048, 32, 4, 128, 256, 512, 1024, 6144, 150144


def nv(n, k, lead=()):
  return NVFP4Weight(S((*lead, n, k // 2), U8), S((*lead, n, k // 16), F8), S(lead, F32))


def lower(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    lowered = lower_for_h200(fn, *args)
  assert "__gpu$xla.gpu.triton" in lowered.as_text()
  return lowered.as_text()


GEMV_SHAPES = [(4096, D), (512, D), (D, 4096), (D, DENSE), (V, D)]


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
def test_gemv_lowers(m, n, k):
  out = F32 if n == V else BF
  lower(functools.partial(gemv, out_dtype=out), S((m, k), BF), S((n, k), BF))


@pytest.mark.parametrize("n", [DENSE, IS])
def test_gemv_silu_mul_lowers(n):
  lower(gemv_silu_mul, S((8, D), BF), S((n, D), BF), S((n, D), BF))


@pytest.mark.parametrize("method", ["dot", "swap"])
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_methods_lower(method, m):
  lower(functools.partial(gemv, method=method), S((m, D), BF), S((4096, D), BF))
  lower(functools.partial(gemv_silu_mul, method=method), S((m, D), BF), S((DENSE, D), BF),
        S((DENSE, D), BF))


def test_gemv_reduce_lowers():
  lower(functools.partial(gemv, method="reduce"), S((1, D), BF), S((4096, D), BF))


@pytest.mark.parametrize("decode", ["fp8", "asm"])
@pytest.mark.parametrize("layout", ["tile", "chunk"])
@pytest.mark.parametrize("m,method", [(8, "dot"), (8, "swap"), (1, "reduce"), (1, "swap"),
                                      (8, "rows"), (2, None),    # None: the default (rows / dot)
                                      (1, "lanes"), (1, "blocks")])
@pytest.mark.parametrize("n,k", [(4096, D), (D, DENSE), (V, D)])
def test_nvfp4_gemv_lowers(decode, layout, m, method, n, k):
  out = F32 if n == V else BF
  fn = functools.partial(nvfp4_gemv, out_dtype=out, decode=decode, layout=layout, method=method)
  if method in ("lanes", "blocks") and layout == "chunk":
    with pytest.raises(ValueError, match=f"{method}.*needs layout='tile'"):
      lower(fn, S((m, k), BF), *nv(n, k))
    return
  lower(fn, S((m, k), BF), *nv(n, k))


@pytest.mark.parametrize("asm,emitted,absent", [("mul", "and.b32 $1, t0, 0xFFFF0000", "shl.b32 t0"),
                                                ("mul_bf16", "mul.lo.u32", "shl.b32"),
                                                ("shift", "shl.b32 t0", "mul.lo.u32"),
                                                ("post", "mul.lo.u32", "mul.rn.bf16x2")])
def test_nvfp4_asm_decode_sequence_lowers(asm, emitted, absent):
  """``nvfp4_gemv.asm_decode`` picks the instruction sequence the kernels' inline asm carries."""
  from flint_jax.pallas.nvfp4_gemv import asm_decode
  with asm_decode(asm):
    text = lower(functools.partial(nvfp4_gemv, decode="asm"), S((1, D), BF), *nv(4096, D))
  assert emitted in text and absent not in text


def test_post_scaled_decode_lowers_in_every_batch_one_kernel():
  """``asm_decode("post")``: the batch-1 NVFP4 kernels on blocks tiles (dense gate|up, q|k|v,
  the routed MoE's two kernels) lower with the raw decode, no bf16x2 scale multiply left."""
  from flint_jax.pallas.nvfp4_gemv import asm_decode
  experts, shared = moe_weights("nvfp4")
  with asm_decode("post"):
    texts = [lower(functools.partial(nvfp4_gemv_silu_mul, decode="asm"), S((1, D), BF),
                   nv(DENSE, D), nv(DENSE, D)),
             lower(functools.partial(multi_gemv, decode="asm"), S((1, D), BF),
                   tuple(nv(n, D) for n in (4096, 512, 512))),
             lower(functools.partial(moe_decode_routed, decode="asm"), S((1, D), BF),
                   S((1, E), F32), experts, shared)]
  for text in texts:
    assert "mul.lo.u32" in text and "mul.rn.bf16x2" not in text


@pytest.mark.parametrize("asm_down", [None, "post"])
def test_moe_asm_down_picks_only_the_down_kernels_decode(asm_down):
  """``moe_decode_routed(asm_down="post")`` (the default step's choice at batch 1): the down
  kernel lowers with the raw decode (no bf16x2 scale multiply), the gate_up kernel keeps the
  ambient "mul" decode."""
  experts, shared = moe_weights("nvfp4")
  text = lower(functools.partial(moe_decode_routed, decode="asm", asm_down=asm_down),
               S((1, D), BF), S((1, E), F32), experts, shared)
  calls = text.split("__gpu$xla.gpu.triton")[1:]    # the text after each Triton custom call
  gate_up = [c for c in calls if "flint_moe_gate_up" in c]
  down = [c for c in calls if "flint_moe_down" in c]
  assert len(gate_up) == len(down) == 1
  assert "mul.rn.bf16x2" in gate_up[0]
  assert ("mul.rn.bf16x2" in down[0]) == (asm_down is None)
  assert "mul.lo.u32" in down[0]


@pytest.mark.parametrize("decode", ["fp8", "asm"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_nvfp4_gemv_silu_mul_lowers(decode, m):
  fn = functools.partial(nvfp4_gemv_silu_mul, decode=decode)
  lower(fn, S((m, D), BF), nv(DENSE, D), nv(DENSE, D))


QKV = (H * DH, KVH * DH, KVH * DH)


@pytest.mark.parametrize("fmt,decode", [("bf16", None), ("nvfp4", "fp8"), ("nvfp4", "asm")])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("ns", [QKV, (KVH * DH, KVH * DH)])
def test_multi_gemv_lowers(fmt, decode, m, ns):
  ws = tuple(S((n, D), BF) if fmt == "bf16" else nv(n, D) for n in ns)
  kw = {} if decode is None else dict(decode=decode)
  lower(functools.partial(multi_gemv, **kw), S((m, D), BF), ws)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m,method", [(1, "dot"), (1, "swap"), (1, "reduce"), (8, "swap"),
                                      (8, "rows"), (3, "rows"), (1, "lanes"), (1, "blocks")])
def test_multi_gemv_methods_lower(fmt, m, method):
  ws = tuple(S((n, D), BF) if fmt == "bf16" else nv(n, D) for n in QKV)
  lower(functools.partial(multi_gemv, method=method), S((m, D), BF), ws)
  if fmt == "nvfp4" and method not in ("lanes", "blocks"):   # tile-layout only (a ValueError)
    lower(functools.partial(multi_gemv, method=method, layout="chunk"), S((m, D), BF), ws)


@pytest.mark.parametrize("m,method", [(1, None), (8, None), (8, "rows"), (3, "dot")])
def test_multi_gemv_rms_lowers(m, method):
  """The q|k|v normalising the residual s as it loads it (rms_sumsq of 128 column blocks per
  row, as the MoE down kernel's residual mode leaves them), at batch 1 and 8."""
  ws = tuple(nv(n, D) for n in QKV)
  def qkv(x, ws, sumsq, w):
    return multi_gemv(x, ws, method=method, decode="asm", rms_sumsq=sumsq, rms_weight=w)
  text = lower(qkv, S((m, D), BF), ws, S((m, D // 16), F32), S((D,), BF))
  assert "_rms" in text


def moe_weights(fmt, e=E):
  if fmt == "bf16":
    experts = dict(gate_up_proj=S((e, 2 * I, D), BF), down_proj=S((e, D, I), BF))
    shared = dict(gate_proj=S((IS, D), BF), up_proj=S((IS, D), BF), down_proj=S((D, IS), BF))
  else:
    g = nv(2 * I, D, (e,))
    dn = nv(D, I, (e,))
    experts = dict(gate_up_qweight=g.qweight, gate_up_weight_scale=g.weight_scale,
                   gate_up_weight_scale_2=S((e, 2), F32), down_qweight=dn.qweight,
                   down_weight_scale=dn.weight_scale, down_weight_scale_2=S((e,), F32))
    shared = dict(gate_proj=nv(IS, D), up_proj=nv(IS, D), down_proj=nv(D, IS))
  return experts, shared


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("down_split", [True, False])
def test_moe_lowers(fmt, m, down_split):
  experts, shared = moe_weights(fmt)
  lower(functools.partial(moe_decode, down_split=down_split), S((m, D), BF), S((m, 6), I32),
        S((m, 6), F32), experts, shared)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 8])
def test_moe_routed_lowers(fmt, m):
  """The routed path's kernels, separately and composed: the composed MoE layer (router logits
  through the next block's normalised input) is 3 Triton kernels and one XLA dot (the routing
  the gate_up kernel stores is 2 more outputs, not a launch)."""
  experts, shared = moe_weights(fmt)
  text = lower(moe_decode_routed, S((m, D), BF), S((m, E), F32), experts, shared)
  # + the top-k kernel of the per-token slots at M > 1 (default_slot_rows: BF16 at M <= 4)
  token = m > 1 and (fmt == "nvfp4" or m <= 4)
  assert text.count("__gpu$xla.gpu.triton") == 2 + token
  lower(functools.partial(moe_decode_routed, top_k=4), S((m, D), BF), S((m, 200), F32),
        *moe_weights(fmt, 200))   # E not a power of two: masked logits load
  if m == 1:  # the per-lane / per-block accumulation in both kernels
    for method in ("lanes", "blocks"):
      lower(functools.partial(moe_decode_routed, method=method), S((m, D), BF), S((m, E), F32),
            experts, shared)
  if fmt == "bf16":   # gate_up in K slices, the down kernel summing the partials
    text = lower(functools.partial(moe_decode_routed, gate_up_split_k=2), S((m, D), BF),
                 S((m, E), F32), experts, shared)
    assert text.count("__gpu$xla.gpu.triton") == 2
    text = lower(lambda x, lg, ex, sh, c: moe_decode_routed(x, lg, ex, sh, gate_up_split_k=2,
                                                            gate_up_counter=c),
                 S((m, D), BF), S((m, E), F32), experts, shared, S((4096,), I32))
    assert text.count("__gpu$xla.gpu.triton") == 2
  if m > 1:   # the other slot_rows mode
    text = lower(functools.partial(moe_decode_routed, slot_rows="all" if token else "token"),
                 S((m, D), BF), S((m, E), F32), experts, shared)
    assert ("flint_moe_gate_up_routed_token" in text) != token
    assert text.count("__gpu$xla.gpu.triton") == (2 if token else 3)
  if fmt == "nvfp4" and m > 1:   # the shared expert's M rows on rows tiles (not the default)
    text = lower(functools.partial(moe_decode_routed, shared_rows="all"), S((m, D), BF),
                 S((m, E), F32), experts, shared)
    assert "flint_moe_gate_up_routed_token" in text and "_shtok" not in text
  # the routing given (XLA's top_k) and the shared expert's programs first
  text = lower(functools.partial(moe_decode_routed, prerouted=True, shared_first=True,
                                 slot_rows="token" if m > 1 else None),
               S((m, D), BF), S((m, E), F32), experts, shared)
  assert text.count("__gpu$xla.gpu.triton") == 3
  lower(moe_combine_add_rms_norm, S((m, D), BF), S((m * 6 + 1, m, D), BF), S((m, 6), F32),
        S((D,), BF))
  lower(moe_combine_add_rms_norm, S((m, D), BF), S((m * 4 + 1, m, D), BF), S((m, 4), F32),
        S((D,), BF))
  text = lower(moe_block_add_rms_norm, S((m, D), BF), S((m, D), BF), S((E, D), F32), experts,
               shared, S((D,), BF))
  assert text.count("__gpu$xla.gpu.triton") == 3 + token
  assert text.count("stablehlo.dot_general") == 1
  for op in ("concatenate", "gather", "sort", "top_k", "reduce", "select", "scatter"):
    assert f"stablehlo.{op}" not in text and f"chlo.{op}" not in text, op


@pytest.mark.parametrize("fmt,m,token", [("nvfp4", 2, True), ("nvfp4", 4, True),
                                         ("nvfp4", 8, True), ("nvfp4", 5, True),
                                         ("bf16", 2, True), ("bf16", 4, True),
                                         ("bf16", 5, False), ("bf16", 8, False),
                                         ("nvfp4", 1, False), ("bf16", 1, False)])
def test_moe_routed_default_slot_rows(fmt, m, token):
  """The measured default (runs 28-29, 99-100, 102, 109-110): per-token slots for NVFP4 at
  M >= 2 and BF16 at M = 2..4, and with them the routing from its own top-k kernel (3 kernels,
  else 2); the shared expert per token (``_shtok``) for NVFP4 unless its down columns are cut
  over 2 programs, on one program per row block for BF16."""
  experts, shared = moe_weights(fmt)
  text = lower(moe_decode_routed, S((m, D), BF), S((m, E), F32), experts, shared)
  assert ("flint_moe_gate_up_routed_token" in text) == token
  assert ("flint_moe_topk" in text) == token
  assert ("_shtok" in text) == (token and fmt == "nvfp4")
  assert text.count("__gpu$xla.gpu.triton") == (3 if token else 2)
  if token and fmt == "bf16":   # per token too when asked, on tiles that fit shared memory
    text = lower(functools.partial(moe_decode_routed, shared_rows="token"), S((m, D), BF),
                 S((m, E), F32), experts, shared)
    assert "_shtok" in text and "_bk128" in text
  if token and fmt == "nvfp4":
    text = lower(functools.partial(moe_decode_routed, down_shared_cols=2, block_n_down=32),
                 S((m, D), BF), S((m, E), F32), experts, shared)
    assert "flint_moe_gate_up_routed_token" in text and "_shtok" not in text


@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("ring,s_len", [(False, 131072), (False, 4096), (True, 576)])
def test_decode_attention_lowers(b, ring, s_len):
  layers = 35 if ring else 14
  fn = functools.partial(decode_attention, ring=ring, window=513 if ring else None)
  cache = S((layers, b, KVH, s_len, DH), BF)
  lower(fn, S((b, H, DH), BF), cache, cache, S((b,), I32), S((H,), F32), S((), I32))


@pytest.mark.parametrize("ring", [False, True])
def test_qk_norm_rope_lowers(ring):
  s_len, layers = (576, 35) if ring else (8192, 14)
  fn = functools.partial(qk_norm_rope, rope=ring, ring=ring)
  cache = S((layers, 8, KVH, s_len, DH), BF)
  lower(fn, S((8, H, DH), BF), S((8, KVH, DH), BF), S((8, KVH, DH), BF), S((DH,), BF),
        S((DH,), BF), S((8,), I32), cache, cache, S((), I32))


@pytest.mark.parametrize("merge", ["kernel", "atomic"])
@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("ring,s_len", [(False, 131072), (True, 576)])
def test_qk_norm_rope_attention_lowers(merge, b, ring, s_len):
  """Norm + RoPE + cache write fused into the attention split kernel: 2 Triton kernels with the
  merge kernel, 1 with the atomic in-kernel merge (counter [L, B, KVH] indexed by the layer or
  by counter_layer) or with a single split."""
  layers = 35 if ring else 14
  cache = S((layers, b, KVH, s_len, DH), BF)
  args = (S((b, H, DH), BF), S((b, KVH, DH), BF), S((b, KVH, DH), BF), S((DH,), BF),
          S((DH,), BF), S((b,), I32), cache, cache, S((H,), F32), S((), I32))
  kw = dict(rope=ring, ring=ring, window=513 if ring else None, merge=merge)
  if merge == "kernel":
    text = lower(functools.partial(qk_norm_rope_attention, **kw), *args)
    assert text.count("__gpu$xla.gpu.triton") == 2
    text = lower(functools.partial(qk_norm_rope_attention, num_splits=1, **kw), *args)
  else:
    text = lower(functools.partial(qk_norm_rope_attention, **kw), *args,
                 S((layers, b, KVH), I32))
    assert text.count("__gpu$xla.gpu.triton") == 1
    fn = lambda *a: qk_norm_rope_attention(*a[:11], counter_layer=a[11], **kw)  # noqa: E731
    text = lower(fn, *args, S((49, b, KVH), I32), S((), I32))
  assert text.count("__gpu$xla.gpu.triton") == 1


def test_norms_lower():
  lower(add_rms_norm, S((8, D), BF), S((8, D), BF), S((D,), BF))
  lower(rms_norm, S((8, D), BF), S((D,), BF))


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 8])
def test_add_rms_norm_partials_lower(parts, m):
  """fp32 split-K partials [S, M, D] summed inside add_rms_norm: one Triton kernel, no XLA op."""
  text = lower(add_rms_norm, S((m, D), BF), S((parts, m, D), F32), S((D,), BF))
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert "stablehlo.reduce" not in text
  lower(add_rms_norm, S((m, 1000), BF), S((parts, m, 1000), F32), S((1000,), BF))   # masked


@pytest.mark.parametrize("m", [1, 2, 8])
def test_nvfp4_o_proj_into_add_rms_norm_lowers(m):
  """o_proj (split-K by default) -> add_rms_norm on its partials: two Triton kernels, no XLA
  reduce between them."""
  def fn(o, q, s, s2, h, w):
    return add_rms_norm(h, nvfp4_gemv(o, q, s, s2, sum_splits=False), w)
  text = lower(fn, S((m, 4096), BF), *nv(D, 4096), S((m, D), BF), S((D,), BF))
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert "stablehlo.reduce" not in text


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("kw", [{}, dict(block_d=2048), dict(block_e=4, block_d=512, num_warps=8)])
def test_add_rms_norm_router_lowers(m, kw):
  from flint_jax.pallas import add_rms_norm_router  # pylint: disable=g-import-not-at-top
  text = lower(functools.partial(add_rms_norm_router, **kw), S((m, D), BF), S((m, D), BF),
               S((D,), BF), S((E, D), F32))
  assert text.count("__gpu$xla.gpu.triton") == 1
  lower(add_rms_norm_router, S((m, 320), BF), S((m, 320), BF), S((320,), BF),
        S((40, 320), F32))   # D and E not powers of two: masked
  text = lower(functools.partial(add_rms_norm_router, **kw), S((m, D), BF), S((4, m, D), F32),
               S((D,), BF), S((E, D), F32))   # the NVFP4 o_proj's split-K partials
  assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.reduce" not in text


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 8])
def test_moe_block_from_attention_lowers(fmt, m):
  """Attention output -> next block's normalised input: 4 Triton kernels (5 with NVFP4's
  per-token slots at M > 1: their top-k kernel), no XLA op (the router dot is inside
  add_rms_norm_router)."""
  from flint_jax.pallas import moe_block_from_attention  # pylint: disable=g-import-not-at-top
  experts, shared = moe_weights(fmt)
  text = lower(moe_block_from_attention, S((m, D), BF), S((m, D), BF), S((D,), BF),
               S((E, D), F32), experts, shared, S((D,), BF))
  assert text.count("__gpu$xla.gpu.triton") == 4 + (fmt == "nvfp4" and m > 1)
  assert "stablehlo.dot_general" not in text
  for op in ("concatenate", "gather", "sort", "top_k", "reduce", "select", "scatter"):
    assert f"stablehlo.{op}" not in text and f"chlo.{op}" not in text, op


# ------------------------------------------------------------------------------------------
# norm_qkv: residual update (MoE combine / dense add / none) + RMSNorm + fused q|k|v, one kernel


@pytest.mark.parametrize("fmt,decode", [("bf16", None), ("nvfp4", "fp8"), ("nvfp4", "asm")])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("mode", ["moe", "dense", "norm"])
def test_norm_qkv_lowers(fmt, decode, m, mode):
  """One Triton custom call and nothing else but free reshapes (and the s2 stack for NVFP4)."""
  from flint_jax.pallas.norm_qkv import norm_qkv   # pylint: disable=g-import-not-at-top
  ws = tuple(S((n, D), BF) if fmt == "bf16" else nv(n, D) for n in QKV)
  kw = {} if decode is None else dict(decode=decode)
  if mode == "moe":
    fn = lambda h, ws, w, y, lg: norm_qkv(h, ws, w, y=y, top_logits=lg, **kw)
    extra = (S((m * 6 + 1, m, D), BF), S((m, 6), F32))
  elif mode == "dense":
    fn = lambda h, ws, w, y: norm_qkv(h, ws, w, y=y, **kw)
    extra = (S((m, D), BF),)
  else:
    fn = lambda h, ws, w: norm_qkv(h, ws, w, **kw)
    extra = ()
  text = lower(fn, S((m, D), BF), ws, S((D,), BF), *extra)
  assert text.count("__gpu$xla.gpu.triton") == 1
  for op in ("dot_general", "concatenate", "gather", "sort", "top_k", "reduce", "select",
             "scatter", "add", "multiply", "convert"):
    assert f"stablehlo.{op} " not in text and f"chlo.{op} " not in text, op


@pytest.mark.parametrize("fmt,decode", [("bf16", None), ("nvfp4", "asm")])
@pytest.mark.parametrize("ring", [False, True])
def test_norm_qkv_split_k_into_attention_lowers(fmt, decode, ring):
  """norm_qkv's K in 2 slices at M = 1, its fp32 partials into the fused attention kernel
  (which sums them): the two Triton kernels and the merge kernel, no XLA op between them."""
  from flint_jax.pallas.norm_qkv import norm_qkv   # pylint: disable=g-import-not-at-top
  ws = tuple(S((n, D), BF) if fmt == "bf16" else nv(n, D) for n in QKV)
  kw = {} if decode is None else dict(decode=decode)
  layers, s_len = (35, 576) if ring else (14, 131072)

  def fn(h, ws, w, y, lg, wq, wk, pos, kc, vc, sinks, layer):
    _, (q, k, v) = norm_qkv(h, ws, w, y=y, top_logits=lg, split_k=2, sum_splits=False, **kw)
    q, k, v = q.reshape(2, 1, H, DH), k.reshape(2, 1, KVH, DH), v.reshape(2, 1, KVH, DH)
    return qk_norm_rope_attention(q, k, v, wq, wk, pos, kc, vc, sinks, layer, rope=ring,
                                  ring=ring, window=513 if ring else None)

  cache = S((layers, 1, KVH, s_len, DH), BF)
  text = lower(fn, S((1, D), BF), ws, S((D,), BF), S((7, 1, D), BF), S((1, 6), F32),
               S((DH,), BF), S((DH,), BF), S((1,), I32), cache, cache, S((H,), F32), S((), I32))
  assert text.count("__gpu$xla.gpu.triton") == 3
  for op in ("reduce", "add", "convert"):
    assert f"stablehlo.{op} " not in text, op


@pytest.mark.parametrize("fmt,m,method,layout", [
    (f, m, meth, "tile") for f in ("bf16", "nvfp4")
    for m, meth in ((1, "reduce"), (1, "dot"), (8, "swap"))] + [("nvfp4", 8, "dot", "chunk")])
def test_norm_qkv_methods_lower(fmt, m, method, layout):
  """Other tile methods / the chunk layout, MoE mode with top_k = 4."""
  from flint_jax.pallas.norm_qkv import norm_qkv   # pylint: disable=g-import-not-at-top
  ws = tuple(S((n, D), BF) if fmt == "bf16" else nv(n, D) for n in QKV)
  fn = lambda h, ws, w, y, lg: norm_qkv(h, ws, w, y=y, top_logits=lg, method=method,
                                        layout=layout)
  text = lower(fn, S((m, D), BF), ws, S((D,), BF), S((m * 4 + 1, m, D), BF), S((m, 4), F32))
  assert text.count("__gpu$xla.gpu.triton") == 1
