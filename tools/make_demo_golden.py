"""Write ``tests/golden/demo_model.npz``: transformers' ``FlintForCausalLM`` on the shipped trained
demo checkpoint (``flint_jax/demo_model``), fp32 eager. CI never runs this script;
``tests/test_demo_model.py`` compares flint_jax against the file it commits.

Run from the repository root with the oracle environment (as for ``tools/make_goldens.py``:
Python 3.11, torch, transformers >= 5.21 with ``models/flint``, numpy)::

    /tmp/venv311/bin/python tools/make_demo_golden.py

Fixtures: the logits of two held-out texts (a standard-library code window and a generated chat,
both ``T`` tokens), and a greedy continuation of a chat prompt (``N_NEW`` tokens, with the top-2
logit margin of every step: a trained model's margins are what make greedy parity meaningful).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, FlintForCausalLM

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "flint_jax" / "demo_model"
OUT = ROOT / "tests" / "golden" / "demo_model.npz"
T = 96
N_NEW = 48
PROMPT = ("[gMASK]<sop><|user|>Write a Python function that computes a factorial."
          "<|assistant|><think>")


def texts() -> list[str]:
    # `import flint_jax` is lazy (no jax); demo_data and chat_format need only jinja2.
    sys.path.insert(0, str(ROOT))
    from flint_jax import demo_data
    rel, code = next(demo_data.code_texts("eval"))
    chat = demo_data.chat_transcript(random.Random(demo_data.EVAL_SEED_BASE + 77))
    return [code, chat]


def main() -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(CKPT))
    model = FlintForCausalLM.from_pretrained(str(CKPT), dtype=torch.float32,
                                             attn_implementation="eager",
                                             experts_implementation="eager")
    model.eval()
    ids = torch.tensor([tok.encode(t, add_special_tokens=False)[:T] for t in texts()])
    assert ids.shape == (2, T), ids.shape
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    prompt = torch.tensor(tok.encode(PROMPT, add_special_tokens=False))
    model.generation_config.eos_token_id = None  # exactly N_NEW argmax tokens
    with torch.no_grad():
        out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                             do_sample=False, max_new_tokens=N_NEW, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
    toks = out.sequences[0, prompt.shape[0]:]
    steps = torch.stack([l[0] for l in out.logits]).float()
    assert torch.equal(steps.argmax(-1), toks)
    top2 = steps.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).numpy()
    np.savez(OUT, input_ids=ids.numpy().astype(np.int64), logits=logits.numpy(),
             greedy_prompt=prompt.numpy().astype(np.int64),
             greedy_tokens=toks.numpy().astype(np.int64), greedy_logits=steps.numpy(),
             greedy_margins=margins)
    info = {"transformers": transformers.__version__, "torch": torch.__version__,
            "script": "tools/make_demo_golden.py", "T": T, "n_new": N_NEW,
            "greedy_text": tok.decode(toks), "greedy_min_margin": float(margins.min()),
            "logits_std": float(logits.std())}
    (OUT.with_suffix(".json")).write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
