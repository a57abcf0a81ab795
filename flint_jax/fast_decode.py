"""The Pallas decode step: one token per row (batch <= 16) through the fused kernels.

Per layer (default `DecodeOptions`): one q|k|v GEMV kernel -> split-KV sink attention with the
Q/K-norm + RoPE + cache write inside it -> merge -> o_proj GEMV -> fused residual add + RMSNorm
(at batch 1 with the router GEMV in the same kernel) -> MoE: the router GEMV (`router_logits`,
batch > 1), the gate_up kernel (picks each slot's expert from the router logits, stores the
route) and the down kernel (shared expert included), then the combine of the experts with the
residual add + next RMSNorm (at batch 1 by the down kernel's last program, else its own
kernel); or, for dense layers, gate|up+SiLU and down GEMVs -> fused residual add + next RMSNorm.
At batch 1 with BF16 weights the layer end goes into the next q|k|v kernel instead
(`norm_in_qkv`), and the MoE gate_up kernel runs in two K slices, the second finishing h
(`moe_gate_up_split_k`; its counters live in the cache, `KVCache.counters`, zeros between
steps). A split-K NVFP4 o_proj or dense down hands its fp32 partials to the norm kernel, which
sums them (no XLA reduce kernel in between). With BF16 weights every kernel lets the next one
launch as soon as it starts (`early_trigger`, `pallas.pdl`).
The caches stay layer-stacked: kernels index the layer inside, so nothing is sliced or copied,
and the cache writes are in place under donation.

The step reads the same parameter state as the XLA path (`model.FlintForCausalLM`), BF16 or NVFP4,
so both paths can run from one loaded model and be compared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from flint_jax.cache import KVCache
from flint_jax.config import FlintConfig
from flint_jax import layers
from flint_jax.pallas import (NVFP4Weight, add_rms_norm, add_rms_norm_router, decode_attention,
                              gemv_silu_mul, moe_block, moe_combine_add_rms_norm,
                              moe_decode_routed, moe_router_logits, multi_gemv, norm_qkv,
                              nvfp4_gemv, nvfp4_gemv_silu_mul, pdl, qk_norm_rope,
                              qk_norm_rope_attention, rms_norm, router_logits)
from flint_jax.pallas.gemv import gemv
from flint_jax.pallas.moe import moe_decode_routed_combine
from flint_jax.pallas.nvfp4_gemv import asm_decode as nvfp4_asm_decode
from flint_jax.pallas.nvfp4_gemv import f16_sums as nvfp4_f16_sums
from flint_jax.pallas.nvfp4_gemv import x16_operand

# KVCache.counters entries of the MoE down kernel's combine (`moe_decode_routed_combine`): one
# for the column blocks and one per block (<= 129 at D = 2048), or in the residual mode at
# batch > 1 one per (block, token) (<= 1 + 128 * MAX_BATCH), above the gate_up kernel's split-K
# entries (< 3136, cache.COUNTER_ENTRIES).
COMBINE_COUNTER_BASE = 3584
# KVCache.counters entries of the q|k|v multi_gemv's finishing slices (`DecodeOptions.qkv_finish`:
# one per row tile, <= 5120 / 16 = 320), above the combine's (<= 3584 + 1 + 128 * 16).
QKV_COUNTER_BASE = 6400

MAX_BATCH = 16


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Which fused kernels the Pallas step uses (the defaults are the fastest measured).

    fused_qkv: q, k and v projections in one `multi_gemv` kernel (else three GEMVs: XLA's for
      BF16, `nvfp4_gemv` for NVFP4).
    moe: "routed" = router dot (XLA) + `moe_decode_routed` (experts picked in-kernel from the
      logits) + `moe_combine_add_rms_norm` (combine, residual add and the next RMSNorm): 4 launches;
      "slots" = XLA routing + `moe_decode` + XLA combine, then `add_rms_norm`; "xla" = the
      reference model's MoE (gathered experts, einsums), then `add_rms_norm`; "v1" = the session-1
      choice ("slots" for NVFP4 experts, "xla" for BF16).
    router_in_norm: (with moe="routed") the residual add + RMSNorm after attention and the router
      GEMV in one kernel (`add_rms_norm_router`): one launch less per MoE layer. None (default)
      = the measured choice: at batch 1 only (H200, run 34: 1.89 us against 2.78 for
      add_rms_norm + XLA's router dot, 2.27 against 3.30 with NVFP4's split-K partials; at batch
      8 7.33 / 13.1 against 6.35 / 6.86). True / False force it.
    norm_in_qkv: (with moe="routed" and fused_qkv) the end of each layer (MoE combine or dense
      output, residual add, the next layer's input RMSNorm) computed inside the next layer's
      q|k|v kernel (`norm_qkv`): one launch less per layer. None (default) = the measured
      choice: on for BF16 weights at batch 1 only. On the H200 it is 0.05-0.1 ms faster there
      (runs 13, 20, 22; kernel 10.2 against 12.2 us for the pair it replaces), slower for
      NVFP4 at batch 1 even on the lanes tiles (run 38: 2.594 against 2.458 ms in-loop, 350
      against 397 kernels; 10.2 us per layer against 3.1 + 6.1 for the pair), and much slower
      at batch 8, where every program repeats a larger prologue (perf log 9, 22, 35). True /
      False force it.
    attention: "fused" (default) = `qk_norm_rope_attention`: the Q/K norm, RoPE and cache
      write inside the split-KV kernel, then the merge kernel (2 launches; H200: ring layer
      6.3 us against 4.1 + 3.5 for the two kernels it replaces); "split" = `qk_norm_rope` then
      `decode_attention` (3 launches); "fused_atomic" = "fused" with the merge done by the last
      program of each KV head (1 launch, one zeroed counter per step; measured no faster: its
      merge tail costs about what the launch saves. H200, batch 1 / 1K, in-loop: BF16 2.681
      against 2.692 ms in run 40, 2.685 against 2.615 in run 42, with 302 against 350
      kernels; NVFP4 2.539 / 2.537 and 2.492 / 2.360 with 349 against 397; a full layer's 64
      splits at 8K+ make its merge tail 4 us longer than the merge kernel, run 41).
    ring_splits: split count of the sliding layers' attention (their 576-slot ring holds 513
      live keys); None = `decode_attention.default_attention_blocks` (16 at batch 1). 1 = one
      program per (row, KV head) that normalises itself: no merge kernel.
    attention_num_warps: warps per program of the fused attention kernels (sliding and full
      layers, `qk_norm_rope_attention`'s ``num_warps``); None = the kernel's default (4).
    moe_slot_rows: `moe_decode_routed`'s ``slot_rows`` at batch > 1: "all" (every routed slot's
      expert times all rows, tensor-core tiles), "token" (each slot times its own token only, the
      M = 1 kernels) or None (the kernel's measured default, `moe.default_slot_rows`: "token" at
      batch > 1 for NVFP4 experts, at batch 2-4 for BF16; at batch 2 the NVFP4 step took 4.51
      ms with "token" against 5.59 with "all", run 28; with the two options below on, batch 8
      7.20 against 8.16 ms and batch 4 4.98 against 5.84, run 100; BF16 4x1K 4.31 against
      4.42 ms, 8x1K 6.26 against 6.10, run 110).
    moe_prerouted: the routed MoE's top-k computed once per token by its own kernel
      (`moe_topk_route_pallas`) instead of in every gate_up program
      (`moe_decode_routed(prerouted=True)`). None = the kernel's default: on with per-token
      slots at batch > 1.
    moe_shared_first: the routed MoE kernels launch the shared expert's programs first
      (`moe_decode_routed(shared_first=True)`). None = the kernel's default: on with per-token
      slots at batch > 1.
    moe_shared_rows: `moe_decode_routed`'s ``shared_rows`` at batch > 1 with per-token slots:
      "token" runs the shared expert as one program per (token, row block) on the M = 1 tiles
      too; "all": one program per row block for all rows. None = the kernel's default
      (`default_shared_rows`: "token" when experts and shared expert are both NVFP4; H200 run
      102: NVFP4 8x1K 5.661 against 7.240 ms with "all", 4x1K 4.384 against 4.942).
    nvfp4_rows: at batch > 1, the NVFP4 q|k|v, o_proj, dense MLP and LM head GEMVs all use the
      CUDA-core ``rows`` tiles (one decode, one row sum per token) instead of the kernels'
      defaults. Off: at batch 8 the step is slower (16.1 against 9.5 ms, run 25); the q|k|v
      kernel already picks ``rows`` by itself at M = 2..3, where it measured faster.
    nvfp4_qkv_method: at batch > 1, the NVFP4 q|k|v `multi_gemv`'s tile method ("rows",
      "dot" or "swap"); None = the kernel's default (`multi_gemv.resolve_method`: "rows" at
      batch 2-3, "dot" above; H200 run 108: 4x1K 4.132 ms on dot against 4.325 on rows, 3x1K
      3.847 against 3.797). For A/B measurements of that choice.
    bf16_dense_pallas: the BF16 dense layers' gate|up + SiLU as one Pallas `gemv_silu_mul`
      kernel instead of XLA's dot + elementwise kernels. None (default) = at batch 1 only (H200,
      run 35: 16.3 us per dense layer against 18.9 + 1.4 for XLA's two kernels; step 2.690
      against 2.714 ms, 350 against 352 kernels). True / False force it.
    moe_gate_up_split_k: the BF16 routed MoE's gate_up kernel with its K (= D) in this many
      slices (`moe_decode_routed(gate_up_split_k=, gate_up_counter=)`: S x the programs, the
      last slice of each tile summing the fp32 partials into h and returning its counter entry
      to zero; the counters are `KVCache.counters`, so no kernel zeroes them); used where the
      layer end goes into the next q|k|v kernel (`norm_in_qkv`: BF16 at batch 1 by default).
      None (default) = 2 at batch 1: H200, BF16 1x1K, in-loop 2.604 against 2.646 ms (run 46)
      and 2.631 against 2.731 (run 45, the paths in the other order), kernel time -24 / -12 us
      (gate_up 12.9 against 13.4 us per layer); 351 against 350 kernels while the step zeroed
      the counters itself (until session 9). 1 turns it off. NVFP4 experts ignore it.
      (Leaving the sum to the down kernel measured slower: run 44.)
    qkv_split_k: (where the attention is "fused" / "fused_atomic") the fused q|k|v kernel's K
      in this many slices, its fp32 partials summed by the attention kernel as it loads q / k
      / v (`norm_qkv(..., split_k=S, sum_splits=False)` where the layer end goes into the
      q|k|v kernel, `norm_in_qkv`; `multi_gemv(..., split_k=S, sum_splits=False)` otherwise):
      S x the programs, no kernel more. Why: a BF16 q|k|v at batch 1 has 80 tiles for 132
      SMs, and so does the NVFP4 one at batch > 1 (`dot` tiles bn64, 16 K steps each). None
      (default): 8 for the NVFP4 `multi_gemv` at batch >= 4 and 2 at batch 2-3, 4 for the BF16
      one at batch 8 (H200 runs 143-147, 8x1K in-loop NVFP4 4.824 against 4.945 ms, BF16 5.808
      against 5.876; see `qkv_split_k_at`), 1 elsewhere: `norm_qkv` measured slower (run 48,
      BF16 1x1K: 13.4 us at S = 2 against 10.4, every program repeating the statistic pass;
      in-loop 2.78 against 2.62 ms).
    early_trigger: every Pallas kernel of the step executes griddepcontrol.launch_dependents at
      its start, so the next kernel's CTAs are placed and wait at their entry while it runs
      (`pallas.pdl`). None (default) = the measured choice: on for BF16 weights, off for NVFP4
      (H200, batch 1 / 1K, three runs in alternating order, run 50: BF16 in-loop 2.543-2.592
      against 2.632-2.653 ms, kernel busy time -65 us; NVFP4 2.438-2.558 against 2.389-2.408,
      +30 us; run 51, every batch / context: busy time BF16 -20 to -65 us, NVFP4 +28 to +160).
      True / False force it; "latency" / "streams": only the latency-bound kernels (attention,
      merge, norms, MoE combine) / only the weight-streaming ones trigger (`pdl.triggers`).
    nvfp4_m1_method: at batch 1, the tile method of every NVFP4 GEMV and of the NVFP4 MoE
      kernels: "reduce" (row sums on every K step), "blocks" (per-block sums in the thread,
      one reduction after the K loop), "lanes" (per-lane FFMAs, one reduction after the K
      loop) or None (the kernels' defaults: blocks since runs 84-85, 2.270 against 2.304 ms
      in-loop at 1x1K with reduce). For A/B measurements.
    moe_down_shared_cols: the routed MoE down kernel's ``down_shared_cols`` (the shared
      expert's columns of each block over that many programs, its K being 2x a routed
      expert's); None = 1 (measured no faster: run 58, BF16 1x1K in-loop 2.550 against 2.573
      ms with 2, busy time 2373 against 2363 us; 8x1K 6.769 against 6.756).
    rms_in_qkv: (NVFP4 q|k|v, routed MoE, the combine in the down kernel) the MoE down kernel
      stops at the residual s and per-column-block sums of squares (its last program of each
      block, no second counter level and no one-program RMSNorm tail), and the next layer's
      q|k|v kernel normalises s as it loads it (`multi_gemv(rms_sumsq=, rms_weight=)`). None
      (default) = at batch 1 (with the combine in the down kernel); True = at every batch,
      the combine moving into the down kernel at batch > 1 too (one launch less per MoE layer:
      no `moe_combine_add_rms_norm`); False = off. H200, NVFP4 1x1K, runs 125-126 (both
      orders in one process): busy 1797 / 1794 against 1840 / 1835 us (down kernel 8.46 ->
      6.64 us, q|k|v 5.42 -> 6.20), 350 kernels, the same logits. At 8x1K (runs 133-134)
      slower: 5.170 against 4.988 ms per token (down 21.1 -> 26.3 us, q|k|v 13.6 -> 16.0,
      against the 3.7 us combine kernel), 445 kernels.
    moe_combine_in_down: (routed MoE, where the layer end is not folded into the next
      q|k|v) the MoE combine + residual add + next RMSNorm done by the down kernel's last
      program (`moe_decode_routed_combine`, two-level arrival counters in
      ``KVCache.counters``) instead of `moe_combine_add_rms_norm`: one launch less per MoE
      layer. None (default) = at batch 1 only (where it applies: NVFP4; BF16 folds the layer
      end into the next q|k|v): H200 run 59, NVFP4 1x1K in-loop 2.376 against 2.406 ms, kernel
      busy time 2136 against 2126 us (the down kernel 9.6 us against 6.4 + 3.1 for the pair), 350
      against 397 kernels; at batch 8 the one program's serial combine of 8 rows makes the down
      kernel 31 us longer (10.95 against 9.67 ms NVFP4, 7.66 against 6.36 BF16).
    router_pallas: where the MoE router GEMV is its own op (batch > 1: at batch 1 the router
      is in ``add_rms_norm_router``), the Pallas ``router_logits`` kernel instead of XLA's dot
      (at batch 8 a split-K GEMM + reduce, 6.9 + 1.2 us per MoE layer on the H200). None
      (default) = at batch > 1: H200 run 59, 8x1K in-loop NVFP4 9.330 against 9.667 ms, BF16
      6.192 against 6.364, the kernel (one router row per program) 3.5 us against 8.1 (NVFP4,
      no early trigger); the first version (4 router rows per program, 3-D products) took 16 us
      in the step (runs 57-58).
    bf16_o_proj_pallas: at batch > 1, the BF16 o_proj on the Pallas ``gemv`` with its split-K
      fp32 partials summed by the ``add_rms_norm`` kernel, instead of XLA's dot (at batch 8 a
      split-K GEMM + reduce, 7.3 + 1.6 us per layer, run 51). None (default) = off: no faster
      (H200 run 57, 8x1K in-loop 6.341 against 6.314 ms; perf log 46).
    nvfp4_asm: the instruction sequence of the NVFP4 kernels' ``asm`` decode
      (``nvfp4_gemv.asm_decode``): "mul" (one integer multiply places a nibble's magnitude and
      sign bits, and the CUDA-core tiles get f32 weights and activations from inline PTX, one
      instruction per value), "mul_bf16" (the multiply, compiler conversions) or "shift"
      (session 11's shifts and or): bit-identical; "post": the batch-1 ``blocks`` tiles decode
      without the scale multiply and scale each 16-value block's sum (SASS: MoE gate_up 338 ->
      317 instructions per K step, 82 -> 64 registers; down 326 -> 300; the same products,
      summed in another order). One of these applies to every kernel. "auto" (default): "post"
      for the kernels it made faster on the H200 -- q|k|v (5.43 against 5.61 us in the step)
      and the MoE down kernel (8.39 against 8.65) -- and "mul" elsewhere (the MoE gate_up
      9.10 against 8.77, the LM head 75.2 against 73.8; run 91, batch 1; ``nvfp4_asm_at``).
      At batch > 1 "post" changes only the ``blocks`` tiles, i.e. the NVFP4 MoE's per-token
      slots; "auto" keeps "mul" for their gate_up there too (run 140: 8x1K 4.961 against
      5.056 ms with "post", 4x1K 3.779 against 3.847).
    nvfp4_swap: at batch > 1, the NVFP4 MoE gate_up and LM head on swap-AB tiles (the decoded
      weights as wgmma's register A operand; their defaults since session 12: H200 run 80, M = 8
      MoE 144.7 against 160.2 us, LM head 142.6 against 185.6). False: session 11's ``dot``
      tiles (mma.sync, gate_up bn64 bk256 w4). For A/B measurements.
    qkv_finish: where the `multi_gemv` q|k|v runs in K slices (`qkv_split_k_at` > 1), the
      kernel's last slice of each tile sums the partials into bf16 q / k / v itself
      (`multi_gemv(counter=)`, arrival counters in ``KVCache.counters`` from
      ``QKV_COUNTER_BASE``), so that the attention kernels load bf16 instead of every split
      program summing the S partials again (+81 us per 8x1K step at S = 8, run 144). Same
      values (the same sums in the same order). False (default): no faster (H200 run 148,
      8x1K: 4.823 against 4.827 ms; the q|k|v kernel's finishing slices cost it 441 -> 527 us
      per step, what the attention kernels save, perf log 86).
    o_proj_split_k: at batch > 1, the o_proj GEMV's K in this many slices (NVFP4, or BF16 on the
      Pallas gemv), its fp32 partials summed by the norm kernel after it. None (default) = the
      kernel's default (4 where K allows): 8 slices make the o_proj faster (run 148, 8x1K:
      8.49 -> 7.78 us per layer) and the norm kernel summing 8 partials slower (2.28 -> 3.30):
      4.826 against 4.827 ms (perf log 87). For measurements.
    moe_tiling: at batch > 1, tile overrides for the routed MoE's two kernels: pairs (name,
      value) with names from ``MOE_TILING_KEYS`` (``block_n`` / ``block_k`` / ``num_warps`` /
      ``num_stages`` of the gate_up kernel, the same with ``_down`` of the down kernel, and
      ``codes_ahead``, `moe.moe_decode`'s), e.g. ``(("block_n_down", 32),)`` (at batch 1 with
      the f16 MoE too). () (default) =
      ``moe.default_moe_tiling``. For measuring
      tiles inside the step, where the L2 and the neighbouring kernels are the real ones.
    lm_head_tiling: overrides for the NVFP4 LM head GEMV (at batch > 1, or at batch 1 with
      ``lm_head_f16``): pairs (name, value) with names from ``LM_HEAD_TILING_KEYS``
      (``nvfp4_gemv``'s ``block_n``, ``block_k``, ``num_warps``, ``num_stages``, ``split_k``,
      ``method``). () (default) = its defaults.
    lm_head_f16: at batch 1, the NVFP4 LM head GEMV multiplies in f16x2 against the final
      norm's output scaled into f16 (`nvfp4_gemv(x16, ..., x_inv=)`, the ``blocks`` tiles'
      f16 K step, sums per ``moe_f16_sums``), the operand written by the last MoE layer's
      down kernel where it does the combine (`moe_decode_routed_combine(x16_next=True)`),
      else by one XLA op (`x16_operand`), on bk512 tiles with 4 warps (SASS of the 150144 x
      2048 head: 211 against 325 instructions per thread and K step). None (default) = on at
      batch 1 with the NVFP4 GEMVs on the ``blocks`` tiles (`nvfp4_m1_method` None /
      "blocks"): H200 run 164, the LM head 73.6 -> 58.9 us, the step 1.732 -> 1.723 ms (busy
      1735 -> 1726 us), logits rel-L2 3.9e-4 against the f32 tiles; False = off; True = on
      (batch 1 only).
    moe_shared_tokens: at batch > 1 with the shared expert per token (``moe_shared_rows``
      "token", the NVFP4 default), each shared-expert gate_up program takes this many tokens
      and decodes its weight tile once for them (`moe_decode_routed(shared_tokens=)`); None
      (default) = one token per program: slower (H200 run 152, 8x1K 4.917 against 4.752 ms at
      2 tokens: the kernel's registers 126 -> 204 for the routed programs too; perf log 90).
    moe_gate_up_f16: at batch > 1 with NVFP4 experts on per-token slots (the default there),
      the MoE gate_up kernel multiplies in f16x2 against x scaled per row into f16 (written by
      the add_rms_norm kernel before it; `moe_decode_routed(gate_up_f16=True, x16_rows=)`,
      `nvfp4_gemv.blocks_fma_f16`): SASS 613 -> 497 instructions per thread and K step, 126 ->
      72 registers. Each pair of exact products is rounded once to f16 (rel-L2 1.6e-4 against
      exact sums, a tenth of bf16's rounding of h). None (default) = on where it applies
      (batch > 1, the routed MoE on per-token slots, `moe_shared_tokens` 1): H200 runs
      154-155, 8x1K 4.743 -> 4.588 ms, 4x1K 3.590 -> 3.417, 2x1K 2.638 -> 2.562 (perf log 91);
      False = off; True = on (an error where per-token slots are off). At batch 1 too (since
      H200 run 160): the routed MoE's one-token slots with the shared expert per token on the
      same f16 K step, x16 written by `add_rms_norm_router`; None = on with the routed MoE on
      the `blocks` tiles (`nvfp4_m1_method` None / "blocks"): NVFP4 1x1K 1.770 -> 1.722 ms
      (busy 1786 -> 1736 us; gate_up 8.71 -> 8.17 us per layer, the down kernels' f16 K step
      -0.9), the same greedy tokens for 16 steps, teacher-forced agreement 1.000.
    moe_down_f16: with the f16 gate_up and the shared expert per token, the MoE down kernel
      multiplies in f16x2 too: the gate_up kernel writes bf16(h) as f16 with one scale per 16
      values (`moe_decode_routed(down_f16=True)`): SASS 627 -> 525 instructions per thread and
      K step, 128 -> 94 registers. None (default) = on where it applies (the f16 gate_up on,
      the shared expert per token and in the experts' format, `moe_down_shared_cols` None /
      1): H200 run 158, with the block sums, 8x1K 4.401 -> 4.228 ms, 4x1K 3.322 -> 3.296, 2x1K
      2.508 -> 2.484 (with the pair sums it paid at batch 8 only: 4.679 -> 4.643, and 4x1K
      3.407 -> 3.426); False = off; True = on (an error where it cannot apply).
    moe_f16_sums: how those f16 kernels sum their products before the block scales
      (`nvfp4_gemv.f16_sums`): "block" (default: each 16-value block's eight products per
      f16 lane summed in f16, then f32: SASS of the 8x1K gate_up 975 -> 784 instructions per
      thread and K step, the down kernel's 525 -> 429; H200 run 158, gate_up 35.7 -> 29.7 us
      per layer at 8x1K, the down kernel 17.7 -> 15.6; the MoE's rel-L2 against exact sums
      2.5e-3 against 1.9e-3, both from h's bf16 rounding flips) or "pair" (each pair of
      products rounded to f16, then f32: session 24's form).
    moe_shared_with_topk: at batch > 1 with NVFP4 experts (per-token slots, the shared expert
      per token: the defaults there), the shared expert's gate_up programs run in the top-k
      kernel beside its M top-k programs, and the gate_up kernel runs only the routed slots
      (`moe_decode_routed(shared_with_topk=True)`): the same launches and values, the top-k's
      dependent latency under the shared weights' stream. False (default) = off (not yet
      measured on the H200); needs `router_topk` off.
    """
    fused_qkv: bool = True
    moe: str = "routed"
    router_in_norm: bool | None = None
    norm_in_qkv: bool | None = None
    attention: str = "fused"
    ring_splits: int | None = None
    attention_num_warps: int | None = None
    moe_slot_rows: str | None = None
    moe_prerouted: bool | None = None
    moe_shared_first: bool | None = None
    moe_shared_rows: str | None = None
    nvfp4_rows: bool = False
    nvfp4_qkv_method: str | None = None
    nvfp4_m1_method: str | None = None
    bf16_dense_pallas: bool | None = None
    moe_gate_up_split_k: int | None = None
    qkv_split_k: int | None = None
    early_trigger: bool | str | None = None
    router_pallas: bool | None = None
    moe_down_shared_cols: int | None = None
    moe_combine_in_down: bool | None = None
    rms_in_qkv: bool | None = None
    bf16_o_proj_pallas: bool | None = None
    nvfp4_asm: str = "auto"
    nvfp4_swap: bool = True
    qkv_finish: bool = False
    o_proj_split_k: int | None = None
    moe_tiling: tuple = ()
    lm_head_tiling: tuple = ()
    moe_shared_tokens: int | None = None
    moe_gate_up_f16: bool | None = None
    moe_down_f16: bool | None = None
    moe_f16_sums: str = "block"
    moe_shared_with_topk: bool = False
    lm_head_f16: bool | None = None

    MOE_TILING_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "block_n_down",
                       "block_k_down", "num_warps_down", "num_stages_down", "codes_ahead")
    LM_HEAD_TILING_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "method")

    #: The kernels ``nvfp4_asm="auto"`` gives the "post" decode (H200 run 91).
    POST_SITES = ("qkv", "moe_down")

    def gate_up_f16_at(self, batch: int) -> bool:
        """Whether the NVFP4 MoE gate_up at this batch size multiplies in f16 (caller checks
        that the experts are NVFP4)."""
        if batch == 1:   # one-token slots on the blocks tiles (H200 run 160)
            if self.moe_gate_up_f16 is not None:
                return self.moe_gate_up_f16
            return (self.moe == "routed" and self.nvfp4_m1_method in (None, "blocks")
                    and self.moe_shared_rows != "all")
        if self.moe_gate_up_f16 is False:
            return False
        return bool(self.moe_gate_up_f16) or (
            self.moe == "routed" and self.moe_slot_rows != "all"
            and self.moe_shared_tokens in (None, 1))

    def lm_head_f16_at(self, batch: int) -> bool:
        """Whether an NVFP4 LM head at this batch size runs on the f16 operand."""
        if batch != 1 or self.lm_head_f16 is False:
            return False
        return bool(self.lm_head_f16) or self.nvfp4_m1_method in (None, "blocks")

    def down_f16_at(self, batch: int, shared_same_format: bool) -> bool:
        """Whether the NVFP4 MoE down kernel at this batch size multiplies in f16 (caller
        checks that the experts are NVFP4; ``shared_same_format``: the shared expert is too)."""
        if self.moe_down_f16 is False or not self.gate_up_f16_at(batch):
            return False
        return bool(self.moe_down_f16) or (
            shared_same_format and self.moe_shared_rows != "all"
            and self.moe_down_shared_cols in (None, 1))

    def nvfp4_asm_at(self, site: str) -> str:
        """The ``asm`` decode sequence of one kernel site: "qkv" (the fused q|k|v GEMV),
        "moe_down" (the routed MoE's down kernel) or "step" (every other kernel)."""
        if self.nvfp4_asm != "auto":
            return self.nvfp4_asm
        return "post" if site in self.POST_SITES else "mul"

    def rms_in_qkv_at(self, batch: int, quant: bool) -> bool:
        """Whether the MoE layers' next RMSNorm moves into the next q|k|v kernel (see
        ``rms_in_qkv``; at batch > 1 it brings the combine into the down kernel with it)."""
        if self.rms_in_qkv is False or not (quant and self.fused_qkv and self.moe == "routed"):
            return False
        if self.rms_in_qkv is None:
            return batch == 1 and self.combine_in_down_at(batch)
        return self.moe_combine_in_down is not False

    def combine_in_down_at(self, batch: int) -> bool:
        """Whether the routed MoE's combine runs in the down kernel at this batch size."""
        return batch == 1 if self.moe_combine_in_down is None else self.moe_combine_in_down

    def router_pallas_at(self, batch: int) -> bool:
        """Whether a separate MoE router GEMV at this batch size runs on `router_logits`."""
        return batch > 1 if self.router_pallas is None else self.router_pallas

    def bf16_o_proj_pallas_at(self, batch: int) -> bool:
        """Whether the BF16 o_proj at this batch size runs on the Pallas gemv."""
        return False if self.bf16_o_proj_pallas is None else (
            self.bf16_o_proj_pallas and batch > 1)

    def early_trigger_for(self, quant: bool) -> tuple[bool, str]:
        """(whether the step's kernels trigger early, which: "all" / "latency" / "streams"), for
        NVFP4 (quant) or BF16 weights."""
        if self.early_trigger is None:
            return not quant, "all"
        if isinstance(self.early_trigger, str):
            return True, self.early_trigger
        return self.early_trigger, "all"

    def qkv_split_k_at(self, batch: int, quant: bool = False, norm_qkv: bool = False,
                       k: int | None = None) -> int:
        """K slices of the fused q|k|v kernel at this batch size (where it applies). The default
        (None), for the `multi_gemv` q|k|v with the fused attention: NVFP4 8 at batch >= 4
        (`dot` tiles; H200 runs 143-144: the q|k|v 660 -> 441 us per 8x1K step, the attention
        kernels summing the partials +81, in-loop 4.945 -> 4.824 ms, 4x1K 3.767 -> 3.605; S = 4
        4.910, S = 16 5.081 at 8x1K) and 2 at batch 2-3 (`rows` tiles; run 147: 2x1K 2.667 ->
        2.638, 3x1K 3.277 -> 3.233; S = 8 2.999 / 3.733), BF16 4 at batch 8 (run 145: 5.876 ->
        5.808 ms; S = 2 5.826, S = 8 5.867), halved until the slices' smallest K steps (64 / 16)
        fit ``k`` (the input features); 1 elsewhere (`norm_qkv` measured slower, run 48)."""
        if self.qkv_split_k is not None:
            return self.qkv_split_k
        if norm_qkv or self.attention == "split":
            return 1
        if quant:
            split, step = (8 if batch >= 4 else 2 if batch >= 2 else 1), 64
        else:
            split, step = (4 if batch >= 8 else 1), 16
        while k is not None and split > 1 and k % (step * split):
            split //= 2
        return split

    def moe_gate_up_split_k_at(self, batch: int) -> int:
        """K slices of the BF16 MoE gate_up kernel at this batch size (where it applies)."""
        if self.moe_gate_up_split_k is None:
            return 2 if batch == 1 else 1
        return self.moe_gate_up_split_k

    def router_in_norm_at(self, batch: int) -> bool:
        """Whether the step at this batch size runs `add_rms_norm_router`."""
        if self.router_in_norm is None:
            return self.moe == "routed" and batch == 1
        return self.router_in_norm

    def bf16_dense_pallas_at(self, batch: int) -> bool:
        """Whether the step at this batch size runs the BF16 dense gate|up on `gemv_silu_mul`."""
        return batch == 1 if self.bf16_dense_pallas is None else self.bf16_dense_pallas

    def norm_in_qkv_at(self, batch: int, quant: bool) -> bool:
        """Whether the step at this batch size (NVFP4 weights or not) runs ``norm_qkv``."""
        if self.norm_in_qkv is None:
            return self.moe == "routed" and self.fused_qkv and batch == 1 and not quant
        return self.norm_in_qkv

    def fold_layer_end(self, batch: int, quant: bool) -> bool:
        """Whether each layer's end is computed inside the next layer's q|k|v kernel."""
        return self.norm_in_qkv_at(batch, quant)

    def __post_init__(self):
        if self.attention not in ("split", "fused", "fused_atomic"):
            raise ValueError("DecodeOptions.attention must be split|fused|fused_atomic, got "
                             f"{self.attention!r}")
        for name, keys in (("moe_tiling", self.MOE_TILING_KEYS),
                           ("lm_head_tiling", self.LM_HEAD_TILING_KEYS)):
            pairs = getattr(self, name)
            ok = isinstance(pairs, tuple) and all(
                isinstance(p, tuple) and len(p) == 2 and p[0] in keys for p in pairs)
            if not ok:
                raise ValueError(f"DecodeOptions.{name} must be a tuple of (name, value) pairs "
                                 f"with names from {keys}, got {pairs!r}")
        if self.moe_down_f16 and (self.moe_gate_up_f16 is False or self.moe_shared_rows == "all"):
            raise ValueError("DecodeOptions.moe_down_f16 needs the f16 gate_up (moe_gate_up_f16 "
                             "not False) and the shared expert per token (moe_shared_rows not "
                             f"'all'), got moe_gate_up_f16={self.moe_gate_up_f16!r}, "
                             f"moe_shared_rows={self.moe_shared_rows!r}")
        if self.moe_f16_sums not in ("pair", "block"):
            raise ValueError("DecodeOptions.moe_f16_sums must be 'pair' or 'block', got "
                             f"{self.moe_f16_sums!r}")
        if self.moe_shared_tokens is not None and self.moe_shared_tokens < 1:
            raise ValueError("DecodeOptions.moe_shared_tokens must be >= 1, got "
                             f"{self.moe_shared_tokens!r}")
        for name in ("ring_splits", "qkv_split_k", "attention_num_warps", "o_proj_split_k"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"DecodeOptions.{name} must be a power of two >= 1, got "
                                 f"{value!r}")
        if self.moe_shared_rows not in (None, "all", "token"):
            raise ValueError("DecodeOptions.moe_shared_rows must be None|'all'|'token', got "
                             f"{self.moe_shared_rows!r}")
        if self.moe_slot_rows not in (None, "all", "token"):
            raise ValueError("DecodeOptions.moe_slot_rows must be None|'all'|'token', got "
                             f"{self.moe_slot_rows!r}")
        if self.nvfp4_qkv_method not in (None, "rows", "dot", "swap"):
            raise ValueError("DecodeOptions.nvfp4_qkv_method must be None|'rows'|'dot'|'swap', "
                             f"got {self.nvfp4_qkv_method!r}")
        if self.nvfp4_m1_method not in (None, "reduce", "lanes", "blocks"):
            raise ValueError("DecodeOptions.nvfp4_m1_method must be None|'reduce'|'lanes'|"
                             "'blocks', got "
                             f"{self.nvfp4_m1_method!r}")
        if self.early_trigger not in (None, True, False, "all", "latency", "streams"):
            raise ValueError("DecodeOptions.early_trigger must be None, a bool or "
                             f"'all'|'latency'|'streams', got {self.early_trigger!r}")
        if (self.qkv_split_k or 1) > 1 and self.attention == "split":
            raise ValueError("DecodeOptions.qkv_split_k > 1 needs attention='fused' or "
                             "'fused_atomic' (the fused attention kernel sums the partials)")
        if self.nvfp4_asm not in ("auto", "mul", "mul_bf16", "shift", "post"):
            raise ValueError("DecodeOptions.nvfp4_asm must be 'auto', 'mul', 'mul_bf16', "
                             f"'shift' or 'post', got {self.nvfp4_asm!r}")
        if self.moe not in ("routed", "slots", "xla", "v1"):
            raise ValueError(f"DecodeOptions.moe must be routed|slots|xla|v1, got {self.moe!r}")
        if self.router_in_norm and self.moe != "routed":
            raise ValueError("DecodeOptions.router_in_norm needs moe='routed'")
        if self.moe_shared_with_topk and (self.moe != "routed" or self.moe_prerouted is False):
            raise ValueError("DecodeOptions.moe_shared_with_topk needs moe='routed' and "
                             "moe_prerouted not False (it computes the top-k itself)")
        if self.norm_in_qkv and (self.moe != "routed" or not self.fused_qkv):
            raise ValueError("DecodeOptions.norm_in_qkv needs moe='routed' and fused_qkv=True")


#: The session-1 Pallas step (three projection GEMVs, MoE routing in XLA), kept for comparison.
V1_OPTIONS = DecodeOptions(fused_qkv=False, moe="v1", attention="split")
#: Every fusion on (benchmark path "pallas_fused"); measured on the H200, none is the default.
FUSED_OPTIONS = DecodeOptions(router_in_norm=True, norm_in_qkv=True, attention="fused_atomic")


# Which implementation each op uses, from the H200 measurements (docs/kernels.md,
# docs/performance.md):
# - NVFP4 GEMVs and the NVFP4 MoE: Pallas (1.7-2.2x XLA's dequantize + dot at M=1).
# - BF16 o_proj, dense MLP and LM head: XLA (its GEMV reaches 3 TB/s where the Pallas one reaches
#   2). BF16 q|k|v and MoE: Pallas, because one kernel replaces 3 (q|k|v) or ~12 (MoE) launches:
#   4.45 -> 3.10 ms per token at batch 1 (perf log 6-7).
# - Attention, Q/K-norm + RoPE + cache write, residual add + RMSNorm: Pallas (1.1-30x).


def _linear(lin, x, interpret, out_dtype=jnp.bfloat16, method=None, sum_splits=True,
            bf16_pallas=False, split_k=None, tiling=(), x_inv=None):
    """x [M, K] -> [M, N]; ``method``: the NVFP4 kernel's tile method (None: its default).
    ``split_k`` / ``tiling`` (pairs of `nvfp4_gemv` keyword arguments): overrides of the Pallas
    GEMV's defaults (``DecodeOptions.o_proj_split_k`` / ``lm_head_tiling``).

    ``sum_splits=False``: a split-K Pallas GEMV returns its fp32 partials [S, M, N] unsummed, for
    `add_rms_norm` to sum (one launch less); only pass it where the result goes there.
    ``bf16_pallas``: BF16 weights on the Pallas `gemv` (K in 4 slices where it divides) instead
    of XLA's dot. ``x_inv`` (NVFP4): x is the f16 operand `x16_operand` gives, x_inv its
    factor (`nvfp4_gemv`'s).
    """
    if lin.quant:
        kw = dict(method=method, split_k=split_k, x_inv=x_inv)
        kw.update(tiling)
        return nvfp4_gemv(x, lin.qweight[...], lin.weight_scale[...], lin.weight_scale_2[...],
                          out_dtype=out_dtype, interpret=interpret, sum_splits=sum_splits, **kw)
    w = lin.weight[...]
    if bf16_pallas:
        k = w.shape[1]
        split = split_k or (4 if k % (4 * 256) == 0 else None)
        return gemv(x, w, out_dtype=out_dtype, split_k=split, interpret=interpret,
                    sum_splits=sum_splits)
    return layers.matmul_t(x, w).astype(out_dtype)


def _router_logits(x, router_w, pallas: bool, interpret: bool):
    """f32 router logits [M, E]: the Pallas `router_logits` kernel or XLA's dot."""
    if pallas:
        return router_logits(x, router_w, interpret=interpret)
    return moe_router_logits(x, router_w)


def _silu_mul(mlp, x, interpret, method=None, bf16_pallas=False):
    """bf16(silu(g) * u) in fp32 from g = bf16(x Wg^T), u = bf16(x Wu^T) (the model's rule);
    BF16 weights: XLA's dots, or with ``bf16_pallas`` the `gemv_silu_mul` kernel."""
    g, u = mlp.gate_proj, mlp.up_proj
    if g.quant:
        return nvfp4_gemv_silu_mul(
            x, (g.qweight[...], g.weight_scale[...], g.weight_scale_2[...]),
            (u.qweight[...], u.weight_scale[...], u.weight_scale_2[...]), method=method,
            interpret=interpret)
    if bf16_pallas:
        return gemv_silu_mul(x, g.weight[...], u.weight[...], interpret=interpret)
    return layers.silu_mul(layers.matmul_t(x, g.weight[...]).astype(x.dtype),
                           layers.matmul_t(x, u.weight[...]).astype(x.dtype))


def _qkv_weights(attn):
    return tuple(NVFP4Weight(lin.qweight[...], lin.weight_scale[...], lin.weight_scale_2[...])
                 if lin.quant else lin.weight[...]
                 for lin in (attn.q_proj, attn.k_proj, attn.v_proj))


def _qkv(attn, x, fused, interpret, method=None, split_k=1, counters=None, finish=False,
         **rms):
    """x [M, D] -> (q [M, H*Dh], k, v [M, KVH*Dh] bf16, counters); with the fused kernel and
    ``split_k`` > 1 their fp32 K-slice partials [S, M, N] instead (for the fused attention
    kernel), unless ``finish``: the kernel then finishes bf16 q / k / v itself on the cache's
    ``counters`` (`multi_gemv(counter=)`, entries from ``QKV_COUNTER_BASE``; returned as the
    kernel leaves them, else unchanged). ``rms``: multi_gemv's ``rms_sumsq`` / ``rms_weight``
    / ``rms_eps`` (x is then the residual)."""
    lins = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not fused:
        return (*(_linear(lin, x, interpret, method=method) for lin in lins), counters)
    kw = dict(method=method if lins[0].quant else None, split_k=split_k, interpret=interpret,
              **rms)
    if split_k > 1 and finish:
        (q, k, v), counters = multi_gemv(x, _qkv_weights(attn), counter=counters,
                                         counter_base=QKV_COUNTER_BASE, **kw)
        return q, k, v, counters
    return (*multi_gemv(x, _qkv_weights(attn), sum_splits=False, **kw), counters)


def _shared_arg(mlp):
    return {n: _lin_arg(getattr(mlp.shared_expert, n)) for n in ("gate_proj", "up_proj", "down_proj")}


def _moe_add_rms_norm(mlp, cfg, x, h, w_next, mode, interpret, logits=None, moe_kw=None,
                      counters=None, route=None, norm=True, x16_next=False):
    """The MoE block on x, then (h + moe, rms_norm(h + moe) * w_next). Routed mode: `logits`
    the router's (`_route`), `route` its routing when that was computed too, `moe_kw`
    `moe_decode_routed`'s options, `counters` the cache's counters, the combine then done by
    the down kernel (with ``norm=False`` it stops at h + moe and returns the sums of squares of
    its column blocks in x's place, `moe_decode_routed_combine`). Returns (h, x, counters,
    x16_rows), the counters as the kernels leave them (None when not given); ``x16_next`` with
    the combine in the down kernel: x16_rows = x's f16 operand (x16, inv) from that kernel,
    else None."""
    eps = cfg.rms_norm_eps
    k = cfg.num_experts_per_tok
    if mode == "v1":
        mode = "slots" if mlp.experts.quant else "xla"
    if mode == "routed":
        if counters is not None:   # the combine in the down kernel's last program
            s, x_next, _, counters, *x16_rows = moe_decode_routed_combine(
                x, logits, _experts_arg(mlp.experts), _shared_arg(mlp), h, w_next, counters,
                counter_base=COMBINE_COUNTER_BASE, eps=eps, norm=norm, top_k=k,
                interpret=interpret, route=route, x16_next=x16_next and norm,
                **(moe_kw or {}))
            return s, x_next, counters, (x16_rows[0] if x16_rows else None)
        y, route = moe_decode_routed(x, logits, _experts_arg(mlp.experts), _shared_arg(mlp),
                                     top_k=k, interpret=interpret, route=route, **(moe_kw or {}))
        return (*moe_combine_add_rms_norm(h, y, route.logits, w_next, eps=eps,
                                          interpret=interpret), counters, None)
    if mode == "slots":
        y = moe_block(x, mlp.gate.weight[...], _experts_arg(mlp.experts), _shared_arg(mlp),
                      top_k=cfg.num_experts_per_tok, interpret=interpret)
    else:
        y = mlp(x[:, None, :])[:, 0]  # the XLA path: gathered experts, einsums
    return (*add_rms_norm(h, y, w_next, eps=eps, interpret=interpret), counters, None)


def _lin_arg(lin):
    if lin.quant:
        return NVFP4Weight(lin.qweight[...], lin.weight_scale[...], lin.weight_scale_2[...])
    return lin.weight[...]


def _experts_arg(ex):
    names = (("gate_up_qweight", "gate_up_weight_scale", "gate_up_weight_scale_2",
              "down_qweight", "down_weight_scale", "down_weight_scale_2") if ex.quant
             else ("gate_up_proj", "down_proj"))
    return {n: getattr(ex, n)[...] for n in names}


def make_decode_step(graphdef, cfg: FlintConfig, *, interpret: bool = False, fallback=None,
                     options: DecodeOptions | None = None):
    """Returns step(state, cache, tokens [B] int32) -> (f32 logits [B, V], cache).

    Batches above MAX_BATCH rows (the low-latency kernels' limit) go to `fallback` (the XLA step).
    `options`: which fusions to use (`DecodeOptions()` by default).
    """
    opts = options or DecodeOptions()
    eps = cfg.rms_norm_eps
    h_, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def step(state, cache: KVCache, tokens):
        b = tokens.shape[0]
        if b > MAX_BATCH:
            if fallback is None:
                raise ValueError(f"the Pallas decode path takes at most {MAX_BATCH} rows, got {b}")
            return fallback(state, cache, tokens)
        m = nnx.merge(graphdef, state)
        quant = m.model.layers[0].self_attn.q_proj.quant
        # read when the kernels are traced (part of the trace context: cached per value)
        trigger, kinds = opts.early_trigger_for(quant)
        with pdl.early_trigger(trigger), pdl.early_trigger_kernels(kinds), \
                nvfp4_asm_decode(opts.nvfp4_asm_at("step")), nvfp4_f16_sums(opts.moe_f16_sums):
            return pallas_step(m, cache, tokens, quant)

    def pallas_step(m, cache: KVCache, tokens, quant: bool):
        b = tokens.shape[0]
        layers = m.model.layers
        pos = cache.lengths
        full_k, full_v, ring_k, ring_v = cache.full_k, cache.full_v, cache.ring_k, cache.ring_v
        h = jnp.take(m.model.embed_tokens.weight[...], tokens, axis=0)
        top_k = cfg.num_experts_per_tok
        # norm_in_qkv: the previous layer's output (y, and for MoE the selected router logits
        # the gate_up kernel stored) waits for the next q|k|v kernel, which forms the residual
        # and the normalised input itself.
        pending = (None, None)
        # One zeroed merge counter per step for every layer (attention="fused_atomic").
        counter = (jnp.zeros((len(layers), b, kvh), jnp.int32)
                   if opts.attention == "fused_atomic" else None)
        fold = opts.fold_layer_end(b, quant)
        # tile method of the NVFP4 GEMVs (the BF16 ones ignore it); the MoE gets it below, for
        # NVFP4 experts only
        nv_method = opts.nvfp4_m1_method if b == 1 else ("rows" if opts.nvfp4_rows else None)
        bf16_dense_pallas = opts.bf16_dense_pallas_at(b)
        moe_kw = dict(slot_rows=opts.moe_slot_rows if b > 1 else None,
                      down_shared_cols=opts.moe_down_shared_cols,
                      shared_rows=opts.moe_shared_rows if b > 1 else None,
                      prerouted=opts.moe_prerouted, shared_first=opts.moe_shared_first)
        moe_quant = any(cfg.is_moe(i) and lay.mlp.experts.quant for i, lay in enumerate(layers))
        if b == 1 and moe_quant and opts.nvfp4_m1_method:
            moe_kw["method"] = opts.nvfp4_m1_method
        if moe_quant:
            moe_kw["asm_down"] = opts.nvfp4_asm_at("moe_down")
        # nvfp4_swap=False: session 11's mma.sync tiles where the kernels now pick swap-AB
        swap_off = b > 1 and opts.nvfp4_swap is False
        all_rows = opts.moe_slot_rows == "all"   # NVFP4 experts: "token" by default at b > 1
        if swap_off and moe_quant and not nv_method and all_rows:
            moe_kw["method"] = "dot"
            moe_kw.update(block_n=64, block_k=256, num_warps=4, num_stages=3)
        gate_up_f16 = opts.gate_up_f16_at(b) and moe_quant
        if b > 1 or gate_up_f16:   # explicit tile overrides last (batch 1: the f16 MoE's)
            moe_kw.update(opts.moe_tiling)
        if b > 1 and opts.moe_shared_tokens not in (None, 1):
            moe_kw["shared_tokens"] = opts.moe_shared_tokens
        if b > 1 and moe_quant and opts.moe_shared_with_topk:
            moe_kw["shared_with_topk"] = True
        if gate_up_f16:
            moe_kw["gate_up_f16"] = True
            if b == 1:   # the one-token slots on the f16 K step
                moe_kw.update(slot_rows="token", shared_rows=opts.moe_shared_rows or "token")
            shared_quant = all(lay.mlp.shared_expert.down_proj.quant
                               for i, lay in enumerate(layers) if cfg.is_moe(i))
            if opts.down_f16_at(b, shared_quant):
                moe_kw["down_f16"] = True
        # The cache's counters (zeros between steps; each kernel returns its entries to zero),
        # threaded through the kernels that count on them: the BF16 MoE gate_up in K slices
        # (with the layer end folded into the next q|k|v) or the MoE combine in the down kernel
        # (where it is not folded).
        counters = cache.counters
        gate_up_split = opts.moe_gate_up_split_k_at(b) if (not moe_quant and fold) else 1
        rms_in_qkv = opts.rms_in_qkv_at(b, quant) and not fold
        combine_in_down = ((opts.combine_in_down_at(b) or rms_in_qkv) and not fold
                           and opts.moe == "routed")
        # the q|k|v's NVFP4 tile method at this batch (the rms_in_qkv one too)
        qkv_method = (opts.nvfp4_qkv_method if b > 1 else None) or nv_method
        pending_rms = None   # (sums of squares, norm weight): the next q|k|v normalises h
        qkv_split = (opts.qkv_split_k_at(b, quant, fold, cfg.hidden_size)
                     if opts.fused_qkv else 1)
        attn_warps = ({} if opts.attention_num_warps is None
                      else dict(num_warps=opts.attention_num_warps))
        # RoPE's cos / sin: computed by the first sliding layer's attention kernel, loaded by
        # the others (SASS: the sincos were ~30% of a ring program's instructions)
        rope_cs = None
        # lm_head_f16: the LM head on the f16 operand, which the last combine may write
        lm16 = opts.lm_head_f16_at(b) and m.lm_head.quant
        x16_head = None
        if not fold:
            x = rms_norm(h, layers[0].input_layernorm.weight[...], eps=eps, interpret=interpret)
        for i, layer in enumerate(layers):
            j = cfg.cache_index[i]
            sliding = cfg.is_sliding(i)
            attn = layer.self_attn
            last = i + 1 == len(layers)
            with jax.named_scope(f"layer_{i}"):
                if fold:
                    # with qkv_split > 1: fp32 partials [S, B, N], summed by the attention kernel
                    h, (q, k, v) = norm_qkv(h, _qkv_weights(attn), layer.input_layernorm.weight[...],
                                            y=pending[0], top_logits=pending[1], eps=eps,
                                            split_k=qkv_split, sum_splits=False,
                                            interpret=interpret)
                elif pending_rms is not None:   # x = RMSNorm(h), formed as it is loaded
                    with nvfp4_asm_decode(opts.nvfp4_asm_at("qkv")):
                        q, k, v, counters = _qkv(
                            attn, h, True, interpret, qkv_method, qkv_split, counters,
                            opts.qkv_finish, rms_sumsq=pending_rms[0],
                            rms_weight=pending_rms[1], rms_eps=eps)
                    pending_rms = None
                else:
                    with nvfp4_asm_decode(opts.nvfp4_asm_at("qkv")):
                        q, k, v, counters = _qkv(attn, x, opts.fused_qkv, interpret,
                                                 qkv_method, qkv_split, counters,
                                                 opts.qkv_finish)
                q = q.reshape(*q.shape[:-1], h_, hd)
                k, v = k.reshape(*k.shape[:-1], kvh, hd), v.reshape(*v.shape[:-1], kvh, hd)
                kc, vc = (ring_k, ring_v) if sliding else (full_k, full_v)
                window = cfg.sliding_window if sliding else None
                splits = opts.ring_splits if sliding else None
                if opts.attention == "split":
                    q, kc, vc = qk_norm_rope(
                        q, k, v, attn.q_norm.weight[...], attn.k_norm.weight[...], pos, kc, vc,
                        j, rope=sliding, ring=sliding, theta=cfg.rope_theta, eps=eps,
                        interpret=interpret)
                    o = decode_attention(q, kc, vc, pos, attn.sinks[...], j, ring=sliding,
                                         window=window, num_splits=splits, interpret=interpret)
                else:
                    atomic = dict(counter=counter, counter_layer=i, merge="atomic") if (
                        counter is not None) else dict(merge="kernel")
                    first_rope = sliding and rope_cs is None   # computes and returns cos / sin
                    res = qk_norm_rope_attention(
                        q, k, v, attn.q_norm.weight[...], attn.k_norm.weight[...], pos, kc, vc,
                        attn.sinks[...], j, rope=sliding, ring=sliding, window=window,
                        theta=cfg.rope_theta, eps=eps, num_splits=splits, interpret=interpret,
                        rope_cos_sin=rope_cs if sliding else None,
                        return_cos_sin=first_rope, **atomic, **attn_warps)
                    o, kc, vc = res[:3]
                    if counter is not None:
                        counter = res[3]
                    if first_rope:
                        rope_cs = res[-1]
                if sliding:
                    ring_k, ring_v = kc, vc
                else:
                    full_k, full_v = kc, vc
                router_in_norm = opts.router_in_norm_at(b) and cfg.is_moe(i)
                # add_rms_norm (or add_rms_norm_router) sums the o_proj's split-K partials
                a = _linear(attn.o_proj, o.reshape(b, h_ * hd), interpret, method=nv_method,
                            sum_splits=False, bf16_pallas=opts.bf16_o_proj_pallas_at(b),
                            split_k=opts.o_proj_split_k if b > 1 else None)
                mlp = layer.mlp
                post_ln = layer.post_attention_layernorm.weight[...]
                router_logits = None
                layer_moe_kw = {}
                if router_in_norm:
                    shared = mlp.shared_expert
                    h, x, router_logits, *x16_rows = add_rms_norm_router(
                        h, a, post_ln, mlp.gate.weight[...], eps=eps, interpret=interpret,
                        x16=gate_up_f16)
                    if x16_rows:   # and the MoE gate_up's f16 operand
                        layer_moe_kw = dict(x16_rows=tuple(x16_rows))
                elif gate_up_f16 and cfg.is_moe(i):   # and the MoE gate_up's f16 operand
                    h, x, *x16_rows = add_rms_norm(h, a, post_ln, eps=eps, x16=True,
                                                   interpret=interpret)
                    layer_moe_kw = dict(x16_rows=tuple(x16_rows))
                else:
                    h, x = add_rms_norm(h, a, post_ln, eps=eps, interpret=interpret)
                nxt = layers[i + 1].input_layernorm.weight[...] if not last else m.model.norm.weight[...]
                route = None
                if cfg.is_moe(i) and router_logits is None and opts.moe == "routed":
                    router_logits = _router_logits(x, mlp.gate.weight[...],
                                                   opts.router_pallas_at(b), interpret)
                if cfg.is_moe(i) and fold and not last:
                    split_kw = (dict(gate_up_split_k=gate_up_split, gate_up_counter=counters)
                                if gate_up_split > 1 else {})
                    y, route, *counter_out = moe_decode_routed(
                        x, router_logits, _experts_arg(mlp.experts), _shared_arg(mlp),
                        top_k=top_k, interpret=interpret, route=route, **moe_kw, **split_kw,
                        **layer_moe_kw)
                    if counter_out:
                        (counters,) = counter_out
                    pending = (y, route.logits)
                elif cfg.is_moe(i):
                    norm = not (rms_in_qkv and not last)   # else the next q|k|v normalises
                    # the last layer's full combine (its norm feeds the LM head) stays its own
                    # kernel where the combine in the down kernel is not the batch's choice
                    in_down = combine_in_down and (not norm or opts.combine_in_down_at(b))
                    h, x, out_counters, x16_head = _moe_add_rms_norm(
                        mlp, cfg, x, h, nxt, opts.moe, interpret, router_logits,
                        {**moe_kw, **layer_moe_kw},
                        counters=counters if in_down else None,
                        route=route, norm=norm, x16_next=lm16 and last)
                    if in_down:
                        counters = out_counters
                    if not norm:    # x holds the sums of squares of h's column blocks
                        x, pending_rms = None, (x, nxt)
                else:
                    hid = _silu_mul(mlp, x, interpret, nv_method, bf16_dense_pallas)
                    # partials only for add_rms_norm (norm_qkv takes [M, D])
                    y = _linear(mlp.down_proj, hid, interpret, method=nv_method,
                                sum_splits=fold and not last)
                    if fold and not last:
                        pending = (y, None)
                    else:
                        h, x = add_rms_norm(h, y, nxt, eps=eps, interpret=interpret)
        if lm16:   # the LM head on the f16 operand (from the last combine, else one XLA op)
            x16, x_inv = x16_head if x16_head is not None else x16_operand(x)
            logits = _linear(m.lm_head, x16, interpret, out_dtype=jnp.float32,
                             tiling=opts.lm_head_tiling, x_inv=x_inv)
        else:
            logits = _linear(m.lm_head, x, interpret, out_dtype=jnp.float32,
                             method=nv_method or ("dot" if swap_off else None),
                             tiling=opts.lm_head_tiling if b > 1 else ())
        new_cache = KVCache(full_k=full_k, full_v=full_v, ring_k=ring_k, ring_v=ring_v,
                            lengths=pos + 1,
                            counters=counters)
        return logits, new_cache

    return step
