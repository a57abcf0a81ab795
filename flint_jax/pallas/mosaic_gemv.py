"""Small-batch bf16 GEMV on Mosaic GPU (TMA + wgmma), with optional programmatic dependent launch.

``mosaic_gemv``: fp32 split-K partials ``y[S, N, 8] = w[N, K] . x8[8, K]^T`` (row ``m`` of x8 is
token ``m``; up to 8 tokens, unused rows zero), ``w`` bf16 in the HF ``[out, in]`` orientation.
It fuses nothing; what it adds over the Triton GEMVs (``gemv.py``) is *how* it starts:

- Its weight tiles arrive by TMA into a ring of ``stages`` shared-memory slots, issued before
  anything the kernel reads from its predecessor.
- With ``pdl=True`` the kernel calls ``griddepcontrol.wait`` only after issuing those weight
  loads, and before its first load of x. The Mosaic GPU lowering then marks the kernel
  ``uses_pdl`` and XLA launches it with programmatic stream serialization: its CTAs may be
  admitted while the previous kernel is still running (once that kernel's CTAs have triggered
  ``griddepcontrol.launch_dependents``, or exited), so the weight stream starts under the
  predecessor's tail. This is the only programmatic dependent launch reachable from JAX 0.11.2:
  the Triton custom calls of ``pl.pallas_call`` are launched without it (docs/kernels.md,
  session 8). Without a PDL launch ``griddepcontrol.wait`` returns at once (a no-op).

Layout: x arrives as ``x_tiles[K / BK, 8, BK]`` (``x_tiles_from_rows`` builds it from ``[M, K]``;
a producer kernel can write it directly), so each K step's ``[8, BK]`` slice is one
``(8, 64)``-tiled, 128-byte-swizzled shared-memory tile, used transposed as the wgmma's N = 8
operand: ``acc[BN, 8] += w[BN, BK] . x[8, BK]^T`` (swap-AB: the weight rows fill the M = 64 side
of the tensor-core tile). Grid ``(N / BN, S)``; each CTA is one warpgroup.

Shapes / dtypes:
  x_tiles: [K / BK, 8, BK] bf16;  w: [N, K] bf16;  returns [S, N, 8] f32 (sum over S = y^T).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["mosaic_gemv", "mosaic_gemv_reference", "x_tiles_from_rows", "ROWS"]

ROWS = 8          # the wgmma's N: tokens per call (padded)
_TILE = (8, 64)   # bf16 tiling for the 128-byte swizzle


def x_tiles_from_rows(x, block_k: int = 64):
  """[M, K] (M <= 8) -> [K / block_k, 8, block_k] bf16, rows M..7 zero."""
  m, k = x.shape
  if m > ROWS:
    raise ValueError(f"mosaic_gemv takes at most {ROWS} rows, got x of shape {x.shape}")
  if k % block_k:
    raise ValueError(f"K={k} is not a multiple of block_k={block_k}")
  x8 = jnp.zeros((ROWS, k), jnp.bfloat16).at[:m].set(x.astype(jnp.bfloat16))
  return x8.reshape(ROWS, k // block_k, block_k).transpose(1, 0, 2)


def mosaic_gemv_reference(x_tiles, w, *, split_k: int = 1):
  """Pure-JAX reference: the same fp32 partials [S, N, 8]."""
  nk, rows, bk = x_tiles.shape
  x8 = x_tiles.transpose(1, 0, 2).reshape(rows, nk * bk).astype(jnp.float32)
  n, k = w.shape
  ks = k // split_k
  parts = [jnp.dot(w[:, s * ks:(s + 1) * ks].astype(jnp.float32), x8[:, s * ks:(s + 1) * ks].T,
                   precision=lax.Precision.HIGHEST) for s in range(split_k)]
  return jnp.stack(parts)


@functools.partial(jax.jit, static_argnames=("block_n", "split_k", "stages", "pdl", "interpret"))
def mosaic_gemv(x_tiles, w, *, block_n: int = 64, split_k: int = 1, stages: int = 4,
                pdl: bool = False, interpret: bool = False):
  """fp32 partials [split_k, N, 8] of w[N, K] . x8^T; see the module docstring."""
  nk, rows, bk = x_tiles.shape
  n, k = w.shape
  if rows != ROWS or bk != _TILE[1] or nk * bk != k:
    raise ValueError(f"x_tiles must be [K/{_TILE[1]}, {ROWS}, {_TILE[1]}] for w {w.shape}, "
                     f"got {x_tiles.shape}")
  if n % block_n or block_n % 64:
    raise ValueError(f"N={n} must be a multiple of block_n={block_n}, itself a multiple of 64")
  if nk % split_k:
    raise ValueError(f"K/{bk}={nk} steps do not split into split_k={split_k}")
  steps = nk // split_k
  stages = max(1, min(stages, steps))
  transforms = (plgpu.TilingTransform(_TILE), plgpu.SwizzleTransform(128))

  def body(x_ref, w_ref, out_ref, w_smem, x_smem, o_smem, w_bar, x_bar):
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    rows_n = pl.ds(ni * block_n, block_n)

    def fetch(step, slot):
      plgpu.copy_gmem_to_smem(w_ref.at[rows_n, pl.ds((si * steps + step) * bk, bk)],
                              w_smem.at[slot], w_bar.at[slot])

    # The weights do not depend on the previous kernel: start them before waiting for it.
    for i in range(stages):
      fetch(i, i)
    if pdl and not interpret:   # the interpreter has no grid dependencies to wait for
      plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(si * steps, steps)], x_smem, x_bar.at[0])
    plgpu.barrier_wait(x_bar.at[0])

    def k_loop(acc_ref):
      @pl.loop(0, steps)
      def _(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(w_bar.at[slot])
        plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[step].transpose((1, 0)))
        plgpu.wgmma_wait(0)

        @pl.when(step + stages < steps)
        def _():
          fetch(step + stages, slot)
      return acc_ref[...]

    acc = pl.run_scoped(k_loop, plgpu.ACC((block_n, ROWS), jnp.float32))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[si, rows_n])
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((split_k, n, ROWS), jnp.float32),
      scratch_types=[
          plgpu.SMEM((stages, block_n, bk), jnp.bfloat16, transforms=transforms),
          plgpu.SMEM((steps, ROWS, bk), jnp.bfloat16, transforms=transforms),
          plgpu.SMEM((block_n, ROWS), jnp.float32),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_barriers=1),
      ],
      grid=(n // block_n, split_k),
      grid_names=("n", "s"),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return kernel(x_tiles, w)
