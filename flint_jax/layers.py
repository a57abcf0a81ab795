"""Flint's building blocks in plain jnp: the reference math every kernel is checked against.

Rounding follows spec section 3: fp32 math for norms, RoPE, router, scores and softmax; one
rounding to the activation dtype per op output; matmuls accumulate in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`cast(w * (x * rsqrt(mean(x^2) + eps)))`, the weight multiplied in fp32 before the cast.

    x: [..., N] any float dtype; weight: [N]. Returns x.dtype.
    """
    xf = x.astype(F32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(F32) * normed).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[head_dim // 2] f32 theta^(-2i/head_dim), computed in float64 on the host and rounded
    once: a constant of every jitted step (an XLA kernel per step otherwise), and the same
    values in the XLA and the Pallas paths."""
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    return (float(theta) ** (-i / head_dim)).astype(np.float32)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of NeoX RoPE in fp32. positions: int [...]. Returns two [..., head_dim // 2] f32."""
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta))
    angles = positions.astype(F32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX ("rotate_half") RoPE over all dims: `[x1 cos - x2 sin, x2 cos + x1 sin]`.

    x: [B, T, N, Dh]; cos, sin: [B, T, Dh // 2] f32. Math in fp32, rounded once to x.dtype.
    """
    xf = x.astype(F32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(g) * u` in fp32, rounded once to the input dtype."""
    g = gate.astype(F32)
    return (g * jax.nn.sigmoid(g) * up.astype(F32)).astype(gate.dtype)


def _operands(*xs):
    # XLA:CPU has no bf16 x bf16 -> f32 dot thunk; upcasting is exact and accumulates the same.
    if jax.default_backend() == "cpu":
        return tuple(x.astype(F32) if x.dtype == jnp.bfloat16 else x for x in xs)
    return xs


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum` with fp32 accumulation and an fp32 result."""
    a, b = _operands(a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w^T` with fp32 accumulation. x: [..., K]; w: [N, K]. Returns f32 [..., N]."""
    x, w = _operands(x, w.astype(x.dtype))
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=F32)


def ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, precision=None) -> jax.Array:
    """Grouped matmul `[N, K] x [G, K, M]` -> f32 `[N, M]` (rows grouped by `sizes`).

    `precision` as `jax.lax.ragged_dot`'s (None: the default, which on a GPU rounds f32 operands
    to TF32)."""
    x, w = _operands(x, w)
    return jax.lax.ragged_dot(x, w, sizes, precision=precision, preferred_element_type=F32)


def blocked_ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, block: int = 128) -> jax.Array:
    """`ragged_dot` as batched GEMMs over row blocks: same result, real grouped-GEMM cost on CPU.

    x: [N, K] rows grouped by `sizes` ([G] int32, summing to N); w: [G, K, M]. Each group's rows are
    copied into blocks of `block` rows (the group's last block zero-padded), every block is
    multiplied by its group's weights (gathered per block), and the rows are read back: at most
    N + G * (block - 1) rows of work. XLA:CPU's `ragged_dot` computes every group for every row
    (measured 5.6 against 125 GFLOP/s useful for a dense GEMM, training the demo model at 16
    experts); this form costs `(N/block + G)` weight blocks of memory, so it suits training and
    small models, not a full-size prefill. Returns f32 [N, M].
    """
    n, kdim = x.shape
    g = w.shape[0]
    nb = -(-(n + g * (block - 1)) // block)
    x, w = _operands(x, w)
    sizes = sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = (sizes + block - 1) // block * block
    pstarts = jnp.cumsum(padded) - padded
    group = jnp.repeat(jnp.arange(g, dtype=jnp.int32), sizes, total_repeat_length=n)
    dest = pstarts[group] + jnp.arange(n, dtype=jnp.int32) - starts[group]
    xp = jnp.zeros((nb * block, kdim), x.dtype).at[dest].set(x)
    block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * block, side="right")
    wb = w[jnp.minimum(block_group, g - 1)]  # [nb, K, M]
    y = jnp.einsum("bnk,bkm->bnm", xp.reshape(nb, block, kdim), wb, preferred_element_type=F32)
    return y.reshape(nb * block, -1)[dest]


def router_topk(x: jax.Array, router_w: jax.Array, k: int, norm_topk_prob: bool = True,
                precision=jax.lax.Precision.HIGHEST):
    """Flint's router: fp32 logits, sigmoid scores, top-k (no selection bias), renormalised.

    x: [N, D]; router_w: [E, D] (fp32 in memory). Returns (scores f32 [N, E], weights f32 [N, k],
    ids int32 [N, k]). `precision`: of the fp32 logits dot (another fp32-exact algorithm may be
    given, e.g. `DotAlgorithmPreset.BF16_BF16_F32_X6` for bf16 x: its products are exact).
    """
    logits = jax.lax.dot_general(
        x.astype(F32), router_w.astype(F32), (((1,), (1,)), ((), ())),
        precision=precision, preferred_element_type=F32)
    scores = jax.nn.sigmoid(logits)
    weights, ids = jax.lax.top_k(scores, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return scores, weights, ids.astype(jnp.int32)
