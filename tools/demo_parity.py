"""Greedy parity of the Pallas decode step and the reference XLA path on the trained demo model.

    python tools/demo_parity.py --out $OUT/demo_parity.json          # H200: the issue's check
    JAX_PLATFORMS=cpu python tools/demo_parity.py --prompts 2 --tokens 6 --formats bf16 --batches 1

For each weight format (BF16; NVFP4 made by the project's own quantize -> GGUF -> convert), 8
held-out prompts (4 chat prompts with the generation header, 4 starts of held-out standard-library
files) are prefilled once by the XLA path; copies of that cache are decoded greedily for
`--tokens` steps by each path (`Flint.decode_logits_fn`), at batch 1 (each prompt alone) and batch
8 (all together, ragged). Reported per (format, batch): whether every row's tokens are identical,
and for each row that diverges, the step and both paths' logit margins there (each path's gap
between its own choice and the other's: trained weights give margins, random ones near-ties).
The Pallas path runs compiled on a GPU and in interpret mode on a CPU (slow: small runs only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prompts(tok, n: int, code_tokens: int = 48) -> list[list[int]]:
    """`n` held-out prompts: chats (generation header, thinking on or off) and code starts."""
    from flint_jax import demo_data
    from flint_jax.chat_format import DEFAULT_CHAT_TEMPLATE, render_chat_template
    rows = []
    chats = demo_data.chat_prompts((n + 1) // 2, seed=demo_data.EVAL_SEED_BASE + 40_000)
    for msgs, tools, thinking in chats:
        text = render_chat_template(DEFAULT_CHAT_TEMPLATE, msgs, tools=tools,
                                    add_generation_prompt=True, enable_thinking=thinking)
        rows.append(tok.encode(text))
    for _, text in demo_data.code_texts("eval"):
        if len(rows) >= n:
            break
        rows.append(tok.encode(text)[:code_tokens])
    return rows[:n]


def choice_gap(a: np.ndarray, b: np.ndarray, row: int) -> dict:
    """Both paths' margins where they chose differently on `row` (a: reference logits [B, V])."""
    ia, ib = int(a[row].argmax()), int(b[row].argmax())
    return {"ref_token": ia, "pallas_token": ib,
            "ref_margin": float(a[row, ia] - a[row, ib]),
            "pallas_margin": float(b[row, ib] - b[row, ia]),
            "max_abs_logit_diff": float(np.abs(a[row] - b[row]).max())}


def greedy_both(xla, pal, rows: list[list[int]], steps: int) -> dict:
    """Greedy decode from one XLA prefill, each path its own tokens. Per row: identical?, the
    first divergence with margins, and the smallest top-2 margin the reference saw."""
    import jax
    import jax.numpy as jnp
    from flint_jax import decode
    cache_len = decode.bucket_length(max(map(len, rows)) + steps + 1, xla.max_length)
    logits, cache0 = decode.prefill(xla, rows, cache_len)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    cx, cp = jax.tree.map(jnp.copy, cache0), jax.tree.map(jnp.copy, cache0)
    fx, fp = xla.decode_logits_fn(), pal.decode_logits_fn()
    tx = tp = first
    b = len(rows)
    diverged: dict[int, dict] = {}
    min_margin = np.full(b, np.inf)
    for step in range(steps):
        lx, cx = fx(xla.leaves, cx, tx)
        lp, cp = fp(pal.leaves, cp, tp)
        a, p = np.asarray(lx, np.float32), np.asarray(lp, np.float32)
        top2 = np.sort(a, axis=-1)[:, -2:]
        same_input = np.asarray(tx) == np.asarray(tp)
        for r in range(b):
            if r in diverged or not same_input[r]:
                continue
            min_margin[r] = min(min_margin[r], float(top2[r, 1] - top2[r, 0]))
            if a[r].argmax() != p[r].argmax():
                diverged[r] = {"step": step, **choice_gap(a, p, r)}
        tx, tp = jnp.argmax(lx, -1).astype(jnp.int32), jnp.argmax(lp, -1).astype(jnp.int32)
    return {"batch": b, "steps": steps, "prompt_lens": [len(r) for r in rows],
            "identical_rows": b - len(diverged), "divergences": {str(k): v for k, v in diverged.items()},
            "ref_min_top2_margin": [float(m) for m in min_margin]}


def handles(fmt: str, directory: str, work: str):
    import flint_jax
    if fmt == "nvfp4":
        from demo_quality import nvfp4_checkpoint
        directory = nvfp4_checkpoint(directory, work)
    return (flint_jax.load(directory, kernels="xla"), flint_jax.load(directory, kernels="pallas"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped demo)")
    p.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], choices=[1, 8],
                   help="1: each prompt alone; 8: all prompts in one batch")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="greedy steps per prompt")
    p.add_argument("--out", default=None, help="write the results JSON here")
    a = p.parse_args(argv)
    import jax
    from flint_jax.demo import TRAINED_DIR
    directory = a.model or TRAINED_DIR
    res = {"device": jax.devices()[0].device_kind, "model": directory, "runs": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        for fmt in a.formats:
            xla, pal = handles(fmt, directory, work)
            rows = prompts(xla.tokenizer, a.prompts)
            for batch in a.batches:
                groups = [[r] for r in rows] if batch == 1 else [rows]
                outs = [greedy_both(xla, pal, g, a.tokens) for g in groups]
                run = {"format": fmt, "batch": batch, "rows": len(rows), "steps": a.tokens,
                       "identical_rows": sum(o["identical_rows"] for o in outs),
                       "divergences": [o["divergences"] for o in outs],
                       "ref_min_top2_margin": [m for o in outs for m in o["ref_min_top2_margin"]],
                       "seconds": round(time.time() - t0, 1)}
                res["runs"].append(run)
                print(f"[demo_parity] {fmt} batch {batch}: {run['identical_rows']}/{len(rows)} rows "
                      f"identical over {a.tokens} greedy tokens; divergences "
                      f"{[d for d in run['divergences'] if d]} ({run['seconds']} s)", flush=True)
                if a.out:
                    with open(a.out, "w") as f:
                        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
