"""Decode benchmark: full-size Flint with random weights built on the device.

For each weight format (bf16, nvfp4), batch and context: the median decode-step time of the XLA
path and of the Pallas path in the same run, tokens/s, the HBM floor (bytes a step must read at
4.3 TB/s, spec section 9) and the percent of it reached, and (with --trace) the kernels launched
per step counted from a profiler trace. The cache is filled with random keys and values up to the
context length (never zeros), so attention reads real data.

Run: `flint-jax bench [--dtype bf16 nvfp4] [--batch 1 8] [--context 1024 8192 100000]` (GPU), or
`flint-jax bench --config tiny --steps 5` for a CPU smoke run. Results: a table on stdout and
JSON with --out.
"""

from __future__ import annotations

import functools
import gzip
import glob
import json
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flint_jax.cache import KVCache, cache_shapes
from flint_jax.config import FlintConfig, preset
from flint_jax.engine import Flint
from flint_jax.model import FlintForCausalLM

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (spec section 9)


def rel_l2(a, b) -> float:
    """Relative L2 error of logits b against reference logits a (both taken as f32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def step_bytes(cfg: FlintConfig, batch: int, context: int, quant: bool) -> float:
    """Bytes one decode step must read at least: active weights and the KV cache in use.

    NVFP4 linear weights cost 36/64 bytes per value (codes + E4M3 scales); the router stays fp32.
    With several rows, the distinct experts touched per layer are counted by their expectation
    under uniform routing: E * (1 - (1 - k/E)^B).
    """
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    wb = 36 / 64 if quant else 2.0
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    experts = e * (1 - (1 - k / e) ** batch)
    attn = (h * hd * d * 2 + kv * hd * d * 2) * wb
    total = cfg.vocab_size * d * wb + batch * d * 2  # lm_head + embedding rows
    for i in range(cfg.num_hidden_layers):
        total += attn
        if cfg.is_moe(i):
            total += e * d * 4 + 3 * d * cfg.shared_expert_intermediate_size * wb
            total += experts * 3 * d * cfg.moe_intermediate_size * wb
        else:
            total += 3 * d * cfg.intermediate_size * wb
    kv_token = 2 * kv * hd * 2
    total += batch * kv_token * (len(cfg.full_layers) * context
                                 + len(cfg.sliding_layers) * min(context, cfg.sliding_window))
    return total


def _leaf_kind(name: str) -> str:
    if name.endswith("qweight"):
        return "codes"
    if name.endswith("weight_scale"):
        return "block_scale"
    if name.endswith("weight_scale_2"):
        return "tensor_scale"
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith("self_attn.sinks"):
        return "sinks"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if name.endswith("embed_tokens.weight"):
        return "embedding"
    return "linear"


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind", "hidden"))
def _random_leaf(key, *, shape, dtype, kind, hidden):
    # The value ranges of model.py's initialisers, one small compiled generator per distinct
    # (shape, kind): jitting the whole module's init at full size took 4 minutes to compile.
    f32 = jnp.float32
    if kind == "codes":
        return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(dtype)
    if kind == "block_scale":
        return jax.random.uniform(key, shape, f32, 64.0, 448.0).astype(dtype)
    if kind == "tensor_scale":
        return jnp.full(shape, 0.02 / (2.93 * 256.0), dtype)
    if kind == "norm":
        return (1.0 + 0.1 * jax.random.normal(key, shape, f32)).astype(dtype)
    if kind == "sinks":
        return jax.random.normal(key, shape, dtype)
    if kind == "router":
        return (0.5 / hidden ** 0.5) * jax.random.normal(key, shape, dtype)
    std = 1.0 if kind == "embedding" else 0.02
    return jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)


def build_state(cfg: FlintConfig, quant: bool, seed: int = 0):
    """Random full-size weights generated on the device, leaf by leaf (no host copy)."""
    abstract = nnx.eval_shape(lambda: FlintForCausalLM(cfg, dtype=jnp.bfloat16, quant=quant,
                                                       rngs=nnx.Rngs(seed)))
    graphdef, abs_state = nnx.split(abstract)
    pairs = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abs_state)):
        sds = var.get_value()
        name = ".".join(str(p) for p in path)
        value = _random_leaf(jax.random.key(seed * 100003 + i), shape=tuple(sds.shape),
                             dtype=jnp.dtype(sds.dtype), kind=_leaf_kind(name),
                             hidden=cfg.hidden_size)
        pairs.append((path, var.replace(value=value)))
    return graphdef, nnx.from_flat_state(pairs)


def random_cache(cfg: FlintConfig, batch: int, length: int, context: int, seed: int = 1) -> KVCache:
    shapes = cache_shapes(cfg, batch, length, jnp.bfloat16)

    @jax.jit
    def make():
        keys = jax.random.split(jax.random.key(seed), 4)
        # Drawn directly in bf16: an fp32 temporary of a 100K-token batch-8 cache is 30 GB.
        arrs = [jax.random.normal(kk, s.shape, s.dtype) * jnp.asarray(0.5, s.dtype)
                for kk, s in zip(keys, (shapes.full_k, shapes.full_v, shapes.ring_k, shapes.ring_v))]
        return KVCache(*arrs, lengths=jnp.full((batch,), context, jnp.int32),
                       counters=jnp.zeros(shapes.counters.shape, jnp.int32))

    return make()


def time_steps(step, state, cache, tokens, steps: int, windows: int = 5):
    """Median per-step time (ms) of `steps` back-to-back asynchronous steps, over `windows`."""
    logits, cache = step(state, cache, tokens)  # compile + warm up
    logits, cache = step(state, cache, tokens)
    jax.block_until_ready(logits)
    per_step = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(state, cache, tokens)
        jax.block_until_ready(logits)
        per_step.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(per_step), per_step, logits, cache


def time_loop(model, cache, tokens, block: int, calls: int, windows: int = 5):
    """Per-step time (ms) of greedy decoding `block` steps per device call (the `generate` loop:
    a fori_loop of steps with sampling inside), two ways, medians over `windows`.

    steady: as `stream_generate` runs, one call always queued behind the one running; the clock
    runs between the completions of calls `calls` apart, so the host's per-call dispatch (~5 ms
    for the full-size Pallas step, run 127) hides under the GPU's work whenever it is shorter.
    This is the per-token time of a long generation.
    idle: windows of `calls` calls started from an idle device (the suite's in-loop figure up to
    run 126), so the first call's dispatch is on the clock: with 2 calls of 8 steps it adds
    ~0.3 ms per step (run 127). This is closer to the latency of a short generation.

    Returns (steady_ms, idle_ms, cache).
    """
    from flint_jax.sampling import SamplingParams
    fn = model.decode_fn(SamplingParams(temperature=0.0), False, block)
    state = {"cache": cache, "rng": jax.random.key(0)}

    def call(last):
        toks, _, state["cache"], _, state["rng"] = fn(model.leaves, state["cache"], last,
                                                       state["rng"], None)
        return toks

    toks = call(tokens)  # compile + warm up
    jax.block_until_ready(toks)
    idle = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            toks = call(toks[:, -1])
        jax.block_until_ready(toks)
        idle.append((time.perf_counter() - t0) * 1e3 / (calls * block))
    running = call(toks[:, -1])
    queued = call(running[:, -1])
    jax.block_until_ready(running)
    steady = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            nxt = call(queued[:, -1])   # queued behind the call the device is running
            jax.block_until_ready(queued)
            queued = nxt
        steady.append((time.perf_counter() - t0) * 1e3 / (calls * block))
    jax.block_until_ready(queued)
    return statistics.median(steady), statistics.median(idle), state["cache"]


def count_kernels(step, state, cache, tokens, steps: int = 3, top: int = 40):
    """GPU kernels per step from a profiler trace, and where the device time goes.

    Returns ({"kernels": launches per step, "kernel_us": summed kernel durations per step,
    "by_kernel": the `top` kernel names by time: [name, launches/step, us/step]}, cache).
    XLA turns command buffers off while profiling, so the trace's gaps between kernels are not
    the real ones (time without the profiler); the kernel durations are.
    """
    logdir = tempfile.mkdtemp(prefix="flint-trace-")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(steps):
            logits, cache = step(state, cache, tokens)
        jax.block_until_ready(logits)
    files = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return None, cache
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    return kernel_stats(trace, steps, top), cache


def kernel_stats(trace, steps: int, top: int = 40) -> dict:
    """Launches and durations per step of the GPU kernels in a perfetto trace (dict or list of
    events): kernels are complete ("X") events on threads whose name starts with "Stream"."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    stream_tids = set()
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            if str(ev.get("args", {}).get("name", "")).startswith("Stream"):
                stream_tids.add((ev.get("pid"), ev.get("tid")))
    by_name: dict[str, list] = {}
    n = 0
    total = 0.0
    spans = []
    for ev in events:
        if ev.get("ph") == "X" and (ev.get("pid"), ev.get("tid")) in stream_tids:
            n += 1
            dur = float(ev.get("dur", 0.0))
            total += dur
            spans.append((float(ev.get("ts", 0.0)), dur))
            rec = by_name.setdefault(str(ev.get("name", "?")), [0, 0.0])
            rec[0] += 1
            rec[1] += dur
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": n / steps, "kernel_us": total / steps, "busy_us": busy_time(spans) / steps,
            "by_kernel": [[name, c / steps, round(d / steps, 2)] for name, (c, d) in ranked]}


def busy_time(spans) -> float:
    """Length of the union of (start, duration) intervals: the time some kernel was on the GPU.
    Unlike the sum of durations it does not count twice a kernel launched early by programmatic
    dependent launch, whose CTAs sit at their entry wait while their predecessor runs."""
    busy, end = 0.0, float("-inf")
    for start, dur in sorted(spans):
        stop = start + dur
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


_PRESCALED: list = []   # [(state, its prescaled copy)]: one copy per benchmark state


def _prescaled(state):
    from flint_jax.nvfp4 import prescale_state
    if not _PRESCALED or _PRESCALED[0][0] is not state:
        _PRESCALED[:] = [(state, prescale_state(state))]
    return _PRESCALED[0][1]


def _fixed_routing(state):
    """The state with every MoE router weight zeroed: all logits 0, so every token selects
    experts 0 .. top_k - 1 (ties go to the lowest index) in every layer and step."""
    pairs = []
    for path, var in nnx.to_flat_state(state):
        if ".".join(str(p) for p in path).endswith("mlp.gate.weight"):
            var = var.replace(value=jnp.zeros_like(var.get_value()))
        pairs.append((path, var))
    return nnx.from_flat_state(pairs)


#: Short names of the tile keys in "pallas_mt-..." / "pallas_lm-..." paths.
_TILE_ABBREV = {"bn": "block_n", "bk": "block_k", "w": "num_warps", "s": "num_stages",
                "bnd": "block_n_down", "bkd": "block_k_down", "wd": "num_warps_down",
                "sd": "num_stages_down", "sk": "split_k", "ca": "codes_ahead"}


def tiling_options(variant: str):
    """`DecodeOptions` of a tile-override path variant: "osk8" (`o_proj_split_k=8`),
    "mt-bnd32-wd8" (`moe_tiling`: block_n_down 32, num_warps_down 8; the token "f16" adds
    `moe_gate_up_f16`, e.g. "mt-f16-w8", and "shtopk" `moe_shared_with_topk`) or
    "lm-bn64-w4-dot" (`lm_head_tiling`; a bare word is the tile method, except "x16":
    `lm_head_f16`, e.g. "lm-x16-bk512-w4"). Keys: ``_TILE_ABBREV``."""
    import re
    from flint_jax.fast_decode import DecodeOptions
    if variant.startswith("osk"):
        return DecodeOptions(o_proj_split_k=int(variant[3:]))
    kind, *tokens = variant.split("-")
    pairs, extra = [], {}
    for tok in tokens:
        if kind == "mt" and tok == "f16":
            extra["moe_gate_up_f16"] = True
            continue
        if kind == "mt" and tok == "shtopk":
            extra["moe_shared_with_topk"] = True
            continue
        if kind == "lm" and tok == "x16":
            extra["lm_head_f16"] = True
            continue
        match = re.fullmatch(r"([a-z]+?)(\d+)", tok)
        if match and match[1] in _TILE_ABBREV:
            pairs.append((_TILE_ABBREV[match[1]], int(match[2])))
        elif kind == "lm" and tok.isalpha():
            pairs.append(("method", tok))
        else:
            raise ValueError(f"bad tile token {tok!r} in path variant {variant!r}; keys: "
                             f"{sorted(_TILE_ABBREV)}")
    field = "moe_tiling" if kind == "mt" else "lm_head_tiling"
    return DecodeOptions(**{field: tuple(pairs)}, **extra)


def make_handle(cfg, graphdef, state, quant, path: str) -> Flint:
    """A model handle for a benchmark path: "xla", "pallas" (default `DecodeOptions`),
    "pallas_v1" (the session-1 Pallas step: three projection GEMVs, MoE routing in XLA) or
    "pallas_fused" (every fusion, including those off by default until measured), "pallas_nq"
    / "pallas_nonq" (`norm_in_qkv` forced on / off; the default: on for BF16 at batch 1), "pallas_fa" / "pallas_faa" (attention "fused" /
    "fused_atomic"), "pallas_nqfa" / "pallas_nqfaa" (both), "pallas_sp" (attention "split": the
    session-2 default step), "pallas_rsN" (the sliding layers' attention in N splits,
    `DecodeOptions.ring_splits`), "pallas_aw2" / "pallas_aw8" / "pallas_aw16"
    (`attention_num_warps`: the fused attention kernels on 2 / 8 / 16 warps per program instead
    of 4), "pallas_rmsq" / "pallas_normsq" (`rms_in_qkv` on / off: the MoE layers' next RMSNorm
    applied by the next q|k|v kernel as it loads the residual; on by default at batch 1), "pallas_qw" (`qkv_wait`: each layer's end and the next q|k|v as one producer /
    consumer kernel), "pallas_allrows" / "pallas_tokrows" (the routed MoE's
    `moe_slot_rows` forced to "all" / "token"), "pallas_tokpre" / "pallas_tokpresf" /
    "pallas_allpresf" (`moe_slot_rows` "token" / "all" with `moe_prerouted`, and
    `moe_shared_first`), "pallas_nopresf" (both off: the batch 2-4 default before run 100),
    "pallas_shtok" / "pallas_shall" (`moe_shared_rows` "token": the shared expert per token on
    the M = 1 tiles, the NVFP4 default since run 102 / "all": its rows on one program per row
    block), "pallas_tokshtok" (per-token slots and shared expert: the NVFP4 batch > 1 MoE, for
    BF16 experts), "pallas_toknopre" / "pallas_toknopresf" (per-token slots with the routing in
    every gate_up program, no top-k kernel; and the shared expert's programs not first),
    "pallas_rtopk" / "pallas_notopk" (`router_topk` on / off: the MoE's top-k in the router
    kernel's last program / in its own kernel, the default), "pallas_qkvdot" /
    "pallas_qkvrows" (`nvfp4_qkv_method`: the NVFP4 q|k|v at batch > 1 on dot / rows tiles),
    "pallas_rows" (`nvfp4_rows`: CUDA-core tiles for
    the NVFP4 GEMVs at batch > 1), "pallas_lanes" / "pallas_reduce" / "pallas_blocks" (`nvfp4_m1_method`: the
    NVFP4 GEMVs and MoE at batch 1 on the "lanes" / "reduce" / "blocks" tile method), "pallas_rin"
    (`router_in_norm` forced on: add + norm + router GEMV in one kernel; the default at batch 1
    only), "pallas_norin" (forced off), "pallas_xgu" (`bf16_dense_pallas=False`: the BF16 dense
    gate|up on XLA at batch 1 too), "pallas_gusk2" / "pallas_gusk4" (`moe_gate_up_split_k`: the
    BF16 MoE gate_up kernel's K in 2 / 4 slices), "pallas_qsk1/2/4/8/16" (`qkv_split_k`: the
    fused q|k|v kernel's K in 1 to 16 slices, `norm_qkv` or `multi_gemv`, its partials summed
    by the attention kernel), "pallas_qfin" (`qkv_finish`: the q|k|v kernel's last K slice of
    each tile sums the partials itself), "pallas_osk8" (`o_proj_split_k`), "pallas_mt-bnd32-wd8" /
    "pallas_lm-bn64-w4" (`moe_tiling` / `lm_head_tiling` at batch > 1, `tiling_options`),
    "pallas_lm-x16" / "pallas_lm-x16-bk512-w4" (`lm_head_f16` forced on: the batch-1 NVFP4 LM
    head on f16x2 products, the default since run 164, with its tiles), "pallas_nolm16" (off:
    the f32 blocks tiles),
    "pallas_x16w" (`x16_loads="words"`: the f16 K step's operand loaded per code word),
    "pallas_ls3" / "pallas_ls3-moe" / "pallas_ls2-gemv" (`load_stages` / `load_stage_kernels`:
    the dot-free K loops software-pipelined in that many stages, in all / the MoE / the dense
    NVFP4 GEMV kernels),
    "pallas_sht2" / "pallas_sht4" / "pallas_sht8" (`moe_shared_tokens`: the shared expert's
    gate_up programs each decode their tile once for 2 / 4 / 8 tokens), "pallas_mt-f16"
    (`moe_gate_up_f16` forced on: the MoE gate_up's f16x2 products, the default at batch > 1;
    with tile tokens, e.g. "pallas_mt-f16-bn32"), "pallas_nogu16" (forced off), "pallas_dn16"
    (`moe_down_f16`: the MoE down kernel's f16x2 products too; on by default since run 158),
    "pallas_nodn16" (off), "pallas_f16blk" / "pallas_dn16blk" (`moe_f16_sums="block"`, the
    default: those kernels' f16 sums over whole blocks), "pallas_f16pair" (session 24's pair
    sums), "pallas_gu16pair" (session 24's default: pair sums, the down kernel in f32),
    "pallas_b1f16" / "pallas_b1gu16" (`moe_gate_up_f16=True`: the f16 MoE kernels, at batch 1
    the default since run 160, with / without the f16 down kernel), "pallas_nogu16" for the
    f32 sums at every batch, "pallas_shtopk" (`moe_shared_with_topk`: at batch > 1 the shared
    expert's gate_up programs in the top-k kernel, the gate_up kernel only the routed slots),
    "pallas_trig" / "pallas_notrig" (`early_trigger` forced on / off: every kernel's early PDL
    trigger, `pallas.pdl`), "pallas_triglat" / "pallas_trigstr" (only the latency-bound / only
    the weight-streaming kernels trigger), "pallas_pf" (`l2_prefetch=True`: later kernels'
    weights fetched into the L2 by the attention, router and MoE down kernels),
    "pallas_pfa" / "pallas_pfr" / "pallas_pfd" / "pallas_pfad" / "pallas_pfkv" (only those
    sites; kv: the sliding layers' attention programs fetch their first K / V blocks),
    "pallas_xrouter" / "pallas_prouter" (`router_pallas` forced off / on: the batch > 1 router
    GEMV on XLA / the Pallas kernel), "pallas_po" / "pallas_xo" (`bf16_o_proj_pallas` on / off:
    the BF16 o_proj at batch > 1 on the Pallas gemv, partials summed by the norm kernel),
    "pallas_sc1" / "pallas_sc2" (`moe_down_shared_cols`: the shared expert's down columns over 1
    / 2 programs per block), "pallas_cd" / "pallas_nocd" (`moe_combine_in_down` on / off: the
    MoE combine + add + norm in the down kernel's last program), "pallas_rincd" /
    "pallas_rincdnopre" / "pallas_cdnopre" (the batch-1 layer end at batch > 1: the router in
    the norm kernel and / or the combine in the down kernel, with or without the top-k
    kernel), "pallas_ffi" (`launch="ffi"`:
    every kernel compiled by the triton package and launched by flint_jax's FFI call),
    "pallas_noswap" (`nvfp4_swap=False`: the NVFP4 MoE gate_up and LM head at batch > 1 on
    session 11's dot tiles), "pallas_shift" (`nvfp4_asm="shift"`: the NVFP4 decode's session-11 instruction sequence),
    "pallas_mulbf16" (`nvfp4_asm="mul_bf16"`: the multiply decode without the f32 outputs),
    "pallas_post" (`nvfp4_asm="post"`: the batch-1 blocks tiles scale each block's sum instead of
    each decoded weight, in every kernel), "pallas_mul" (`nvfp4_asm="mul"` in every kernel: the
    default until run 91, which gives q|k|v and the MoE down kernel "post"),
    "pallas_e4m3" (NVFP4: the default step on the state's e4m3 block scales; every other Pallas
    path gets them pre-scaled to bf16, `nvfp4.prescale_state`, as `flint_jax.load` does),
    "pallas_tlba" / "pallas_tlbr" / "pallas_tlbg" / "pallas_tlbrg" / "pallas_tlbarg"
    (`tlb_touch` "attn" / "router" / "gate_up" / both / all three: kernels touch every 2 MiB
    page of the MoE experts before the kernels that read them), "xla_fixroute" /
    "pallas_fixroute" (the router weights zeroed: every token of every step selects experts 0-5,
    so the step reads the same expert pages each time; what a first-touch cost per expert is
    worth)."""
    from flint_jax.fast_decode import FUSED_OPTIONS, V1_OPTIONS, DecodeOptions
    kernels, _, variant = path.partition("_")
    if kernels == "pallas" and quant and variant != "e4m3":
        state = _prescaled(state)   # as `flint_jax.load` holds it for the Pallas path on a GPU
    if variant == "fixroute":    # shares every other array with the state
        state, variant = _fixed_routing(state), ""
    if variant.startswith("rs"):
        return Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels=kernels,
                     decode_options=DecodeOptions(ring_splits=int(variant[2:])))
    if variant.startswith("sht") and variant[3:].isdigit():
        return Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels=kernels,
                     decode_options=DecodeOptions(moe_shared_tokens=int(variant[3:])))
    if variant.startswith(("osk", "mt-", "lm-")):
        return Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels=kernels,
                     decode_options=tiling_options(variant))
    options = {"": None, "v1": V1_OPTIONS, "fused": FUSED_OPTIONS,
               "nq": DecodeOptions(norm_in_qkv=True),
               "nogu16": DecodeOptions(moe_gate_up_f16=False),
               "dn16": DecodeOptions(moe_down_f16=True),
               "nodn16": DecodeOptions(moe_down_f16=False),
               "f16pair": DecodeOptions(moe_f16_sums="pair"),
               "f16blk": DecodeOptions(moe_f16_sums="block"),
               "dn16blk": DecodeOptions(moe_down_f16=True, moe_f16_sums="block"),
               "gu16pair": DecodeOptions(moe_down_f16=False, moe_f16_sums="pair"),
               "b1f16": DecodeOptions(moe_gate_up_f16=True),
               "b1gu16": DecodeOptions(moe_gate_up_f16=True, moe_down_f16=False),
               "shtopk": DecodeOptions(moe_shared_with_topk=True),
               "nolm16": DecodeOptions(lm_head_f16=False),
               "nonq": DecodeOptions(norm_in_qkv=False),
               "sp": DecodeOptions(attention="split"),
               "fa": DecodeOptions(attention="fused"),
               "faa": DecodeOptions(attention="fused_atomic"),
               "nqfaa": DecodeOptions(norm_in_qkv=True, attention="fused_atomic"),
               "nqfa": DecodeOptions(norm_in_qkv=True, attention="fused"),
               "allrows": DecodeOptions(moe_slot_rows="all"),
               "tokrows": DecodeOptions(moe_slot_rows="token"),
               "tokpre": DecodeOptions(moe_slot_rows="token", moe_prerouted=True),
               "tokpresf": DecodeOptions(moe_slot_rows="token", moe_prerouted=True,
                                         moe_shared_first=True),
               "allpresf": DecodeOptions(moe_slot_rows="all", moe_prerouted=True,
                                         moe_shared_first=True),
               "nopresf": DecodeOptions(moe_prerouted=False, moe_shared_first=False),
               "shtok": DecodeOptions(moe_shared_rows="token"),
               "shall": DecodeOptions(moe_shared_rows="all"),
               "rmsq": DecodeOptions(rms_in_qkv=True),
               "normsq": DecodeOptions(rms_in_qkv=False),
               "aw2": DecodeOptions(attention_num_warps=2),
               "aw8": DecodeOptions(attention_num_warps=8),
               "aw16": DecodeOptions(attention_num_warps=16),
               "tokshtok": DecodeOptions(moe_slot_rows="token", moe_shared_rows="token"),
               "toknopre": DecodeOptions(moe_slot_rows="token", moe_prerouted=False),
               "toknopresf": DecodeOptions(moe_slot_rows="token", moe_prerouted=False,
                                           moe_shared_first=False),
               "qkvdot": DecodeOptions(nvfp4_qkv_method="dot"),
               "qkvrows": DecodeOptions(nvfp4_qkv_method="rows"),
               "rows": DecodeOptions(nvfp4_rows=True),
               "rin": DecodeOptions(router_in_norm=True),
               "norin": DecodeOptions(router_in_norm=False),
               "xgu": DecodeOptions(bf16_dense_pallas=False),
               "lanes": DecodeOptions(nvfp4_m1_method="lanes"),
               "shift": DecodeOptions(nvfp4_asm="shift"),
               "mulbf16": DecodeOptions(nvfp4_asm="mul_bf16"),
               "post": DecodeOptions(nvfp4_asm="post"),
               "mul": DecodeOptions(nvfp4_asm="mul"),
               "noswap": DecodeOptions(nvfp4_swap=False),
               "reduce": DecodeOptions(nvfp4_m1_method="reduce"),
               "blocks": DecodeOptions(nvfp4_m1_method="blocks"),
               "gusk2": DecodeOptions(moe_gate_up_split_k=2),
               "gusk4": DecodeOptions(moe_gate_up_split_k=4),
               "qsk1": DecodeOptions(qkv_split_k=1),
               "qsk2": DecodeOptions(qkv_split_k=2),
               "qsk4": DecodeOptions(qkv_split_k=4),
               "qsk8": DecodeOptions(qkv_split_k=8),
               "qsk16": DecodeOptions(qkv_split_k=16),
               "qfin": DecodeOptions(qkv_finish=True),
               "trig": DecodeOptions(early_trigger=True),
               "notrig": DecodeOptions(early_trigger=False),
               "triglat": DecodeOptions(early_trigger="latency"),
               "trigstr": DecodeOptions(early_trigger="streams"),
               "xrouter": DecodeOptions(router_pallas=False),
               "prouter": DecodeOptions(router_pallas=True),
               "po": DecodeOptions(bf16_o_proj_pallas=True),
               "xo": DecodeOptions(bf16_o_proj_pallas=False),
               "sc1": DecodeOptions(moe_down_shared_cols=1),
               "sc2": DecodeOptions(moe_down_shared_cols=2),
               "cd": DecodeOptions(moe_combine_in_down=True),
               "rincd": DecodeOptions(router_in_norm=True, moe_combine_in_down=True),
               "rincdnopre": DecodeOptions(router_in_norm=True, moe_combine_in_down=True,
                                           moe_prerouted=False),
               "cdnopre": DecodeOptions(moe_combine_in_down=True, moe_prerouted=False),
               "nocd": DecodeOptions(moe_combine_in_down=False),
               "e4m3": None}[variant]
    return Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels=kernels,
                 decode_options=options)


def run_case(cfg, graphdef, state, quant, batch, context, paths, steps, trace, loop_block=8):
    """One (batch, context) case for every path; a path that fails records its error and the
    others still run."""
    from flint_jax.decode import bucket_length
    # Room for the warm-up, the timed windows and the parity logits after `context`.
    length = bucket_length(context + steps * 14 + 64, 1 << 30, minimum=256)
    tokens = jax.random.randint(jax.random.key(3), (batch,), 0, cfg.vocab_size, jnp.int32)
    floor_ms = step_bytes(cfg, batch, context, quant) / HBM_BYTES_PER_S * 1e3
    row = {"format": "nvfp4" if quant else "bf16", "batch": batch, "context": context,
           "floor_ms": floor_ms, "floor_gb": step_bytes(cfg, batch, context, quant) / 1e9}
    logits_by_path = {}
    for path in paths:
        try:
            model = make_handle(cfg, graphdef, state, quant, path)
            step = model.decode_logits_fn()
            cache = random_cache(cfg, batch, length, context)
            t0 = time.perf_counter()
            ms, windows, logits, cache = time_steps(step, model.leaves, cache, tokens, steps)
            row[f"{path}_step_s_incl_compile"] = time.perf_counter() - t0
            row[f"{path}_ms"] = ms
            row[f"{path}_windows_ms"] = windows
            row[f"{path}_tok_s"] = batch / ms * 1e3
            row[f"{path}_pct_floor"] = 100 * floor_ms / ms
            if loop_block:
                (row[f"{path}_loop_ms"], row[f"{path}_loop_idle_ms"],
                 cache) = time_loop(model, cache, tokens, loop_block, max(2, steps // loop_block))
                row[f"{path}_loop_pct_floor"] = 100 * floor_ms / row[f"{path}_loop_ms"]
            if trace and jax.default_backend() == "gpu":
                stats, cache = count_kernels(step, model.leaves, cache, tokens)
                if stats:
                    row[f"{path}_kernels"] = stats["kernels"]
                    row[f"{path}_kernel_us"] = stats["kernel_us"]
                    row[f"{path}_busy_us"] = stats["busy_us"]
                    row[f"{path}_by_kernel"] = stats["by_kernel"]
            # Same inputs for every path: the logits of one step from the same cache contents.
            del cache, logits
            cache = random_cache(cfg, batch, length, context)
            logits_by_path[path], cache = step(model.leaves, cache, tokens)
            del cache
        except Exception as e:  # noqa: BLE001 (a benchmark reports, then goes on)
            row[f"{path}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"[{path}] FAILED: {row[f'{path}_error'][:500]}", flush=True)
    if "xla" in logits_by_path:
        a = np.asarray(logits_by_path["xla"], np.float32)
        for p, lg in logits_by_path.items():
            if p == "xla":
                continue
            b = np.asarray(lg, np.float32)
            tag = "" if p == "pallas" else f"_{p}"
            row[f"rel_l2_pallas_vs_xla{tag}"] = rel_l2(a, b)
            row[f"argmax_equal{tag}"] = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    elif "pallas" in logits_by_path:  # a run without the XLA path: compare with the default step
        a = np.asarray(logits_by_path["pallas"], np.float32)
        for p, lg in logits_by_path.items():
            if p != "pallas":
                b = np.asarray(lg, np.float32)
                row[f"rel_l2_{p}_vs_pallas"] = rel_l2(a, b)
    return row


def format_row(r, paths):
    parts = [f"{r['format']:5s} B={r['batch']} ctx={r['context']:6d} floor {r['floor_ms']:.3f} ms"]
    for p in paths:
        if f"{p}_ms" not in r:
            parts.append(f"{p} FAILED")
            continue
        parts.append(f"{p} {r[f'{p}_ms']:.3f} ms ({r[f'{p}_pct_floor']:.0f}% of floor"
                     + (f", {r[f'{p}_kernels']:.0f} kernels" if r.get(f"{p}_kernels") else "") + ")"
                     + (f" loop {r[f'{p}_loop_ms']:.3f} ms (from idle {r[f'{p}_loop_idle_ms']:.3f})"
                        if r.get(f"{p}_loop_ms") else ""))
    if "rel_l2_pallas_vs_xla" in r:
        parts.append(f"rel-L2 {r['rel_l2_pallas_vs_xla']:.2e}")
    return " | ".join(parts)


def table(rows, paths):
    paths = [p for p in dict.fromkeys(paths) if any(f"{p}_ms" in r for r in rows)]
    head = "| format | batch | context | floor ms |" + "".join(
        f" {p} ms/step | {p} in-loop ms/step | {p} tok/s (loop) | {p} % floor (loop) | {p} kernels |"
        for p in paths)
    sep = "|" + "---|" * (4 + 5 * len(paths))
    lines = [head, sep]
    for r in rows:
        cells = [r["format"], str(r["batch"]), str(r["context"]), f"{r['floor_ms']:.3f}"]
        for p in paths:
            if f"{p}_ms" not in r:
                cells += ["-"] * 5
                continue
            k = r.get(f"{p}_kernels")
            loop = r.get(f"{p}_loop_ms")
            cells += [f"{r[f'{p}_ms']:.3f}", f"{loop:.3f}" if loop else "-",
                      f"{r['batch'] / (loop or r[f'{p}_ms']) * 1e3:.0f}",
                      f"{100 * r['floor_ms'] / (loop or r[f'{p}_ms']):.0f}", f"{k:.0f}" if k else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args) -> int:
    cfg = preset(args.config)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    results = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
               "config": args.config, "layers": cfg.num_hidden_layers, "cases": []}
    print(f"device {results['device']}; {cfg.num_hidden_layers} layers; steps/window {args.steps}")
    for fmt in args.dtype:
        quant = fmt == "nvfp4"
        t0 = time.perf_counter()
        graphdef, state = build_state(cfg, quant)
        jax.block_until_ready(state)
        print(f"[{fmt}] random weights built on device in {time.perf_counter() - t0:.1f} s")
        for batch in args.batch:
            for context in args.context:
                row = run_case(cfg, graphdef, state, quant, batch, context, args.paths,
                               args.steps, args.trace)
                results["cases"].append(row)
                print(format_row(row, args.paths), flush=True)
        del state
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results["cases"], args.paths))
    return 0


