"""NVFP4 codec: GGUF blocks <-> the flint_jax kernel layout, quantizer, dequantizers.

Pure numpy (+ one jnp dequantizer usable inside ``jit``); no model code.

Formats (``FLINT_SPEC.md`` section 5, ``docs/design.md`` "flint_jax NVFP4 layout"):

* **GGUF block** (GGML type 40): 36 bytes per 64 consecutive values along ``K``.
  Bytes 0..3 are one UE4M3 scale per 16-value sub-block; byte ``4 + 8s + j`` holds the
  E2M1 code of value ``16s + j`` in its low nibble and of ``16s + 8 + j`` in its high one.
* **flint_jax layout**: ``qweight`` uint8 ``[..., N, K/2]``, half-split per 64-value block
  (byte ``32b + j`` holds ``k = 64b + j`` low and ``k = 64b + 32 + j`` high);
  ``weight_scale`` float8_e4m3fn ``[..., N, K/16]`` in natural order;
  ``weight_scale_2`` float32 tensor scale, applied to the fp32 matmul output.

``value = e2m1(code) * e4m3(scale) * tensor_scale``; the first product is exact in bf16.

UE4M3 scale bytes (decision; matches ``gguf.quants.NVFP4.ue4m3_to_fp32`` and llama.cpp's
``ggml_ue4m3_to_fp32``, which ignore bit 7 and special-case 0x00 and 0x7F):

* 0x00..0x7E decode exactly as float8_e4m3fn and are stored unchanged.
* 0x7F (the e4m3fn NaN pattern) decodes as 0 and is stored as 0x00.
* 0x80..0xFE: UE4M3 has no sign bit; gguf/ggml decode them as ``byte & 0x7F`` (0x80 -> 0).
  We match that and store ``byte & 0x7F``. A real quantizer never writes these bytes, so a
  file containing them (or 0x7F) does not round-trip bit for bit through
  ``gguf_to_kernel`` / ``kernel_to_gguf``; every other file does.
* 0xFF is refused with a ``ValueError`` naming tensor, row and block (gguf would decode
  it as 480, llama.cpp likewise: an invalid byte, not a scale).

Quantizer (``quantize_nvfp4``): ModelOpt's recipe. Tensor scale
``ts = amax / (6 * 448)``; block scale ``s = e4m3(amax_block / (6 * ts))`` rounded to nearest
(ties to even, saturating at 448); codes = nearest E2M1 of ``w / (s * ts)``, **ties to the
even code** (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4: the
same choice as ModelOpt's ``_cast_fp4``, IEEE round-half-even), magnitudes above 6 saturate
to 6, the sign bit is ``w < 0`` (so a small negative value may give code 8, -0, as ModelOpt
does). A block whose e4m3 scale is 0 (all zero, or amax below e4m3's range) gets codes 0
and scale 0x00 (ModelOpt writes scale 1.0 for an all-zero block: same values). An all-zero
tensor gets tensor scale 1.0.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# --- constants -----------------------------------------------------------------------------

GGML_TYPE_NVFP4 = 40
BLOCK_VALUES = 64  # values per GGUF block
BLOCK_BYTES = 36  # 4 scale bytes + 32 code bytes
SUB_BLOCK = 16  # values per UE4M3 / e4m3 scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# E2M1 value of each 4-bit code; codes 8..15 are the negatives (code 8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
# Midpoints between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
# Ties on these bounds round up (to the even codes 2, 4, 6); the others round down.
_E2M1_TIE_UP = np.array([0.75, 1.75, 3.5], dtype=np.float32)

FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

# Rows per chunk when streaming a big tensor (about 16 MiB of GGUF bytes per chunk).
_CHUNK_BYTES = 1 << 24


# --- small helpers ---------------------------------------------------------------------------


def _rows(a: np.ndarray) -> np.ndarray:
    """View ``[..., W]`` as ``[R, W]`` (no copy for contiguous arrays and memmaps)."""
    return a.reshape(-1, a.shape[-1])


def _chunks(n_rows: int, row_bytes: int) -> list[slice]:
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _check_raw(raw: np.ndarray, name: str) -> None:
    if raw.dtype != np.uint8 or raw.ndim < 2:
        raise ValueError(
            f"tensor {name!r}: NVFP4 GGUF data must be uint8 [..., N, K/64*36], "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )
    if raw.shape[-1] % BLOCK_BYTES:
        raise ValueError(
            f"tensor {name!r}: NVFP4 row has {raw.shape[-1]} bytes, not a multiple of "
            f"{BLOCK_BYTES} (36-byte blocks of 64 values)"
        )


def _refuse_ff(scale_bytes: np.ndarray, row0: int, lead: tuple[int, ...], name: str) -> None:
    """Raise on the first UE4M3 byte 0xFF. ``scale_bytes`` [R, K/16], rows from ``row0``."""
    bad = scale_bytes == 0xFF
    if not bad.any():
        return
    r, g = np.argwhere(bad)[0]
    row = np.unravel_index(row0 + int(r), lead) if lead else ()
    raise ValueError(
        f"tensor {name!r}: invalid UE4M3 block scale 0xFF at row {tuple(int(i) for i in row)}, "
        f"block {g // 4} (sub-block {g % 4}, values {16 * g}..{16 * g + 15}); "
        f"{int(bad.sum())} such byte(s) in this chunk"
    )


def _map_rows(
    fn: Callable[..., tuple[np.ndarray, ...]],
    inputs: Sequence[np.ndarray],
    out_widths: Sequence[int],
    out_dtypes: Sequence[np.dtype],
    on_rows: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, ...]:
    """Apply ``fn(row0, *row_chunks)`` over row chunks of ``[R, W_i]`` inputs into new outputs;
    ``on_rows(rows_done, rows_total)`` after each chunk (progress bars)."""
    n_rows = inputs[0].shape[0]
    outs = tuple(np.empty((n_rows, w), dt) for w, dt in zip(out_widths, out_dtypes))
    row_bytes = sum(a.shape[1] * a.dtype.itemsize for a in inputs)
    for sl in _chunks(n_rows, row_bytes):
        results = fn(sl.start, *(np.asarray(a[sl]) for a in inputs))
        for o, r in zip(outs, results):
            o[sl] = r
        if on_rows is not None:
            on_rows(sl.stop, n_rows)
    return outs


def canonical_scale_bytes(scale_bytes: np.ndarray) -> np.ndarray:
    """UE4M3 bytes uint8 (any shape, no 0xFF) -> float8_e4m3fn bit patterns uint8.

    Bit 7 is dropped (gguf/ggml ignore it) and 0x7F (decodes as 0) becomes 0x00.
    """
    s = scale_bytes & np.uint8(0x7F)
    s[s == 0x7F] = 0
    return s


# --- GGUF blocks <-> codes / kernel layout ---------------------------------------------------


def decode_gguf_blocks(raw: np.ndarray, name: str = "<tensor>") -> tuple[np.ndarray, np.ndarray]:
    """Unpack GGUF NVFP4 blocks.

    Args:
      raw: uint8 ``[..., N, K/64*36]`` (a GGUFReader memmap is fine).
      name: tensor name used in error messages.
    Returns:
      codes: uint8 ``[..., N, K]``, E2M1 code of every value in natural order.
      scale_bytes: uint8 ``[..., N, K/16]``, the raw UE4M3 bytes (0x7F and 0x80..0xFE kept
        as stored; see ``canonical_scale_bytes``).
    Raises ValueError on a bad shape or a 0xFF scale byte (naming tensor, row and block).
    """
    _check_raw(raw, name)
    lead, nb = raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES

    def fn(row0, chunk):
        blocks = chunk.reshape(-1, nb, BLOCK_BYTES)
        scales = blocks[:, :, :4].reshape(-1, nb * 4)
        _refuse_ff(scales, row0, lead, name)
        qs = blocks[:, :, 4:].reshape(-1, nb, 4, 8)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [r, nb, 4, 16]
        return codes.reshape(-1, nb * 64), scales

    codes, scales = _map_rows(fn, [_rows(raw)], [nb * 64, nb * 4], [np.uint8, np.uint8])
    return codes.reshape(*lead, nb * 64), scales.reshape(*lead, nb * 4)


def validate_gguf_blocks(raw: np.ndarray, name: str = "<tensor>") -> None:
    """Check GGUF NVFP4 data uint8 ``[..., N, K/64*36]``: shape and no 0xFF scale byte.

    Streams row chunks (reads every block's 4 scale bytes). Raises ValueError naming
    tensor, row and block.
    """
    _check_raw(raw, name)
    rows, nb = _rows(raw), raw.shape[-1] // BLOCK_BYTES
    for sl in _chunks(rows.shape[0], rows.shape[1]):
        scales = np.asarray(rows[sl]).reshape(-1, nb, BLOCK_BYTES)[:, :, :4].reshape(-1, nb * 4)
        _refuse_ff(scales, sl.start, raw.shape[:-1], name)


def gguf_to_kernel(raw: np.ndarray, name: str = "<tensor>") -> tuple[np.ndarray, np.ndarray]:
    """GGUF NVFP4 blocks -> flint_jax layout (a lossless nibble reshuffle).

    Args:
      raw: uint8 ``[..., N, K/64*36]``; streamed in row chunks, so a memmapped
        ``[256, N, K/64*36]`` expert stack never needs more than one output copy.
      name: tensor name used in error messages.
    Returns:
      qweight: uint8 ``[..., N, K/2]``, half-split per 64-value block.
      weight_scale: float8_e4m3fn ``[..., N, K/16]`` (0x7F -> 0x00, bit 7 dropped).
    Raises ValueError on a bad shape or a 0xFF scale byte.
    """
    _check_raw(raw, name)
    lead, nb = raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES

    def fn(row0, chunk):
        blocks = chunk.reshape(-1, nb, BLOCK_BYTES)
        scales = blocks[:, :, :4].reshape(-1, nb * 4)
        _refuse_ff(scales, row0, lead, name)
        # Sub-block s code bytes: lo nibble = value 16s+j, hi = 16s+8+j (j < 8).
        a, b, c, d = (blocks[:, :, 4 + 8 * s : 12 + 8 * s] for s in range(4))
        # Kernel byte j holds values j (lo) and 32+j (hi): sub-blocks 0/1 pair with 2/3.
        q = np.concatenate(
            [(a & 0x0F) | (c << 4), (a >> 4) | (c & 0xF0), (b & 0x0F) | (d << 4), (b >> 4) | (d & 0xF0)],
            axis=-1,
        )
        return q.reshape(-1, nb * 32), canonical_scale_bytes(scales)

    q, s = _map_rows(fn, [_rows(raw)], [nb * 32, nb * 4], [np.uint8, np.uint8])
    return q.reshape(*lead, nb * 32), s.reshape(*lead, nb * 4).view(FLOAT8_E4M3)


def _scale_bits(weight_scale: np.ndarray, name: str) -> np.ndarray:
    """float8_e4m3fn (or its uint8 bits) -> uint8 bits; refuses NaN and negative scales."""
    if weight_scale.dtype == FLOAT8_E4M3:
        bits = weight_scale.view(np.uint8)
    elif weight_scale.dtype == np.uint8:
        bits = weight_scale
    else:
        raise ValueError(f"tensor {name!r}: weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    bits = np.where(bits == 0x80, np.uint8(0), bits)  # -0 is 0
    bad = (bits & 0x7F) == 0x7F
    if (bits >= 0x80).any() or bad.any():
        idx = tuple(int(i) for i in np.argwhere((bits >= 0x80) | bad)[0])
        raise ValueError(
            f"tensor {name!r}: weight_scale at {idx} is negative or NaN "
            f"(bits 0x{int(bits[idx]):02X}); UE4M3 cannot store it"
        )
    return bits


def _check_kernel(qweight: np.ndarray, weight_scale: np.ndarray, name: str) -> int:
    """Validate flint_jax layout shapes; return K."""
    if qweight.dtype != np.uint8 or qweight.ndim < 2:
        raise ValueError(f"tensor {name!r}: qweight must be uint8 [..., N, K/2], got {qweight.dtype} {qweight.shape}")
    k = qweight.shape[-1] * 2
    if k % BLOCK_VALUES:
        raise ValueError(f"tensor {name!r}: K = {k} is not a multiple of {BLOCK_VALUES}")
    if tuple(weight_scale.shape) != (*qweight.shape[:-1], k // SUB_BLOCK):
        raise ValueError(
            f"tensor {name!r}: weight_scale shape {tuple(weight_scale.shape)} does not match "
            f"qweight {tuple(qweight.shape)} (expected {(*qweight.shape[:-1], k // SUB_BLOCK)})"
        )
    return k


def kernel_to_gguf(qweight: np.ndarray, weight_scale: np.ndarray, name: str = "<tensor>") -> np.ndarray:
    """flint_jax layout -> GGUF NVFP4 blocks (inverse of ``gguf_to_kernel``).

    Args:
      qweight: uint8 ``[..., N, K/2]`` half-split; weight_scale: float8_e4m3fn (or uint8
        bits) ``[..., N, K/16]``, non-negative and not NaN (-0 is written as 0x00).
    Returns:
      raw: uint8 ``[..., N, K/64*36]``.
    """
    qweight, weight_scale = np.asarray(qweight), np.asarray(weight_scale)
    k = _check_kernel(qweight, weight_scale, name)
    lead, nb = qweight.shape[:-1], k // BLOCK_VALUES

    def fn(row0, q, s):
        s = _scale_bits(s, name)
        q = q.reshape(-1, nb, 32)
        p0, p1, p2, p3 = (q[:, :, 8 * i : 8 * i + 8] for i in range(4))
        # Inverse of the reshuffle in gguf_to_kernel: rebuild sub-blocks 0..3.
        sub = [(p0 & 0x0F) | (p1 << 4), (p2 & 0x0F) | (p3 << 4), (p0 >> 4) | (p1 & 0xF0), (p2 >> 4) | (p3 & 0xF0)]
        blocks = np.concatenate([s.reshape(-1, nb, 4), *sub], axis=-1)
        return (blocks.reshape(-1, nb * BLOCK_BYTES),)

    scale_u8 = weight_scale.view(np.uint8) if weight_scale.dtype == FLOAT8_E4M3 else weight_scale
    (raw,) = _map_rows(fn, [_rows(qweight), _rows(scale_u8)], [nb * BLOCK_BYTES], [np.uint8])
    return raw.reshape(*lead, nb * BLOCK_BYTES)


# --- dequantizers ------------------------------------------------------------------------------


def unpack_kernel_codes(qweight: np.ndarray) -> np.ndarray:
    """Half-split ``qweight`` uint8 ``[..., N, K/2]`` -> codes uint8 ``[..., N, K]`` (natural order)."""
    qweight = np.asarray(qweight)
    q = qweight.reshape(*qweight.shape[:-1], -1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=-1).reshape(*qweight.shape[:-1], -1)


def dequantize_kernel_np(qweight: np.ndarray, weight_scale: np.ndarray) -> np.ndarray:
    """Exact ``e2m1(code) * e4m3(scale)`` as float32 ``[..., N, K]`` (tensor scale NOT applied).

    Args: qweight uint8 ``[..., N, K/2]``; weight_scale float8_e4m3fn (or its uint8 bits)
    ``[..., N, K/16]``.
    """
    qweight, weight_scale = np.asarray(qweight), np.asarray(weight_scale)
    if weight_scale.dtype == np.uint8:  # raw e4m3 bits
        weight_scale = weight_scale.view(FLOAT8_E4M3)
    k = _check_kernel(qweight, weight_scale, "<dequantize>")
    vals = E2M1_VALUES[unpack_kernel_codes(qweight)].reshape(*qweight.shape[:-1], k // SUB_BLOCK, SUB_BLOCK)
    scale = np.asarray(weight_scale).astype(np.float32)[..., None]
    return (vals * scale).reshape(*qweight.shape[:-1], k)


def dequantize(qweight: jax.Array, weight_scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """jnp dequantizer (jit-friendly): exact ``e2m1 * e4m3`` as ``dtype`` ``[..., N, K]``.

    Args:
      qweight: uint8 ``[..., N, K/2]`` half-split; weight_scale: float8_e4m3fn (or its uint8
        bits, or pre-scaled bf16: ``prescale_state``) ``[..., N, K/16]``.
      dtype: bf16 or f32 output; exact either way (every product fits bf16's 8-bit mantissa).
    The tensor scale ``weight_scale_2`` is not applied (it scales the fp32 matmul output).

    Elementwise only (fuses into one XLA loop): E2M1 code ``s e e m`` is re-biased into a
    float8_e4m3fn bit pattern ``s 0 0 e e m 0 0`` whose value is exactly ``e2m1 / 64``
    (subnormal ``m`` included), so the nibble "table lookup" is a bitcast and the 64 folds
    into the scale.
    """
    *lead, n, half = qweight.shape
    k = half * 2
    if weight_scale.dtype == jnp.uint8:  # raw e4m3 bits
        weight_scale = jax.lax.bitcast_convert_type(weight_scale, jnp.float8_e4m3fn)
    if weight_scale.dtype == jnp.bfloat16:  # pre-scaled (prescale_state): scale * 2^119, exact
        weight_scale = weight_scale.astype(jnp.float32) * (1.0 / PRESCALE)
    q = qweight.reshape(*lead, n, k // BLOCK_VALUES, 32)
    codes = jnp.concatenate([q & 0x0F, q >> 4], axis=-1)  # [..., N, K/64, 64] natural order
    f8 = ((codes & 0x08) << 4) | ((codes & 0x07) << 2)
    vals = jax.lax.bitcast_convert_type(f8, jnp.float8_e4m3fn).astype(jnp.float32)
    scale = weight_scale.astype(jnp.float32) * 64.0
    out = vals.reshape(*lead, n, k // SUB_BLOCK, SUB_BLOCK) * scale[..., None]
    return out.reshape(*lead, n, k).astype(dtype)


#: Block scales may be held *pre-scaled*: bf16 ``scale * 2^119`` (exact), the operand of the Pallas
#: kernels' bf16 decode, so that no kernel converts a scale (``prescale_state``).
PRESCALE = 2.0 ** 119


def prescale_state(state):
    """``state`` (an nnx State or any pytree of arrays) with every float8_e4m3fn leaf -- the
    NVFP4 block scales, the only such leaves of a Flint model -- as bf16 ``scale * 2^119``.

    Exact, and every NVFP4 kernel (and ``dequantize``) gives bit-identical results with it;
    the block scales take twice the bytes (+11% of the NVFP4 weights). Measured on the H200
    (H200 runs 71-74, docs at 35c0874): the tensor-core (M = 8) NVFP4 kernels issue ~14% fewer
    instructions per K step and run 5-14% faster; the M = 1 kernels are unchanged."""
    def one(a):
        return prescale_block_scales(a) if getattr(a, "dtype", None) == jnp.float8_e4m3fn else a
    return jax.tree.map(one, state)


def prescale_block_scales(weight_scale: jax.Array) -> jax.Array:
    """float8_e4m3fn block scales -> bf16 ``scale * 2^119`` (exact: 3 mantissa bits, and
    ``448 * 2^119 < 2^128``)."""
    return (weight_scale.astype(jnp.float32) * PRESCALE).astype(jnp.bfloat16)


def dequantize_gguf_np(raw: np.ndarray, name: str = "<tensor>", tensor_scale=None) -> np.ndarray:
    """GGUF NVFP4 blocks -> float32 ``[..., N, K]``, as ``gguf.quants.dequantize`` (+0 aside).

    ``tensor_scale`` (the ``X.scale`` companion of ``X.weight``: ``[1]`` or ``[E]`` for an ``[E, N, ...]``
    stack), when given, multiplies the result in float32.
    """
    out = dequantize_kernel_np(*gguf_to_kernel(raw, name))
    if tensor_scale is not None:
        ts = np.asarray(tensor_scale, np.float32).reshape(-1)
        ts = ts.reshape(()) if ts.size == 1 else ts.reshape(-1, *([1] * (out.ndim - 1)))
        out = out * ts
    return out


# --- quantizer ---------------------------------------------------------------------------------


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 code uint8: nearest, ties to even code, saturating at 6, sign = x < 0."""
    mag = np.abs(x)
    codes = np.searchsorted(_E2M1_BOUNDS, mag, side="left").astype(np.uint8)  # ties round down
    codes += np.isin(mag, _E2M1_TIE_UP).astype(np.uint8)  # ...except these, which go up
    return codes | ((x < 0).astype(np.uint8) << 3)


def pack_kernel_codes(codes: np.ndarray) -> np.ndarray:
    """Codes uint8 ``[..., N, K]`` (natural order) -> half-split ``qweight`` uint8 ``[..., N, K/2]``."""
    c = codes.reshape(*codes.shape[:-1], -1, BLOCK_VALUES)
    return (c[..., :32] | (c[..., 32:] << 4)).reshape(*codes.shape[:-1], -1)


def _quantize_rows(w: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w float32 ``[R, K]``, ts float32 ``[R]`` -> (qweight uint8 [R, K/2], scale bits uint8 [R, K/16])."""
    wb = w.reshape(w.shape[0], -1, SUB_BLOCK)
    amax = np.abs(wb).max(axis=-1)
    s = np.minimum(amax / (np.float32(E2M1_MAX) * ts[:, None]), np.float32(E4M3_MAX))
    s8 = s.astype(FLOAT8_E4M3)  # round to nearest even
    denom = s8.astype(np.float32) * ts[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = wb / denom[..., None]
    codes = np.where((denom > 0)[..., None], _round_e2m1(x), np.uint8(0))
    return pack_kernel_codes(codes.reshape(w.shape)), s8.view(np.uint8)


def _tensor_axes(ndim: int, axes: Sequence[int] | None) -> tuple[int, ...]:
    axes = tuple(range(ndim)) if axes is None else tuple(sorted({a % ndim for a in axes}))
    if ndim - 1 not in axes or ndim - 2 not in axes:
        raise ValueError(f"tensor_amax_axes {axes} must include the last two axes (N, K)")
    return axes


def quantize_nvfp4(
    w: np.ndarray,
    tensor_amax_axes: Sequence[int] | None = (-2, -1),
    tensor_scale: np.ndarray | float | None = None,
    on_rows: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize to NVFP4 (ModelOpt recipe, see module docstring) in the flint_jax layout.

    Args:
      w: float ``[..., N, K]`` with K a multiple of 64 (e.g. ``[E, N, K]`` expert stack).
      tensor_amax_axes: axes reduced for the tensor amax; must include the last two.
        Default ``(-2, -1)``: one scale per matrix (``[E]`` for a stack; quantize a fused
        gate_up as ``[E, 2, I, D]`` to get ``[E, 2]``). ``None``: one scale for everything.
      tensor_scale: optional given float32 tensor scale (shape of ``weight_scale_2``, or
        broadcastable to it) instead of ``amax / (6 * 448)``; must be positive.
      on_rows: optional ``on_rows(rows_done, rows_total)``, called as row chunks are quantized
        (a big expert stack takes seconds: progress bars).
    Returns:
      qweight uint8 ``[..., N, K/2]``, weight_scale float8_e4m3fn ``[..., N, K/16]``,
      weight_scale_2 float32 = ``w.shape`` without ``tensor_amax_axes`` (``[]`` for 2-D).
    """
    w = np.asarray(w)
    if w.ndim < 2 or w.shape[-1] % BLOCK_VALUES:
        raise ValueError(f"quantize_nvfp4: need [..., N, K] with K % 64 == 0, got {w.shape}")
    axes = _tensor_axes(w.ndim, tensor_amax_axes)
    amax = np.maximum(w.max(axis=axes, keepdims=True), -w.min(axis=axes, keepdims=True)).astype(np.float32)
    if not np.isfinite(amax).all():
        raise ValueError("quantize_nvfp4: weights contain NaN or inf")
    if tensor_scale is None:
        ts = amax / np.float32(E2M1_MAX * E4M3_MAX)
        ts[ts == 0] = 1.0  # all-zero tensor: any scale works
    else:
        out_shape = tuple(d for i, d in enumerate(w.shape) if i not in axes)
        given = np.asarray(tensor_scale, np.float32)
        given = given.reshape(()) if given.size == 1 else given  # GGUF's [1] is a scalar
        ts = np.broadcast_to(given, out_shape).reshape(amax.shape)
        if not (np.isfinite(ts).all() and (ts > 0).all()):
            raise ValueError("quantize_nvfp4: tensor_scale must be positive and finite")
    ts_rows = np.broadcast_to(ts, (*w.shape[:-1], 1)).reshape(-1)
    q, s = _map_rows(
        lambda row0, wr, tr: _quantize_rows(wr.astype(np.float32), tr[:, 0]),
        [_rows(w), ts_rows[:, None]],
        [w.shape[-1] // 2, w.shape[-1] // SUB_BLOCK],
        [np.uint8, np.uint8],
        on_rows,
    )
    lead = w.shape[:-1]
    return (
        q.reshape(*lead, -1),
        s.reshape(*lead, -1).view(FLOAT8_E4M3),
        ts.reshape(tuple(d for i, d in enumerate(w.shape) if i not in axes)).astype(np.float32),
    )


def quantize_to_gguf(
    w: np.ndarray,
    tensor_amax_axes: Sequence[int] | None = (-2, -1),
    tensor_scale: np.ndarray | float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize like ``quantize_nvfp4`` and return GGUF data.

    Returns:
      raw: uint8 ``[..., N, K/64*36]`` GGUF NVFP4 blocks.
      scale: float32 ``X.scale`` companion of ``X.weight``: ``[1]`` for one tensor scale, else the
        flattened ``weight_scale_2`` (``[E]`` for an ``[E, N, K]`` stack).
    """
    q, s, ts = quantize_nvfp4(w, tensor_amax_axes, tensor_scale)
    return kernel_to_gguf(q, s), ts.reshape(-1).astype(np.float32)


def _broadcast_tensor_scale(ts: np.ndarray, ndim: int) -> np.ndarray:
    """weight_scale_2 ``[...]`` -> broadcastable to ``[..., N, K]`` of rank ``ndim``."""
    ts = np.asarray(ts, np.float32)
    if ts.size == 1:
        return ts.reshape(())
    return ts.reshape(*ts.shape, *([1] * (ndim - ts.ndim)))


def quantization_error(
    w: np.ndarray, qweight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: np.ndarray,
    on_rows: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Error statistics of a quantized tensor against the original ``w`` ``[..., N, K]``.

    ``weight_scale_2`` is ``[]``/``[1]`` or has the leading shape of ``w`` (e.g. ``[E]``).
    Returns ``{"max_abs_err": max |w - w_hat|, "rel_rms_err": rms(w - w_hat) / rms(w)}``.
    Computed over row chunks (a few MiB of temporaries, not several copies of an expert stack);
    ``on_rows(rows_done, rows_total)`` after each chunk.
    """
    w = np.asarray(w)
    k = w.shape[-1]
    ts = np.broadcast_to(_broadcast_tensor_scale(weight_scale_2, w.ndim), (*w.shape[:-1], 1))
    rows_w, rows_q, rows_s = _rows(w), _rows(np.asarray(qweight)), _rows(np.asarray(weight_scale))
    rows_t = ts.reshape(-1, 1)
    n_rows = rows_w.shape[0]
    sum_w2 = sum_e2 = max_e = 0.0
    for sl in _chunks(n_rows, k * 4):
        wr = rows_w[sl].astype(np.float32)
        w_hat = dequantize_kernel_np(rows_q[sl], rows_s[sl]) * rows_t[sl]
        err = (wr - w_hat).astype(np.float64)
        sum_w2 += float(np.sum(np.square(wr, dtype=np.float64)))
        sum_e2 += float(np.sum(np.square(err)))
        max_e = max(max_e, float(np.abs(err).max()))
        if on_rows is not None:
            on_rows(sl.stop, n_rows)
    if w.size == 0:
        return {"max_abs_err": 0.0, "rel_rms_err": 0.0}
    rms_w, rms_e = float(np.sqrt(sum_w2 / w.size)), float(np.sqrt(sum_e2 / w.size))
    return {"max_abs_err": max_e, "rel_rms_err": rms_e / rms_w if rms_w > 0 else rms_e}

