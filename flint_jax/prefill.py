"""Chunked prefill on the Pallas prefill kernels: grouped-GEMM experts and flash attention.

The same contract as the XLA path's chunk step (`FlintForCausalLM.__call__`, run by
`decode.Flint.chunk_fn` and `decode.prefill`): a chunk of `T` tokens per row goes through the
model against the KV cache, each row at its own positions (`cache.lengths`), `n_tokens[b]`
valid tokens per row, and the cache comes back exactly as the XLA path leaves it (full layers:
slot = position; sliding layers: the ring of the last `R` positions; `lengths += n_tokens`).

Per layer:

- attention: q/k/v projections, QK-norm and RoPE (sliding layers) in XLA (the module's math,
  `_qkv`; NVFP4 weights of the XLA dots are dequantized into bf16 buffers of their own once per
  chunk, `_linear`); full layers write the chunk's K/V into the stacked cache (an in-place
  scatter) and attend by reading it; sliding layers attend over [the ring before the chunk, the chunk's own
  K/V] and then write the ring (`pallas.prefill_attention`, bottom-right causal, window blocks
  skipped, sinks in the denominator); on a GPU the full layers attend on cuDNN's flash attention
  instead (`cudnn_attention`, `PrefillOptions.attention`); the o_proj in XLA.
- MoE: the fp32 router (bf16x6 dot on the tensor cores) and top-k in XLA, the routed experts as two grouped GEMMs over rows
  sorted by expert (`pallas.grouped_matmul.moe_experts`: SiLU(gate)*up fused; NVFP4 decoded in
  the K loop, or dequantized to bf16 first for large chunks; padding tokens are not routed), the
  weighted combine and the shared expert in XLA.
- dense layers and the LM head: XLA dots (tensor cores).

Chunk policy (`chunk_length`): chunks of up to `max_tokens` tokens in all (default 16,384: every
expert then sees ~380 rows per chunk, so its weights are read once per many tokens), T a power
of two, so one compiled function serves every prompt of a batch size whose longest row fits
the same T. Activations scale with `max_tokens` (under 1 GB at 16K tokens for Flint, mostly the
down projection's padded rows, [131072, 2048] bf16; NVFP4 experts dequantized for a chunk add
1.6 GB of bf16 weights per MoE layer while it runs), never with the prompt length; attention
builds no `[T, S]` buffer.

`prefill(model, rows, cache_length)` takes what `decode.prefill` takes and returns what it
returns; `chunk_fn(model)` is the jitted step with `decode.Flint.chunk_fn`'s signature;
`run_prefill` is the chunk loop of both (`decode` imports this module; it imports nothing of
`decode`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax import cudnn_attention, layers
from flint_jax.cache import KVCache, check_cache_fits, init_cache
from flint_jax.pallas.grouped_matmul import moe_experts
from flint_jax.pallas.prefill_attention import prefill_attention

F32 = jnp.float32

#: Tokens per prefill chunk, all rows together (module docstring).
DEFAULT_MAX_TOKENS = 16384

#: ``PrefillOptions.attention``: the full layers' attention kernel ("auto": cuDNN on a GPU for
#: bf16 / fp16 models, else the Pallas kernel).
ATTENTION = ("auto", "pallas", "cudnn")

#: ``PrefillOptions.router`` -> the router logits dot's precision.
ROUTER_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST,
                     "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


@dataclasses.dataclass(frozen=True)
class PrefillOptions:
  """Static knobs of the prefill kernels (hashable: a key of the jitted step). None everywhere
  means the kernels' own defaults, the best measured on the H200 (docs/prefill.md).

  ``block_m``: rows per expert tile (``grouped_matmul.default_block_m``); ``gate_up_blocks`` /
  ``down_blocks``: (block_n, block_k) of the two grouped GEMMs; ``moe_warps`` / ``moe_stages``:
  their Triton compiler parameters; ``nvfp4_experts``: NVFP4 experts decoded in the kernels or
  dequantized first (``grouped_matmul.NVFP4_MODES``); ``router``: the fp32 router logits as an
  XLA dot at ``Precision.HIGHEST`` ("highest") or with the ``BF16_BF16_F32_X6`` algorithm
  ("bf16x6": the f32 router weight split exactly into three bf16 parts, each product with the
  bf16 activations exact, fp32 sums: the same fp32 logits up to summation order, on the tensor
  cores; the default: 134.4 against 138.1 ms at 1 x 8K BF16, H200 run 196); ``attention``: the
  full layers' attention on the Pallas kernel ("pallas") or on cuDNN's flash attention
  (``cudnn_attention.full_attention``, two calls merged by log-sum-exp; on the CPU its
  plain-JAX stand-in); "auto" (default) = cuDNN on a GPU for bf16 / fp16 models (1 x 32K BF16:
  715 against 745 ms, H200 run prefill-2), else Pallas; ``attn_full`` / ``attn_ring``:
  (block_q, block_k, num_warps, num_stages) of the Pallas full-layer and sliding-layer
  attention (entries may be None); ``interpret``: None = on any backend but the GPU."""
  block_m: int | None = None
  gate_up_blocks: tuple | None = None
  down_blocks: tuple | None = None
  moe_warps: int | None = None
  moe_stages: int | None = None
  nvfp4_experts: str = "auto"
  router: str = "bf16x6"
  attention: str = "auto"
  attn_full: tuple | None = None
  attn_ring: tuple | None = None
  interpret: bool | None = None

  def __post_init__(self):
    if self.router not in ROUTER_PRECISIONS:
      raise ValueError(f"router must be one of {tuple(ROUTER_PRECISIONS)}, got {self.router!r}")
    if self.attention not in ATTENTION:
      raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

  def resolved_interpret(self) -> bool:
    return jax.default_backend() != "gpu" if self.interpret is None else self.interpret

  def resolved_attention(self, dtype) -> str:
    """"pallas" or "cudnn" for a model of this dtype ("auto": cuDNN where it runs)."""
    if self.attention != "auto":
      return self.attention
    ok = not self.resolved_interpret() and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "cudnn" if ok else "pallas"

  def attention_kwargs(self, ring: bool) -> dict:
    bq, bk, nw, ns = (self.attn_ring if ring else self.attn_full) or (None,) * 4
    return dict(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns,
                interpret=self.resolved_interpret())


def chunk_length(batch: int, t_max: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                 minimum: int = 16) -> int:
  """T of the chunks: the power of two >= the longest row (at least ``minimum``), at most the
  largest power of two with ``batch * T <= max_tokens`` (but never below ``minimum``)."""
  t = max(minimum, 1 << max(0, int(t_max) - 1).bit_length())
  cap = max(minimum, 1 << max(0, (max_tokens // max(1, batch)).bit_length() - 1))
  return min(t, cap)


def _scatter_rows(cache, j, new, slots):
  """cache [L, B, KVH, S, Dh] layer j <- new [B, T, KVH, Dh] at slots [B, T] (out of range:
  dropped): model._scatter_rows on the layer stack, in place."""
  b, t, kvh, _ = new.shape
  bi = jnp.arange(b)[:, None, None]
  hi = jnp.arange(kvh)[None, None, :]
  return cache.at[j, bi, hi, slots[:, :, None]].set(new.astype(cache.dtype), mode="drop")


def _linear(lin, x, out_dtype=None):
  """``lin(x, out_dtype)`` (``model.Linear``, the same math), with an NVFP4 weight dequantized
  into a bf16 buffer of its own first: the ``optimization_barrier`` keeps XLA from fusing the
  elementwise decode into the GEMM's operand loads, where each of the chunk's ``T / tile``
  row tiles would decode the whole weight again; materialised, it is decoded once per chunk
  (~50 MB written per layer) and the dot is a plain bf16 GEMM."""
  if not lin.quant:
    return lin(x, out_dtype)
  w = jax.lax.optimization_barrier(lin.dense_weight(x.dtype))
  y = layers.matmul_t(x, w) * lin.weight_scale_2[...]
  return y.astype(out_dtype or x.dtype)


def _qkv(attn, x, positions):
  """``FlintAttention.qkv`` through ``_linear``: q [B,T,H,Dh], k, v [B,T,KVH,Dh]."""
  cfg = attn.cfg
  b, t, _ = x.shape
  q = _linear(attn.q_proj, x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
  k = _linear(attn.k_proj, x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
  v = _linear(attn.v_proj, x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
  q, k = attn.q_norm(q), attn.k_norm(k)
  if attn.sliding:
    cos, sin = layers.rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
  return q, k, v


def _mlp(mlp, x, out_dtype=None):
  """``FlintMLP.__call__`` (dense layers, shared expert) through ``_linear``."""
  return _linear(mlp.down_proj, layers.silu_mul(_linear(mlp.gate_proj, x),
                                                _linear(mlp.up_proj, x)), out_dtype)


def _experts_dict(experts) -> dict:
  names = (("gate_up_qweight", "gate_up_weight_scale", "gate_up_weight_scale_2", "down_qweight",
            "down_weight_scale", "down_weight_scale_2") if experts.quant
           else ("gate_up_proj", "down_proj"))
  return {n: getattr(experts, n)[...] for n in names}


def chunk_forward(m, tokens: jax.Array, cache: KVCache, n_tokens: jax.Array, *,
                  logits: str = "last", options: PrefillOptions = PrefillOptions()):
  """One prefill chunk through the module tree ``m`` (a ``FlintForCausalLM``).

  tokens: int32 [B, T] (right-padded); n_tokens: int32 [B] valid tokens per row (0 allowed).
  logits: "last" -> f32 [B, V] at each row's last valid token (garbage for n_tokens == 0),
  "all" -> f32 [B, T, V], "none" -> None. Returns (logits, new_cache, {}): the XLA step's
  outputs (no captures)."""
  cfg = m.cfg
  interpret = options.resolved_interpret()
  b, t = tokens.shape
  offs = jnp.arange(t, dtype=jnp.int32)[None, :]
  lengths = cache.lengths
  positions = lengths[:, None] + offs
  valid = offs < n_tokens[:, None]
  lengths_after = lengths + n_tokens
  full_k, full_v, ring_k, ring_v = cache.full_k, cache.full_v, cache.ring_k, cache.ring_v
  r = cache.ring_size
  full_kw, ring_kw = options.attention_kwargs(False), options.attention_kwargs(True)
  h = m.model.embed_tokens(tokens).astype(m.dtype)
  for i, layer in enumerate(m.model.layers):
    j = cfg.cache_index[i]
    attn = layer.self_attn
    with jax.named_scope(f"layer_{i}"):
      q, k, v = _qkv(attn, layer.input_layernorm(h), positions)
      sinks = attn.sinks[...]
      if cfg.is_sliding(i):
        o = prefill_attention(q, ring_k, ring_v, lengths, n_tokens, sinks, j, k, v, ring=True,
                              window=cfg.sliding_window, **ring_kw)
        # The ring write must follow the kernel that reads the old ring: tie it to the output,
        # so that XLA updates the ring stack in place instead of copying it first.
        o, ring_k, ring_v = jax.lax.optimization_barrier((o, ring_k, ring_v))
        keep = valid & (positions >= lengths_after[:, None] - r)
        slots = jnp.where(keep, positions % r, r)
        ring_k, ring_v = _scatter_rows(ring_k, j, k, slots), _scatter_rows(ring_v, j, v, slots)
      else:
        slots = jnp.where(valid, positions, full_k.shape[3])
        full_k, full_v = _scatter_rows(full_k, j, k, slots), _scatter_rows(full_v, j, v, slots)
        if options.resolved_attention(q.dtype) == "cudnn":
          o = cudnn_attention.full_attention(
              q, full_k, full_v, j, lengths, n_tokens, sinks, k, v,
              implementation="xla" if interpret else "cudnn")
        else:
          o = prefill_attention(q, full_k, full_v, lengths, n_tokens, sinks, j, ring=False,
                                **full_kw)
      h = h + _linear(attn.o_proj, o.reshape(b, t, -1))
      x = layer.post_attention_layernorm(h)
      if layer.moe:
        h = h + _moe(layer.mlp, x, valid, options, interpret)
      else:
        h = h + _mlp(layer.mlp, x)
  new_cache = KVCache(full_k=full_k, full_v=full_v, ring_k=ring_k, ring_v=ring_v,
                      lengths=lengths_after, counters=cache.counters)
  out = None
  if logits != "none":
    if logits == "last":
      idx = jnp.maximum(n_tokens - 1, 0)
      h = jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
    out = m.lm_head(m.model.norm(h), out_dtype=F32)
  return out, new_cache, {}


def _moe(moe, x, valid, options: PrefillOptions, interpret: bool):
  """FlintMoE.__call__ with the routed experts on the grouped GEMMs. x [B, T, D]."""
  cfg = moe.cfg
  b, t, d = x.shape
  xf = x.reshape(b * t, d)
  _, weights, ids = layers.router_topk(xf, moe.gate.weight[...], cfg.num_experts_per_tok,
                                       cfg.norm_topk_prob, ROUTER_PRECISIONS[options.router])
  y = moe_experts(xf, weights, ids, _experts_dict(moe.experts), valid.reshape(b * t),
                  block_m=options.block_m, gate_up_blocks=options.gate_up_blocks,
                  down_blocks=options.down_blocks, num_warps=options.moe_warps,
                  num_stages=options.moe_stages, nvfp4=options.nvfp4_experts,
                  interpret=interpret)
  y = y + _mlp(moe.shared_expert, xf).astype(F32)
  return y.astype(x.dtype).reshape(b, t, d)


def chunk_fn(model, logits: str = "last", options: PrefillOptions = PrefillOptions()):
  """jit(leaves, tokens [B, T], cache, n_tokens [B]) -> (logits, cache, {}), the cache donated:
  ``decode.Flint.chunk_fn``'s signature on the prefill kernels (one compile per chunk shape)."""
  from flax import nnx   # pylint: disable=g-import-not-at-top

  def build():
    graphdef, unflatten = model.graphdef, model._unflatten()

    def run(leaves, tokens, cache, n_tokens):
      m = nnx.merge(graphdef, unflatten(leaves))
      return chunk_forward(m, tokens, cache, n_tokens, logits=logits, options=options)

    return jax.jit(run, donate_argnums=(2,))

  return model.jitted(("prefill_chunk", logits, options), build)


def run_prefill(model, rows: list[list[int]], cache_length: int, chunk: int, fn, stats=None):
  """The chunk loop of ``decode.prefill`` and ``prefill``, with the chunk length and the jitted
  chunk step ``fn`` (``decode.Flint.chunk_fn``'s signature) given: allocates the cache, runs the
  right-padded rows through it chunk by chunk and keeps each row's logits at its last token.
  With ``stats`` (a ``decode.GenerationStats``), the first chunk call's time is added to
  ``stats.compile_s``."""
  cfg = model.config
  b = len(rows)
  lengths = np.array([len(r) for r in rows], np.int32)
  check_cache_fits(cfg, b, cache_length, model.dtype,
                   num_devices=model.mesh.size if model.mesh is not None else 1)
  shardings = model.cache_sharding(b, cache_length) if model.cache_sharding else None
  cache = init_cache(cfg, b, cache_length, model.dtype, shardings)
  t_max = int(lengths.max())
  n_chunks = -(-t_max // chunk)
  tokens = np.zeros((b, n_chunks * chunk), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  last = None
  for c in range(n_chunks):
    n = np.clip(lengths - c * chunk, 0, chunk).astype(np.int32)
    t0 = time.perf_counter()
    logits, cache, _ = fn(model.leaves, jnp.asarray(tokens[:, c * chunk:(c + 1) * chunk]), cache,
                          jnp.asarray(n))
    if c == 0 and stats is not None:
      stats.compile_s += time.perf_counter() - t0
    last = logits if last is None else jnp.where(jnp.asarray(n > 0)[:, None], logits, last)
  return last, cache


def prefill(model, rows: list[list[int]], cache_length: int, chunk_size: int | None = None, *,
            max_tokens: int = DEFAULT_MAX_TOKENS, options: PrefillOptions = PrefillOptions()):
  """``decode.prefill`` on the prefill kernels: allocates a cache and runs the prompts through it
  in chunks of ``chunk_size`` tokens per row (None: ``chunk_length(B, longest, max_tokens)``).

  Returns (last-token logits f32 [B, V], cache). Rows may have different lengths."""
  chunk = chunk_size or chunk_length(len(rows), max(len(r) for r in rows), max_tokens)
  return run_prefill(model, rows, cache_length, chunk, chunk_fn(model, "last", options))
