"""The KV cache: full layers hold every position, sliding layers a ring of the last window.

Layout (docs/design.md): `full_k/full_v [L_full, B, KVH, S, Dh]`, `ring_k/ring_v [L_slide, B, KVH,
R, Dh]` with `R = round_up(window, 64)`, `lengths [B]`, the tokens already written per row, and
`counters [COUNTER_ENTRIES]` int32, zeros between decode steps: the device-side counters of the
Pallas decode step's kernels (each kernel that counts on an entry returns it to zero), kept here
so that no step has to zero them first (one kernel fewer). A decode kernel for KV head `g` reads
one contiguous `[S, Dh]` slab, shared by the query heads of its group: no transposes on the hot
path.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import struct

from flint_jax.config import FlintConfig, human_bytes, kv_cache_bytes


#: Entries of `KVCache.counters` (>= the programs of the largest counting kernel: the BF16 MoE
#: gate_up in K slices, 6 * 16 slots x 512 / 16 + 1024 / 16 = 3136 at its smallest tiles; the MoE
#: down kernel's combine uses entries 3584 .. 3584 + 1 + D / its block_n, ``fast_decode``; the
#: size is part of the cache's shape, kept from the retired counting kernels' days).
COUNTER_ENTRIES = 8192


class CacheTooLargeError(MemoryError):
    """The requested KV cache does not fit in the device's free memory."""


@struct.dataclass
class KVCache:
    full_k: jax.Array  # [L_full, B, KVH, S, Dh]
    full_v: jax.Array  # [L_full, B, KVH, S, Dh]
    ring_k: jax.Array  # [L_slide, B, KVH, R, Dh]
    ring_v: jax.Array  # [L_slide, B, KVH, R, Dh]
    lengths: jax.Array  # [B] int32: tokens written per row (= next position)
    counters: jax.Array  # [COUNTER_ENTRIES] int32, zeros between steps (module docstring)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_length(self) -> int:
        """Positions the full layers can hold."""
        return self.full_k.shape[3]

    @property
    def ring_size(self) -> int:
        return self.ring_k.shape[3]


def cache_shapes(cfg: FlintConfig, batch: int, length: int, dtype=jnp.bfloat16) -> KVCache:
    """Abstract shapes (jax.ShapeDtypeStruct leaves) of a cache: nothing is allocated."""
    kvh, hd = cfg.num_key_value_heads, cfg.head_dim
    full = jax.ShapeDtypeStruct((len(cfg.full_layers), batch, kvh, length, hd), dtype)
    ring = jax.ShapeDtypeStruct((len(cfg.sliding_layers), batch, kvh, cfg.ring_size, hd), dtype)
    return KVCache(full_k=full, full_v=full, ring_k=ring, ring_v=ring,
                   lengths=jax.ShapeDtypeStruct((batch,), jnp.int32),
                   counters=jax.ShapeDtypeStruct((COUNTER_ENTRIES,), jnp.int32))


def device_free_bytes(device: jax.Device | None = None) -> int | None:
    """Free memory of a device (None if unknown). On CPU: the host's available memory."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not implement it
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_cache_fits(cfg: FlintConfig, batch: int, length: int, dtype=jnp.bfloat16,
                     num_devices: int = 1) -> dict[str, int]:
    """Computes the cache's bytes and refuses, clearly, a cache that cannot fit.

    The cache is checked against the first device's free memory times the devices it is sharded
    over. Returns the byte counts (`full`, `sliding`, `total`).
    """
    sizes = kv_cache_bytes(cfg, batch, length, jnp.dtype(dtype).itemsize)
    free = device_free_bytes()
    if os.environ.get("FLINT_JAX_MAX_CACHE_BYTES"):  # lets tests and users set a budget
        free = int(os.environ["FLINT_JAX_MAX_CACHE_BYTES"])
    if free is not None and sizes["total"] > free * num_devices:
        per_token = sizes["full"] // max(1, batch * length)
        raise CacheTooLargeError(
            f"KV cache for batch {batch} x {length} tokens needs {human_bytes(sizes['total'])} "
            f"({human_bytes(sizes['full'])} for {len(cfg.full_layers)} full-attention layers at "
            f"{human_bytes(per_token)} per token per sequence, plus "
            f"{human_bytes(sizes['sliding'])} of sliding-window rings) but only "
            f"{human_bytes(free * num_devices)} is free; lower max_length / max_new_tokens or the "
            "batch size")
    return sizes


def init_cache(cfg: FlintConfig, batch: int, length: int, dtype=jnp.bfloat16,
               shardings: KVCache | None = None) -> KVCache:
    """Allocates a zeroed cache (zeros keep masked slots finite: 0 * garbage never makes NaN).

    One jitted allocator per (shapes, dtype, shardings), kept across calls: a fresh
    ``jax.jit`` per call traced and looked up its executable every time (~70-100 ms of host
    time before each Flint prefill on the H200, run prefill-2)."""
    leaves, treedef = jax.tree.flatten(cache_shapes(cfg, batch, length, dtype))
    spec = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in leaves)
    out = None if shardings is None else tuple(jax.tree.leaves(shardings))
    return jax.tree.unflatten(treedef, _zeros_fn(spec, out)())


@functools.lru_cache(maxsize=64)
def _zeros_fn(spec: tuple, out_shardings: tuple | None):
    def make():
        return tuple(jnp.zeros(shape, dtype) for shape, dtype in spec)

    return jax.jit(make) if out_shardings is None else jax.jit(make, out_shardings=out_shardings)


def with_lengths(cache: KVCache, lengths) -> KVCache:
    return dataclasses.replace(cache, lengths=jnp.asarray(lengths, jnp.int32))
