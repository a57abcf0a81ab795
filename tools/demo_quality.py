"""Quality of the shipped demo model in fp32, BF16 and NVFP4: the table in docs/demo_model.md.

    python tools/demo_quality.py                        # the whole table (under 3 min, 2 CPU cores)
    python tools/demo_quality.py --rows 8 --chats 16    # quicker, noisier

Rows:

* **held-out loss** (nats/token, teacher-forced, next-token cross-entropy) on the held-out
  standard-library files and on held-out generated chats (`flint_jax.demo_data`), per format.
* **argmax agreement**: the share of positions where BF16's (NVFP4's) greedy next token equals
  fp32's, same inputs.
* **tool calls**: over held-out chat prompts whose answer is a tool call, greedy replies: the share
  `parse_assistant` accepts against the tools' schemas (at least one call, no error), the share
  that calls the expected tool, the share of the expected arguments given with the expected value,
  and the share whose call is exactly the expected one (name and every argument).

NVFP4 is the project's own pipeline: `quantize` (BF16 checkpoint -> NVFP4 GGUF) -> `convert` ->
`load`. Everything runs on the XLA path (any machine; `--kernels` to change).
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

from flint_jax import demo_data  # noqa: E402


def held_out_rows(tok, kind: str, n: int, seq: int) -> np.ndarray:
    """int32 [n, seq + 1]: windows of the held-out code stream, or held-out chats packed."""
    eot = tok.token_id(demo_data.EOT)
    if kind == "code":
        ids: list[int] = []
        for _, text in demo_data.code_texts("eval"):
            ids += tok.encode(text) + [eot]
        stride = max(1, (len(ids) - seq - 1) // n)
        return np.asarray([ids[i * stride:i * stride + seq + 1] for i in range(n)], np.int32)
    rows = []
    for i in range(n):
        rng = random.Random(demo_data.EVAL_SEED_BASE + 20_000 + i)
        row: list[int] = []
        while len(row) < seq + 1:
            row += tok.encode(demo_data.chat_transcript(rng))
        rows.append(row[:seq + 1])
    return np.asarray(rows, np.int32)


def teacher_forced(model, rows: np.ndarray, batch: int = 8):
    """(mean cross-entropy, greedy next tokens int32 [n, seq]) of `rows` [n, seq + 1]."""
    import jax
    import flint_jax
    ces, preds = [], []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        logits = flint_jax.forward(model, chunk[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -np.take_along_axis(np.asarray(logp), chunk[:, 1:, None], axis=-1)[..., 0]
        ces.append(nll)
        preds.append(np.asarray(logits.argmax(-1)))
    return float(np.mean(np.concatenate(ces))), np.concatenate(preds)


def tool_call_prompts(n: int):
    """`n` held-out prompts whose reference answer is a tool call: (messages, tools, thinking,
    expected {"name", "arguments"})."""
    out, seed = [], demo_data.EVAL_SEED_BASE + 30_000
    while len(out) < n:
        msgs, tools, thinking = demo_data.chat_messages(random.Random(seed))
        seed += 1
        first = next(j for j, m in enumerate(msgs) if m["role"] == "assistant")
        calls = msgs[first].get("tool_calls")
        if calls:
            out.append((msgs[:first], tools, thinking, calls[0]["function"]))
    return out


def tool_call_rates(model, prompts, max_new_tokens: int = 96) -> dict:
    import flint_jax
    parsed = exact = right_tool = 0
    args_right = args_total = 0
    examples = []
    for msgs, tools, thinking, expected in prompts:
        reply = flint_jax.chat(model, msgs, tools=tools, enable_thinking=thinking,
                               max_new_tokens=max_new_tokens, temperature=0.0)
        ok = bool(reply["tool_calls"]) and not reply["errors"]
        parsed += ok
        hit = ok and reply["tool_calls"][0]["function"] == {"name": expected["name"],
                                                            "arguments": expected["arguments"]}
        exact += hit
        got = reply["tool_calls"][0]["function"] if ok else {"name": None, "arguments": {}}
        right_tool += got["name"] == expected["name"]
        args_total += len(expected["arguments"])
        if got["name"] == expected["name"]:
            args_right += sum(got["arguments"].get(k) == v for k, v in expected["arguments"].items())
        if len(examples) < 3:
            examples.append({"user": msgs[-1]["content"], "tool_calls": reply["tool_calls"],
                             "content": reply["content"]})
    return {"parsed": parsed / len(prompts), "right_tool": right_tool / len(prompts),
            "arguments": args_right / max(args_total, 1), "expected": exact / len(prompts),
            "n": len(prompts), "examples": examples}


def nvfp4_checkpoint(directory: str, workdir: str) -> str:
    """quantize -> GGUF -> convert, as a user would: the converted checkpoint's directory."""
    from flint_jax import convert, quantize
    gguf_dir = os.path.join(workdir, "nvfp4")
    quantize.quantize(directory, gguf_dir)
    converted = os.path.join(workdir, "nvfp4-converted")
    convert.convert(quantize.output_gguf(gguf_dir), converted, progress=False)
    return converted


def nvfp4_model(directory: str, workdir: str, kernels: str = "xla"):
    """`nvfp4_checkpoint`, then `load`."""
    import flint_jax
    return flint_jax.load(nvfp4_checkpoint(directory, workdir), kernels=kernels)


def quality(directory: str, *, rows: int = 32, seq: int = 512, chats: int = 48,
            kernels: str = "xla", log=print) -> dict:
    """The quality table of the checkpoint at `directory` (module docstring)."""
    import flint_jax
    t0 = time.time()
    models = {"fp32": flint_jax.load(directory, dtype="float32", kernels=kernels),
              "bf16": flint_jax.load(directory, dtype="bfloat16", kernels=kernels)}
    tok = models["fp32"].tokenizer
    data = {k: held_out_rows(tok, k, rows, seq) for k in ("code", "chat")}
    with tempfile.TemporaryDirectory() as work:
        models["nvfp4"] = nvfp4_model(directory, work, kernels)
        result: dict = {"rows": rows, "seq": seq}
        preds = {}
        for fmt, model in models.items():
            for kind, r in data.items():
                ce, p = teacher_forced(model, r)
                result[f"loss_{kind}_{fmt}"] = ce
                preds[fmt, kind] = p
            log(f"[quality] {fmt}: held-out loss code {result[f'loss_code_{fmt}']:.4f}, "
                f"chat {result[f'loss_chat_{fmt}']:.4f} ({time.time() - t0:.0f} s)")
        for fmt in ("bf16", "nvfp4"):
            for kind in data:
                result[f"argmax_{kind}_{fmt}"] = float(np.mean(preds[fmt, kind] == preds["fp32", kind]))
        prompts = tool_call_prompts(chats)
        for fmt, model in models.items():
            rates = tool_call_rates(model, prompts)
            result[f"tools_parsed_{fmt}"] = rates["parsed"]
            result[f"tools_right_tool_{fmt}"] = rates["right_tool"]
            result[f"tools_arguments_{fmt}"] = rates["arguments"]
            result[f"tools_expected_{fmt}"] = rates["expected"]
            result[f"tools_examples_{fmt}"] = rates["examples"]
            log(f"[quality] {fmt}: tool calls parsed {rates['parsed']:.1%}, right tool "
                f"{rates['right_tool']:.1%}, arguments {rates['arguments']:.1%}, exact "
                f"{rates['expected']:.1%} of {rates['n']} ({time.time() - t0:.0f} s)")
    result["seconds"] = time.time() - t0
    return result


def markdown(r: dict) -> str:
    lines = ["| | fp32 | BF16 | NVFP4 (quantize -> GGUF -> convert) |", "|---|---|---|---|"]
    for kind in ("code", "chat"):
        lines.append(f"| held-out loss, {kind} (nats/token) | " + " | ".join(
            f"{r[f'loss_{kind}_{f}']:.4f}" for f in ("fp32", "bf16", "nvfp4")) + " |")
    for kind in ("code", "chat"):
        lines.append(f"| argmax agreement with fp32, {kind} | 1 | "
                     f"{r[f'argmax_{kind}_bf16']:.2%} | {r[f'argmax_{kind}_nvfp4']:.2%} |")
    lines.append("| tool-call turns `parse_assistant` accepts | " + " | ".join(
        f"{r[f'tools_parsed_{f}']:.0%}" for f in ("fp32", "bf16", "nvfp4")) + " |")
    for key, what in (("right_tool", "... calling the expected tool"),
                      ("arguments", "expected arguments given with the expected value"),
                      ("expected", "... turns with exactly the expected call")):
        lines.append(f"| {what} | " + " | ".join(
            f"{r[f'tools_{key}_{f}']:.0%}" for f in ("fp32", "bf16", "nvfp4")) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped demo)")
    p.add_argument("--rows", type=int, default=32, help="held-out rows per kind")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--chats", type=int, default=48, help="tool-call prompts")
    p.add_argument("--kernels", default="xla")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    from flint_jax.demo import TRAINED_DIR
    r = quality(a.model or TRAINED_DIR, rows=a.rows, seq=a.seq, chats=a.chats, kernels=a.kernels)
    print(markdown(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
