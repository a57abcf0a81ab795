"""Flint as a Flax NNX module tree (pure-JAX path), parameter paths following the HF names.

`FlintForCausalLM(cfg, rngs=...)` builds `model.embed_tokens`, `model.layers[i]` (`self_attn`,
`mlp` = dense `FlintMLP` or `FlintMoE` with `gate`, `experts`, `shared_expert`), `model.norm`
and `lm_head`. Modules hold weights only: the KV cache goes in and comes out of `__call__`.

One call processes a chunk of `T` tokens per row against the cache (prefill chunks and single-token
decode steps are the same code), so no `[T, T]` score matrix of a whole prompt is ever built.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flint_jax import layers
from flint_jax.cache import KVCache
from flint_jax.config import FlintConfig

F32 = jnp.float32

# What `capture=` may ask for (the research API).
CAPTURABLE = ("hidden_states", "router_scores", "router_ids", "router_weights", "sink_mass")


def _init_normal(rngs: nnx.Rngs, shape, dtype, std):
    return (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)


def _init_norm(rngs: nnx.Rngs, shape, dtype):
    # Around 1 with some spread: random checkpoints exercise the norm weights (never all ones).
    return (1.0 + 0.1 * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)


def _init_nvfp4(rngs: nnx.Rngs, lead: tuple[int, ...], n: int, k: int, std: float):
    """Random NVFP4 leaves with realistic ranges: random codes, block scales in [64, 448]."""
    if k % 64:
        raise ValueError(f"NVFP4 needs an input dim that is a multiple of 64, got {k}")
    q = jax.random.randint(rngs.params(), (*lead, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.uniform(rngs.params(), (*lead, n, k // 16), F32, 64.0, 448.0)
    s = s.astype(jnp.float8_e4m3fn)
    # E2M1 codes drawn uniformly have an RMS of ~2.93; scale so the weights' std is `std`.
    ts = jnp.full(lead, std / (2.93 * 256.0), F32)
    return q, s, ts


class Param(nnx.Param):
    pass


class Linear(nnx.Module):
    """`y = x W^T`, W `[out, in]` (HF orientation), bf16 or NVFP4 (`qweight`, `weight_scale`,
    `weight_scale_2`: docs/design.md). Accumulates in fp32; returns `out_dtype` (x.dtype default).
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, quant: bool,
                 rngs: nnx.Rngs, std: float = 0.02):
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        if quant:
            q, s, ts = _init_nvfp4(rngs, (), out_features, in_features, std)
            self.qweight, self.weight_scale, self.weight_scale_2 = nnx.Param(q), nnx.Param(s), nnx.Param(ts)
        else:
            self.weight = nnx.Param(_init_normal(rngs, (out_features, in_features), dtype, std))

    def dense_weight(self, dtype) -> jax.Array:
        """The weight as a dense `[out, in]` array of `dtype` (NVFP4: exact block decode)."""
        if self.quant:
            from flint_jax import nvfp4
            return nvfp4.dequantize(self.qweight[...], self.weight_scale[...], dtype)
        return self.weight[...]

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        out_dtype = out_dtype or x.dtype
        y = layers.matmul_t(x, self.dense_weight(x.dtype))
        if self.quant:
            y = y * self.weight_scale_2[...]
        return y.astype(out_dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(_init_norm(rngs, (dim,), dtype))

    def __call__(self, x):
        return layers.rms_norm(x, self.weight[...], self.eps)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init_normal(rngs, (vocab, dim), dtype, 1.0))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


@dataclasses.dataclass
class ChunkInfo:
    """Where a chunk's tokens go. positions/valid: [B, T]; lengths_before/after: [B]."""
    positions: jax.Array
    valid: jax.Array
    lengths_before: jax.Array
    lengths_after: jax.Array


class FlintAttention(nnx.Module):
    def __init__(self, cfg: FlintConfig, layer: int, *, dtype, quant: bool, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        h, kvh, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.sliding = cfg.is_sliding(layer)
        self.q_proj = Linear(d, h * hd, dtype=dtype, quant=quant, rngs=rngs)
        self.k_proj = Linear(d, kvh * hd, dtype=dtype, quant=quant, rngs=rngs)
        self.v_proj = Linear(d, kvh * hd, dtype=dtype, quant=quant, rngs=rngs)
        self.o_proj = Linear(h * hd, d, dtype=dtype, quant=quant, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.sinks = nnx.Param(jax.random.normal(rngs.params(), (h,), F32))

    def qkv(self, x: jax.Array, positions: jax.Array):
        """q [B,T,H,Dh], k, v [B,T,KVH,Dh]: projections, QK-norm, then RoPE on sliding layers."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.sliding:
            cos, sin = layers.rope_angles(positions, cfg.head_dim, cfg.rope_theta)
            q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
        return q, k, v

    def __call__(self, x, info: ChunkInfo, cache_k, cache_v, captures=None):
        """x: [B, T, D]; cache_k/v: this layer's [B, KVH, S or R, Dh]. Returns (out, k, v)."""
        cfg = self.cfg
        q, k, v = self.qkv(x, info.positions)
        if self.sliding:
            keys, values, key_pos, key_ok = _ring_keys(cache_k, cache_v, k, v, info)
            cache_k, cache_v = _ring_write(cache_k, cache_v, k, v, info)
            window = cfg.sliding_window
        else:
            cache_k, cache_v = _full_write(cache_k, cache_v, k, v, info)
            keys, values = cache_k, cache_v
            s = cache_k.shape[2]
            key_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (x.shape[0], s))
            key_ok = key_pos < info.lengths_after[:, None]
            window = None
        o, sink_mass = attention_reference(q, keys, values, key_pos, key_ok, info.positions,
                                           self.sinks[...], window)
        if captures is not None and "sink_mass" in captures:
            captures["sink_mass"].append(sink_mass)
        b, t = x.shape[:2]
        return self.o_proj(o.reshape(b, t, -1)), cache_k, cache_v


def attention_reference(q, k, v, key_pos, key_ok, q_pos, sinks, window):
    """Attention with a learned sink logit per head (spec section 3), in fp32.

    q: [B, T, H, Dh]; k, v: [B, KVH, S, Dh]; key_pos, key_ok: [B, S]; q_pos: [B, T];
    sinks: [H] f32; window: keys `p - window + 1 .. p` (None: causal only).
    Returns (o [B, T, H, Dh] in v.dtype, sink_mass [B, T, H] f32: the probability the sink takes).
    """
    b, t, h, hd = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg.astype(F32), k.astype(F32),
                        precision=jax.lax.Precision.HIGHEST) * (hd ** -0.5)
    mask = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    if window is not None:
        mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    sink = sinks.astype(F32).reshape(1, kvh, g, 1)
    m = jnp.maximum(jnp.max(scores, axis=-1), sink)  # the sink keeps every row finite
    p = jnp.exp(scores - m[..., None])
    sink_p = jnp.exp(sink - m)
    denom = jnp.sum(p, axis=-1) + sink_p
    probs = (p / denom[..., None]).astype(v.dtype)
    o = layers.einsum("bkgts,bksd->btkgd", probs, v)
    sink_mass = (sink_p / denom).transpose(0, 3, 1, 2).reshape(b, t, h)
    return o.reshape(b, t, h, hd).astype(v.dtype), sink_mass


def _scatter_rows(cache, new, slots):
    """cache [B, KVH, S, Dh]; new [B, T, KVH, Dh]; slots [B, T] (out of range: dropped)."""
    b, t, kvh, _ = new.shape
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(kvh)[None, None, :]
    return cache.at[bi, hi, slots[:, :, None]].set(new.astype(cache.dtype), mode="drop")


def _full_write(cache_k, cache_v, k, v, info: ChunkInfo):
    s = cache_k.shape[2]
    slots = jnp.where(info.valid, info.positions, s)
    return _scatter_rows(cache_k, k, slots), _scatter_rows(cache_v, v, slots)


def _ring_write(cache_k, cache_v, k, v, info: ChunkInfo):
    # Only the last R valid tokens survive; they map to distinct slots.
    r = cache_k.shape[2]
    keep = info.valid & (info.positions >= info.lengths_after[:, None] - r)
    slots = jnp.where(keep, info.positions % r, r)
    return _scatter_rows(cache_k, k, slots), _scatter_rows(cache_v, v, slots)


def ring_positions(lengths: jax.Array, r: int) -> jax.Array:
    """Position held by each ring slot after `lengths` tokens: [B, R] (negative: empty)."""
    last = lengths[:, None] - 1
    s = jnp.arange(r, dtype=jnp.int32)[None, :]
    return last - jnp.mod(last - s, r)


def _ring_keys(cache_k, cache_v, k, v, info: ChunkInfo):
    """Keys a chunk attends on a sliding layer: the ring before the chunk, then the chunk."""
    r = cache_k.shape[2]
    old_pos = ring_positions(info.lengths_before, r)
    keys = jnp.concatenate([cache_k, k.transpose(0, 2, 1, 3).astype(cache_k.dtype)], axis=2)
    values = jnp.concatenate([cache_v, v.transpose(0, 2, 1, 3).astype(cache_v.dtype)], axis=2)
    key_pos = jnp.concatenate([old_pos, info.positions], axis=1)
    key_ok = jnp.concatenate([old_pos >= 0, info.valid], axis=1)
    return keys, values, key_pos, key_ok


class FlintMLP(nnx.Module):
    """SwiGLU `down(silu(gate x) * up x)`: the dense MLP and the shared expert."""

    def __init__(self, d: int, inter: int, *, dtype, quant: bool, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, inter, dtype=dtype, quant=quant, rngs=rngs)
        self.up_proj = Linear(d, inter, dtype=dtype, quant=quant, rngs=rngs)
        self.down_proj = Linear(inter, d, dtype=dtype, quant=quant, rngs=rngs)

    def __call__(self, x, out_dtype=None):
        return self.down_proj(layers.silu_mul(self.gate_proj(x), self.up_proj(x)), out_dtype)


class Router(nnx.Module):
    def __init__(self, e: int, d: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init_normal(rngs, (e, d), F32, 0.5 / np.sqrt(d)))


class FlintExperts(nnx.Module):
    """Stacked routed experts: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`.

    NVFP4: `gate_up_qweight [E, 2I, D/2]`, `gate_up_weight_scale [E, 2I, D/16]`,
    `gate_up_weight_scale_2 [E, 2]` (gate, up), `down_qweight [E, D, I/2]`,
    `down_weight_scale [E, D, I/16]`, `down_weight_scale_2 [E]`.
    """

    def __init__(self, cfg: FlintConfig, *, dtype, quant: bool, rngs: nnx.Rngs):
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.quant, self.inter = quant, i
        if quant:
            q, s, ts = _init_nvfp4(rngs, (e,), 2 * i, d, 0.02)
            self.gate_up_qweight, self.gate_up_weight_scale = nnx.Param(q), nnx.Param(s)
            self.gate_up_weight_scale_2 = nnx.Param(jnp.stack([ts, ts], axis=-1))
            q, s, ts = _init_nvfp4(rngs, (e,), d, i, 0.02)
            self.down_qweight, self.down_weight_scale = nnx.Param(q), nnx.Param(s)
            self.down_weight_scale_2 = nnx.Param(ts)
        else:
            self.gate_up_proj = nnx.Param(_init_normal(rngs, (e, 2 * i, d), dtype, 0.02))
            self.down_proj = nnx.Param(_init_normal(rngs, (e, d, i), dtype, 0.02))

    def selected(self, ids: jax.Array, dtype):
        """Dense weights of the experts `ids` (any int shape S): gate_up [*S, 2I, D] and down
        [*S, D, I] in `dtype`, with their fp32 tensor scales ([*S, 2] and [*S], ones for bf16)."""
        if not self.quant:
            gu, dn = self.gate_up_proj[...][ids], self.down_proj[...][ids]
            one = jnp.ones(ids.shape, F32)
            return gu, dn, jnp.stack([one, one], -1), one
        from flint_jax import nvfp4
        gu = nvfp4.dequantize(self.gate_up_qweight[...][ids], self.gate_up_weight_scale[...][ids], dtype)
        dn = nvfp4.dequantize(self.down_qweight[...][ids], self.down_weight_scale[...][ids], dtype)
        return gu, dn, self.gate_up_weight_scale_2[...][ids], self.down_weight_scale_2[...][ids]


class FlintMoE(nnx.Module):
    def __init__(self, cfg: FlintConfig, *, dtype, quant: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Router(cfg.num_experts, cfg.hidden_size, rngs=rngs)
        self.experts = FlintExperts(cfg, dtype=dtype, quant=quant, rngs=rngs)
        self.shared_expert = FlintMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                      dtype=dtype, quant=quant, rngs=rngs)
        # The grouped matmul of many tokens: "ragged" (`jax.lax.ragged_dot`) or "blocked"
        # (`layers.blocked_ragged_dot`, batched GEMMs: training on a CPU); see `use_blocked_experts`.
        self.grouped_matmul = "ragged"

    def __call__(self, x, captures=None):
        """x: [B, T, D] -> [B, T, D]. `out = sum_k w_k y_k + shared(x)` combined in fp32."""
        cfg = self.cfg
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        scores, weights, ids = layers.router_topk(xf, self.gate.weight[...],
                                                  cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if captures is not None:
            if "router_scores" in captures:
                captures["router_scores"].append(scores.reshape(b, t, -1))
            if "router_ids" in captures:
                captures["router_ids"].append(ids.reshape(b, t, -1))
            if "router_weights" in captures:
                captures["router_weights"].append(weights.reshape(b, t, -1))
        if xf.shape[0] * cfg.num_experts_per_tok <= 4 * cfg.num_experts:
            y = self._experts_gathered(xf, weights, ids)
        else:
            y = self._experts_ragged(xf, weights, ids)
        y = y + self.shared_expert(xf).astype(F32)
        return y.astype(x.dtype).reshape(b, t, d)

    def _experts_gathered(self, x, weights, ids):
        """Few tokens (decode): gather the selected experts' weights only. Returns f32 [N, D]."""
        inter = self.cfg.moe_intermediate_size
        gu, dn, gu_scale, dn_scale = self.experts.selected(ids, x.dtype)  # [N,k,2I,D], [N,k,D,I]
        h = layers.einsum("nd,nkfd->nkf", x, gu)
        gate = (h[..., :inter] * gu_scale[..., :1]).astype(x.dtype)
        up = (h[..., inter:] * gu_scale[..., 1:]).astype(x.dtype)
        act = layers.silu_mul(gate, up)
        y = layers.einsum("nkf,nkdf->nkd", act, dn)
        y = (y * dn_scale[..., None]).astype(x.dtype)  # each expert's output rounded once
        return jnp.einsum("nkd,nk->nd", y.astype(F32), weights)

    def _experts_ragged(self, x, weights, ids):
        """Many tokens (prefill): sort token-expert pairs by expert, grouped matmuls."""
        cfg = self.cfg
        n, k = ids.shape
        inter = cfg.moe_intermediate_size
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tok = order // k
        xs = x[tok]  # [N*k, D]
        sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
        all_ids = jnp.arange(cfg.num_experts)
        gu, dn, gu_scale, dn_scale = self.experts.selected(all_ids, x.dtype)
        grouped = layers.blocked_ragged_dot if self.grouped_matmul == "blocked" else layers.ragged_dot
        h = grouped(xs, gu.transpose(0, 2, 1), sizes)
        e_sorted = flat[order]
        s = gu_scale[e_sorted]  # [N*k, 2]
        gate = (h[:, :inter] * s[:, :1]).astype(x.dtype)
        up = (h[:, inter:] * s[:, 1:]).astype(x.dtype)
        act = layers.silu_mul(gate, up)
        y = grouped(act, dn.transpose(0, 2, 1), sizes)
        y = (y * dn_scale[e_sorted][:, None]).astype(x.dtype).astype(F32)
        w = weights.reshape(-1)[order]
        return jnp.zeros((n, x.shape[1]), F32).at[tok].add(y * w[:, None])


def use_blocked_experts(model: "FlintForCausalLM", blocked: bool = True) -> None:
    """Makes every MoE layer of `model` run its many-token experts as `layers.blocked_ragged_dot`
    (same values as `ragged_dot` up to summation order; much faster on a CPU, memory grows with
    the weight blocks gathered). Set before `nnx.split` / jit."""
    for layer in model.model.layers:
        if layer.moe:
            layer.mlp.grouped_matmul = "blocked" if blocked else "ragged"


class FlintDecoderLayer(nnx.Module):
    def __init__(self, cfg: FlintConfig, layer: int, *, dtype, quant: bool, rngs: nnx.Rngs):
        self.layer, self.moe = layer, cfg.is_moe(layer)
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = FlintAttention(cfg, layer, dtype=dtype, quant=quant, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        if self.moe:
            self.mlp = FlintMoE(cfg, dtype=dtype, quant=quant, rngs=rngs)
        else:
            self.mlp = FlintMLP(d, cfg.intermediate_size, dtype=dtype, quant=quant, rngs=rngs)

    def __call__(self, h, info, cache_k, cache_v, captures=None):
        a, cache_k, cache_v = self.self_attn(self.input_layernorm(h), info, cache_k, cache_v,
                                             captures)
        h = h + a
        x = self.post_attention_layernorm(h)
        h = h + (self.mlp(x, captures) if self.moe else self.mlp(x))
        return h, cache_k, cache_v


class FlintModel(nnx.Module):
    def __init__(self, cfg: FlintConfig, *, dtype, quant: bool, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([FlintDecoderLayer(cfg, i, dtype=dtype, quant=quant, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)


class FlintForCausalLM(nnx.Module):
    """Flint. `dtype`: bf16 (default) or fp32 weights and activations; `quant=True` makes every
    linear layer but the router NVFP4 (W4A16), the LM head included."""

    def __init__(self, cfg: FlintConfig, *, dtype=jnp.bfloat16, quant: bool = False,
                 rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg, self.dtype, self.quant = cfg, jnp.dtype(dtype), quant
        self.model = FlintModel(cfg, dtype=dtype, quant=quant, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, quant=quant, rngs=rngs)

    def __call__(self, tokens: jax.Array, cache: KVCache, n_tokens: jax.Array, *,
                 logits: str = "all", capture: tuple[str, ...] = ()):
        """Runs a chunk of tokens per row against the cache.

        tokens: int32 [B, T] (right-padded); n_tokens: int32 [B], the valid tokens of each row in
        this chunk (0 allowed). logits: "all" -> f32 [B, T, V]; "last" -> f32 [B, V] at each row's
        last valid token (garbage for rows with n_tokens == 0); "none" -> None.
        Returns (logits, new_cache, captured: dict of stacked per-layer arrays).
        """
        cfg = self.cfg
        b, t = tokens.shape
        offs = jnp.arange(t, dtype=jnp.int32)[None, :]
        info = ChunkInfo(positions=cache.lengths[:, None] + offs, valid=offs < n_tokens[:, None],
                         lengths_before=cache.lengths, lengths_after=cache.lengths + n_tokens)
        captures = {name: [] for name in capture}
        h = self.model.embed_tokens(tokens).astype(self.dtype)
        if "hidden_states" in captures:
            captures["hidden_states"].append(h)
        full_k, full_v, ring_k, ring_v = cache.full_k, cache.full_v, cache.ring_k, cache.ring_v
        for i, layer in enumerate(self.model.layers):
            j = cfg.cache_index[i]
            with jax.named_scope(f"layer_{i}"):
                if cfg.is_sliding(i):
                    h, ck, cv = layer(h, info, ring_k[j], ring_v[j], captures)
                    ring_k, ring_v = ring_k.at[j].set(ck), ring_v.at[j].set(cv)
                else:
                    h, ck, cv = layer(h, info, full_k[j], full_v[j], captures)
                    full_k, full_v = full_k.at[j].set(ck), full_v.at[j].set(cv)
            if "hidden_states" in captures:
                captures["hidden_states"].append(h)
        new_cache = KVCache(full_k=full_k, full_v=full_v, ring_k=ring_k, ring_v=ring_v,
                            lengths=info.lengths_after, counters=cache.counters)
        out = None
        if logits != "none":
            if logits == "last":
                idx = jnp.maximum(n_tokens - 1, 0)
                h = jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
            out = self.lm_head(self.model.norm(h), out_dtype=F32)
        # Stacked along a leading layer axis: hidden_states [L+1, B, T, D] (embeddings first),
        # router_* [L_moe, B, T, ...], sink_mass [L, B, T, H].
        captured = {k: jnp.stack(v, axis=0) for k, v in captures.items() if v}
        return out, new_cache, captured
