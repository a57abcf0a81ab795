"""Which Flint shapes and dtypes the Pallas decode step supports (issue 45).

``decode_support(cfg, quant, dtype)`` checks a model against the table below when it is
loaded, from its config before any weight is read (``loading.resolve_kernels``, called by every
path of ``loading.load``; ``from_module`` and ``make_handle`` check handles made other ways):
``kernels="pallas"`` refuses a model with a "step" problem in one line naming the field and the
limit; ``kernels="auto"`` takes the XLA path for it with a one-line notice. A problem with an
op's name as its scope (``"lm_head"``) is not a refusal: the Pallas step runs that op through
XLA (``fast_decode.make_decode_step``).

The kernels keep their own ``C.check``s as the last line of defence; each rule here names the
check it stands for.

| field | BF16 | NVFP4 | scope | the kernels' check |
|---|---|---|---|---|
| dtype | bfloat16 | bfloat16 | step | ``qk_norm_rope`` / ``decode_attention``: q, k, v and the caches share a dtype; every kernel computes in bf16 operands |
| head_dim | power of two >= 32 | same | step | ``attention_block``: Dh/2 >= 16 (the dot's K), ``qk_norm_rope``: Dh/2 a power of two |
| head_dim | <= 256 | same | step | the prefill's cuDNN flash attention (full layers, GPU): <= 256 on Hopper (``jax._src.cudnn``'s check; it raises at the first prompt); the Pallas attention kernels are not compiled or tested above 256 either |
| hidden_size | multiple of 16 | multiple of 64 | step | K steps of 16 bf16 / 64 NVFP4 values (``multi_gemv``, ``norm_qkv`` block_d, the MoE down kernel's block_n_down >= 16) |
| num_attention_heads * head_dim | (power of two >= 32 with head_dim) | multiple of 64 | step | the o_proj's K (``nvfp4_gemv``) |
| moe_intermediate_size | multiple of 16 | multiple of 64 | step | the MoE gate_up's row block (>= 16, dividing I and I_s) and the down kernel's K steps (``moe.gate_up`` / ``moe.down``) |
| shared_expert_intermediate_size | multiple of 16 | multiple of 64 | step | as moe_intermediate_size |
| intermediate_size (with dense layers) | multiple of 16 | multiple of 64 | step | the dense gate|up's row block (``gemv_silu_mul`` / ``nvfp4_gemv_silu_mul``), the NVFP4 down's K |
| vocab_size | any (XLA's dot) | multiple of 16 | lm_head | ``nvfp4_gemv``: block_n a power of two >= 16 dividing N |

Not load-time properties, checked per call: the batch (1..16 rows on the Pallas step, more on
the XLA step: ``fast_decode.MAX_BATCH``) and the cache length S, which the attention kernels
need divisible by their key block (a power of two >= 16; ``decode.bucket_length`` allocates
multiples of 64 and larger, ``attention_block`` checks it).

Out-of-bounds access. For an accepted shape every block either tiles its dimension exactly (the
kernels' ``C.check``s: a block size a power of two dividing the dimension, so each ``pl.ds``
slice lies inside the array) or is padded to a power of two and read and stored through masks
(a masked-off element is not accessed) or clamped indices (``_common.row_load_index`` /
``row_store_index`` for the 1..16 rows and the G query heads; the K and N blocks of
``grouped_matmul``, Dh in ``prefill_attention``, E in the router kernels). These rules keep
the shapes inside what those checks and masks cover. What the CPU sweep
(tests/test_shape_sweep.py, interpret mode) can and cannot see: interpret mode does not fault on an out-of-bounds access. A load
with array indices is clamped to an in-bounds element (finite, plausible), a ``pl.ds`` slice
that overruns reads padding (NaN for float arrays, the integer minimum for integer ones: 0 for
the uint8 NVFP4 codes) and an out-of-bounds store is dropped. So its finiteness assert catches
only float slice overruns; any other out-of-bounds access shows at most as a deviation from the
XLA step. On a GPU the same access reads or writes other memory or faults: the compiled sweep
of the GPU test stage (``FLINT_SWEEP=full``) runs the same cases; no memory checker
(compute-sanitizer) has been run over them.

Prefill. The Pallas path is also the prefill kernels on a GPU (``Flint.pallas_prefill``:
``prefill_kernels="auto"`` follows ``kernels``), so this table covers them too:

- ``grouped_matmul`` (the routed experts): BF16 takes any D, I and E (masked, clamped loads
  for sizes that are not multiples of its blocks); NVFP4 needs K % 64 (D, I) and N % 16 (I, D),
  which the NVFP4 rows above imply. It refuses nothing else at a model's shapes.
- ``prefill_attention``: any head_dim (padded to a power of two, masked; the GPU's dots need
  >= 16, implied by >= 32 above) and any group size (padded); full layers need the cache length
  a multiple of its key block (64, what ``decode.bucket_length`` allocates: checked per call),
  sliding layers a window <= the ring (``FlintConfig.ring_size`` rounds it up to 64).
- cuDNN's flash attention (``cudnn_attention``, the full layers' default on a GPU for bf16):
  head_dim a multiple of 8 and <= 256 on Hopper: the head_dim <= 256 row above, so a model
  accepted here does not fail at its first prompt on an H100 / H200 (before Hopper cuDNN takes
  <= 128: head_dim 256 is not covered there).
- dense layers, the shared expert, the projections and the LM head of prefill are XLA dots.

Not checked at load: ``prefill_kernels="pallas"`` asked for explicitly on a handle whose
``kernels`` is "xla" (a float32 model, say) runs the prefill kernels whatever this table says.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flint_jax.config import FlintConfig

__all__ = ["Problem", "Support", "decode_support"]


@dataclasses.dataclass(frozen=True)
class Problem:
    field: str      # the config field (or "dtype")
    value: object
    limit: str      # what the kernels need, in words
    scope: str      # "step" (the whole Pallas step) or the op that runs on XLA instead

    def __str__(self):
        return f"{self.field}={self.value} ({self.limit})"


@dataclasses.dataclass(frozen=True)
class Support:
    problems: tuple[Problem, ...]

    @property
    def step(self) -> tuple[Problem, ...]:
        """Problems that rule out the whole Pallas step."""
        return tuple(p for p in self.problems if p.scope == "step")

    @property
    def ok(self) -> bool:
        return not self.step

    def xla_ops(self) -> frozenset[str]:
        """Ops the Pallas step runs on XLA for this model."""
        return frozenset(p.scope for p in self.problems if p.scope != "step")

    def message(self, scope: str = "step") -> str:
        ps = [p for p in self.problems if p.scope == scope]
        return "; ".join(str(p) for p in ps)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decode_support(cfg: FlintConfig, quant: bool, dtype=jnp.bfloat16) -> Support:
    """The table above, for one model: ``Support.problems`` lists every rule it breaks."""
    fmt = "NVFP4" if quant else "BF16"
    mult = 64 if quant else 16
    out = []

    def need(ok, field, value, limit, scope="step"):
        if not ok:
            out.append(Problem(field, value, limit, scope))

    dt = jnp.dtype(dtype)
    need(dt == jnp.dtype(jnp.bfloat16), "dtype", dt.name,
         "the Pallas decode kernels take bfloat16 models")
    hd = cfg.head_dim
    need(_pow2(hd) and hd >= 32, "head_dim", hd,
         "the Pallas attention kernels need a power of two >= 32")
    need(hd <= 256, "head_dim", hd,
         "the prefill's cuDNN attention takes at most 256 (and no Pallas kernel is tested above)")
    need(cfg.hidden_size % mult == 0, "hidden_size", cfg.hidden_size,
         f"{fmt} Pallas kernels need a multiple of {mult}")
    if quant:
        qd = cfg.num_attention_heads * hd
        need(qd % 64 == 0, "num_attention_heads*head_dim", qd,
             "the NVFP4 o_proj kernel needs a multiple of 64")
    has_moe = any(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    has_dense = any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    if has_moe:
        for f in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            v = getattr(cfg, f)
            need(v % mult == 0, f, v, f"{fmt} Pallas MoE kernels need a multiple of {mult}")
    if has_dense:
        v = cfg.intermediate_size
        need(v % mult == 0, "intermediate_size", v,
             f"{fmt} Pallas dense MLP kernels need a multiple of {mult}")
    if quant:
        need(cfg.vocab_size % 16 == 0, "vocab_size", cfg.vocab_size,
             "the NVFP4 LM head kernel needs a multiple of 16", scope="lm_head")
    return Support(tuple(out))
