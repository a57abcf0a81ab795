"""The NVFP4 ``asm`` decode's inline PTX, executed by a small emulator on the CPU.

Inline PTX runs only compiled on a GPU (interpret mode decodes through float8 instead), so these
tests run the emitted instruction text itself -- every code byte, both nibble halves, both signs
-- through a numpy model of the few PTX instructions it uses, and compare with the E2M1 table.
"""


import numpy as np
import pytest

from flint_jax.pallas import nvfp4_gemv as NV

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                 -4.0, -6.0], np.float32)


def _bf16_lanes_to_f32(r):
  lo = (r & np.uint32(0xFFFF)) << np.uint32(16)
  hi = r & np.uint32(0xFFFF0000)
  return lo.view(np.float32), hi.view(np.float32)


def _f32_to_bf16_bits(f):
  """Round-to-nearest-even f32 -> bf16 bits (uint32 in the low 16 bits)."""
  b = f.astype(np.float32).view(np.uint32)
  b = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
  return b >> np.uint32(16)


def _prmt(a, b, sel):
  """prmt.b32 default mode: output byte i = byte (sel nibble i & 7) of {b, a}; bit 3 of the
  nibble replicates that byte's sign bit."""
  src = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
  src += [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
  out = np.zeros_like(a)
  for i in range(4):
    nib = (sel >> (4 * i)) & 0xF
    byte = src[nib & 7]
    if nib & 8:
      byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
    out |= byte.astype(np.uint32) << np.uint32(8 * i)
  return out


def _f16_lanes(r):
  """A b32 register's two f16 lanes as float64 (lane 0 = bits 0-15)."""
  lo = (r & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
  hi = (r >> np.uint32(16)).astype(np.uint16).view(np.float16)
  return lo.astype(np.float64), hi.astype(np.float64)


def _f16x2_bits(lo, hi):
  """Two float64 lanes rounded (to nearest even) into f16x2 bits."""
  b = lambda v: v.astype(np.float16).view(np.uint16).astype(np.uint32)  # noqa: E731
  return b(lo) | (b(hi) << np.uint32(16))


def run_ptx(asm: str, operands: dict) -> dict:
  """Executes ``asm`` (the ``{ ... }`` block of an inline-asm call) on uint32 arrays.
  ``operands``: {"$4": codes, ...}; returns every register, outputs included."""
  regs = dict(operands)
  shape = next(iter(operands.values())).shape

  def val(t):
    return regs[t] if t in regs else np.full(shape, int(t, 0), np.uint32)

  for raw in asm.strip().strip("{}").split("\n"):
    line = raw.strip().rstrip(";")
    if not line or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    if op == "mov.b32" and args.startswith("{"):      # mov.b32 {lo, hi}, r: unpack b16 halves
      halves, src = args[1:].split("}")
      lo, hi = (x.strip() for x in halves.split(","))
      r = val(src.strip(", "))
      regs[lo], regs[hi] = r & np.uint32(0xFFFF), r >> np.uint32(16)
      continue
    a = [x.strip() for x in args.split(",")]
    if op == "mov.b32":
      regs[a[0]] = val(a[1])
    elif op == "prmt.b32":
      regs[a[0]] = _prmt(val(a[1]), val(a[2]), int(a[3], 0))
    elif op == "and.b32":
      regs[a[0]] = val(a[1]) & val(a[2])
    elif op == "or.b32":
      regs[a[0]] = val(a[1]) | val(a[2])
    elif op == "shl.b32":
      regs[a[0]] = val(a[1]) << val(a[2])
    elif op == "shr.b32":
      regs[a[0]] = val(a[1]) >> val(a[2])
    elif op == "mul.rn.f16x2":    # float64 products of f16 lanes are exact: one rounding
      (xl, xh), (yl, yh) = _f16_lanes(val(a[1])), _f16_lanes(val(a[2]))
      regs[a[0]] = _f16x2_bits(xl * yl, xh * yh)
    elif op == "fma.rn.f16x2":    # a * b + c exact in float64 here, then one rounding
      (xl, xh), (yl, yh), (cl, ch) = (_f16_lanes(val(t)) for t in a[1:4])
      regs[a[0]] = _f16x2_bits(xl * yl + cl, xh * yh + ch)
    elif op == "cvt.f32.f16":
      h = val(a[1]).astype(np.uint16).view(np.float16)
      regs[a[0]] = h.astype(np.float32).view(np.uint32)
    elif op == "mul.lo.u32":
      regs[a[0]] = (val(a[1]).astype(np.uint64) * val(a[2]).astype(np.uint64)).astype(np.uint32)
    elif op == "mul.rn.bf16x2":   # exact products here (<= 7 significant bits), rounded anyway
      (xl, xh), (yl, yh) = _bf16_lanes_to_f32(val(a[1])), _bf16_lanes_to_f32(val(a[2]))
      regs[a[0]] = _f32_to_bf16_bits(xl * yl) | (_f32_to_bf16_bits(xh * yh) << np.uint32(16))
    else:
      raise NotImplementedError(f"PTX emulator: {op}")
  return regs


def _all_code_words():
  """Every byte value at every byte position of a 32-bit register: [256 * 4] words."""
  vals = np.arange(256, dtype=np.uint32)
  words = []
  for pos in range(4):
    other = (vals[::-1] * np.uint32(7)) & np.uint32(0xFF)   # varied neighbours
    w = np.zeros(256, np.uint32)
    for p in range(4):
      w |= (vals if p == pos else (other + np.uint32(p)) & np.uint32(0xFF)) << np.uint32(8 * p)
    words.append(w)
  return np.concatenate(words)


def _expected(words, half):
  """E2M1 values [N, 4] of each byte's low (half 0) or high (half 1) nibble."""
  bytes_ = np.stack([(words >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], axis=1)
  nib = (bytes_ >> np.uint32(4 * half)) & np.uint32(15)
  return E2M1[nib]


@pytest.mark.parametrize("half", [0, 1])
def test_raw_decode_is_e2m1_times_2_pow_minus_126(half):
  """``post``'s decode without the scale multiply: four f32 per code register, each the E2M1
  value of its byte's nibble times 2^-126 exactly (the code 0.5 as an f32 subnormal), signs
  (also of zero) kept."""
  words = _all_code_words()
  regs = run_ptx(NV._ASM_RAW[half], {"$4": words})
  got = np.stack([regs[f"${i}"].view(np.float32) for i in range(4)], axis=1)
  want = _expected(words, half) * np.float32(NV.RAW_FACTOR)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("seq", ["f32", "bf16"])
def test_scaled_decode_sequences(half, seq):
  """The scaled sequences (with f32 outputs for the CUDA-core tiles, with bf16 outputs for the
  tensor-core ones) give E2M1 x scale x 2^-7 for pre-scaled bf16 scales (scale x 2^119),
  exactly."""
  from flint_jax.nvfp4 import prescale_block_scales
  import jax.numpy as jnp
  words = _all_code_words()
  g = np.random.default_rng(half)
  e4m3 = g.integers(0x08, 0x7F, size=(words.size, 4)).astype(np.uint8)   # normal e4m3 scales
  scale = np.asarray(jnp.asarray(e4m3.view(jnp.float8_e4m3fn)).astype(jnp.float32))
  pre = np.asarray(prescale_block_scales(jnp.asarray(e4m3.view(jnp.float8_e4m3fn)))
                   .view(jnp.uint16)).astype(np.uint32)
  s01 = pre[:, 0] | (pre[:, 1] << np.uint32(16))
  s23 = pre[:, 2] | (pre[:, 3] << np.uint32(16))
  asm = {"f32": NV._ASM_F32, "bf16": NV._ASM_MUL}[seq][half]
  if seq == "f32":
    regs = run_ptx(asm, {"$4": words, "$5": s01, "$6": s23})
    got = np.stack([regs[f"${i}"].view(np.float32) for i in range(4)], axis=1)
  else:
    regs = run_ptx(asm, {"$2": words, "$3": s01, "$4": s23})
    got = np.stack([*_bf16_lanes_to_f32(regs["$0"]), *_bf16_lanes_to_f32(regs["$1"])], axis=1)
  want = _expected(words, half) * scale * np.float32(2.0 ** -7)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _f16_pairs(x16):
  """f16 [N, 4] (x16_operand order x0, x2, x1, x3) -> the two f16x2 registers of the asm."""
  b = x16.view(np.uint16).astype(np.uint32)
  return b[:, 0] | (b[:, 1] << np.uint32(16)), b[:, 2] | (b[:, 3] << np.uint32(16))


def test_f16_block_asm():
  """``blocks_fma_f16``'s asm (every code byte at every position, random f16 x of both signs
  and a wide range): per word (lo lane 0, lo lane 1, hi lane 0, hi lane 1) = the f16 rounding
  of the pair of exact products E2M1 x 2^-14 x x -- lane 0 bytes 0 and 1, lane 1 bytes 2 and 3
  -- the first product rounded alone first (``mul`` then ``fma``), and equal to the jnp form
  the interpret mode runs (``_f16_lane_sums``)."""
  import jax.numpy as jnp
  words = _all_code_words()
  g = np.random.default_rng(16)
  n = words.size
  xs = [(g.standard_normal((n, 4)) * 2.0 ** g.integers(-6, 14, (n, 4))).astype(np.float16)
        for _ in range(2)]
  (l02, l13), (h02, h13) = _f16_pairs(xs[0]), _f16_pairs(xs[1])
  regs = run_ptx(NV._ASM_F16, {"$4": words, "$5": l02, "$6": l13, "$7": h02, "$8": h13})
  got = np.stack([regs[f"${i}"].view(np.float32) for i in range(4)], axis=1)
  want = []
  for half, x in enumerate(xs):
    w = _expected(words, half).astype(np.float64) * 2.0 ** -14            # bytes 0..3
    xn = x.astype(np.float64)[:, [0, 2, 1, 3]]                            # x0 .. x3
    for a, b in ((0, 1), (2, 3)):
      first = (w[:, a] * xn[:, a]).astype(np.float16).astype(np.float64)
      want.append((first + w[:, b] * xn[:, b]).astype(np.float16).astype(np.float32))
  np.testing.assert_array_equal(got, np.stack(want, axis=1))
  # the interpret-mode form on the same operands (rows of 16 bytes: four words)
  q = np.stack([(words >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], 1)
  q = q.astype(np.uint8).reshape(-1, 16)
  em = NV._f16_lane_sums(jnp.asarray(q), jnp.asarray(xs[0].reshape(-1, 16)),
                         jnp.asarray(xs[1].reshape(-1, 16)))
  np.testing.assert_array_equal(np.asarray(em).reshape(-1, 4), got)


def test_f16_acc_asm():
  """``f16_sums="block"``: the asm run on a block's four code words in turn (the first one's
  ``mul`` form, then the accumulating one) gives per nibble half two f16 lanes, each the sum of
  its eight products E2M1 x 2^-14 x x rounded to f16 after every product (lane 0: bytes 0 and
  1 of each word, lane 1: bytes 2 and 3, words in order), equal to the interpret mode's jnp
  form (``_f16_block_lane_sums``)."""
  import jax.numpy as jnp
  g = np.random.default_rng(17)
  words = _all_code_words()
  words = np.concatenate([words, g.permutation(words)])[: (words.size // 4) * 4]
  n = words.size // 4                                                      # blocks
  words = words.reshape(n, 4)
  xs = [(g.standard_normal((n, 16)) * 2.0 ** g.integers(-6, 13, (n, 16))).astype(np.float16)
        for _ in range(2)]
  acc = {}
  for i in range(4):
    (l02, l13), (h02, h13) = (_f16_pairs(x[:, 4 * i: 4 * i + 4]) for x in xs)
    ops = {"$2": words[:, i], "$3": l02, "$4": l13, "$5": h02, "$6": h13}
    if i:
      ops.update({"$7": acc["$0"], "$8": acc["$1"]})
    acc = run_ptx(NV._ASM_F16_ACC[i > 0], ops)
  got = np.stack([v.astype(np.float32) for r in ("$0", "$1") for v in _f16_lanes(acc[r])],
                 axis=1)
  want = []
  for half, x in enumerate(xs):
    w = np.stack([_expected(words[:, i], half) for i in range(4)], 1)      # [n, 4 words, 4 bytes]
    w = w.astype(np.float64) * 2.0 ** -14
    xn = x.astype(np.float64).reshape(n, 4, 4)[:, :, [0, 2, 1, 3]]        # x0 .. x3 per word
    for a, b in ((0, 1), (2, 3)):
      lane = None
      for i in range(4):
        for j in (a, b):
          p = w[:, i, j] * xn[:, i, j]
          lane = (p if lane is None else p + lane).astype(np.float16).astype(np.float64)
      want.append(lane.astype(np.float32))
  np.testing.assert_array_equal(got, np.stack(want, axis=1))
  q = np.stack([(words >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], -1)
  q = q.astype(np.uint8).reshape(n, 16)
  em = NV._f16_block_lane_sums(jnp.asarray(q), jnp.asarray(xs[0]), jnp.asarray(xs[1]))
  np.testing.assert_array_equal(np.asarray(em), got)


def test_emulator_rejects_unknown_instructions():
  with pytest.raises(NotImplementedError, match="sin"):
    run_ptx("{\nsin.approx.f32 $0, $1;\n}", {"$1": np.zeros(2, np.uint32)})
