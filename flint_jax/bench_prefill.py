"""Prefill benchmark: full-size Flint with random weights built on the device
(`flint-jax bench --prefill`).

For each weight format (bf16, nvfp4) and prompt case (``1x8K``: one row of 8,192 tokens,
``8x2K``: eight rows of 2,048, ``1x32K``, ``1x100K`` (100,000 tokens), ``1x262K``; any ``BxN`` or
``BxNK`` with K = 1024): the wall time of a whole prefill on the Pallas prefill kernels
(``flint_jax.prefill.prefill``: cache allocation, every chunk, the last-token logits), its first
call (which compiles) and the median of ``--reps`` timed calls after it, tokens/s, the compute
floor (matmul + attention FLOPs at 790 TFLOP/s, the H200's measured bf16 dense peak) and the
percent of it reached, and the device's peak memory so far. Where the case has at most
``--reference-max-tokens`` tokens (default 8,192: the XLA path takes ~8 s per 8K tokens on the
H200, ~34 s at 32K), the reference XLA path (``decode.prefill``, 256-token chunks) is timed in the
same run, and the rel-L2 error of the Pallas path's last-token logits against its logits is
reported. Prompts are random token ids from a fixed seed. NVFP4 block scales are pre-scaled to
bf16 (``nvfp4.prescale_state``), as ``flint_jax.load`` holds them on a GPU.

Where the reference runs, it also runs once with 512-token chunks: the rel-L2 between its own two
chunkings is the spread of the reference's bf16 arithmetic, the yardstick for the Pallas path's
error. On the same cases ``flint_jax.generate(..., max_new_tokens=1, return_details=True)`` runs
twice through the public API: the second call's time to first token (``ttft_s``) is the
prefill as a user meets it (tokenizer-free: the prompts are token ids).

Run: `flint-jax bench --prefill [--cases 1x8K 8x2K ...] [--dtype bf16 nvfp4] [--reps 3]
[--reference-max-tokens 8192] [--option KEY=VALUE ...] [--out F]` (GPU), or
`flint-jax bench --prefill --config smoke` on a CPU (the Pallas kernels in interpret mode: a
2-layer tiny model, cases 1x64 and 2x40, both formats and both paths). Results: a markdown table
on stdout and JSON with --out. benchmarks/gpu_suite.py (``--prefill-cases``) and
tools/gpu_prefill.py build on the same functions.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax import decode, prefill
from flint_jax.bench import _value, build_state, rel_l2
from flint_jax.config import FULL, SLIDING, FlintConfig, preset

PEAK_FLOPS = 790e12   # bf16 dense, measured on the H200 (FLINT_SPEC section 9)

#: Named cases -> row lengths (tokens). "1x100K" is 100,000 tokens, not 100 x 1024.
NAMED_CASES = {"1x8K": [8192], "8x2K": [2048] * 8, "1x32K": [32768], "1x100K": [100000],
               "1x262K": [262144]}
DEFAULT_CASES = list(NAMED_CASES)
SMOKE_CASES = ["1x64", "2x40"]
#: `--config smoke`: tiny cut to 2 layers, layer 0 dense with sliding attention, layer 1 MoE with
#: full attention, so every prefill kernel (ring and full attention, grouped-GEMM experts) runs.
SMOKE_CONFIG = dict(num_hidden_layers=2, layer_types=(SLIDING, FULL), mlp_only_layers=(0,))
REFERENCE_CHUNK = 256   # tokens per row per chunk of the reference XLA path
SPREAD_CHUNK = 512      # the reference's second chunking (its own arithmetic spread)
#: The XLA path takes ~8 s per 8K tokens on the H200 (~34 s at 32K): timed up to this many.
DEFAULT_REFERENCE_MAX_TOKENS = 8192


def parse_case(name: str) -> list[int]:
    """A case name -> its row lengths: a named case (``NAMED_CASES``) or ``BxN`` / ``BxNK``
    (B rows of N tokens, K = 1024), e.g. ``2x100`` -> [100, 100]."""
    if name in NAMED_CASES:
        return list(NAMED_CASES[name])
    m = re.fullmatch(r"(\d+)x(\d+)([kK]?)", name)
    if not m or int(m[1]) == 0 or int(m[2]) == 0:
        raise ValueError(f"bad prefill case {name!r}: want BxN or BxNK (B rows of N tokens, "
                         f"K = 1024), e.g. 1x8K, 8x2K, 2x100")
    return [int(m[2]) * (1024 if m[3] else 1)] * int(m[1])


def prefill_flops(cfg: FlintConfig, lengths) -> dict:
    """Matmul and attention FLOPs of prefilling rows of ``lengths`` tokens from position 0, and the
    compute floor: {"matmul", "attention", "floor_ms" (their sum at ``PEAK_FLOPS``)}.

    Matmuls: every token through q/k/v/o, the router and the active experts (or the dense MLP),
    the LM head for each row's last token only. Attention: QK^T and PV over the causal triangle
    (full layers) or the sliding window (sliding layers), 4 * heads * head_dim per query-key pair.
    """
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_tok = 0
    for i in range(cfg.num_hidden_layers):
        per_tok += d * (h * hd * 2 + kv * hd * 2)
        if cfg.is_moe(i):
            per_tok += cfg.num_experts * d + 3 * d * (
                cfg.num_experts_per_tok * cfg.moe_intermediate_size
                + cfg.shared_expert_intermediate_size)
        else:
            per_tok += 3 * d * cfg.intermediate_size
    tokens = sum(lengths)
    mm = 2 * per_tok * tokens + 2 * d * cfg.vocab_size * len(lengths)
    w = cfg.sliding_window
    full = sum(n * (n + 1) // 2 for n in lengths)
    slide = sum(w * (w + 1) // 2 + (n - w) * w if n > w else n * (n + 1) // 2 for n in lengths)
    attn = 4 * h * hd * (len(cfg.full_layers) * full + len(cfg.sliding_layers) * slide)
    return {"matmul": mm, "attention": attn, "floor_ms": (mm + attn) / PEAK_FLOPS * 1e3}


def parse_options(items) -> prefill.PrefillOptions:
    """``--option KEY=VALUE`` strings -> ``prefill.PrefillOptions`` (its fields; a tuple field
    as numbers joined by "x", e.g. ``gate_up_blocks=128x64``; ``none`` for None). Unknown keys
    and items without "=" are refused."""
    fields = {f.name for f in dataclasses.fields(prefill.PrefillOptions)}
    kw = {}
    for item in items or ():
        key, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"bad --option {item!r}: want KEY=VALUE")
        if key not in fields:
            raise ValueError(f"--option {key}: PrefillOptions has no field {key!r} "
                             f"(fields: {', '.join(sorted(fields))})")
        # A tuple field as "128x64"; anything else as the decode bench reads its values.
        tup = re.fullmatch(r"\d+(x\d+)+", v)
        kw[key] = tuple(int(x) for x in v.split("x")) if tup else _value(v)
    return prefill.PrefillOptions(**kw)


def bench_config(name: str, layers: int | None = None) -> FlintConfig:
    """A preset (``smoke``: ``SMOKE_CONFIG`` on tiny), optionally cut to ``layers`` layers."""
    cfg = preset("tiny", **SMOKE_CONFIG) if name == "smoke" else preset(name)
    return cfg.replace(num_hidden_layers=layers) if layers else cfg


def random_rows(cfg: FlintConfig, lengths, seed: int = 0) -> list[list[int]]:
    """Random prompts (token ids in [0, vocab)), one per length, the same for every run."""
    gen = np.random.default_rng(seed)
    return [gen.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def cache_length(cfg: FlintConfig, rows) -> int:
    """The cache a generation after the prompts would use: bucketed, 256 tokens of room."""
    return decode.bucket_length(max(len(r) for r in rows) + 256, cfg.max_position_embeddings)


def model_handle(cfg: FlintConfig, graphdef, state, quant: bool) -> decode.Flint:
    """A handle on ``nnx.split``'s (graphdef, state) whose decode kernels are Pallas, NVFP4 block
    scales pre-scaled to bf16 (a copy of them: +11% of the NVFP4 weights)."""
    from flint_jax.nvfp4 import prescale_state
    if quant:
        state = prescale_state(state)
    jax.block_until_ready(jax.tree.leaves(state))
    return decode.Flint(config=cfg, graphdef=graphdef, state=state, dtype=jnp.bfloat16,
                        quant=quant, kernels="pallas", max_length=cfg.max_position_embeddings)


def build_model(cfg: FlintConfig, quant: bool) -> decode.Flint:
    """``model_handle`` on random weights built on the device (``bench.build_state``)."""
    return model_handle(cfg, *build_state(cfg, quant), quant)


def reference_model(model: decode.Flint) -> decode.Flint:
    """A handle sharing ``model``'s weights whose ``decode.prefill`` is the reference XLA chunk
    step (on a GPU a Pallas handle's own ``decode.prefill`` takes the Pallas prefill kernels)."""
    return dataclasses.replace(model, prefill_kernels="xla")


def run_prefill(fn, model, rows, cache_len: int, reps: int):
    """``fn(model, rows, cache_len)`` once (compiles), then ``reps`` timed calls.

    Returns (last-token logits f32 [B, V], first call s, [ms of each timed call])."""
    t0 = time.perf_counter()
    logits, cache = fn(model, rows, cache_len)
    jax.block_until_ready(logits)
    first = time.perf_counter() - t0
    del cache
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits, cache = fn(model, rows, cache_len)
        jax.block_until_ready(logits)
        per.append((time.perf_counter() - t0) * 1e3)
        del cache   # the next call allocates its own: one cache alive at a time
    return logits, first, per


def peak_bytes() -> int | None:
    """The device's peak memory in use since the process started (None where not reported)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 (a backend without memory statistics)
        stats = {}
    return stats.get("peak_bytes_in_use")


def _pallas(options: prefill.PrefillOptions):
    return lambda model, rows, cache_len: prefill.prefill(model, rows, cache_len, options=options)


def _reference(model, rows, cache_len):
    return decode.prefill(model, rows, cache_len, REFERENCE_CHUNK)


def time_to_first_token(model, rows) -> dict:
    """``flint_jax.generate(rows, max_new_tokens=1, return_details=True)`` twice (the first
    compiles): the second call's stats, {"ttft_s", "prompt_tokens_per_s"}."""
    from flint_jax import generate   # pylint: disable=g-import-not-at-top
    try:
        for _ in range(2):
            out = generate(model, rows, max_new_tokens=1, temperature=0, return_details=True)
    except Exception as e:  # noqa: BLE001 (a benchmark reports, then goes on)
        print(f"FAILED (generate): {type(e).__name__}: {str(e)[:500]}", flush=True)
        return {"ttft_error": f"{type(e).__name__}: {str(e)[:2000]}"}
    stats = (out[0] if isinstance(out, list) else out).stats
    return {"ttft_s": stats.ttft_s, "ttft_prompt_tokens_per_s": stats.prompt_tokens_per_s}


def time_path(fn, model, rows, cache_len: int, reps: int, floor_ms: float) -> tuple[dict, object]:
    """One path's measurements (a dict) and its last-token logits; an error is recorded."""
    try:
        logits, first, per = run_prefill(fn, model, rows, cache_len, reps)
    except Exception as e:  # noqa: BLE001 (a benchmark reports, then goes on)
        print(f"FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
        return {"error": f"{type(e).__name__}: {str(e)[:2000]}"}, None
    ms = statistics.median(per) if per else first * 1e3
    tokens = sum(len(r) for r in rows)
    return {"first_s": first, "ms": ms, "runs_ms": per, "tokens_per_s": tokens / ms * 1e3,
            "pct_of_floor": 100 * floor_ms / ms, "peak_bytes": peak_bytes(),
            "finite": bool(np.isfinite(np.asarray(logits)).all())}, logits


def run_case(model, name: str, reps: int, reference_max_tokens: int,
             options: prefill.PrefillOptions = prefill.PrefillOptions(),
             ttft: bool = True) -> list[dict]:
    """One case on the Pallas path (with ``options``) and, when it has at most
    ``reference_max_tokens`` tokens, on the reference XLA path (``reference_model``) and its
    second chunking (``SPREAD_CHUNK``); ``ttft``: on those cases too, the time to first token
    through ``generate`` (default options only: ``generate`` takes the defaults). Returns one row
    per path run."""
    cfg = model.config
    lengths = parse_case(name)
    rows = random_rows(cfg, lengths)
    cl = cache_length(cfg, rows)
    fl = prefill_flops(cfg, lengths)
    base = {"format": "nvfp4" if model.quant else "bf16", "case": name, "rows": len(rows),
            "tokens": sum(lengths), "cache_length": cl, "floor_ms": fl["floor_ms"],
            "tflop": (fl["matmul"] + fl["attention"]) / 1e12}
    chunk = prefill.chunk_length(len(rows), max(lengths))
    r, logits = time_path(_pallas(options), model, rows, cl, reps, fl["floor_ms"])
    out = [{**base, "path": "pallas", "chunk": chunk, **r}]
    if options != prefill.PrefillOptions():
        out[0]["options"] = {k: v for k, v in dataclasses.asdict(options).items()
                             if v != getattr(prefill.PrefillOptions(), k)}
    elif ttft and logits is not None and sum(lengths) <= reference_max_tokens:
        out[0].update(time_to_first_token(model, rows))
    if sum(lengths) > reference_max_tokens:
        out[0]["reference"] = f"skipped: {sum(lengths)} tokens > --reference-max-tokens"
        return out
    r, ref_logits = time_path(_reference, reference_model(model), rows, cl, reps, fl["floor_ms"])
    out.append({**base, "path": "xla",
                "chunk": decode.prefill_chunk(max(lengths), cl, REFERENCE_CHUNK), **r})
    if logits is not None and ref_logits is not None:
        a, b = np.asarray(ref_logits, np.float32), np.asarray(logits, np.float32)
        out[0]["rel_l2_vs_xla"] = rel_l2(a, b)
        out[0]["argmax_equal"] = float(np.mean(a.argmax(-1) == b.argmax(-1)))
        spread, _ = decode.prefill(reference_model(model), rows, cl, SPREAD_CHUNK)
        out[1]["rel_l2_vs_chunk512"] = rel_l2(a, np.asarray(spread, np.float32))
    return out


def table(rows) -> str:
    """The results as a markdown table (one line per format x case x path)."""
    lines = ["| format | case | path | chunk | first call s | median ms | tokens/s | floor ms | "
             "% of floor | rel-L2 vs xla (xla: vs its 512-token chunks) | TTFT s | peak GiB |",
             "|" + "---|" * 12]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['format']} | {r['case']} | {r['path']} | FAILED: "
                         f"{r['error'][:80]} |")
            continue
        err = r.get("rel_l2_vs_xla", r.get("rel_l2_vs_chunk512"))
        err = f"{err:.2e}" if err is not None else "-"
        ttft = f"{r['ttft_s']:.3f}" if r.get("ttft_s") is not None else "-"
        peak = f"{r['peak_bytes'] / 2**30:.1f}" if r.get("peak_bytes") else "-"
        lines.append(f"| {r['format']} | {r['case']} | {r['path']} | {r['rows']}x{r['chunk']} | "
                     f"{r['first_s']:.1f} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['floor_ms']:.3g} | {r['pct_of_floor']:.3g}% | {err} | {ttft} | {peak} |")
    return "\n".join(lines)


def main(args) -> int:
    """`flint-jax bench --prefill`: ``args`` has config, layers, dtype, cases, reps,
    reference_max_tokens, option and out (``cli.prefill_options`` fills the defaults)."""
    for name in args.cases:
        parse_case(name)   # a bad case or option fails before any weights are built
    options = parse_options(getattr(args, "option", None))
    cfg = bench_config(args.config, args.layers)
    results = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
               "config": args.config, "layers": cfg.num_hidden_layers, "reps": args.reps,
               "peak_flops": PEAK_FLOPS, "options": dataclasses.asdict(options), "cases": []}
    print(f"device {results['device']}; {cfg.num_hidden_layers} layers; {args.reps} timed runs "
          f"per case; reference XLA path up to {args.reference_max_tokens} tokens", flush=True)
    for fmt in args.dtype:
        t0 = time.perf_counter()
        model = build_model(cfg, fmt == "nvfp4")
        print(f"[{fmt}] random weights built on device in {time.perf_counter() - t0:.1f} s",
              flush=True)
        for name in args.cases:
            rows = run_case(model, name, args.reps, args.reference_max_tokens, options)
            results["cases"] += rows
            print("\n".join(table(rows).splitlines()[2:]), flush=True)
            if args.out:   # rewritten after every case: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
        del model
    print(table(results["cases"]))
    return 0
