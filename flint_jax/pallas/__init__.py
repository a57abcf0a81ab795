"""Fused Pallas (Triton backend) kernels for Flint decode and prefill on NVIDIA GPUs (H200 target).

One op per module (the MoE: one package of rooms), each kernel beside its plain-jnp
``*_reference`` (same math-level signature, the numerical contract of the kernel and the XLA
fallback). Import the ops from their modules (``from flint_jax.pallas.multi_gemv import
multi_gemv``): the package re-exports nothing, so a module and its op never shadow each other.

| module | op (the decode step's use) |
|---|---|
| ``multi_gemv`` | ``multi_gemv``: 1-4 GEMVs sharing x (q\\|k\\|v), bf16 or NVFP4; NVFP4 with the RMSNorm on load |
| ``norm_qkv`` | ``norm_qkv``: MoE combine / residual add + RMSNorm + the bf16 q\\|k\\|v, one kernel (BF16, batch 1) |
| ``nvfp4_gemv`` | ``nvfp4_gemv``, ``nvfp4_gemv_silu_mul``: W4A16 GEMV (o_proj, dense MLP, LM head) |
| ``gemv`` | ``gemv_silu_mul``: bf16 fused gate/up + SiLU (BF16 dense layers, batch 1) |
| ``attention_block`` | ``qk_norm_rope_attention``: Q/K norm + RoPE + cache write + split-KV sink attention, then the merge |
| ``decode_attention`` | the attention's reference and merge kernel |
| ``qk_norm_rope`` | the Q/K norm + RoPE reference and row code |
| ``add_rms_norm`` | ``add_rms_norm`` (with split-K partials, with the f16 operand), ``rms_norm`` |
| ``add_rms_norm_router`` | ``add_rms_norm_router``: residual add + RMSNorm + fp32 router GEMV (batch 1) |
| ``moe`` | the routed MoE: ``routing`` / ``gate_up`` / ``down`` / ``combine`` / ``tiling`` (``MoEPlan``) |
| ``pdl`` | ``launch_dependents``: every kernel wrapper's ``early_trigger`` lets the next kernel launch first |
| ``grouped_matmul`` | ``moe_experts``: prefill's routed experts, grouped GEMMs over rows sorted by expert (``group_rows``), fused SiLU(gate)*up, BF16 or NVFP4 decoded in the K loop |
| ``prefill_attention`` | ``prefill_attention``: flash attention with sinks for prefill chunks (bottom-right causal, GQA, window blocks skipped, cache or ring + chunk keys) |

Every wrapper is jitted with its tuning knobs static, takes ``early_trigger`` (static) and
``interpret=True`` to run on CPU. One section per kernel in ``docs/kernels.md``
(its tuning log is in that file at commit 35c0874).
"""

# In interpret mode jax 0.11.2's Pallas lowering imports its fuser lazily, in the middle of the
# first kernel's trace, and that import defines a jit-keyed config state
# (`pallas_fuser_disable_nested_fuse`): the trace context grows by one value after the first
# jitted decode call was traced, so its second call misses the cache and traces and compiles the
# whole step again (on CPU; the GPU lowering does not reach that import, H200 run 170). Defining
# the state here, before any trace, keeps one compile (test_fast_decode::test_decode_compiles_once).
from jax.experimental.pallas import fuser as _fuser  # noqa: F401

__all__ = []
