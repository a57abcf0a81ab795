"""Shared fixtures: CPU only, the oracle fixtures under tests/golden/."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib

import numpy as np
import pytest

GOLDEN = pathlib.Path(__file__).parent / "golden"
CONFIGS = ("tiny_a", "tiny_b", "tiny_c")


def golden(name: str):
    return np.load(GOLDEN / name / "golden.npz")


@pytest.fixture(scope="session")
def fp32_models():
    """flint_jax handles of the golden checkpoints in fp32 (XLA path), loaded once."""
    import flint_jax
    return {name: flint_jax.load(GOLDEN / name, dtype="float32", kernels="xla") for name in CONFIGS}


@pytest.fixture(scope="session")
def bf16_tiny_a():
    import flint_jax
    return flint_jax.load(GOLDEN / "tiny_a", kernels="xla")
