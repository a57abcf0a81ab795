"""Tests of flint_jax.nvfp4: GGUF block codec, kernel layout, dequantizers, quantizer."""

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from flint_jax import nvfp4

F8 = ml_dtypes.float8_e4m3fn
NVFP4 = gguf.GGMLQuantizationType.NVFP4


def random_raw(rng, shape, scale_bytes="valid"):
    """Random GGUF NVFP4 data for a ``[..., N, K]`` tensor: uint8 ``[..., N, K/64*36]``.

    scale_bytes: "valid" = any byte but 0xFF (0x7F and 0x80..0xFE included),
    "canonical" = 0x00..0x7E only (the bytes that round-trip bit for bit).
    """
    *lead, k = shape
    blocks = rng.integers(0, 256, size=(*lead, k // 64, 36), dtype=np.uint8)
    hi = 0xFF if scale_bytes == "valid" else 0x7F
    blocks[..., :4] = rng.integers(0, hi, size=(*lead, k // 64, 4), dtype=np.uint8)
    return blocks.reshape(*lead, k // 64 * 36)


def random_kernel(rng, shape):
    """Random flint_jax layout for ``[..., N, K]``: (qweight uint8, weight_scale float8_e4m3fn)."""
    *lead, k = shape
    q = rng.integers(0, 256, size=(*lead, k // 2), dtype=np.uint8)
    s = rng.integers(0, 0x7F, size=(*lead, k // 16), dtype=np.uint8).view(F8)
    return q, s


SHAPES = [(1, 64), (3, 128), (2, 5, 192), (4, 3, 2, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_gguf_dequantize(shape):
    rng = np.random.default_rng(1)
    raw = random_raw(rng, shape)
    ref = gguf_dequantize(raw, NVFP4)
    assert ref.shape == shape
    # Through the kernel layout (bit 7 dropped, 0x7F -> 0 as gguf does).
    ours = nvfp4.dequantize_gguf_np(raw, "t")
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, ref)  # -0 == +0 (gguf gives +0 for code 8)
    # Straight from decode_gguf_blocks: natural-order codes and raw scale bytes.
    codes, sb = nvfp4.decode_gguf_blocks(raw, "t")
    assert codes.shape == shape and sb.shape == (*shape[:-1], shape[-1] // 16)
    scale = nvfp4.canonical_scale_bytes(sb).view(F8).astype(np.float32)
    vals = nvfp4.E2M1_VALUES[codes] * np.repeat(scale, 16, axis=-1)
    np.testing.assert_array_equal(vals, ref)


def test_scale_byte_table_matches_gguf():
    """Every UE4M3 byte but 0xFF, one block per byte, code 2 (= 1.0) everywhere."""
    blocks = np.full((255, 36), 0x22, np.uint8)
    blocks[:, :4] = np.arange(255, dtype=np.uint8)[:, None]
    ref = gguf_dequantize(blocks, NVFP4)
    np.testing.assert_array_equal(nvfp4.dequantize_gguf_np(blocks), ref)
    q, s = nvfp4.gguf_to_kernel(blocks)
    bits = s.view(np.uint8)[:, 0]
    expect = np.arange(255) & 0x7F
    expect[expect == 0x7F] = 0
    np.testing.assert_array_equal(bits, expect)


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_kernel_roundtrip_and_layout(shape):
    rng = np.random.default_rng(2)
    raw = random_raw(rng, shape, scale_bytes="canonical")
    q, s = nvfp4.gguf_to_kernel(raw, "t")
    k = shape[-1]
    assert q.dtype == np.uint8 and q.shape == (*shape[:-1], k // 2)
    assert s.dtype == F8 and s.shape == (*shape[:-1], k // 16)
    np.testing.assert_array_equal(nvfp4.kernel_to_gguf(q, s), raw)
    # The half-split definition of docs/design.md, checked byte by byte.
    codes, sb = nvfp4.decode_gguf_blocks(raw)
    qb = q.reshape(*shape[:-1], k // 64, 32)
    cb = codes.reshape(*shape[:-1], k // 64, 64)
    np.testing.assert_array_equal(qb & 0x0F, cb[..., :32])
    np.testing.assert_array_equal(qb >> 4, cb[..., 32:])
    np.testing.assert_array_equal(s.view(np.uint8), sb)
    np.testing.assert_array_equal(nvfp4.unpack_kernel_codes(q), codes)
    np.testing.assert_array_equal(nvfp4.pack_kernel_codes(codes), q)


def test_chunked_streaming_matches(monkeypatch):
    rng = np.random.default_rng(3)
    raw = random_raw(rng, (3, 7, 128), scale_bytes="canonical")
    q0, s0 = nvfp4.gguf_to_kernel(raw)
    monkeypatch.setattr(nvfp4, "_CHUNK_BYTES", 100)  # ~1 row per chunk
    q1, s1 = nvfp4.gguf_to_kernel(raw)
    np.testing.assert_array_equal(q0, q1)
    np.testing.assert_array_equal(s0.view(np.uint8), s1.view(np.uint8))
    np.testing.assert_array_equal(nvfp4.kernel_to_gguf(q1, s1), raw)
    raw[2, 5, 36 + 2] = 0xFF  # expert 2, row 5, block 1, sub-block 2
    with pytest.raises(ValueError, match=r"'e'.*0xFF at row \(2, 5\), block 1 \(sub-block 2, values 96\.\.111\)"):
        nvfp4.gguf_to_kernel(raw, "e")


def test_ff_scale_refused():
    rng = np.random.default_rng(4)
    raw = random_raw(rng, (2, 4, 256))
    raw[1, 2, 3 * 36 + 1] = 0xFF
    name = "blk.7.ffn_down_exps.weight"
    for fn in (nvfp4.decode_gguf_blocks, nvfp4.gguf_to_kernel, nvfp4.dequantize_gguf_np):
        with pytest.raises(ValueError, match=r"blk\.7\.ffn_down_exps\.weight.*0xFF.*row \(1, 2\), block 3"):
            fn(raw, name)


def test_bad_shapes_refused():
    with pytest.raises(ValueError, match="'w'.*not a multiple of 36"):
        nvfp4.gguf_to_kernel(np.zeros((2, 40), np.uint8), "w")
    with pytest.raises(ValueError, match="'w'.*uint8"):
        nvfp4.decode_gguf_blocks(np.zeros((2, 36), np.float32), "w")
    q, s = random_kernel(np.random.default_rng(5), (2, 64))
    with pytest.raises(ValueError, match="weight_scale shape"):
        nvfp4.kernel_to_gguf(q, s[:, :2])
    with pytest.raises(ValueError, match="multiple of 64"):
        nvfp4.kernel_to_gguf(q[:, :16], s[:, :2])


def test_kernel_to_gguf_scale_checks():
    q, s = random_kernel(np.random.default_rng(6), (2, 64))
    bits = s.view(np.uint8).copy()
    bits[0, 0] = 0x80  # -0: written as 0x00
    assert nvfp4.kernel_to_gguf(q, bits.view(F8))[0, 0] == 0
    for bad in (0x7F, 0xFF, 0x81, 0xC0):
        bits[1, 3] = bad
        with pytest.raises(ValueError, match=r"'x'.*\(1, 3\).*negative or NaN"):
            nvfp4.kernel_to_gguf(q, bits.view(F8), name="x")


@pytest.mark.parametrize("shape", [(5, 64), (3, 8, 128)])
def test_jnp_dequantize_equals_numpy(shape):
    rng = np.random.default_rng(7)
    q, s = random_kernel(rng, shape)
    ref = nvfp4.dequantize_kernel_np(q, s)
    f = jax.jit(nvfp4.dequantize, static_argnums=2)
    out32 = np.asarray(f(jnp.asarray(q), jnp.asarray(s), jnp.float32))
    np.testing.assert_array_equal(out32, ref)
    assert np.array_equal(np.signbit(out32), np.signbit(ref))
    out16 = f(jnp.asarray(q), jnp.asarray(s), jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16.astype(jnp.float32)), ref)  # exact in bf16
    bits = s.view(np.uint8)  # raw e4m3 bits are accepted too
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(q), jnp.asarray(bits), jnp.float32)), ref)
    np.testing.assert_array_equal(nvfp4.dequantize_kernel_np(q, bits), ref)


def test_jnp_dequantize_exhaustive():
    """All 16 codes x all 127 finite non-negative e4m3 scales, bf16 output."""
    codes = np.tile(np.arange(16, dtype=np.uint8), 4)  # 64 values = one block
    q = np.tile(nvfp4.pack_kernel_codes(codes), (127, 1))
    s = np.repeat(np.arange(127, dtype=np.uint8)[:, None], 4, axis=1).view(F8)
    expect = nvfp4.E2M1_VALUES[codes][None, :] * s.astype(np.float32)[:, :1]
    out = nvfp4.dequantize(jnp.asarray(q), jnp.asarray(s), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expect)
    np.testing.assert_array_equal(nvfp4.dequantize_kernel_np(q, s), expect)


def brute_force_codes(x):
    """Nearest E2M1 code of each x (ties to the even code), sign bit from x < 0."""
    mags = nvfp4.E2M1_VALUES[:8].astype(np.float64)
    d = np.abs(np.abs(x)[..., None].astype(np.float64) - mags)
    best = d.min(axis=-1, keepdims=True)
    cand = np.where(d == best, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(axis=-1)
    code = np.where(even < 99, even, cand.min(axis=-1)).astype(np.uint8)
    return code | ((x < 0).astype(np.uint8) << 3)


def test_quantizer_random_normal_stack():
    rng = np.random.default_rng(8)
    e, n, k = 4, 32, 256
    w = (rng.standard_normal((e, n, k)) * rng.uniform(0.01, 1.0, size=(e, 1, 1))).astype(np.float32)
    q, s, ts = nvfp4.quantize_nvfp4(w)
    assert q.shape == (e, n, k // 2) and q.dtype == np.uint8
    assert s.shape == (e, n, k // 16) and s.dtype == F8
    assert ts.shape == (e,) and ts.dtype == np.float32
    np.testing.assert_array_equal(ts, np.abs(w).max(axis=(1, 2)) / np.float32(6 * 448))
    # Block scales: e4m3 of amax_block / (6 ts), and the max block maps to 448.
    amax_b = np.abs(w.reshape(e, n, k // 16, 16)).max(-1)
    expect_s = (amax_b / (np.float32(6) * ts[:, None, None])).astype(F8)
    np.testing.assert_array_equal(s.view(np.uint8), expect_s.view(np.uint8))
    assert (s.astype(np.float32).max(axis=(1, 2)) == 448).all()
    # Codes: the nearest E2M1 value of w / (s ts), ties to even.
    denom = s.astype(np.float32) * ts[:, None, None]
    x = w.reshape(e, n, k // 16, 16) / denom[..., None]
    np.testing.assert_array_equal(nvfp4.unpack_kernel_codes(q), brute_force_codes(x).reshape(e, n, k))
    # Error: at most one E2M1 grid step (2 between 4 and 6, halved) per block scale.
    w_hat = nvfp4.dequantize_kernel_np(q, s) * ts[:, None, None]
    err = np.abs(w - w_hat).reshape(e, n, k // 16, 16)
    assert (err <= denom[..., None] * 1.0001).all()
    stats = nvfp4.quantization_error(w, q, s, ts)
    assert stats["rel_rms_err"] < 0.12 and stats["max_abs_err"] == pytest.approx(err.max())


def test_quantizer_exact_roundtrip():
    """An exactly representable stack (every block holds a +-6, one block scale 448) comes back."""
    rng = np.random.default_rng(9)
    e, n, k = 3, 8, 128
    codes = rng.integers(0, 16, size=(e, n, k), dtype=np.uint8)
    codes[..., ::16] = rng.choice(np.array([7, 15], np.uint8), size=(e, n, k // 16))
    scale_bits = rng.integers(0x08, 0x7F, size=(e, n, k // 16), dtype=np.uint8)
    scale_bits[:, 0, 0] = 0x7E  # 448
    ts0 = np.array([2.0**-7, 2.0**-3, 1.0], np.float32)
    w = nvfp4.E2M1_VALUES[codes] * np.repeat(scale_bits.view(F8).astype(np.float32), 16, -1)
    w = w * ts0[:, None, None]
    q, s, ts = nvfp4.quantize_nvfp4(w)
    np.testing.assert_array_equal(ts, ts0)
    np.testing.assert_array_equal(s.view(np.uint8), scale_bits)
    plus_zero = np.where(codes == 8, 0, codes)  # -0 in w quantizes to code 0
    np.testing.assert_array_equal(nvfp4.unpack_kernel_codes(q), plus_zero)
    w_hat = nvfp4.dequantize_kernel_np(q, s) * ts[:, None, None]
    np.testing.assert_array_equal(w_hat, w)
    assert nvfp4.quantization_error(w, q, s, ts) == {"max_abs_err": 0.0, "rel_rms_err": 0.0}


def test_quantizer_ties_zero_blocks_and_axes():
    # Block 0: amax 6 and every midpoint, both signs; powers of two keep x = row exact.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = np.zeros(64, np.float32)
    row[0] = 6.0
    row[1:8] = mids
    row[8:15] = [-m for m in mids]
    row[15] = -0.1  # rounds to -0: code 8, as ModelOpt
    row[32:48] = 0.0  # all-zero block: scale 0, codes 0
    w = row[None, :] * np.float32(2.0**-10)
    q, s, ts = nvfp4.quantize_nvfp4(w, tensor_scale=2.0**-8)  # block scale 0.25, denom 2^-10
    assert ts.shape == () and float(ts) == 2.0**-8 and s.astype(np.float32)[0, 0] == 0.25
    codes = nvfp4.unpack_kernel_codes(q)[0]
    assert list(codes[:16]) == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8]
    assert s.view(np.uint8)[0, 2] == 0 and (codes[32:48] == 0).all()
    # All-zero tensor: tensor scale 1, everything zero.
    q, s, ts = nvfp4.quantize_nvfp4(np.zeros((2, 64), np.float32))
    assert float(ts) == 1.0 and not q.any() and not s.view(np.uint8).any()
    # Axes: None -> one scale; [E, 2, I, D] -> [E, 2]; explicit tensor_scale.
    w = np.random.default_rng(10).standard_normal((3, 2, 4, 64)).astype(np.float32)
    assert nvfp4.quantize_nvfp4(w, None)[2].shape == ()
    _, _, ts2 = nvfp4.quantize_nvfp4(w)
    assert ts2.shape == (3, 2)
    np.testing.assert_array_equal(ts2, np.abs(w).max(axis=(2, 3)) / np.float32(2688))
    q1, s1, ts1 = nvfp4.quantize_nvfp4(w, tensor_scale=ts2)
    q2, s2, _ = nvfp4.quantize_nvfp4(w)
    np.testing.assert_array_equal(q1, q2)
    np.testing.assert_array_equal(ts1, ts2)
    with pytest.raises(ValueError, match="last two axes"):
        nvfp4.quantize_nvfp4(w, tensor_amax_axes=(0, 3))
    with pytest.raises(ValueError, match="K % 64"):
        nvfp4.quantize_nvfp4(np.ones((2, 48), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        nvfp4.quantize_nvfp4(np.full((2, 64), np.nan, np.float32))


def test_quantize_to_gguf_matches_gguf_dequantize():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2, 16, 128)).astype(np.float32)
    raw, scale = nvfp4.quantize_to_gguf(w)
    assert raw.shape == (2, 16, 2 * 36) and scale.shape == (2,) and scale.dtype == np.float32
    q, s, ts = nvfp4.quantize_nvfp4(w)
    np.testing.assert_array_equal(raw, nvfp4.kernel_to_gguf(q, s))
    np.testing.assert_array_equal(gguf_dequantize(raw, NVFP4) * scale[:, None, None],
                                  nvfp4.dequantize_gguf_np(raw, tensor_scale=scale))
    raw1, scale1 = nvfp4.quantize_to_gguf(w[0])
    assert scale1.shape == (1,)
    np.testing.assert_array_equal(raw1, nvfp4.quantize_to_gguf(w[0], tensor_scale=scale1)[0])
