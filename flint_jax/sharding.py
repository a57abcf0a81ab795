"""Logical axes of every parameter and cache array, and their placement on a mesh.

Parameters are named by logical axes ("vocab", "embed", "q_heads", "kv_heads", "mlp",
"experts"); `ShardingRules` maps those to mesh axes. An axis whose size the mesh axis does not
divide is replicated instead (Flint has 4 KV heads: on 8 devices they are replicated).
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None: replicated)."""
    vocab: str | None = "model"
    q_heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    experts: str | None = "model"
    embed: str | None = None
    batch: str | None = None

    @classmethod
    def for_mesh(cls, mesh: Mesh) -> "ShardingRules":
        """Defaults from the mesh's axis names: tensor parallelism over "model" (or "tensor", or
        the last axis), experts over "expert" if present, batch over "data" if present."""
        names = mesh.axis_names
        tensor = "model" if "model" in names else "tensor" if "tensor" in names else names[-1]
        expert = "expert" if "expert" in names else tensor
        batch = "data" if "data" in names else None
        return cls(vocab=tensor, q_heads=tensor, kv_heads=tensor, mlp=tensor, experts=expert,
                   embed=None, batch=batch)


# (regex on the dotted parameter name, logical axes of the array)
_PARAM_AXES = [
    (r"embed_tokens\.weight$", ("vocab", "embed")),
    (r"lm_head\.(weight|qweight|weight_scale)$", ("vocab", "embed")),
    (r"self_attn\.q_proj\.(weight|qweight|weight_scale)$", ("q_heads", "embed")),
    (r"self_attn\.[kv]_proj\.(weight|qweight|weight_scale)$", ("kv_heads", "embed")),
    (r"self_attn\.o_proj\.(weight|qweight|weight_scale)$", ("embed", "q_heads")),
    (r"(mlp|shared_expert)\.(gate|up)_proj\.(weight|qweight|weight_scale)$", ("mlp", "embed")),
    (r"(mlp|shared_expert)\.down_proj\.(weight|qweight|weight_scale)$", ("embed", "mlp")),
    (r"experts\.(gate_up_proj|gate_up_qweight|gate_up_weight_scale|down_proj|down_qweight|"
     r"down_weight_scale)$", ("experts", None, None)),
    (r"experts\.(gate_up_weight_scale_2)$", ("experts", None)),
    (r"experts\.(down_weight_scale_2)$", ("experts",)),
]


def param_logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    for pattern, axes in _PARAM_AXES:
        if re.search(pattern, name):
            return axes
    return (None,) * ndim  # norms, sinks, router, tensor scales: replicated


def spec_for(shape, axes, mesh: Mesh, rules: ShardingRules) -> P:
    """PartitionSpec for `shape` with logical `axes`; non-divisible or repeated axes replicate."""
    used, spec = set(), []
    for dim, ax in zip(shape, axes):
        mesh_ax = getattr(rules, ax) if ax else None
        if mesh_ax is None or mesh_ax in used or dim % mesh.shape[mesh_ax]:
            spec.append(None)
        else:
            spec.append(mesh_ax)
            used.add(mesh_ax)
    return P(*spec)


def param_sharding(name: str, shape, mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, spec_for(shape, param_logical_axes(name, len(shape)), mesh, rules))


def cache_shardings(cache_shapes, mesh: Mesh, rules: ShardingRules):
    """KVCache of NamedShardings: [L, B, KVH, S, Dh] over (None, batch, kv_heads, None, None),
    lengths [B] over batch, the step counters replicated."""
    def one(s):
        if len(s.shape) == 1:
            return NamedSharding(mesh, spec_for(s.shape, ("batch",), mesh, rules))
        return NamedSharding(mesh, spec_for(s.shape, (None, "batch", "kv_heads", None, None),
                                            mesh, rules))
    out = jax.tree.map(one, cache_shapes)
    return dataclasses.replace(out, counters=NamedSharding(mesh, P()))
