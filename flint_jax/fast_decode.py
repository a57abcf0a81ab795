"""The Pallas decode step: one token per row (batch <= 16) through the fused kernels.

Per layer: the q|k|v GEMVs in one kernel -> split-KV sink attention with the Q/K norm + RoPE +
cache write inside it -> merge -> o_proj GEMV -> residual add + RMSNorm (with the router GEMV at
batch 1) -> MoE: the router GEMV (batch > 1), the gate_up kernel (each slot's expert picked from
the router logits in-kernel or by a top-k kernel) and the down kernel (shared expert included),
then the combine with the residual add and the next RMSNorm; or, for dense layers, gate|up + SiLU
and down GEMVs -> residual add + next RMSNorm. Where each layer ends -- and every other fusion
choice -- depends on the weight format and the batch: ``decode_plan`` states them in one table.

The caches stay layer-stacked: kernels index the layer inside, so nothing is sliced or copied,
and the cache writes are in place under donation. Kernels that count (the BF16 MoE gate_up's
K slices, the combine in the MoE down kernel) keep their counters in ``KVCache.counters``: zeros
between steps, every kernel returns its entries to zero.

The step reads the same parameter state as the XLA path (``model.FlintForCausalLM``), BF16 or
NVFP4, so both paths can run from one loaded model and be compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from flint_jax import layers
from flint_jax.cache import KVCache
from flint_jax.config import FlintConfig
from flint_jax.pallas.add_rms_norm import add_rms_norm, rms_norm
from flint_jax.pallas.add_rms_norm_router import add_rms_norm_router
from flint_jax.pallas.attention_block import qk_norm_rope_attention
from flint_jax.pallas.gemv import gemv_silu_mul
from flint_jax.pallas.moe import (MoEPlan, moe_combine_add_rms_norm, moe_decode_routed,
                                  moe_decode_routed_combine, moe_plan, router_logits)
from flint_jax.pallas.multi_gemv import multi_gemv
from flint_jax.pallas.norm_qkv import norm_qkv
from flint_jax.pallas.support import decode_support
from flint_jax.pallas.nvfp4_gemv import (NVFP4Weight, nvfp4_gemv, nvfp4_gemv_silu_mul,
                                         x16_operand)

__all__ = ["DecodePlan", "decode_plan", "make_decode_step", "MAX_BATCH",
           "COMBINE_COUNTER_BASE"]

# KVCache.counters entries of the MoE down kernel's combine (`moe_decode_routed_combine`: one for
# the column blocks and one per block, <= 129 at D = 2048), above the gate_up kernel's split-K
# entries (< 3136, cache.COUNTER_ENTRIES).
COMBINE_COUNTER_BASE = 3584

MAX_BATCH = 16


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The fused kernels of the Pallas step at one (weight format, batch size): the measured
    choices (H200 run N: docs/gpu_runs/runN/, or docs at 35c0874), built by ``decode_plan``.

    | field | BF16 1 | BF16 2-4 | BF16 5-7 | BF16 8-16 | NVFP4 1 | NVFP4 2-3 | NVFP4 4-16 |
    |---|---|---|---|---|---|---|---|
    | early_trigger | on | on | on | on | off | off | off |
    | layer_end | qkv | norm | norm | norm | down | norm | norm |
    | router_in_norm | on | off | off | off | on | off | off |
    | qkv_split_k | 1 | 1 | 1 | 4 | 1 | 2 | 8 |
    | qkv_post_scale | -- | -- | -- | -- | on | -- | -- |
    | bf16_dense_pallas | on | off | off | off | -- | -- | -- |
    | lm_head_f16 | -- | -- | -- | -- | on | off | off |
    | moe.slot_rows | all | token | all | all | token | token | token |
    | moe.prerouted, shared_first | no | yes | no | no | no | yes | yes |
    | moe.shared_rows | all | all | all | all | token | token | token |
    | moe f16 gate_up / down | -- | -- | -- | -- | on | on | on |
    | moe.gate_up_split_k | 2 | 1 | 1 | 1 | 1 | 1 | 1 |

    early_trigger: every kernel lets the next one launch at its start (``pallas.pdl``). H200
      run 50, batch 1 / 1K, in-loop: BF16 2.543-2.592 against 2.632-2.653 ms, NVFP4 2.438-2.558
      against 2.389-2.408 (kernel busy time +30 us); run 51, every batch / context: BF16 -20 to
      -65 us of busy time, NVFP4 +28 to +160.
    layer_end: where each layer's end (MoE combine or dense output, residual add, the next
      layer's RMSNorm) runs. "qkv": inside the next layer's q|k|v kernel (``norm_qkv``; one
      launch less per layer; runs 13, 20, 22: 10.2 against 12.2 us for the pair it replaces;
      slower for NVFP4, run 38, and at batch 8, docs at 35c0874). "down": the MoE combine +
      residual add by the down kernel's last programs (``moe_decode_routed_combine``, counters
      in the cache), the RMSNorm by the next q|k|v kernel as it loads the residual
      (``multi_gemv(rms_sumsq=)``): H200 runs 59 and 125-126 (NVFP4 1x1K busy 1797 against
      1840 us; at batch 8 slower: runs 133-134). "norm": their own kernels
      (``moe_combine_add_rms_norm`` / ``add_rms_norm``).
    router_in_norm: the residual add + RMSNorm after attention and the MoE router GEMV in one
      kernel (``add_rms_norm_router``); run 34: 1.89 us against 2.78 for the pair at batch 1,
      7.33 against 6.35 at batch 8. Elsewhere the router is the Pallas ``router_logits`` kernel
      (run 59: 3.5 us against XLA's 8.1 at batch 8).
    qkv_split_k: the ``multi_gemv`` q|k|v's K in this many slices, its fp32 partials summed by
      the attention kernel as it loads q / k / v (halved until the slices hold whole K steps of
      the input features). Runs 143-147: NVFP4 8x1K in-loop 4.945 -> 4.824 ms (8 slices), 2x1K
      2.667 -> 2.638 (2); BF16 8x1K 5.876 -> 5.808 (4).
    qkv_post_scale: the NVFP4 ``blocks`` q|k|v scales each 16-value block's sum instead of each
      decoded weight (run 91: 5.43 against 5.61 us in the step).
    bf16_dense_pallas: the BF16 dense layers' gate|up + SiLU on the Pallas ``gemv_silu_mul``
      instead of XLA's dot + elementwise kernels (run 35: 16.3 against 18.9 + 1.4 us).
    lm_head_f16: the NVFP4 LM head multiplies in f16x2 against the final norm's output scaled
      into f16 (written by the last MoE down kernel's combine): run 164, 73.6 -> 58.9 us.
    moe: the routed MoE's ``MoEPlan`` (``pallas.moe.tiling``: rows per slot, routing, f16 K
      steps and tiles; the BF16 gate_up's K slices finish h on the cache's counters, runs
      45-46). The last layer's MoE (its combine feeds the LM head) runs without K slices.
    """
    quant: bool                  # NVFP4 weights (else BF16)
    batch: int
    early_trigger: bool
    layer_end: str               # "qkv" | "down" | "norm"
    router_in_norm: bool
    qkv_split_k: int
    qkv_post_scale: bool
    bf16_dense_pallas: bool
    lm_head_f16: bool
    moe: MoEPlan

    LAYER_ENDS = ("qkv", "down", "norm")

    def __post_init__(self):
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"DecodePlan.batch must be 1..{MAX_BATCH}, got {self.batch}")
        if self.layer_end not in self.LAYER_ENDS:
            raise ValueError(f"DecodePlan.layer_end must be one of {self.LAYER_ENDS}, got "
                             f"{self.layer_end!r}")
        if self.layer_end == "qkv" and self.quant:
            raise ValueError("DecodePlan.layer_end='qkv' needs BF16 weights (norm_qkv)")
        if self.layer_end == "down" and (not self.quant or self.batch != 1):
            raise ValueError("DecodePlan.layer_end='down' needs NVFP4 weights at batch 1")
        if self.qkv_split_k < 1 or self.qkv_split_k & (self.qkv_split_k - 1):
            raise ValueError(f"DecodePlan.qkv_split_k must be a power of two, got "
                             f"{self.qkv_split_k}")
        if self.layer_end == "qkv" and self.qkv_split_k != 1:
            raise ValueError("DecodePlan.qkv_split_k > 1 needs the multi_gemv q|k|v "
                             "(layer_end 'down' or 'norm')")
        if self.lm_head_f16 and (not self.quant or self.batch != 1):
            raise ValueError("DecodePlan.lm_head_f16 needs NVFP4 weights at batch 1")
        if self.moe.rows != self.batch:
            raise ValueError(f"DecodePlan.moe is for {self.moe.rows} rows, the plan for "
                             f"{self.batch}")
        if self.moe.gate_up_split_k > 1 and self.layer_end != "qkv":
            raise ValueError("DecodePlan.moe.gate_up_split_k > 1 runs where the layer end is in "
                             "the next q|k|v kernel (layer_end 'qkv')")


def decode_plan(quant: bool, batch: int) -> DecodePlan:
    """The measured ``DecodePlan`` for NVFP4 (``quant``) or BF16 weights at ``batch`` rows
    (1..16; the table in ``DecodePlan``'s docstring)."""
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"the Pallas decode path takes 1..{MAX_BATCH} rows, got {batch}")
    one = batch == 1
    fmt = "nvfp4" if quant else "bf16"
    if quant:
        layer_end = "down" if one else "norm"
        qkv_split_k = 8 if batch >= 4 else 2 if batch >= 2 else 1
    else:
        layer_end = "qkv" if one else "norm"
        qkv_split_k = 4 if batch >= 8 else 1
    return DecodePlan(
        quant=quant, batch=batch, early_trigger=not quant, layer_end=layer_end,
        router_in_norm=one, qkv_split_k=qkv_split_k, qkv_post_scale=quant and one,
        bf16_dense_pallas=not quant and one, lm_head_f16=quant and one,
        moe=moe_plan(fmt, fmt, batch, gate_up_split_k=2 if layer_end == "qkv" else 1))


def _fit_split(split: int, k: int, quant: bool) -> int:
    """``split`` halved until its slices hold whole K steps (64 values NVFP4, 16 BF16) of K."""
    step = 64 if quant else 16
    while split > 1 and k % (step * split):
        split //= 2
    return split


# Which implementation each op uses, from the H200 measurements (docs/kernels.md,
# docs/performance.md):
# - NVFP4 GEMVs and the NVFP4 MoE: Pallas (1.7-2.2x XLA's dequantize + dot at M=1).
# - BF16 o_proj, dense down and LM head: XLA (its GEMV reaches 3 TB/s where the Pallas one
#   reaches 2; the Pallas BF16 o_proj at batch > 1 measured no faster, run 57). BF16 q|k|v and
#   MoE: Pallas, because one kernel replaces 3 (q|k|v) or ~12 (MoE) launches: 4.45 -> 3.10 ms per
#   token at batch 1 (H200 runs 7-8, docs at 35c0874).
# - Attention, Q/K-norm + RoPE + cache write, residual add + RMSNorm: Pallas (1.1-30x).


def _linear(lin, x, kw, out_dtype=jnp.bfloat16, sum_splits=True, x_inv=None):
    """x [M, K] -> [M, N]: NVFP4 on ``nvfp4_gemv`` (``kw``: its interpret / early_trigger),
    BF16 on XLA's dot. ``sum_splits=False``: a split-K NVFP4 GEMV returns its fp32 partials
    [S, M, N] unsummed, for ``add_rms_norm`` to sum (one launch less). ``x_inv``: x is the f16
    operand ``x16_operand`` gives, x_inv its factor."""
    if lin.quant:
        return nvfp4_gemv(x, lin.qweight[...], lin.weight_scale[...], lin.weight_scale_2[...],
                          out_dtype=out_dtype, sum_splits=sum_splits, x_inv=x_inv, **kw)
    return layers.matmul_t(x, lin.weight[...]).astype(out_dtype)


def _silu_mul(mlp, x, kw, bf16_pallas):
    """bf16(silu(g) * u) in fp32 from g = bf16(x Wg^T), u = bf16(x Wu^T) (the model's rule);
    BF16 weights: XLA's dots, or with ``bf16_pallas`` the ``gemv_silu_mul`` kernel."""
    g, u = mlp.gate_proj, mlp.up_proj
    if g.quant:
        return nvfp4_gemv_silu_mul(x, _lin_arg(g), _lin_arg(u), **kw)
    if bf16_pallas:
        return gemv_silu_mul(x, g.weight[...], u.weight[...], **kw)
    return layers.silu_mul(layers.matmul_t(x, g.weight[...]).astype(x.dtype),
                           layers.matmul_t(x, u.weight[...]).astype(x.dtype))


def _qkv_weights(attn):
    return tuple(_lin_arg(lin) for lin in (attn.q_proj, attn.k_proj, attn.v_proj))


def _lin_arg(lin):
    if lin.quant:
        return NVFP4Weight(lin.qweight[...], lin.weight_scale[...], lin.weight_scale_2[...])
    return lin.weight[...]


def _shared_arg(mlp):
    return {n: _lin_arg(getattr(mlp.shared_expert, n)) for n in ("gate_proj", "up_proj", "down_proj")}


def _experts_arg(ex):
    names = (("gate_up_qweight", "gate_up_weight_scale", "gate_up_weight_scale_2",
              "down_qweight", "down_weight_scale", "down_weight_scale_2") if ex.quant
             else ("gate_up_proj", "down_proj"))
    return {n: getattr(ex, n)[...] for n in names}


def make_decode_step(graphdef, cfg: FlintConfig, *, interpret: bool = False, fallback=None,
                     plan: Callable[[bool, int], DecodePlan] | None = None):
    """Returns step(state, cache, tokens [B] int32) -> (f32 logits [B, V], cache).

    Batches above MAX_BATCH rows (the low-latency kernels' limit) go to ``fallback`` (the XLA
    step). ``plan``: a function (quant, batch) -> ``DecodePlan`` (default ``decode_plan``, the
    measured choices); called when the step is traced.
    """
    plan_for = plan or decode_plan
    eps = cfg.rms_norm_eps
    h_, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    top_k = cfg.num_experts_per_tok

    def step(state, cache: KVCache, tokens):
        b = tokens.shape[0]
        if b > MAX_BATCH:
            if fallback is None:
                raise ValueError(f"the Pallas decode path takes at most {MAX_BATCH} rows, got {b}")
            return fallback(state, cache, tokens)
        m = nnx.merge(graphdef, state)
        quant = m.model.layers[0].self_attn.q_proj.quant
        # what the kernels support (pallas.support; loading refuses or falls back at load)
        sup = decode_support(cfg, quant, m.model.embed_tokens.weight[...].dtype)
        if not sup.ok:
            raise ValueError(f"the Pallas decode step does not support this model: "
                             f"{sup.message()}")
        p = plan_for(quant, b)
        if p.batch != b:
            raise ValueError(f"the plan is for batch {p.batch}, the step runs {b} rows")
        return _pallas_step(m, cache, tokens, p, sup.xla_ops())

    def _pallas_step(m, cache: KVCache, tokens, p: DecodePlan, xla_ops=frozenset()):
        b = tokens.shape[0]
        # the BF16 gate_up's K slices halved until each holds whole K steps of D (small models;
        # Flint's D = 2048 takes the plan's)
        gsk = _fit_split(p.moe.gate_up_split_k, cfg.hidden_size, p.quant)
        if gsk != p.moe.gate_up_split_k:
            p = dataclasses.replace(p, moe=dataclasses.replace(p.moe, gate_up_split_k=gsk))
        layers_ = m.model.layers
        n_layers = len(layers_)
        kw = dict(interpret=interpret, early_trigger=p.early_trigger)   # every kernel's
        pos = cache.lengths
        full_k, full_v, ring_k, ring_v = cache.full_k, cache.full_v, cache.ring_k, cache.ring_v
        counters = cache.counters
        h = jnp.take(m.model.embed_tokens.weight[...], tokens, axis=0)
        fold = p.layer_end == "qkv"
        f16 = p.moe.gate_up_f16
        qkv_split = 1 if fold else _fit_split(p.qkv_split_k, cfg.hidden_size, p.quant)
        # layer_end "qkv": the previous layer's output (y, and for MoE the selected router
        # logits) waits for the next q|k|v kernel, which forms the residual and the normalised
        # input itself. layer_end "down": the next q|k|v normalises h with the sums of squares
        # the MoE down kernel left (sums, norm weight).
        pending, pending_rms = (None, None), None
        rope_cs = None   # RoPE's cos / sin: computed by the first sliding layer's attention
        x16_head = None  # the LM head's f16 operand from the last combine (lm_head_f16)
        if not fold:
            x = rms_norm(h, layers_[0].input_layernorm.weight[...], eps=eps, **kw)
        for i, layer in enumerate(layers_):
            j = cfg.cache_index[i]
            sliding, moe = cfg.is_sliding(i), cfg.is_moe(i)
            attn, mlp = layer.self_attn, layer.mlp
            last = i + 1 == n_layers
            nxt = layers_[i + 1].input_layernorm.weight[...] if not last else m.model.norm.weight[...]
            with jax.named_scope(f"layer_{i}"):
                # q|k|v (split-K: fp32 partials [S, B, N], summed by the attention kernel)
                if fold:
                    h, (q, k, v) = norm_qkv(h, _qkv_weights(attn), layer.input_layernorm.weight[...],
                                            y=pending[0], top_logits=pending[1], eps=eps, **kw)
                else:
                    rms = {} if pending_rms is None else dict(
                        rms_sumsq=pending_rms[0], rms_weight=pending_rms[1], rms_eps=eps)
                    q, k, v = multi_gemv(h if pending_rms is not None else x, _qkv_weights(attn),
                                         split_k=qkv_split, sum_splits=False,
                                         post_scale=p.qkv_post_scale, **rms, **kw)
                    pending_rms = None
                q = q.reshape(*q.shape[:-1], h_, hd)
                k, v = k.reshape(*k.shape[:-1], kvh, hd), v.reshape(*v.shape[:-1], kvh, hd)
                # attention (the Q/K norm, RoPE and cache write inside), then the merge
                kc, vc = (ring_k, ring_v) if sliding else (full_k, full_v)
                first_rope = sliding and rope_cs is None   # computes and returns cos / sin
                o, kc, vc, *cs = qk_norm_rope_attention(
                    q, k, v, attn.q_norm.weight[...], attn.k_norm.weight[...], pos, kc, vc,
                    attn.sinks[...], j, rope=sliding, ring=sliding,
                    window=cfg.sliding_window if sliding else None, theta=cfg.rope_theta,
                    eps=eps, rope_cos_sin=rope_cs if sliding else None,
                    return_cos_sin=first_rope, **kw)
                if first_rope:
                    (rope_cs,) = cs
                if sliding:
                    ring_k, ring_v = kc, vc
                else:
                    full_k, full_v = kc, vc
                # o_proj, its split-K partials summed by the norm kernel after it
                a = _linear(attn.o_proj, o.reshape(b, h_ * hd), kw, sum_splits=False)
                post_ln = layer.post_attention_layernorm.weight[...]
                x16_rows = {}       # the MoE gate_up's f16 operand (MoEPlan.gate_up_f16)
                if moe and p.router_in_norm:
                    h, x, logits, *x16 = add_rms_norm_router(h, a, post_ln, mlp.gate.weight[...],
                                                             eps=eps, x16=f16, **kw)
                else:
                    h, x, *x16 = add_rms_norm(h, a, post_ln, eps=eps, x16=f16 and moe, **kw)
                    if moe:
                        logits = router_logits(x, mlp.gate.weight[...], **kw)
                if x16:
                    x16_rows = dict(x16_rows=tuple(x16))
                if moe:
                    moe_args = (x, logits, _experts_arg(mlp.experts), _shared_arg(mlp))
                    if fold and not last:      # the layer end goes into the next q|k|v kernel
                        split = (dict(gate_up_counter=counters)
                                 if p.moe.gate_up_split_k > 1 else {})
                        y, route, *counter_out = moe_decode_routed(
                            *moe_args, top_k=top_k, plan=p.moe, **split, **x16_rows, **kw)
                        if counter_out:
                            (counters,) = counter_out
                        pending = (y, route.logits)
                    elif p.layer_end == "down":   # the combine in the down kernel
                        norm = last    # else the next q|k|v normalises: x = sums of squares
                        h, x, _, counters, *x16_head = moe_decode_routed_combine(
                            *moe_args, h, nxt, counters, counter_base=COMBINE_COUNTER_BASE,
                            eps=eps, norm=norm, top_k=top_k, plan=p.moe,
                            x16_next=last and p.lm_head_f16 and "lm_head" not in xla_ops,
                            **x16_rows, **kw)
                        if not norm:
                            x, pending_rms = None, (x, nxt)
                    else:
                        moe_plan_ = p.moe if not fold else dataclasses.replace(
                            p.moe, gate_up_split_k=1)   # the last layer of a folded step
                        y, route = moe_decode_routed(*moe_args, top_k=top_k, plan=moe_plan_,
                                                     **x16_rows, **kw)
                        h, x = moe_combine_add_rms_norm(h, y, route.logits, nxt, eps=eps, **kw)
                else:
                    hid = _silu_mul(mlp, x, kw, p.bf16_dense_pallas)
                    # partials only for add_rms_norm (norm_qkv takes [M, D])
                    y = _linear(mlp.down_proj, hid, kw, sum_splits=fold and not last)
                    if fold and not last:
                        pending = (y, None)
                    else:
                        h, x = add_rms_norm(h, y, nxt, eps=eps, x16=False, **kw)
        if "lm_head" in xla_ops:    # a vocabulary the NVFP4 LM head kernel cannot tile
            logits = m.lm_head(x, out_dtype=jnp.float32)
        elif p.lm_head_f16 and m.lm_head.quant:   # the LM head on the f16 operand
            x16, x_inv = x16_head[0] if x16_head else x16_operand(x)
            logits = _linear(m.lm_head, x16, kw, out_dtype=jnp.float32, x_inv=x_inv)
        else:
            logits = _linear(m.lm_head, x, kw, out_dtype=jnp.float32)
        new_cache = KVCache(full_k=full_k, full_v=full_v, ring_k=ring_k, ring_v=ring_v,
                            lengths=pos + 1, counters=counters)
        return logits, new_cache

    return step
