"""The MoE router GEMV for a few tokens, fp32, Pallas Triton backend.

``router_logits(x, router_w)``: ``logits[M, E] = f32(x) . f32(router_w)^T`` for M = 1..16 tokens,
the op ``moe.moe_router_logits`` gives to XLA. Why a kernel: at batch 8 XLA emits a split-K
Triton GEMM plus a reduce kernel for this 2 MB fp32 matrix, 7.1 + 1.3 us per MoE layer on the
H200 (run 51), where the bytes take 0.5 us; at batch 1 the step already folds the router into
``add_rms_norm_router``.

Kernel: grid ``(E / block_e,)``; each program streams ``block_e`` router rows over K = D in
``block_k`` steps and multiplies them with all M rows of x (padded to a power of two by
repeating the last row) on the CUDA cores in exact fp32 (``tl.dot`` would round fp32 inputs to
TF32). The products accumulate lane by lane in ``block_e`` tiles ``[Mp, block_k]``, one per router
row, each a ``[block_k]`` weight vector broadcast over the rows (FFMAs, no reduction inside the
K loop: the ``lanes`` idea of ``_common.mm_tile``), and are summed once at the end. (A first
version multiplied ``[Mp, 1, BK] * [1, block_e, BK]`` in 3-D: 9.5-10.3 us at batch 8, run 57,
where XLA's split-K GEMM + reduce take 7.0-7.6.)
The result differs from XLA's ``Precision.HIGHEST`` dot only in the fp32 summation order.

Shapes: x [M, D] (bf16 or f32), router_w [E, D] (fp32, or bf16 upcast); D a multiple of
``block_k``, E of ``block_e``. Returns f32 [M, E].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas.moe import moe_router_logits

__all__ = ["router_logits", "router_logits_reference"]

MAX_ROWS = 16


def _kernel(x_ref, w_ref, o_ref, *, m, mp, block_e, block_k, d):
  """One program: block_e router rows times all M rows of x."""
  e0 = pl.multiple_of(pl.program_id(0) * block_e, block_e)
  rows = C.row_load_index(m, mp)

  def body(i, accs):
    k0 = pl.multiple_of(i * block_k, block_k)
    x = x_ref[rows, pl.ds(k0, block_k)].astype(jnp.float32)               # [Mp, BK]
    # one router row at a time: a [BK] vector broadcast over the rows (no 3-D layouts)
    return tuple(acc + x * w_ref[e0 + e, pl.ds(k0, block_k)].astype(jnp.float32)[None, :]
                 for e, acc in enumerate(accs))

  zeros = jnp.zeros((mp, block_k), jnp.float32)
  accs = lax.fori_loop(0, d // block_k, body, (zeros,) * block_e)
  r, rmask = C.row_store_index(m, mp)
  for e, acc in enumerate(accs):
    plgpu.store(o_ref.at[r, e0 + e], jnp.sum(acc, axis=1), mask=rmask)      # [Mp]


def default_router_blocks(m: int, n_exp: int, d: int) -> tuple[int, int]:
  """(block_e, block_k): one router row per program (E programs) and an accumulator [Mp,
  block_k] of 8192 fp32 elements (64 registers per thread with 4 warps). H200, E = 256,
  D = 2048, weights warm in the L2 (run 58, ``kernels.py --groups router``): block_e = 1 takes
  1.89 / 2.40 / 3.49 us at M = 2 / 4 / 8, block_e = 2 2.32 / 3.01 / 4.67, block_e = 4 3.01 /
  4.45 / 7.94; XLA's dot 5.6."""
  mp = C.next_pow2(m)
  block_e = 1
  block_k = C.pow2_divisor(d, max(16, 8192 // (mp * block_e)))
  return block_e, block_k


@functools.partial(jax.jit, static_argnames=("block_e", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def router_logits(x, router_w, *, block_e: int | None = None, block_k: int | None = None,
                  num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
  """f32 [M, E] = f32(x) . f32(router_w)^T; see the module docstring."""
  C.check(x.ndim == 2, f"x must be [M, D], got {x.shape=}")
  m, d = x.shape
  C.check(1 <= m <= MAX_ROWS, f"router_logits handles 1..{MAX_ROWS} rows, got M={m}")
  C.check(router_w.ndim == 2 and router_w.shape[1] == d,
          f"router_w must be [E, D={d}], got {router_w.shape=}")
  C.check(jnp.issubdtype(router_w.dtype, jnp.floating),
          f"router_w must be a float array (fp32), got {router_w.dtype=}")
  n_exp = router_w.shape[0]
  dbe, dbk = default_router_blocks(m, n_exp, d)
  block_e, block_k = block_e or dbe, block_k or dbk
  C.check(C.is_pow2(block_e) and n_exp % block_e == 0,
          f"block_e must be a power of two dividing E={n_exp}, got {block_e=}")
  C.check(C.is_pow2(block_k) and d % block_k == 0,
          f"block_k must be a power of two dividing D={d}, got {block_k=}")
  mp = C.next_pow2(m)
  kernel = functools.partial(_kernel, m=m, mp=mp, block_e=block_e, block_k=block_k, d=d)
  return C.pallas_call(
      kernel, grid=(n_exp // block_e,), out_shape=jax.ShapeDtypeStruct((m, n_exp), jnp.float32),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      name=f"flint_router_m{m}_be{block_e}_bk{block_k}")(x, router_w)


def router_logits_reference(x, router_w, **unused_tuning):
  """Plain jnp: ``moe.moe_router_logits`` (one XLA dot at precision HIGHEST)."""
  del unused_tuning
  return moe_router_logits(x, router_w)

