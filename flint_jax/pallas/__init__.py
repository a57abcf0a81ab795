"""Fused Pallas (Triton backend) kernels for Flint decode on NVIDIA GPUs (H200 target).

One op per module, each beside its plain-jnp ``*_reference`` (same math-level signature, the
numerical contract of the kernel and the XLA fallback):

| module | op |
|---|---|
| ``gemv`` | ``gemv``, ``gemv_silu_mul``: bf16 small-batch GEMV, fused gate/up + SiLU |
| ``multi_gemv`` | ``multi_gemv``: 1-4 GEMVs sharing x (fused q, k, v), bf16 or NVFP4 |
| ``norm_qkv`` | ``norm_qkv``: MoE combine / residual add + RMSNorm + ``multi_gemv``, one kernel |
| ``layer_end_qkv`` | ``layer_end_qkv``: the same split into producer programs and GEMV programs |
| | that load their weights first and wait on a device-side counter |
| ``nvfp4_gemv`` | ``nvfp4_gemv``, ``nvfp4_gemv_silu_mul``: W4A16 GEMV on the half-split layout |
| ``moe`` | ``moe_route`` (XLA), ``moe_decode``, ``moe_block``: expert-indexed MoE decode; |
| | ``moe_block_add_rms_norm``: routing in-kernel + fused combine/add/norm (4 launches; 5 for NVFP4 at M > 1: the top-k kernel) |
| ``decode_attention`` | ``decode_attention``: split-KV sink-softmax attention, full or ring cache |
| ``qk_norm_rope`` | ``qk_norm_rope``: per-head q/k RMSNorm + NeoX RoPE + KV-cache write |
| ``attention_block`` | ``qk_norm_rope_attention``: ``qk_norm_rope`` fused into the attention |
| | split kernel; merge by a second kernel or by the last split program (atomic counter) |
| ``add_rms_norm`` | ``add_rms_norm``, ``rms_norm`` |
| ``add_rms_norm_router`` | ``add_rms_norm_router``: residual add + RMSNorm + fp32 router GEMV; |
| | ``moe_block_from_attention``: attention output -> next block's input, 4 launches |
| ``router`` | ``router_logits``: the fp32 MoE router GEMV for a few tokens (batch > 1); |
| | ``router_logits_topk``: the same with the top-k in its last program (atomic counter) |
| ``l2_prefetch`` | ``prefetch_l2``: a later kernel's weights into the L2 (cp.async.bulk; |
| | measured no gain, off: docs/performance.md perf log 44) |
| ``pdl`` | ``launch_dependents``, ``grid_dependency_wait``: programmatic dependent launch |
| | from inside a kernel; ``early_trigger``: every kernel lets the next one launch first |
| ``load_stages`` | ``stages(n)``: ``tt.num_stages`` on the dot-free K loops (cp.async for the |
| | CUDA-core kernels' weight loads) |
| ``grouped_matmul`` | ``moe_experts``: prefill's routed experts, grouped GEMMs over rows sorted by |
| | expert (``group_rows``), fused SiLU(gate)*up, BF16 or NVFP4 decoded in the K loop |
| ``prefill_attention`` | ``prefill_attention``: flash attention with sinks for prefill chunks |
| | (bottom-right causal, GQA, window blocks skipped, cache or ring + chunk keys) |
| ``mosaic_gemv`` | ``mosaic_gemv``: bf16 GEMV on Mosaic GPU (TMA + wgmma) with an optional |
| | programmatic-dependent-launch wait; a probe, not used by the decode step (docs/kernels.md) |

Every wrapper is jitted with its tuning knobs static and takes ``interpret=True`` to run on CPU.
Measurements and the tuning log live in ``docs/kernels.md``.
"""

# In interpret mode jax 0.11.2's Pallas lowering imports its fuser lazily, in the middle of the
# first kernel's trace, and that import defines a jit-keyed config state
# (`pallas_fuser_disable_nested_fuse`): the trace context grows by one value after the first
# jitted decode call was traced, so its second call misses the cache and traces and compiles the
# whole step again (on CPU; the GPU lowering does not reach that import, H200 run 170). Defining
# the state here, before any trace, keeps one compile (test_fast_decode::test_decode_compiles_once).
from jax.experimental.pallas import fuser as _fuser  # noqa: F401

from flint_jax.pallas import load_stages as _load_stages

_load_stages.install()   # kernels named "..._ls<n>" get their dot-free loops pipelined

from flint_jax.pallas.add_rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from flint_jax.pallas.add_rms_norm_router import (add_rms_norm_router,
                                                  add_rms_norm_router_reference,
                                                  moe_block_from_attention,
                                                  moe_block_from_attention_reference)
from flint_jax.pallas.attention_block import (qk_norm_rope_attention,
                                              qk_norm_rope_attention_reference)
from flint_jax.pallas.decode_attention import decode_attention, decode_attention_reference
from flint_jax.pallas.gemv import gemv, gemv_reference, gemv_silu_mul, gemv_silu_mul_reference
from flint_jax.pallas.grouped_matmul import moe_experts, moe_experts_reference
from flint_jax.pallas.layer_end_qkv import layer_end_qkv, layer_end_qkv_reference
from flint_jax.pallas.moe import (MoERoute, moe_block, moe_block_add_rms_norm,
                                  moe_block_add_rms_norm_reference, moe_block_reference,
                                  moe_combine_add_rms_norm, moe_combine_add_rms_norm_reference,
                                  moe_decode, moe_decode_reference, moe_decode_routed,
                                  moe_decode_routed_combine,
                                  moe_decode_routed_reference, moe_route, moe_route_from_logits,
                                  moe_route_weights, moe_router_logits, moe_slots,
                                  moe_topk_route)
from flint_jax.pallas.multi_gemv import multi_gemv, multi_gemv_reference
from flint_jax.pallas.norm_qkv import norm_qkv, norm_qkv_reference
from flint_jax.pallas.prefill_attention import prefill_attention, prefill_attention_reference
from flint_jax.pallas.nvfp4_gemv import (NVFP4Weight, dequantize_nvfp4_reference, nvfp4_gemv,
                                         nvfp4_gemv_reference, nvfp4_gemv_silu_mul,
                                         nvfp4_gemv_silu_mul_reference)
from flint_jax.pallas.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from flint_jax.pallas.router import (router_logits, router_logits_reference, router_logits_topk,
                                     router_logits_topk_reference)
from flint_jax.pallas import pdl  # noqa: E402  (griddepcontrol primitives, early_trigger)
from flint_jax.pallas import ffi_launch  # noqa: E402  (our own PDL launch of a Pallas kernel)

__all__ = [
    "add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference",
    "add_rms_norm_router", "add_rms_norm_router_reference", "moe_block_from_attention",
    "moe_block_from_attention_reference",
    "decode_attention", "decode_attention_reference",
    "gemv", "gemv_reference", "gemv_silu_mul", "gemv_silu_mul_reference",
    "moe_block", "moe_block_reference", "moe_decode", "moe_decode_reference", "moe_route",
    "moe_slots", "moe_router_logits", "moe_route_from_logits", "MoERoute", "moe_topk_route",
    "moe_route_weights", "moe_decode_routed", "moe_decode_routed_combine",
    "moe_decode_routed_reference", "moe_combine_add_rms_norm",
    "moe_combine_add_rms_norm_reference", "moe_block_add_rms_norm",
    "moe_block_add_rms_norm_reference",
    "moe_experts", "moe_experts_reference", "prefill_attention", "prefill_attention_reference",
    "multi_gemv", "multi_gemv_reference", "norm_qkv", "norm_qkv_reference",
    "layer_end_qkv", "layer_end_qkv_reference",
    "NVFP4Weight", "dequantize_nvfp4_reference", "nvfp4_gemv", "nvfp4_gemv_reference",
    "nvfp4_gemv_silu_mul", "nvfp4_gemv_silu_mul_reference",
    "qk_norm_rope", "qk_norm_rope_reference",
    "qk_norm_rope_attention", "qk_norm_rope_attention_reference",
    "router_logits", "router_logits_reference", "router_logits_topk",
    "router_logits_topk_reference",
]
