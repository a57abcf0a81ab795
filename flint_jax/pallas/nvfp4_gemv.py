"""Small-batch NVFP4 (W4A16) GEMV, Pallas Triton backend.

``nvfp4_gemv``: ``y[M, N] = out_dtype((x[M, K] @ dequant(W)[N, K]^T in fp32) * weight_scale_2)``
for M = 1..16 tokens, with W in the flint_jax NVFP4 layout (docs/design.md):

  qweight        uint8          [N, K/2]   E2M1 codes, half-split per 64-value block: byte
                                           ``32b + j`` holds k = 64b + j (low nibble) and
                                           k = 64b + 32 + j (high nibble)
  weight_scale   float8_e4m3fn  [N, K/16]  block scale of values 16g .. 16g+15
  weight_scale_2 float32        []         tensor scale, applied to the fp32 accumulator

``nvfp4_gemv_silu_mul``: the fused gate|up step ``bf16(silu(g) * u)`` with ``g, u`` the fp32
products times their tensor scales, rounded to bf16 as the model's projections are.

What the kernel fuses: the dequantization (never materialised in HBM), the GEMV on the tensor
cores, the tensor scale and the output cast. Every ``e2m1 * e4m3`` product is exact in bf16, so
the dot sees exactly the reference weights; only the summation order differs.

Decode of a 16-byte weight chunk (knob ``decode``):

- ``"fp8"`` (portable; the interpret-mode path): ``((c & 7) << 2) | ((c & 8) << 4)`` turns an
  E2M1 code into the float8_e4m3fn byte of ``value * 2^-6`` exactly (subnormal code 1 = 0.5
  included), the hardware fp8 -> bf16 conversion follows, then one bf16 multiply by the block
  scale; ``2^6`` is folded into the epilogue.
- ``"asm"`` (GPU only; falls back to ``"fp8"`` in interpret mode): inline PTX on packed 32-bit
  words. One ``prmt`` spreads two bytes into the two bf16 lanes of a register; an ``and``
  isolates a nibble per lane and one integer multiply puts ``e1 e0 m`` into the low exponent
  bits / top mantissa bit and the sign into bit 15 (``value * 2^-126``: Marlin's bit
  placement), a mask clears the rest, and one ``mul.rn.bf16x2`` applies the block scale
  pre-multiplied by ``2^119`` (exact, no overflow below 448 * 2^119); ``2^7`` goes to the
  epilogue. About 2.25 integer/bf16 instructions per weight value instead of ~8. The CUDA-core
  tiles get the values as f32 from the same asm (one instruction per value), and x through
  ``x_to_f32``. (An earlier shift-and-or sequence and a bf16-output variant, bit-identical and
  slower, were retired after 35c0874.)

A K step loads ``[BN, nb, 2, 16]`` code bytes (nb 64-value blocks), decodes them and reshapes to
``[BN, 32 nb]`` for one dot per nibble half (the "tile" layout, the only one since 35c0874). The
activation ``x`` is read through a free ``[M, K/64, 2, 2, 16]`` view, so the low nibbles
multiply ``x[64b : 64b+32]`` and the high nibbles ``x[64b+32 : 64b+64]`` with no interleave.

Tile method (knob ``method``, see ``_common.mm_tile``): ``blocks`` (default at M = 1; decoded
weights times x on the CUDA cores, each 16-value block's sum in the thread, one reduction
after the K loop), ``rows`` (CUDA-core row sums for each of M rows, one decode; default at M = 2
below 16384 output rows) or ``dot`` / ``swap`` on the tensor cores (see ``default_method``).
Measured on the H200 (docs/kernels.md at 35c0874):
M = 1 is 1.7-2.2x faster than XLA's dequantize + GEMV (q_proj 9.9 vs 16.7 us, dense gate|up
19.4 vs 42.2 us); M = 8 is at parity on the 2048-row layers and 2.2x faster on large N, but far
from the bandwidth floor. (The decoded operand does *not* go through shared memory: Triton
decodes straight into the ``mma.sync`` operand registers, per the SASS (``tools/triton_sass.py`` at 35c0874);
the M = 8 tile is latency-bound inside each warp: H200 run 32, docs at 35c0874.)

Shapes / dtypes: x [M, K] bf16, M <= 16, K % 64 == 0; returns [M, N] ``out_dtype`` (bf16 default,
f32 for a logits head).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.nvfp4 import PRESCALE, prescale_block_scales
from flint_jax.pallas import _common as C

__all__ = [
    "NVFP4Weight", "nvfp4_gemv", "nvfp4_gemv_reference", "nvfp4_gemv_silu_mul",
    "nvfp4_gemv_silu_mul_reference", "dequantize_nvfp4_reference", "nvfp4_tile_dot",
    "decode_factor", "nvfp4_views", "x_view", "lanes_shape", "DECODES",
    "prescale_block_scales", "PRESCALE", "load_scale", "is_block_scale_dtype",
]

DECODES = ("fp8", "asm")
MAX_ROWS = 16


class NVFP4Weight(NamedTuple):
  """One NVFP4 linear layer in the flint_jax kernel layout (leading expert dims allowed)."""
  qweight: jax.Array          # uint8 [..., N, K/2]
  weight_scale: jax.Array     # float8_e4m3fn [..., N, K/16]
  weight_scale_2: jax.Array   # float32 [...]


# Block scales may also be given *pre-scaled*: bf16 holding ``scale * 2^119`` (exact), the operand
# the ``asm`` decode multiplies by; the kernels then skip the e4m3 -> f16 -> f32 -> bf16
# conversions and the multiply per scale, for twice the scale bytes (+11% of the weight bytes).
# ``flint_jax.nvfp4.prescale_state`` converts a model (H200 runs 71-74, docs at 35c0874).
def is_block_scale_dtype(dtype) -> bool:
  """float8_e4m3fn (the checkpoint's) or bf16 (``prescale_block_scales``)."""
  return dtype in (jnp.float8_e4m3fn, jnp.bfloat16)


def load_scale(s):
  """A loaded block-scale tile for ``_decode_pair``: e4m3 -> f32; pre-scaled bf16 kept."""
  return s if s.dtype == jnp.bfloat16 else s.astype(jnp.float32)


# ------------------------------------------------------------------------------------------
# Reference decode (plain jnp, exact)


def _e2m1_to_bf16(codes):
  """uint8 codes 0..15 -> bf16 E2M1 values (0, .5, 1, 1.5, 2, 3, 4, 6 and negatives)."""
  mag = jnp.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], jnp.float32)[codes & 7]
  return jnp.where((codes & 8) != 0, -mag, mag).astype(jnp.bfloat16)


def dequantize_nvfp4_reference(qweight, weight_scale):
  """[..., N, K/2] codes + [..., N, K/16] e4m3 scales -> [..., N, K] bf16 (exact)."""
  *lead, n, kh = qweight.shape
  k = kh * 2
  q = qweight.reshape(*lead, n, k // 64, 32)
  lo = _e2m1_to_bf16(q & 15)                                # k = 64b + j
  hi = _e2m1_to_bf16(q >> 4)                                # k = 64b + 32 + j
  vals = jnp.concatenate([lo, hi], axis=-1).reshape(*lead, n, k // 16, 16)
  scale = weight_scale.astype(jnp.float32)[..., None]
  if weight_scale.dtype == jnp.bfloat16:   # pre-scaled (prescale_block_scales)
    scale = scale * (1.0 / PRESCALE)
  return (vals.astype(jnp.float32) * scale).astype(jnp.bfloat16).reshape(*lead, n, k)


# ------------------------------------------------------------------------------------------
# In-kernel decode


def _fp8_decode(codes):
  """uint8 codes 0..15 -> bf16 value * 2^-6 through the float8_e4m3fn bit pattern (exact)."""
  e = ((codes & 7) << 2) | ((codes & 8) << 4)
  return lax.bitcast_convert_type(e, jnp.float8_e4m3fn).astype(jnp.bfloat16)


# Marlin's bit placement by one integer multiply (an earlier decode's two shifts and an or were
# retired after 35c0874): with the nibble isolated at bit p of each lane (p = 0 low, 4 high), ``t * (2^(6-p) + 2^(12-p))`` puts a copy of it at
# bit 6 (e1 e0 m -> bits 6-8) and one at bit 12 (s -> bit 15); the copies do not overlap, so no
# carries, and the lane's product stays below bit 16. Mask, then the scale multiply.
# With ``f32`` (for the CUDA-core tiles, which multiply in fp32) each bf16x2 product is then
# split into two f32 (shl 16 / and 0xffff0000: one instruction per value, where the compiler's
# bf16 -> f32 conversion of each lane takes two, a PRMT and a shift).
def _mul_decode_asm(iso: str, mul: str, f32: bool) -> str:
  """Operands: the outputs (two bf16x2, or four f32 with ``f32``), then four code bytes and the
  two bf16x2 scales."""
  n_out = 4 if f32 else 2
  q = f"${n_out}"
  lines = [".reg .b32 a, b, t0, t1, z;", "mov.b32 z, 0;", f"prmt.b32 a, {q}, z, 0x4140;",
           f"prmt.b32 b, {q}, z, 0x4342;"]
  for i, (src, t) in enumerate((("a", "t0"), ("b", "t1"))):
    scale = f"${n_out + 1 + i}"
    lines += [f"and.b32 {t}, {src}, {iso};", f"mul.lo.u32 {t}, {t}, {mul};",
              f"and.b32 {t}, {t}, 0x81C081C0;"]
    if f32:
      lines += [f"mul.rn.bf16x2 {t}, {t}, {scale};", f"shl.b32 ${2 * i}, {t}, 16;",
                f"and.b32 ${2 * i + 1}, {t}, 0xFFFF0000;"]
    else:
      lines.append(f"mul.rn.bf16x2 ${i}, {t}, {scale};")
  return "{\n" + "\n".join(lines) + "\n}"


# Without the scale multiply (``post``: the ``blocks`` tiles scale each 16-value block's sum
# instead): the placed bits read as bf16 are the E2M1 value times 2^-126 -- the normal codes
# (exponent 1-3) are normal numbers, the code 0.5 a subnormal -- split into f32 as above. The
# CUDA-core FFMAs keep subnormals (Triton emits no .ftz for f32 arithmetic), so the products
# are exact to 2^-150 (2^-24 of the E2M1 value times x), far below the f32 sums' own rounding.
def _raw_decode_asm(iso: str, mul: str) -> str:
  """Operands: four f32 outputs, then four code bytes."""
  lines = [".reg .b32 a, b, t0, t1, z;", "mov.b32 z, 0;", "prmt.b32 a, $4, z, 0x4140;",
           "prmt.b32 b, $4, z, 0x4342;"]
  for i, (src, t) in enumerate((("a", "t0"), ("b", "t1"))):
    lines += [f"and.b32 {t}, {src}, {iso};", f"mul.lo.u32 {t}, {t}, {mul};",
              f"and.b32 {t}, {t}, 0x81C081C0;", f"shl.b32 ${2 * i}, {t}, 16;",
              f"and.b32 ${2 * i + 1}, {t}, 0xFFFF0000;"]
  return "{\n" + "\n".join(lines) + "\n}"


_LO, _HI = ("0x000F000F", "0x1040"), ("0x00F000F0", "0x104")   # x (2^6 + 2^12), x (2^2 + 2^8)
_ASM_MUL = tuple(_mul_decode_asm(*half, f32=False) for half in (_LO, _HI))
_ASM_F32 = tuple(_mul_decode_asm(*half, f32=True) for half in (_LO, _HI))
_ASM_RAW = tuple(_raw_decode_asm(*half) for half in (_LO, _HI))
#: The raw decode's values are the E2M1 values times this (before the block scale).
RAW_FACTOR = 2.0 ** -126

def x_to_f32(x, decode):
  """An activation tile bf16 -> f32 for the CUDA-core tiles; with the ``asm`` decode two values
  per register in inline PTX, one instruction each (the compiler's conversion takes a PRMT and
  a shift per value)."""
  if decode != "asm" or x.dtype != jnp.bfloat16:
    return x.astype(jnp.float32)
  (y,) = plgpu.elementwise_inline_asm(
      "shl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xFFFF0000;", args=[x], constraints="=r,=r,r",
      pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def _asm_decode(q, scale_bf16, asm, f32=False):
  """Four values per code register: two bf16x2 outputs, or four f32 with ``f32``."""
  outs = "=r," * (4 if f32 else 2)
  (w,) = plgpu.elementwise_inline_asm(
      asm, args=[q, scale_bf16], constraints=outs + "r,r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.float32 if f32 else jnp.bfloat16)])
  return w


def _asm_decode_raw(q, asm):
  """Four f32 values per code register, without the block scale (``_ASM_RAW``)."""
  (w,) = plgpu.elementwise_inline_asm(
      asm, args=[q], constraints="=r,=r,=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.float32)])
  return w


def decode_factor(decode: str) -> float:
  """Power of two the in-kernel decode leaves on the weights (folded into the epilogue)."""
  return {"fp8": 64.0, "asm": 128.0}[decode]


def _decode_pair(q, s_lo, s_hi, decode, f32=False):
  """q uint8 [..., 16]; s_lo/s_hi block scales broadcastable to q, f32 or pre-scaled bf16
  (``load_scale``) -> (w_lo, w_hi) bf16, or their values as f32 with ``f32`` (for the
  CUDA-core tiles)."""
  prescaled = s_lo.dtype == jnp.bfloat16
  if decode == "fp8":
    if prescaled:
      s_lo, s_hi = (s.astype(jnp.float32) * (1.0 / PRESCALE) for s in (s_lo, s_hi))
    w_lo = _fp8_decode(q & 15) * s_lo.astype(jnp.bfloat16)
    w_hi = _fp8_decode(q >> 4) * s_hi.astype(jnp.bfloat16)
  else:
    if not prescaled:
      s_lo, s_hi = ((s * PRESCALE).astype(jnp.bfloat16) for s in (s_lo, s_hi))
    s_lo = jnp.broadcast_to(s_lo, q.shape)
    s_hi = jnp.broadcast_to(s_hi, q.shape)
    if f32:
      return _asm_decode(q, s_lo, _ASM_F32[0], True), _asm_decode(q, s_hi, _ASM_F32[1], True)
    w_lo, w_hi = _asm_decode(q, s_lo, _ASM_MUL[0]), _asm_decode(q, s_hi, _ASM_MUL[1])
  if f32:
    return w_lo.astype(jnp.float32), w_hi.astype(jnp.float32)
  return w_lo, w_hi


def nvfp4_views(qweight, weight_scale):
  """Free reshapes used by the kernels: codes [..., N, K/64, 2, 16], scales [..., N, K/64, 2, 2].

  Scale view index (half, h): half 0 = low nibbles (k = 64b + 16h + j), half 1 = high nibbles.
  """
  *lead, n, kh = qweight.shape
  nb = kh // 32
  return (qweight.reshape(*lead, n, nb, 2, 16), weight_scale.reshape(*lead, n, nb, 2, 2))


def x_view(x):
  """[..., M, K] -> [..., M, K/64, 2 (half), 2 (h), 16] (a free reshape)."""
  *lead, m, k = x.shape
  return x.reshape(*lead, m, k // 64, 2, 2, 16)


def lanes_shape(block_k: int) -> tuple:
  """Per-row product shape of one K step: [K/64 blocks, 2 (h), 16] (``blocks`` keeps one sum per
  16-value block of it: ``_common.acc_shape``)."""
  return (block_k // 64, 2, 16)


def nvfp4_tile_dot(x_ref, x_idx, m, mp, q_ref, s_ref, w_idx, n0, bn, b0, nb, *, decode,
                   method="dot", acc=None, x_scale_ref=None, post=False, f16_sums="block"):
  """fp32 partial x . W^T over the 64-value blocks b0 .. b0+nb of weight rows n0 .. n0+bn.

  x_ref: view [..., M, K/64, 2, 2, 16] bf16 indexed by ``x_idx`` (leading indices), rows 0..m-1
  padded to mp; q_ref / s_ref: views from ``nvfp4_views``, indexed by ``w_idx``. Returns
  ``_common.acc_shape(mp, bn, method)``: [Mp, BN] (dot, rows) or [BN, Mp] (swap), or ``acc``
  plus it when ``acc`` is given. ``blocks`` (M=1) needs ``acc`` [BN, nb, 2] and adds each
  16-value block's sum (``blocks_fma``; with ``post`` and the asm decode, the block scales
  applied to those sums instead of to each weight: ``blocks_fma_post``).
  The result carries the decode's power of two (``decode_factor``). An f16 x (``blocks`` only)
  selects ``blocks_fma_f16`` (its sums per ``f16_sums``: ``f16_sums_for_tile``); ``x_scale_ref``
  then holds its per-block factors, viewed [..., M, K/64, 2, 2] (``store_x16_blocks``), and the
  result carries ``F16_DECODE_FACTOR``.
  """
  part = _nvfp4_tile_dot(x_ref, x_idx, m, mp, q_ref, s_ref, w_idx, n0, bn, b0, nb,
                         decode=decode, method=method, acc=acc, x_scale_ref=x_scale_ref,
                         post=post, f16_sums=f16_sums)
  return part if acc is None or method == "blocks" else acc + part


def load_codes(q_ref, s_ref, w_idx, n0, bn, b0, nb):
  """The raw tile ``decode_tile`` decodes: (codes [BN, nb, 2, 16] uint8, the low and high
  nibbles' block scales [BN, nb, 2] as stored). (Three loads: Triton cannot slice a value.)"""
  ds, nrow, blk = slice(None), pl.ds(n0, bn), pl.ds(b0, nb)
  return (q_ref[(*w_idx, nrow, blk, ds, ds)], s_ref[(*w_idx, nrow, blk, 0, ds)],
          s_ref[(*w_idx, nrow, blk, 1, ds)])


def decode_codes(codes, decode, f32=False):
  """(w_lo, w_hi) bf16 (f32 with ``f32``) [BN, nb, 2, 16] of a ``load_codes`` tile."""
  q, s_lo, s_hi = codes
  return _decode_pair(q, load_scale(s_lo)[..., None], load_scale(s_hi)[..., None], decode, f32)


def decode_tile(q_ref, s_ref, w_idx, n0, bn, b0, nb, decode, f32=False):
  """(w_lo, w_hi) bf16 [BN, nb, 2, 16]: weight rows n0 .. n0+bn, 64-value blocks b0 .. b0+nb of
  the ``nvfp4_views``, decoded with their block scales; ``f32``: the values as f32 (for the
  CUDA-core tiles, which multiply in f32)."""
  return decode_codes(load_codes(q_ref, s_ref, w_idx, n0, bn, b0, nb), decode, f32)


def blocks_fma(acc, w_lo, w_hi, x_half):
  """The ``blocks`` K step: acc [BN, nb, 2] + the sum over each 16-value block (in the thread:
  the 16 bytes are one vector load) of w_lo * x_half(0) + w_hi * x_half(1)."""
  for half, w in enumerate((w_lo, w_hi)):
    x = x_half(half).astype(jnp.float32)                                  # [nb, 2, 16]
    acc = acc + jnp.sum(w.astype(jnp.float32) * x[None], axis=3)
  return acc


def raw_decode_codes(codes):
  """The ``post`` decode's raw values (E2M1 x 2^-126, f32) of a ``load_codes`` tile:
  (w_lo, w_hi) [BN, nb, 2, 16]."""
  q = codes[0]
  return _asm_decode_raw(q, _ASM_RAW[0]), _asm_decode_raw(q, _ASM_RAW[1])


def blocks_fma_post(acc, codes, x_half, w=None):
  """The ``blocks`` K step with the block scales applied after the sums (``nvfp4_tile_dot(post=
  True)``):
  acc [BN, nb, 2] + s_lo * sum_16(w_lo * x_half(0)) + s_hi * sum_16(w_hi * x_half(1)), w the raw
  decode (E2M1 values x 2^-126) of the ``load_codes`` tile ``codes`` (``raw_decode_codes``,
  computed here unless given); the same decode factor as the scaled decode (pre-scaled scales
  are ``scale * 2^119``)."""
  _, s_lo, s_hi = codes
  w = raw_decode_codes(codes) if w is None else w                          # [BN, nb, 2, 16]
  for half, s in enumerate((s_lo, s_hi)):                                  # s [BN, nb, 2]
    s = s.astype(jnp.float32) * (1.0 if s.dtype == jnp.bfloat16 else PRESCALE)
    x = x_half(half).astype(jnp.float32)                                  # [nb, 2, 16]
    acc = acc + s * jnp.sum(w[half] * x[None], axis=3)
  return acc


# ------------------------------------------------------------------------------------------
# f16 block sums (the per-token MoE kernels, ``moe`` plan ``gate_up_f16`` / ``down_f16``, and
# the batch-1 LM head)
#
# The ``blocks`` K step spends ~4.8 instructions per weight (the bf16 decode with its scale
# multiply, the split into f32, one FFMA). This variant multiplies in f16x2 instead: Marlin's
# E2M1 -> f16 placement (a nibble at bits 12-15 of a 16-bit lane: ``(t & 0x7000) >> 3`` puts
# e1 e0 m at bits 9-11, ``t & 0x8000`` keeps the sign; the f16 of the E2M1 value times 2^-14,
# the code 0.5 a subnormal), the four nibble positions of a code word reached by shifting it
# 0 / 4 / 8 / 12 bits, so that lanes pair bytes (b1, b3) / (b0, b2); then one ``mul`` / ``fma``
# f16x2 per two values against x in f16 (``x16_operand``: scaled per row so that its largest
# magnitude lies in [2^14, 2^15), exact, its groups of four stored x0, x2, x1, x3 to match the
# byte pairs). Each output is the sum of two products rounded once to f16 (the products are
# exact: 2 x 8 significant bits); the block scales multiply those sums in f32.
F16_DECODE_FACTOR = 128.0   # the f16 sums carry 2^-14 (decode) x 2^7 (the scales as s x 2^7)


def _e2m1_f16_lines(codes: str) -> list:
  """PTX placing the E2M1 nibbles of the code word ``codes`` as f16x2 (E2M1 x 2^-14): w13h /
  w13l the high / low nibbles of bytes 1 and 3, w02h / w02l those of bytes 0 and 2 (registers
  t, m, s as scratch)."""
  lines = []
  for shift, w in ((0, "w13h"), (4, "w13l"), (8, "w02h"), (12, "w02l")):
    src = codes
    if shift:
      lines.append(f"shl.b32 t, {codes}, {shift};")
      src = "t"
    lines += [f"and.b32 m, {src}, 0x70007000;", "shr.b32 m, m, 3;",
              f"and.b32 s, {src}, 0x80008000;", f"or.b32 {w}, m, s;"]
  return lines


def _f16_block_asm() -> str:
  """Operands: $0-$3 f32 outputs (low nibbles' lane 0 / lane 1 sums, high nibbles'), $4 four
  code bytes, $5 / $6 the low nibbles' x pairs (x0, x2) / (x1, x3) as f16x2, $7 / $8 the high
  nibbles'. Lane 0 sums bytes 0 and 1, lane 1 bytes 2 and 3."""
  lines = [".reg .b32 t, m, s, w13h, w13l, w02h, w02l, plo, phi;", ".reg .b16 h0, h1, h2, h3;"]
  lines += _e2m1_f16_lines("$4")
  lines += ["mul.rn.f16x2 plo, w02l, $5;", "fma.rn.f16x2 plo, w13l, $6, plo;",
            "mul.rn.f16x2 phi, w02h, $7;", "fma.rn.f16x2 phi, w13h, $8, phi;",
            "mov.b32 {h0, h1}, plo;", "mov.b32 {h2, h3}, phi;",
            "cvt.f32.f16 $0, h0;", "cvt.f32.f16 $1, h1;",
            "cvt.f32.f16 $2, h2;", "cvt.f32.f16 $3, h3;"]
  return "{\n" + "\n".join(lines) + "\n}"


_ASM_F16 = _f16_block_asm()


# the "block" sums (``f16_sums_for_tile``): the same decode and products, but each nibble half's two f16x2 lanes
# accumulate over the four code words of a 16-byte block (one ``fma.rn.f16x2`` per two values,
# the sums of 8 products per lane rounded to f16 after each fma), so the conversions to f32 and
# the block-scale FFMAs run once per block instead of once per word (SASS: ~4 f32 instructions
# per 32 values instead of ~16). The accumulator passes from word to word as an elementwise
# operand (``f16_block_lane_sums``).
def _f16_acc_asm(first: bool) -> str:
  """Operands: $0 / $1 the low / high nibbles' f16x2 accumulators (lane 0: bytes 0 and 1, lane
  1: bytes 2 and 3), $2 four code bytes, $3 / $4 the low nibbles' x pairs (x0, x2) / (x1, x3)
  as f16x2, $5 / $6 the high nibbles'; unless ``first``, $7 / $8 the accumulators so far."""
  lines = [".reg .b32 t, m, s, w13h, w13l, w02h, w02l, alo, ahi;"]
  lines += _e2m1_f16_lines("$2")
  if first:
    lines += ["mul.rn.f16x2 alo, w02l, $3;", "mul.rn.f16x2 ahi, w02h, $5;"]
  else:
    lines += ["fma.rn.f16x2 alo, w02l, $3, $7;", "fma.rn.f16x2 ahi, w02h, $5, $8;"]
  lines += ["fma.rn.f16x2 alo, w13l, $4, alo;", "fma.rn.f16x2 ahi, w13h, $6, ahi;",
            "mov.b32 $0, alo;", "mov.b32 $1, ahi;"]
  return "{\n" + "\n".join(lines) + "\n}"


_ASM_F16_ACC = (_f16_acc_asm(True), _f16_acc_asm(False))

def _x16_words(v):
  """An x16 half ([nb, 2, 16], loaded whole) as the four code words' pieces, split in
  registers."""
  return jnp.split(v, 4, axis=-1)


_F16_MIN_BYTES = 4   # code bytes per thread the f16 K step's asm needs (one pack of 4)


def f16_warps_that_fit(bn: int, bk: int, num_warps: int) -> int:
  """``num_warps`` halved until each thread holds the f16 K step's minimum of code bytes of a
  [bn, bk] tile (small models; every Flint tile fits its default warps)."""
  while num_warps > 1 and bn * bk // 2 < _F16_MIN_BYTES * 32 * num_warps:
    num_warps //= 2
  return num_warps


def f16_sums_for_tile(bn: int, bk: int, num_warps: int) -> str:
  """How an f16 K step on [bn, bk / 64, 2, 16]-byte code tiles and ``num_warps`` warps sums its
  products before the block scales (``blocks_fma_f16``): "block" (f16 lanes over a whole
  16-value block, then f32: H200 run 158, the 8x1K MoE gate_up 35.7 -> 29.7 us per layer) or
  "pair" (each pair of products rounded to f16, then f32: the first f16 form, H200 runs 154-156; the pair sums as a
  choice were retired after 35c0874). The asm runs on packs of 4 elements that each thread must
  hold: "block" splits a thread's whole 16-byte groups into four words, so it needs >= 16 code
  bytes per thread, else the "pair" sums (one word at a time) are taken; below 4 bytes per
  thread neither fits and this raises (on the H200 both computed NaNs there: runs 160 and 164).
  Every Flint tile holds 32-64 bytes per thread: "block"; small test models take "pair"."""
  nbytes, threads = bn * bk // 2, 32 * num_warps
  C.check(nbytes >= _F16_MIN_BYTES * threads,
          f"the f16 K step's {bn} x {bk} NVFP4 tile ({nbytes} code bytes) is too small for "
          f"{num_warps} warps: each thread needs >= 4 bytes; use a larger block_n / block_k or "
          f"fewer warps")
  return "pair" if nbytes < 16 * threads else "block"


def x16_exponent(amax):
  """c (int32) with amax * 2^c in [2^14, 2^15) for a normal amax > 0, clipped to [-100, 100]
  (0 for amax == 0): from amax's f32 exponent bits, the same in jnp and inside a kernel."""
  e = (lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF
  return jnp.where(amax > 0, jnp.clip(141 - e, -100, 100), 0)


def pow2_f32(n):
  """2.0^n as f32 for int32 n in [-126, 127] (exact, from the exponent bits)."""
  return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def x16_position(k):
  """Where ``x16_operand`` stores value k of a row: groups of four as x0, x2, x1, x3 (the
  permutation is its own inverse)."""
  r = k % 4
  return k + (r == 1).astype(k.dtype) - (r == 2).astype(k.dtype)


def to_x16(vf, axis=-1):
  """f32 values -> (f16(vf * 2^c), 2^-c), c = ``x16_exponent`` of the largest magnitude along
  ``axis`` (kept as a size-1 axis in both results): the exact f16 scaling shared by
  ``x16_operand``, ``store_x16_blocks`` and ``add_rms_norm(x16=True)``."""
  c = x16_exponent(jnp.max(jnp.abs(vf), axis=axis, keepdims=True))
  return (vf * pow2_f32(c)).astype(jnp.float16), pow2_f32(-c)


def _x16_order(x16):
  """[..., K] -> groups of four stored x0, x2, x1, x3 (``x16_position``)."""
  *lead, k = x16.shape
  return jnp.swapaxes(x16.reshape(*lead, k // 4, 2, 2), -1, -2).reshape(*lead, k)


def x16_operand(x):
  """The f16 activation operand of the ``blocks`` f16 K step: x [..., K] (bf16, K % 4 == 0) ->
  (x16 [..., K] f16, inv [...] f32). x16 = x * 2^c per row, c putting the row's largest
  magnitude in [2^14, 2^15) (``x16_exponent``; exact wherever x * 2^c is an f16 normal: bf16's
  8 significant bits fit f16's 11), each group of four values stored x0, x2, x1, x3
  (``x16_position``); inv = 2^-c, the factor that takes a sum over x16 back to x's scale.
  ``add_rms_norm(x16=True)`` writes the same from its kernel."""
  x16, inv = to_x16(x.astype(jnp.float32))
  return _x16_order(x16), inv[..., 0]


def store_x16_blocks(x16_ref, inv_ref, lead, v, n0, n):
  """Values v [n] (n % 16 == 0; e.g. a GEMV's bf16 outputs n0 .. n0 + n) as the f16 operand of
  a later ``blocks_fma_f16`` with one scale per 16-value block instead of per row:
  ``x16_ref[*lead, n0 + x16_position(k)] = f16(v[k] 2^c_b)`` and ``inv_ref[*lead, n0 / 16 + b]
  = 2^-c_b``, c_b = ``x16_exponent`` of block b's largest magnitude (exact, as ``x16_operand``)."""
  x16, inv = to_x16(v.astype(jnp.float32).reshape(n // 16, 16))          # [n/16, 16], [n/16, 1]
  plgpu.store(x16_ref.at[(*lead, n0 + x16_position(jnp.arange(n, dtype=jnp.int32)))],
              x16.reshape(n))
  plgpu.store(inv_ref.at[(*lead, n0 // 16 + jnp.arange(n // 16, dtype=jnp.int32))],
              inv.reshape(n // 16))


def x16_blocks_reference(v):
  """Plain jnp: v [..., K] -> (x16 [..., K] f16, inv [..., K / 16] f32) as ``store_x16_blocks``
  writes them."""
  *lead, k = v.shape
  x16, inv = to_x16(v.astype(jnp.float32).reshape(*lead, k // 16, 16))
  return _x16_order(x16.reshape(*lead, k)), inv[..., 0]


def _f16_words(codes, x):
  """The jnp forms' operands per code word: nibbles codes [..., 16] (one half) -> f32 (E2M1 x
  2^-14 [..., 4 words, 4 bytes], x [..., 4 words, 4] in ``x16_operand`` order x0, x2, x1, x3)."""
  words = codes.shape[:-1] + (4, 4)
  w = (_fp8_decode(codes).astype(jnp.float32) * 2.0 ** -8).reshape(words)
  return w, jnp.broadcast_to(x, codes.shape).astype(jnp.float32).reshape(words)


def _f16_lane_sums(q, xl, xh):
  """The asm's outputs in jnp (interpret mode): q uint8 [..., 16], xl / xh f16 [..., 16]
  (``x16_operand`` order) -> f32 [..., 16], per code word (lo lane 0, lo lane 1, hi lane 0, hi
  lane 1). The f16 rounding of each product and of each pair sum as on the GPU (up to double
  rounding of the f32 sum, where the exact sum needs more than 24 bits)."""
  f32, f16 = jnp.float32, jnp.float16
  shape = q.shape

  def lanes(codes, x):
    w, xv = _f16_words(codes, x)
    p0 = (w[..., 0] * xv[..., 0]).astype(f16).astype(f32)
    p2 = (w[..., 2] * xv[..., 1]).astype(f16).astype(f32)
    return ((p0 + w[..., 1] * xv[..., 2]).astype(f16),
            (p2 + w[..., 3] * xv[..., 3]).astype(f16))

  lo0, lo1 = lanes(q & 15, xl)
  hi0, hi1 = lanes(q >> 4, xh)
  return jnp.stack([lo0, lo1, hi0, hi1], axis=-1).astype(f32).reshape(shape)


def _f16_block_lane_sums(q, xl, xh):
  """``f16_block_lane_sums`` in jnp (interpret mode): the same products and the same f16
  rounding after each ``mul`` / ``fma`` (up to double rounding of the f32 sum)."""
  f32, f16 = jnp.float32, jnp.float16

  def lanes(codes, x):
    w, xv = _f16_words(codes, x)
    a0 = a1 = None
    for i in range(4):                                                   # the block's words
      p0, p2 = w[..., i, 0] * xv[..., i, 0], w[..., i, 2] * xv[..., i, 1]
      a0 = p0.astype(f16) if a0 is None else (p0 + a0.astype(f32)).astype(f16)
      a1 = p2.astype(f16) if a1 is None else (p2 + a1.astype(f32)).astype(f16)
      a0 = (w[..., i, 1] * xv[..., i, 2] + a0.astype(f32)).astype(f16)
      a1 = (w[..., i, 3] * xv[..., i, 3] + a1.astype(f32)).astype(f16)
    return a0, a1

  lo0, lo1 = lanes(q & 15, xl)
  hi0, hi1 = lanes(q >> 4, xh)
  return jnp.stack([lo0, lo1, hi0, hi1], axis=-1).astype(f32)


def f16_block_lane_sums(q, xl, xh, decode):
  """Per 16-byte block of q uint8 [BN, nb, 2, 16] (``load_codes``) and the f16 x halves xl / xh
  [nb, 2, 16]: f32 [BN, nb, 2, 4] = (lo lane 0, lo lane 1, hi lane 0, hi lane 1), each the f16
  sum of 8 products E2M1 x 2^-14 times x16 (``_f16_acc_asm``; the words' sums in order, lane 0
  bytes 0 and 1 of each word, lane 1 bytes 2 and 3). GPU: inline PTX, the four words split off
  the loaded tile (``jnp.split``: register moves); interpret: jnp."""
  if decode != "asm":
    return _f16_block_lane_sums(q, xl, xh)
  words = q.shape[:-1] + (4,)
  qs = jnp.split(q, 4, axis=-1)
  xls, xhs = _x16_words(xl), _x16_words(xh)
  acc = None
  for i in range(4):
    args = [qs[i]] + [jnp.broadcast_to(v[i], words) for v in (xls, xhs)]
    args += [] if acc is None else [acc]
    (acc,) = plgpu.elementwise_inline_asm(
        _ASM_F16_ACC[acc is not None], args=args,
        constraints="=r,=r,r,r,r,r,r" + ("" if len(args) == 3 else ",r,r"), pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(words, jnp.float16)])
  return acc.astype(jnp.float32)


def f16_lane_sums(q, xl, xh, decode):
  """Per code word of q uint8 [BN, nb, 2, 16] (``load_codes``) and the f16 x halves xl / xh
  [nb, 2, 16]: f32 [BN, nb, 2, 16] = (lo lane 0, lo lane 1, hi lane 0, hi lane 1) sums of
  E2M1 x 2^-14 times x16 (see ``_f16_block_asm``). GPU: inline PTX; interpret: jnp."""
  if decode != "asm":
    return _f16_lane_sums(q, xl, xh)
  xl, xh = (jnp.broadcast_to(v, q.shape) for v in (xl, xh))
  (out,) = plgpu.elementwise_inline_asm(
      _ASM_F16, args=[q, xl, xh], constraints="=r,=r,=r,=r,r,r,r,r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.float32)])
  return out


def _scale_x128(s, decode="asm"):
  """A loaded block-scale tile -> f32 scale x 2^7 (pre-scaled bf16 holds scale x 2^119).
  Outside the ``asm`` decode (interpret mode, where XLA compiles the kernel) the pre-scaled
  form takes 112 off the exponent field instead of multiplying by 2^-112: XLA's simplifier
  moves such a constant onto the neighbouring product with x's block factors, where 2^-112 x
  2^-19 is an f32 subnormal and the CPU flushes it to zero (every product then vanished).
  Triton keeps the order written, so the GPU multiplies (one FMUL)."""
  if s.dtype != jnp.bfloat16:
    return s.astype(jnp.float32) * 128.0
  if decode == "asm":
    return s.astype(jnp.float32) * (2.0 ** -112)
  bits = lax.bitcast_convert_type(s.astype(jnp.float32), jnp.int32)
  scaled = lax.bitcast_convert_type(bits - (112 << 23), jnp.float32)   # exponent >= 110 + 127
  return jnp.where((bits & 0x7FFFFFFF) == 0, 0.0, scaled)


def blocks_fma_f16(acc, codes, x_half, decode, x_scales=None, sums="block"):
  """The ``blocks`` K step on f16 products: acc [BN, nb, 2] + per 16-value block, s x 2^7 times
  the sum of its ``f16_block_lane_sums`` (``sums`` "block") or ``f16_lane_sums`` ("pair")
  (x_half(h): the ``x16_operand`` half h, f16 [nb, 2, 16]).
  The result carries ``F16_DECODE_FACTOR`` times x16's row scale; or, with ``x_scales`` (the
  low and high nibbles' x block factors, f32 [nb, 2] each: ``store_x16_blocks``' inv), the
  factor only."""
  q, s_lo, s_hi = codes
  lane_sums = f16_block_lane_sums if sums == "block" else f16_lane_sums
  sums = lane_sums(q, x_half(0), x_half(1), decode)
  s_lo, s_hi = _scale_x128(s_lo, decode), _scale_x128(s_hi, decode)      # sums [BN, nb, 2, 4 | 16]
  if x_scales is not None:
    s_lo, s_hi = s_lo * x_scales[0], s_hi * x_scales[1]
  hi = (jnp.arange(sums.shape[-1], dtype=jnp.int32) % 4) >= 2            # hi lanes of a word
  s = jnp.where(hi, s_hi[..., None], s_lo[..., None])
  return acc + jnp.sum(sums * s, axis=3)


def _nvfp4_tile_dot(x_ref, x_idx, m, mp, q_ref, s_ref, w_idx, n0, bn, b0, nb, *, decode,
                    method, acc, x_scale_ref=None, post=False, f16_sums="block"):
  ds = slice(None)
  rows = C.row_load_index(m, mp)
  blk = pl.ds(b0, nb)
  if method == "blocks" and getattr(x_ref, "dtype", None) == jnp.float16:   # x16_operand
    C.check(acc is not None, "method='blocks' accumulates into acc: pass acc=")
    codes = load_codes(q_ref, s_ref, w_idx, n0, bn, b0, nb)
    x_half = lambda h: x_ref[(*x_idx, 0, blk, h, ds, ds)]                 # noqa: E731
    x_scales = (None if x_scale_ref is None else
                tuple(x_scale_ref[(*x_idx, 0, blk, half, ds)] for half in (0, 1)))
    return blocks_fma_f16(acc, codes, x_half, decode, x_scales, sums=f16_sums)
  if method == "blocks" and decode == "asm" and post:
    C.check(acc is not None, "method='blocks' accumulates into acc: pass acc=")
    codes = load_codes(q_ref, s_ref, w_idx, n0, bn, b0, nb)
    x_half = lambda h: x_to_f32(x_ref[(*x_idx, 0, blk, h, ds, ds)], decode)  # noqa: E731
    return blocks_fma_post(acc, codes, x_half)
  w_lo, w_hi = decode_tile(q_ref, s_ref, w_idx, n0, bn, b0, nb, decode,
                           f32=method in ("blocks", "rows"))
  x_half = lambda h: x_to_f32(x_ref[(*x_idx, 0, blk, h, ds, ds)], decode)  # noqa: E731
  if method == "blocks":
    C.check(acc is not None, "method='blocks' accumulates into acc: pass acc=")
    return blocks_fma(acc, w_lo, w_hi, x_half)
  if method == "rows":
    wf = (w_lo, w_hi)   # f32 already (decode_tile's f32)

    def row_sum(row):   # the decoded tile times x row ``row``, summed over K: [BN]
      acc = None
      for half, w in enumerate(wf):
        x = x_to_f32(x_ref[(*x_idx, row, blk, half, ds, ds)], decode)     # [nb, 2, 16]
        p = jnp.sum(w * x[None], axis=3)                                   # [BN, nb, 2]
        p = jnp.sum(jnp.sum(p, axis=2), axis=1)                            # [BN]
        acc = p if acc is None else acc + p
      return acc

    # one decode, m row sums (no reshapes), placed in row r of [Mp, BN]
    ids = jnp.arange(mp, dtype=jnp.int32)[:, None]
    acc = jnp.zeros((mp, bn), jnp.float32)
    for row in range(m):
      acc = acc + jnp.where(ids == row, row_sum(row)[None, :], 0.0)
    return acc
  x_lo = x_ref[(*x_idx, rows, blk, 0, ds, ds)].reshape(mp, nb * 32)       # [Mp, 32 nb]
  x_hi = x_ref[(*x_idx, rows, blk, 1, ds, ds)].reshape(mp, nb * 32)
  w_lo, w_hi = w_lo.reshape(bn, nb * 32), w_hi.reshape(bn, nb * 32)
  return C.mm_tile(x_lo, w_lo, method) + C.mm_tile(x_hi, w_hi, method)


def default_method(m: int, n: int = 0) -> str:
  """``blocks`` at M = 1 (per-block sums in the thread, one cross-warp reduction per program;
  H200 run 84, in the batch-1 step: MoE gate_up 8.77 against 9.44 us for a row sum per K step,
  LM head 75.8 against 79.6, dense gate|up 13.8 against 15.2; the tensor-core tile wastes 15 of
  its 16 MMA rows there); ``rows`` (CUDA-core row sums per row) at M = 2 for N < 16384 rows (H200, run 30: o_proj 8.2 against 16.8 us, dense
  down 14.7 against 21.3, dense gate|up 25.6 against 39.8; at M = 4 it wins only for the o_proj,
  and the LM head keeps a tensor-core method: 190 against 215 us at M = 2); for N >= 16384 (the
  LM head) ``swap`` (H200 run 80: 142.6 against 185.6 us at M = 8); ``dot`` otherwise."""
  if m == 1:
    return "blocks"
  if n >= 16384:   # the LM head: swap-AB tiles (wgmma, register A), 142.6 against 185.6 us at
    return "swap"  # M = 8 (H200 run 80; dot 190 against rows 215 at M = 2, run 30)
  return "rows" if m == 2 else "dot"


def resolve_decode(decode: str, interpret: bool) -> str:
  C.check(decode in DECODES, f"decode must be one of {DECODES}, got {decode=}")
  return "fp8" if interpret else decode


def default_nvfp4_blocks(n: int, k: int, *, m: int = 1, n_mats: int = 1,
                         method: str | None = None, x16: bool = False):
  """(block_n, block_k, split_k, num_warps) for an [n, k] NVFP4 weight on an H200. ``rows``
  (M row sums per decoded tile) takes the M = 1 tiles at any M. ``x16`` (the f16 operand, M =
  1): N >= 16384 (the LM head) on bk512 with 4 warps (H200 run 164, in the step: 58.9 us
  against 73.2 on the f32 tiles' bk256 and 61.3 on bk1024 with 8 warps); otherwise as the f32
  ``blocks`` tiles (not timed).

  From the H200 sweeps (kernel-bench run 2, docs/kernels.md at 35c0874; device time per call):
  M = 1 (``reduce``): q_proj 4096x2048 bn32 bk512 w4 10.1 us (XLA 16.7); o_proj 2048x4096 bn64
  split-K 4 11.3 us (XLA 15.1); dense down 2048x6144 bn64 bk512 split-K 3 w8 12.4 us (XLA 20.8);
  dense gate|up bn64 bk512 w8 19.7 us (XLA 42.5).
  M > 1 (``dot``): bn64 bk256 w4 (q_proj 17.5 us, o_proj split-K 4 13.1 us, gate|up 33.6 us vs
  XLA 40.7); N >= 16384: bn128 w8 (65536x2048: 81 us vs XLA 185 us). Measured (H200 runs 104-105,
  M = 8, pre-scaled scales, ``kernels.py --groups m8dense,m8dense2``; run 109 ``--groups
  m8silu`` for the dense gate|up pair; groups of kernels.py at 35c0874): bk128 (o_proj split-K 4 8.05 us against 9.3; split-K 8
  7.2, not taken: 8 partials for the norm kernel to sum; bn32 11.0, bn16 24.5, bn128 10.6; the
  gate|up pair 22.5 against 27.5 at bk256).
  Session-3 sweep, M = 1, N <= 2048 (o_proj 2048x4096): bn16 bk1024 split-K 4 w8 5.4 us (the
  previous bn64 bk512 split-K 4: 6.9 us): many small programs with 8 warps each.
  """
  if method == "rows":
    m = 1
  if x16 and n >= 16384 and n_mats == 1:
    return 16, C.pow2_divisor(k, 512), 1, 4
  blocks = method == "blocks"
  if m == 1 and n <= 2048 and n_mats == 1:
    # blocks: K steps of 512 (run 85: o_proj split-K 4 4.83 against 4.98 us at bk1024, dense
    # down split-K 3 6.61 against 6.95)
    bk = C.pow2_divisor(k, 1024 if k >= 4096 and not blocks else 512)
    bn = C.pow2_divisor(n, 16)
    split = next((c for c in (4, 3, 2) if k % (bk * c) == 0), 1)
    return bn, bk, split, 8
  if m == 1 and blocks and n_mats == 2:   # dense gate|up: 8.82 us against 13.65 at bn64 bk512
    return C.pow2_divisor(n, 16), C.pow2_divisor(k, 1024), 1, 8    # (run 85)
  if m == 1:   # N >= 16384 (the LM head): bk256, 79.9 against 86.3 us at bk512 (run 82); blocks
    # on 16-row tiles: 72.9 against 74.5 us at bn32 (run 85)
    bk = C.pow2_divisor(k, 256 if (n >= 16384 and n_mats == 1) else 512)
    lm_bn = 16 if blocks else 32
    bn = C.pow2_divisor(n, lm_bn if (n >= 4096 and n_mats == 1) else 64 if n >= 1024 else 16)
  else:   # N >= 16384 on swap tiles: bn128 bk128 w8 (run 80: 142.6 us at M = 8, bk256 151.9);
    # single matrices below that on dot tiles: bk128 too (runs 104-105, M = 8, the o_proj's
    # split-K 4: 8.05 us against 9.3-9.8 on bk256; the fused q|k|v 13.2 against 16.3). The
    # gate|up pair (n_mats 2) too: 22.5 against 27.5 us at M = 8 with 3 stages, run 109
    short_k = n < 16384 or (n_mats == 1 and method == "swap")
    bk = C.pow2_divisor(k, 128 if short_k else 256)
    bn = C.pow2_divisor(n, 128 if n >= 16384 else 64)
  split = 1
  if n_mats == 1:
    for cand in (4, 3, 2):
      if (n // bn) * split < 64 and k % (bk * cand) == 0 and k // (bk * cand) >= 1:
        split = cand
        break
  warps = 8 if (bn >= 128 or (bn >= 64 and bk >= 512)) else 4
  return bn, bk, split, warps


# ------------------------------------------------------------------------------------------
# GEMV


def _validate(x, ws, block_n, block_k, split_k=1):
  C.check(x.ndim == 2, f"x must be [M, K], got {x.shape=}")
  m, k = x.shape
  C.check(1 <= m <= MAX_ROWS, f"nvfp4 gemv handles 1..{MAX_ROWS} rows, got {m=}")
  C.check(k % 64 == 0, f"K must be a multiple of 64, got {k=}")
  for w in ws:
    q, s, s2 = w
    C.check(q.dtype == jnp.uint8 and q.ndim == 2 and q.shape[1] * 2 == k,
            f"qweight must be uint8 [N, K/2={k // 2}], got {q.shape=} {q.dtype=}")
    C.check(is_block_scale_dtype(s.dtype) and s.shape == (q.shape[0], k // 16),
            f"weight_scale must be float8_e4m3fn (or pre-scaled bf16) [N, K/16], got "
            f"{s.shape=} {s.dtype=}")
    C.check(jnp.size(s2) == 1, f"weight_scale_2 must be a scalar, got {jnp.shape(s2)=}")
    C.check(q.shape == ws[0][0].shape, "gate/up weights differ in shape")
  n = ws[0][0].shape[0]
  C.check(C.is_pow2(block_n) and block_n >= 16 and n % block_n == 0,
          f"block_n must be a power of two >= 16 dividing N: {block_n=} {n=}")
  C.check(C.is_pow2(block_k) and block_k >= 64 and k % (block_k * split_k) == 0,
          f"block_k must be a power of two >= 64 and block_k * split_k must divide K: "
          f"{block_k=} {split_k=} {k=}")
  return m, n, k


def _nvfp4_gemv_kernel(x_ref, q_ref, s_ref, s2_ref, *refs, m, mp, bn, nb, n_iter, split_k,
                       decode, method, x16=False, f16_sums="block"):
  """One program per (row tile, K split). ``x16``: x is the f16 operand (``x16_operand``) and
  ``refs`` starts with its row factor inv [1] f32."""
  xinv_ref, o_ref = refs if x16 else (None, *refs)
  n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
  bbase = pl.program_id(1) * (n_iter * nb) if split_k > 1 else 0

  def body(i, acc):
    b0 = pl.multiple_of(bbase + i * nb, nb)
    return nvfp4_tile_dot(x_ref, (), m, mp, q_ref, s_ref, (), n0, bn, b0, nb, decode=decode,
                          method=method, acc=acc, f16_sums=f16_sums)

  acc = lax.fori_loop(0, n_iter, body, C.acc_zeros(mp, bn, method, lanes_shape(nb * 64)))
  factor = F16_DECODE_FACTOR * xinv_ref[0] if x16 else decode_factor(decode)
  acc = C.finish_acc(acc, method) * (s2_ref[0] * factor)
  lead = (pl.program_id(1),) if split_k > 1 else ()
  C.store_tile(o_ref, lead, acc, n0, bn, m, mp, method)


@functools.partial(jax.jit, static_argnames=(
    "out_dtype", "block_n", "block_k", "split_k", "decode", "method", "num_warps", "num_stages",
    "early_trigger", "interpret", "sum_splits"))
def nvfp4_gemv(x, qweight, weight_scale, weight_scale_2, *, out_dtype=jnp.bfloat16,
               block_n: int | None = None, block_k: int | None = None,
               split_k: int | None = None, decode: str = "asm", method: str | None = None,
               num_warps: int | None = None, num_stages: int = 3, early_trigger: bool = True,
               interpret: bool = False, sum_splits: bool = True, x_inv=None):
  """y[M, N] = out_dtype((x @ dequant(qweight, weight_scale)^T) * weight_scale_2).

  ``x_inv`` (M = 1): x is then the f16 operand of ``x16_operand`` (x16 [1, K] f16, values scaled
  by 2^c and stored in groups of four as x0, x2, x1, x3) and ``x_inv`` its factor 2^-c, [1] f32:
  the ``blocks`` K step multiplies in f16x2 (``blocks_fma_f16``, the sums of a 16-value block
  in f16 per ``f16_sums``) instead of decoding to f32, ~2 instead of ~4.8 instructions per
  weight. The products are exact; each f16 sum rounds (relative error ~2^-11 per block).

  With split-K (``split_k`` > 1, given or the default) the kernel writes float32 partials
  [split_k, M, N], partial s over the contiguous K range [s K/split_k, (s+1) K/split_k), each
  already times weight_scale_2; ``sum_splits`` (default) sums them in an XLA op and casts to
  ``out_dtype``. ``sum_splits=False`` returns them unsummed (``out_dtype`` unused): the caller
  must compute ``out_dtype(sum(y, axis=0))`` in fp32 itself, e.g. ``add_rms_norm`` takes them
  as its ``y`` (one launch less). Without split-K the result is [M, N] ``out_dtype`` either way.
  ``early_trigger``: the kernel lets the next one launch first (``pdl``).
  """
  n, kh = qweight.shape
  method = method or default_method(x.shape[0], n)
  dbn, dbk, dsplit, dwarps = default_nvfp4_blocks(n, kh * 2, m=x.shape[0], method=method,
                                                  x16=x.dtype == jnp.float16)
  if split_k is None:
    same_tiles = (block_n or dbn, block_k or dbk) == (dbn, dbk)
    split_k = dsplit if same_tiles else 1
  elif block_k is None and (kh * 2) % split_k == 0:   # a given split: K steps that fit it
    dbk = C.pow2_divisor(kh * 2 // split_k, dbk)
  block_n, block_k = block_n or dbn, block_k or dbk
  if num_warps is None and x.dtype == jnp.float16:
    dwarps = f16_warps_that_fit(block_n, block_k, dwarps)
  num_warps = num_warps or dwarps
  w = (qweight, weight_scale, weight_scale_2)
  m, n, k = _validate(x, [w], block_n, block_k, split_k)
  x16 = _check_x16(x, x_inv, method)
  C.check(not x16 or interpret or decode == "asm",
          f"the f16 operand compiled for the GPU needs decode='asm' (the f16 K step's jnp form "
          f"is for interpret mode), got {decode=}")
  decode = resolve_decode(decode, interpret)
  C.check_method(method, m)
  mp = C.pad_rows(m, method)
  nb = block_k // 64
  q4, s4 = nvfp4_views(qweight, weight_scale)
  s2 = C.scalar_f32(weight_scale_2)
  # the f16 K step's sums as its tiles allow
  f16_sums = f16_sums_for_tile(block_n, block_k, num_warps) if x16 else "block"
  kernel = functools.partial(_nvfp4_gemv_kernel, m=m, mp=mp, bn=block_n, nb=nb,
                             n_iter=k // block_k // split_k, split_k=split_k, decode=decode,
                             method=method, x16=x16, f16_sums=f16_sums)
  xinv = (x_inv.reshape(1).astype(jnp.float32),) if x16 else ()
  if split_k > 1:
    out_shape, grid = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32), (n // block_n, split_k)
  else:
    out_shape, grid = jax.ShapeDtypeStruct((m, n), out_dtype), (n // block_n,)
  y = C.pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger,
      name=(f"flint_nvfp4_gemv_{method}_bn{block_n}_bk{block_k}_{decode}_tile"
            f"{'_x16' if x16 else ''}"),
  )(x_view(x), q4, s4, s2, *xinv)
  if split_k > 1 and sum_splits:
    y = jnp.sum(y, axis=0).astype(out_dtype)
  return y


def nvfp4_gemv_reference(x, qweight, weight_scale, weight_scale_2, *, out_dtype=jnp.bfloat16,
                         split_k: int | None = None, sum_splits: bool = True, x_inv=None,
                         **unused_tuning):
  """Plain jnp: exact bf16 dequantisation, fp32 dot, tensor scale on the fp32 result.

  ``sum_splits=False`` with ``split_k`` > 1: ``nvfp4_gemv``'s fp32 partials [split_k, M, N] (one
  dot per contiguous K range). The reference picks no tiles, so ``split_k`` must be given then.
  ``x_inv``: x is an ``x16_operand``, taken back to the bf16 values it holds (exactly).
  """
  del unused_tuning
  if x_inv is not None:
    x = from_x16(x, x_inv)
  if sum_splits or split_k == 1:
    split_k = 1
  C.check(split_k is not None, "sum_splits=False needs an explicit split_k in the reference")
  return _nvfp4_gemv_reference(x, qweight, weight_scale, weight_scale_2, out_dtype=out_dtype,
                               split_k=split_k)


def _check_x16(x, x_inv, method) -> bool:
  """Whether x is an f16 ``x16_operand`` (then checked against ``x_inv`` and the tiles)."""
  if x.dtype != jnp.float16 and x_inv is None:
    return False
  C.check(x.dtype == jnp.float16 and x_inv is not None,
          f"an f16 x is the x16_operand and needs its x_inv (and x_inv an f16 x), got "
          f"{x.dtype=} x_inv={'None' if x_inv is None else 'given'}")
  C.check(x.shape[0] == 1 and jnp.size(x_inv) == 1,
          f"the f16 operand is for one row: x [1, K] and x_inv [1], got {x.shape=} "
          f"{jnp.shape(x_inv)=}")
  C.check(method == "blocks", f"the f16 operand runs the 'blocks' tiles, got {method=}")
  return True


def from_x16(x16, inv, dtype=jnp.bfloat16):
  """The inverse of ``x16_operand``: x16 [..., K] f16 (x16 order), inv [...] f32 -> [..., K]
  ``dtype`` (exact for what ``x16_operand`` produced from bf16 values)."""
  v = _x16_order(x16).astype(jnp.float32) * jnp.asarray(inv, jnp.float32)[..., None]
  return v.astype(dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "split_k"))
def _nvfp4_gemv_reference(x, qweight, weight_scale, weight_scale_2, *, out_dtype, split_k=1):
  w = dequantize_nvfp4_reference(qweight, weight_scale)
  s2 = jnp.asarray(weight_scale_2, jnp.float32)
  if split_k > 1:   # partial s: K range s of split_k, [S, M, N] fp32
    (m, k), n = x.shape, w.shape[0]
    C.check(k % split_k == 0, f"split_k must divide K: {split_k=} {k=}")
    xs, ws = x.reshape(m, split_k, k // split_k), w.reshape(n, split_k, k // split_k)
    y = lax.dot_general(xs, ws, (((2,), (2,)), ((1,), (1,))),
                        preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return y * s2
  y = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST)
  return (y * s2).astype(out_dtype)


def _nvfp4_silu_mul_kernel(x_ref, qg_ref, sg_ref, qu_ref, su_ref, s2g_ref, s2u_ref, o_ref, *, m,
                           mp, bn, nb, n_iter, decode, method):
  n0 = pl.multiple_of(pl.program_id(0) * bn, bn)

  def body(i, carry):
    acc_g, acc_u = carry
    b0 = pl.multiple_of(i * nb, nb)
    kw = dict(decode=decode, method=method)
    acc_g = nvfp4_tile_dot(x_ref, (), m, mp, qg_ref, sg_ref, (), n0, bn, b0, nb, acc=acc_g, **kw)
    acc_u = nvfp4_tile_dot(x_ref, (), m, mp, qu_ref, su_ref, (), n0, bn, b0, nb, acc=acc_u, **kw)
    return acc_g, acc_u

  z = C.acc_zeros(mp, bn, method, lanes_shape(nb * 64))
  acc_g, acc_u = lax.fori_loop(0, n_iter, body, (z, z))
  acc_g, acc_u = C.finish_acc(acc_g, method), C.finish_acc(acc_u, method)
  f = decode_factor(decode)
  h = C.silu_mul_f32(acc_g * (s2g_ref[0] * f), acc_u * (s2u_ref[0] * f))
  C.store_tile(o_ref, (), h, n0, bn, m, mp, method)


@functools.partial(jax.jit, static_argnames=(
    "block_n", "block_k", "decode", "method", "num_warps", "num_stages", "early_trigger",
    "interpret"))
def nvfp4_gemv_silu_mul(x, gate, up, *, block_n: int | None = None, block_k: int | None = None,
                        decode: str = "asm", method: str | None = None,
                        num_warps: int | None = None, num_stages: int = 3,
                        early_trigger: bool = True, interpret: bool = False):
  """h[M, I] = bf16(silu(g) * u), g/u = (x @ dequant(gate|up)^T) * their weight_scale_2.

  gate, up: ``NVFP4Weight`` (or (qweight, weight_scale, weight_scale_2)) of shape [I, K].
  """
  gate, up = NVFP4Weight(*gate), NVFP4Weight(*up)
  n, kh = gate.qweight.shape
  method = method or default_method(x.shape[0], n)
  dbn, dbk, _, dwarps = default_nvfp4_blocks(n, kh * 2, m=x.shape[0], n_mats=2, method=method)
  block_n, block_k = block_n or dbn, block_k or dbk
  num_warps = num_warps or dwarps
  m, n, k = _validate(x, [gate, up], block_n, block_k)
  decode = resolve_decode(decode, interpret)
  C.check_method(method, m)
  mp = C.pad_rows(m, method)
  nb = block_k // 64
  qg, sg = nvfp4_views(gate.qweight, gate.weight_scale)
  qu, su = nvfp4_views(up.qweight, up.weight_scale)
  # the two tensor scales as separate [1] inputs: a jnp.stack would be one more XLA launch
  s2g, s2u = C.scalar_f32(gate.weight_scale_2), C.scalar_f32(up.weight_scale_2)
  kernel = functools.partial(_nvfp4_silu_mul_kernel, m=m, mp=mp, bn=block_n, nb=nb,
                             n_iter=k // block_k, decode=decode, method=method)
  return C.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(n // block_n,),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger,
      name=f"flint_nvfp4_silu_mul_{method}_bn{block_n}_bk{block_k}_{decode}_tile",
  )(x_view(x), qg, sg, qu, su, s2g, s2u)


def nvfp4_gemv_silu_mul_reference(x, gate, up, **unused_tuning):
  """Plain jnp: bf16(silu(g) * u) from the fp32 products times their tensor scales, each
  rounded to bf16 first."""
  del unused_tuning
  g = _nvfp4_gemv_reference(x, *gate, out_dtype=jnp.float32)
  u = _nvfp4_gemv_reference(x, *up, out_dtype=jnp.float32)
  return C.silu_mul_f32(g, u).astype(x.dtype)
