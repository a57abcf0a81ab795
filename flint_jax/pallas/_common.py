"""Helpers shared by the Pallas (Triton backend) kernels of flint_jax.

Rules these helpers encode (measured or read in jax 0.11.2, see ``shared/NOTES_PALLAS_GPU.md``):

- Every loaded or stored block must have a power-of-two number of elements: small row counts
  (M = 1..8 tokens, G = 1..8 query heads) are padded to ``Mp = max(16, next_pow2(M))`` rows
  *inside* the kernel. Loads read the padded rows as duplicates of the last real row
  (``row_load_index``: always in bounds, no mask needed); stores write only the real rows
  (``row_store_index`` + mask). Duplicated indices must never be stored: interpret mode scatters
  them in an undefined order.
- ``dot_general`` operands share a dtype; M padded to 16 is the safe shape for ``tl.dot``.
- Multi-axis reductions fail to lower under an abstract mesh: reduce one axis at a time.
- Interpret mode cannot discharge a *store* that mixes array indices and slices: stores index
  every dimension with arrays (or scalars).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import pdl

# A large finite negative logit: masked scores never produce inf - inf = NaN
# (JAX:.../gpu/paged_attention.py DEFAULT_MASK_VALUE uses 0.7 * finfo.min the same way).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def pad_rows(m: int, method: str = "dot") -> int:
  """Rows a small-batch operand is padded to inside a kernel: >= 16 (a power of two) for the
  tensor-core methods, the next power of two for the CUDA-core ``rows``."""
  return next_pow2(m) if method == "rows" else max(16, next_pow2(m))


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two <= cap that divides n (1 if n is odd)."""
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def split_block_k(block_k: int, k: int, split_k: int, fmt: str, min_steps: int = 1) -> int:
  """A default K step for ``split_k`` slices of K: halved (down to the format's smallest step,
  64 for NVFP4, 16 for bf16) until the slices divide K into at least ``min_steps`` steps each."""
  floor = 16 if fmt == "bf16" else 64
  while block_k > floor and (k % (block_k * split_k) or k // (block_k * split_k) < min_steps):
    block_k //= 2
  return block_k


def row_load_index(m: int, mp: int, offset=0):
  """[mp] int32 row indices offset + min(i, m - 1): padded rows repeat the last real row."""
  return offset + jnp.minimum(jnp.arange(mp, dtype=jnp.int32), m - 1)


def row_store_index(m: int, mp: int, offset=0):
  """([mp] row indices, [mp] bool mask of the m real rows) for a masked store."""
  i = jnp.arange(mp, dtype=jnp.int32)
  return offset + i, i < m


def dot_nt(a, b):
  """a [M, K] @ b[N, K]^T with fp32 accumulation (b in HF [out, in] orientation)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def dot_nn(a, b):
  """a [M, K] @ b [K, N] with fp32 accumulation."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


#: Tile methods of the small-batch GEMV kernels (``mm_tile``; ``blocks``: NVFP4 only).
METHODS = ("dot", "swap", "rows", "blocks")
# ``blocks`` (M = 1, the NVFP4 tile layout, ``nvfp4_gemv.nvfp4_tile_dot``): the decoded weights
# times the one row of x on the CUDA cores, each 16-value block's products summed in the thread,
# so the accumulator is [BN, nb, 2] (one value per block) and one cross-warp reduction follows
# the K loop (``finish_acc``). A finished ``blocks`` accumulator is one row [BN] (layout "row").


def check_method(method: str, m: int, allowed=METHODS):
  check(method in allowed, f"method must be one of {allowed}, got {method=}")
  check(method != "blocks" or m == 1, f"method={method!r} needs M == 1, got {m=}")


def mm_tile(x, w, method: str):
  """One K step of a small-batch GEMV tile, fp32.

  x [Mp, BK] (padded rows), w [BN, BK] same dtype. ``dot``: x . w^T -> [Mp, BN] on the tensor
  cores (M = 16: mma.sync). ``swap``: w . x^T -> [BN, Mp] (swap-AB: the weight rows are the
  MMA's M dimension, wgmma-eligible when BN >= 64). ``rows`` (any M, rows padded to a power of
  two only): broadcast multiply and row sums on the CUDA cores for every row at once, x [Mp, BK]
  -> [Mp, BN].
  """
  if method == "dot":
    return dot_nt(x, w)
  if method == "swap":
    return dot_nt(w, x)
  check(method == "rows", f"mm_tile: method must be dot, swap or rows, got {method=}")
  return jnp.sum(w.astype(jnp.float32)[None] * x.astype(jnp.float32)[:, None], axis=2)


def load_x(x_ref, lead, m, mp, cols):
  """x tile for mm_tile: rows 0..m-1 padded to mp (duplicates of the last)."""
  return x_ref[(*lead, row_load_index(m, mp), cols)]


def acc_shape(mp: int, bn: int, method: str, lanes: tuple = ()):
  """Accumulator shape of a K loop; ``lanes`` (``blocks`` only): the per-row product shape of
  one K step, ``nvfp4_gemv.lanes_shape`` ([nb, 2, 16]: the accumulator keeps [BN, nb, 2])."""
  if method == "blocks":
    return (bn, *lanes[:-1])
  return {"dot": (mp, bn), "rows": (mp, bn), "swap": (bn, mp), "row": (bn,)}[method]


def acc_zeros(mp: int, bn: int, method: str, lanes: tuple = ()):
  return jnp.zeros(acc_shape(mp, bn, method, lanes), jnp.float32)


def finish_method(method: str) -> str:
  """The layout of a finished accumulator (``blocks`` -> "row", one row [BN])."""
  return "row" if method == "blocks" else method


def finish_acc(acc, method: str):
  """The K loop's accumulator in ``store_tile`` layout: ``blocks`` sums its block axes (one
  axis at a time, the innermost first), the other methods are already reduced."""
  if method != "blocks":
    return acc
  while acc.ndim > 1:
    acc = jnp.sum(acc, axis=acc.ndim - 1)
  return acc


def _tile_rows_cols(n0, bn, m, mp, row0=0):
  r, rmask = row_store_index(m, mp, row0)
  return r, rmask, n0 + jnp.arange(bn, dtype=jnp.int32)


def _tile_index(lead, r, cols, method, row0):
  """Index of rows r / columns cols in the ``acc_shape`` layout of ``method``."""
  if method in ("dot", "rows"):
    return (*lead, r[:, None], cols[None, :])
  if method == "swap":
    return (*lead, r[None, :], cols[:, None])
  return (*lead, row0, cols)


def _tile_mask(rmask, method):
  """The row mask in the layout of ``_tile_index`` (None: the one-row methods)."""
  if method in ("dot", "rows"):
    return rmask[:, None]
  return rmask[None, :] if method == "swap" else None


def store_tile(o_ref, lead, acc, n0, bn, m, mp, method, row0=0):
  """Stores the real rows of an accumulator in ``acc_shape`` layout at
  o_ref[*lead, row0:row0+m, n0:n0+bn] (row0 may be traced); ``blocks`` accumulators must have
  been through ``finish_acc``."""
  r, rmask, cols = _tile_rows_cols(n0, bn, m, mp, row0)
  acc = acc.astype(o_ref.dtype)
  dst = o_ref.at[_tile_index(lead, r, cols, method, row0)]
  plgpu.store(dst, acc, mask=_tile_mask(rmask, method))


def load_tile(ref, lead, n0, bn, m, mp, method):
  """The tile ``store_tile`` stored (padded rows 0), volatile: for tiles other programs wrote."""
  r, rmask, cols = _tile_rows_cols(n0, bn, m, mp)
  idx, mask = _tile_index(lead, r, cols, method, 0), _tile_mask(rmask, method)
  if mask is None:   # the one-row methods: no padded rows
    return plgpu.load(ref.at[idx], volatile=True)
  return plgpu.load(ref.at[idx], mask=mask, other=0.0, volatile=True)


def scalar_f32(v):
  """A tensor scale as an f32 [1] kernel input (a free reshape of an f32 scalar: no XLA op, unlike
  stacking several scales into one array)."""
  return jnp.asarray(v, jnp.float32).reshape(1)


def silu_mul_f32(g, u, act_dtype=jnp.bfloat16):
  """silu(g) * u in fp32 from the fp32 products g, u, each first rounded to ``act_dtype``: the
  reference model (and HF's) takes gate and up as the bf16 outputs of their projections, so the
  kernels round there too rather than at a point the reference does not have."""
  g = g.astype(act_dtype).astype(jnp.float32)
  u = u.astype(act_dtype).astype(jnp.float32)
  return g / (1.0 + jnp.exp(-g)) * u


def pallas_call(kernel, *, early_trigger: bool, **kw):
  """``pl.pallas_call`` for every flint_jax Triton kernel. ``early_trigger`` (every kernel
  wrapper's static argument of that name): the kernel first lets the next kernel launch
  (``pdl.with_early_trigger``; the ``pdl`` module docstring)."""
  return pl.pallas_call(pdl.with_early_trigger(kernel) if early_trigger else kernel, **kw)


def compiler_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check(cond: bool, msg: str):
  if not cond:
    raise ValueError(msg)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def as_index_array(x, name: str) -> jax.Array:
  """A scalar (Python int or 0-d / 1-element array) as an int32 [1] array input."""
  x = jnp.asarray(x, jnp.int32).reshape(-1)
  check(x.shape == (1,), f"{name} must be a scalar, got shape {x.shape}")
  return x


__all__ = [
    "METHODS", "check_method", "mm_tile", "load_x",
    "acc_shape", "acc_zeros", "finish_method", "finish_acc", "store_tile",
    "MASK_VALUE", "next_pow2", "pad_rows", "is_pow2", "pow2_divisor", "row_load_index",
    "row_store_index", "load_tile", "dot_nt", "dot_nn", "scalar_f32",
    "silu_mul_f32", "compiler_params", "pallas_call", "check", "cdiv",
    "as_index_array",
]
