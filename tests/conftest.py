"""Shared fixtures: CPU only, the oracle fixtures under tests/golden/."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"

# On the CPU the tests' time goes to XLA compiling interpret-mode kernels, and a third of that is
# LLVM optimising code that runs for milliseconds: compile it unoptimised (the HLO, its reduction
# orders and the float semantics do not change; XLA's CPU backend does no fast-math either way).
if ON_CPU and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()

import pathlib

import numpy as np
import pytest

GOLDEN = pathlib.Path(__file__).parent / "golden"
CONFIGS = ("tiny_a", "tiny_b", "tiny_c")


def golden(name: str):
    return np.load(GOLDEN / name / "golden.npz")


def disk_fills_after(monkeypatch, n_writes: int) -> dict:
    """Orbax's tensor writes fail with ENOSPC after the first `n_writes` (a disk filling up
    midway through a checkpoint). Returns the call counter {"n": writes attempted}."""
    from orbax.checkpoint import type_handlers
    real = type_handlers.NumpyHandler._background_serialize
    calls = {"n": 0}

    async def failing(self, values, infos, args=None):
        calls["n"] += 1
        if calls["n"] > n_writes:
            raise OSError(28, "No space left on device")
        return await real(self, values, infos, args)

    monkeypatch.setattr(type_handlers.NumpyHandler, "_background_serialize", failing)
    return calls


@pytest.fixture(scope="session")
def fp32_models():
    """flint_jax handles of the golden checkpoints in fp32 (XLA path), loaded once."""
    import flint_jax
    return {name: flint_jax.load(GOLDEN / name, dtype="float32", kernels="xla") for name in CONFIGS}


@pytest.fixture(scope="session")
def bf16_tiny_a():
    import flint_jax
    return flint_jax.load(GOLDEN / "tiny_a", kernels="xla")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drops every compiled executable after each test module. XLA's CPU JIT maps memory per
    executable, and a test worker that keeps thousands of them runs into the kernel's limit on
    memory mappings (vm.max_map_count, 65530 here): a later compile then segfaults inside XLA
    (seen in CI at ~1130 tests, in whichever test compiled next). The persistent compilation
    cache makes the recompiles of the next module cheap."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


def pytest_runtest_logreport(report):
  """With FLINT_FAILURES_LOG set (the GPU scripts), each failure is appended to that file as it
  happens, so a run cut short by a device call's time limit still names its failures. Under
  pytest-xdist the controller writes them (it gets each worker's reports, and reports a crashed
  worker's test): in the workers too, each failure was written twice."""
  path = os.environ.get("FLINT_FAILURES_LOG")
  if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
    with open(path, "a") as f:
      f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
