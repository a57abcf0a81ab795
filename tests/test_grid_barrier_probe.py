"""benchmarks/grid_barrier_probe.py: both variants compute the same stages (interpret mode on the
CPU: the chain with several programs, the barrier kernel with one), a stale read would show,
and the barrier kernel lowers for an H200 with its arrival, polls and acquire in the IR."""

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import grid_barrier_probe as P  # noqa: E402
from flint_jax.pallas.testing import triton_modules  # noqa: E402

ON_GPU = jax.default_backend() not in ("cpu", "tpu")


@pytest.mark.parametrize("rounds,g", [(1, 1), (3, 4), (4, 8)])
def test_chain_stages(rounds, g):
  out = np.asarray(P.chain(rounds, g, d=64, interpret=not ON_GPU)())
  assert out.shape == (64,) and (out == rounds).all()


@pytest.mark.parametrize("rounds", [1, 2, 5])
@pytest.mark.parametrize("sync", ["atomic", "fence", "none"])
def test_barrier_kernel_stages_one_program(rounds, sync):
  out = np.asarray(P.persistent(rounds, 1, d=64, interpret=not ON_GPU, sync=sync)())
  assert out.shape == (64,) and (out == rounds).all()


def test_barrier_needs_one_program_in_interpret_mode():
  with pytest.raises(ValueError, match="G = 1"):
    P.persistent(2, 4, d=64, interpret=True)
  with pytest.raises(ValueError, match="sync must be"):
    P.persistent(2, 1, d=64, sync="spin")


def test_stage_count_must_divide():
  with pytest.raises(ValueError, match="multiple of G"):
    P.chain(2, 3, d=64)


@pytest.mark.parametrize("sync,atomics,fence", [("atomic", 2, False), ("fence", 1, True),
                                                ("none", 0, False)])
def test_barrier_kernel_lowers_for_h200(sync, atomics, fence):
  (mod,) = triton_modules(P.persistent(4, 128, d=2048, sync=sync).__wrapped__)
  ir = mod["asm"]
  assert mod["grid"][0] == 128
  assert ir.count("tt.atomic_rmw") == atomics, "arrival / acquire"
  assert ("fence.acq_rel.gpu" in ir) == fence
  if sync == "none":
    return
  assert "scf.while" in ir, "the poll loop was removed"
  assert "isVolatile = true" in ir, "the polls and the gathered loads must be volatile"


@pytest.mark.skipif(not ON_GPU, reason="the barrier with many programs needs them all resident")
@pytest.mark.parametrize("sync", ["atomic", "fence"])
def test_barrier_kernel_on_gpu(sync):
  out = np.asarray(P.persistent(16, 128, sync=sync)())
  assert (out == 16).all()
