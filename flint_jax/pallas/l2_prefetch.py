"""L2 prefetch lanes: extra programs of a latency-bound kernel that pull the *next* kernel's
weights into the GPU's L2 cache.

Why: at decode, about a third of every layer is spent in small latency-bound kernels (attention
at short context, the merge, residual add + RMSNorm, the MoE combine) during which HBM sits
almost idle, while the weight-streaming GEMVs right after them run at 2-2.5 TB/s of the 4.3 the
H200 copies at. vLLM hides this with programmatic dependent launch (each GEMV issues its weight
loads before waiting on the previous kernel); XLA launches kernels in sequence, so here the
latency-bound kernel itself does it: its grid grows by a few rows of *prefetch programs* that
load the next GEMV's weights once (``evict_last``) and fold them into one float each, stored to a
small sink output so the loads cannot be dropped. The H200's L2 holds 50 MB; the o_proj
(16.8 MB BF16) or a q|k|v (21 MB) fits, so the GEMV that follows reads them from L2.

What the lanes do not change: the host kernel's outputs (its programs are the same; a prefetch
program touches nothing but the sink). What it costs: the host kernel ends when its slowest
program ends, so it only pays when the host kernel runs longer than the prefetch.

- ``prefetch_views(arrays)``: the 2-D views (free reshapes) a kernel receives.
- ``prefetch_part(refs, part, n_parts)``: in-kernel; program ``part`` of ``n_parts`` loads its
  share of every view (whole row tiles of ~``TILE_BYTES``, round-robin) -> f32 scalar sink.
- ``with_prefetch(kernel, ...)``: wraps a ``pallas_call`` kernel so that programs whose
  ``program_id(0) >= grid[0]`` run ``prefetch_part`` instead (grid dim 0 grows by a few rows).
- ``l2_prefetch(arrays)``: the lanes alone as one kernel (benchmarks, tests), returning the
  sinks; ``l2_prefetch_reference`` computes the same sinks in plain jnp.

Shapes: any arrays; each is viewed as ``[prod(shape[:-1]), shape[-1]]``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax._src.pallas import core as pallas_core  # GridEnv: program ids inside a branch (jax pinned)

from flint_jax.pallas import _common as C

__all__ = ["prefetch_views", "prefetch_part", "with_prefetch", "prefetch_call", "l2_prefetch",
           "l2_prefetch_reference", "extra_rows", "TILE_BYTES", "DEFAULT_PROGRAMS"]

#: Bytes one prefetch program loads per step (4 warps: 256 B in flight per thread).
TILE_BYTES = 32 * 1024
#: Prefetch programs per host kernel: two per H200 SM.
DEFAULT_PROGRAMS = 264


class _View(NamedTuple):
  rows: int
  cols: int
  tile_rows: int      # power of two


def prefetch_views(arrays: Sequence[jax.Array]) -> list[jax.Array]:
  """Each array as [rows, last dim] (a free reshape of a contiguous array)."""
  out = []
  for a in arrays:
    C.check(a.ndim >= 1 and a.size > 0, f"cannot prefetch an empty array: {a.shape=}")
    out.append(a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a)
  return out


def _view(ref_shape, dtype) -> _View:
  rows, cols = ref_shape[-2], ref_shape[-1]
  row_bytes = C.next_pow2(cols) * jnp.dtype(dtype).itemsize
  tile_rows = max(1, min(C.next_pow2(rows), TILE_BYTES // row_bytes))
  return _View(rows, cols, 1 << (tile_rows.bit_length() - 1))


def _tiles(v: _View) -> int:
  return -(-v.rows // v.tile_rows)


def prefetch_part(refs, part, n_parts: int, lead=()):
  """In-kernel: load program ``part``'s share (tiles part, part + n_parts, ...) of every ref
  (2-D, or ``ref[*lead]`` is) with ``evict_last`` and return the f32 sum of what it loaded (the
  sink that keeps the loads)."""
  total = jnp.zeros((), jnp.float32)
  for ref in refs:
    v = _view(ref.shape, ref.dtype)
    cp = C.next_pow2(v.cols)
    cols = jnp.arange(cp, dtype=jnp.int32)
    steps = -(-_tiles(v) // n_parts)

    def body(it, acc, ref=ref, v=v, cols=cols):
      t = part + it * n_parts
      rows = t * v.tile_rows + jnp.arange(v.tile_rows, dtype=jnp.int32)
      mask = (rows < v.rows)[:, None] & (cols < v.cols)[None, :]
      tile = plgpu.load(ref.at[(*lead, jnp.minimum(rows, v.rows - 1)[:, None], cols[None, :])],
                        mask=mask, eviction_policy="evict_last")
      tile = jnp.where(mask, tile.astype(jnp.float32), 0.0)   # no `other`: fp8 has no cast
      return acc + jnp.sum(jnp.sum(tile, axis=1), axis=0)

    total = lax.fori_loop(0, steps, body, total)
  return total


def extra_rows(inner_programs: int, n_programs: int = DEFAULT_PROGRAMS) -> int:
  """Rows to add to grid dim 0 (each row holds ``inner_programs`` programs) for about
  ``n_programs`` prefetch programs."""
  return max(1, -(-n_programs // max(1, inner_programs)))


def with_prefetch(kernel, *, grid: tuple[int, ...], n_in: int, n_prefetch: int, rows: int):
  """Wrap ``kernel(*in_refs, *out_refs)`` for a call whose inputs gain ``n_prefetch`` 2-D
  prefetch arrays (appended after the ``n_in`` original inputs) and whose outputs gain a f32
  sink ``[rows * prod(grid[1:])]`` (appended last), with grid ``(grid[0] + rows, *grid[1:])``.
  Input / output alias indices of the original call stay valid."""
  inner = math.prod(grid[1:])
  n_parts = rows * inner

  def wrapped(*refs):
    ins, pf = refs[:n_in], refs[n_in:n_in + n_prefetch]
    outs, sink = refs[n_in + n_prefetch:-1], refs[-1]
    pids = [pl.program_id(ax) for ax in range(len(grid))]
    pid0 = pids[0]

    @pl.when(pid0 < grid[0])
    def _():
      # The host kernel reads its program ids inside this branch: serve the ones read above
      # (interpret mode cannot evaluate program_id inside a cond), with the host's grid sizes.
      env = [pallas_core.GridAxis(p, n) for p, n in zip(pids, grid)]
      with pallas_core.grid_env(env):
        kernel(*ins, *outs)

    @pl.when(pid0 >= grid[0])
    def _():
      part = pid0 - grid[0]
      for ax in range(1, len(grid)):
        part = part * grid[ax] + pids[ax]
      sink[part] = prefetch_part(pf, part, n_parts)

  return wrapped, (grid[0] + rows, *grid[1:]), jax.ShapeDtypeStruct((n_parts,), jnp.float32)


@functools.partial(jax.jit, static_argnames=("num_programs", "num_warps", "interpret"))
def l2_prefetch(arrays, *, num_programs: int = DEFAULT_PROGRAMS, num_warps: int = 4,
                interpret: bool = False):
  """The prefetch lanes alone: ``num_programs`` programs load every array once -> f32 sinks
  ``[num_programs]`` (program p's sum of the row tiles it loaded; see ``prefetch_part``)."""
  views = prefetch_views(list(arrays))
  n = len(views)

  def kernel(*refs):
    refs[n][pl.program_id(0)] = prefetch_part(refs[:n], pl.program_id(0), num_programs)

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((num_programs,), jnp.float32),
      grid=(num_programs,), compiler_params=C.compiler_params(num_warps, 1),
      interpret=interpret, name=f"flint_l2_prefetch_p{num_programs}",
  )(*views)


def l2_prefetch_reference(arrays, *, num_programs: int = DEFAULT_PROGRAMS, **unused_tuning):
  """Plain jnp: the sinks ``l2_prefetch`` returns (same tile partition, any summation order)."""
  del unused_tuning
  sinks = jnp.zeros((num_programs,), jnp.float32)
  for a in prefetch_views(list(arrays)):
    v = _view(a.shape, a.dtype)
    t = _tiles(v)
    pad = t * v.tile_rows - v.rows
    x = jnp.pad(a.astype(jnp.float32), ((0, pad), (0, 0)))
    per_tile = x.reshape(t, v.tile_rows * v.cols).sum(axis=1)
    sinks = sinks.at[jnp.arange(t) % num_programs].add(per_tile)
  return sinks


def prefetch_call(kernel, *, grid, out_shape, args, prefetch=(),
                  prefetch_programs: int = DEFAULT_PROGRAMS, name: str, **call_kw):
  """``pl.pallas_call(kernel, grid=grid, out_shape=out_shape, name=name, **call_kw)(*args)``,
  with prefetch lanes for the ``prefetch`` arrays when there are any (``with_prefetch``; the
  name gains ``_l2pf``). Returns the call's own outputs (the sink is dropped)."""
  if not prefetch:
    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, name=name, **call_kw)(*args)
  views = prefetch_views(list(prefetch))
  rows = extra_rows(math.prod(grid[1:]), prefetch_programs)
  wrapped, grid2, sink = with_prefetch(kernel, grid=tuple(grid), n_in=len(args),
                                       n_prefetch=len(views), rows=rows)
  single = not isinstance(out_shape, (tuple, list))
  shapes = ((out_shape,) if single else tuple(out_shape)) + (sink,)
  outs = pl.pallas_call(wrapped, grid=grid2, out_shape=shapes, name=name + "_l2pf",
                        **call_kw)(*args, *views)
  return outs[0] if single else tuple(outs[:-1])
