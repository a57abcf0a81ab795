"""Golden outputs of HF transformers' logits processors for tests/test_sampling.py.

Run with an environment that has torch + transformers (not a flint_jax
dependency), from the repository root:

    python tools/make_sampling_goldens.py   # writes tests/golden/sampling_cases.npz

Each case stores fp32 logits ``[B, V]``, ``input_ids`` ``[B, L]`` (the tokens
the repetition penalty applies to), the knobs, and HF's processed scores. The
processors are chained in the order ``GenerationMixin._get_logits_processor``
uses (repetition penalty, then temperature, top-k, top-p, min-p), each added
only when its knob is not at the "off" value, exactly as HF does.

Top-p cases use continuous fp32 logits (no exact ties: HF's top-p keeps an
arbitrary subset of a tie group straddling the cutoff, see flint_jax.sampling);
top-k tie cases use bf16-rounded logits with top-p off.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden" / "sampling_cases.npz"


def hf_process(logits: np.ndarray, input_ids: np.ndarray, knobs: dict) -> np.ndarray:
    procs = LogitsProcessorList()
    if knobs["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(knobs["repetition_penalty"])))
    if knobs["temperature"] != 1.0:
        procs.append(TemperatureLogitsWarper(float(knobs["temperature"])))
    if knobs["top_k"] != 0:
        procs.append(TopKLogitsWarper(top_k=int(knobs["top_k"]), min_tokens_to_keep=1))
    if knobs["top_p"] < 1.0:
        procs.append(TopPLogitsWarper(top_p=float(knobs["top_p"]), min_tokens_to_keep=1))
    if knobs["min_p"] > 0.0:
        procs.append(MinPLogitsWarper(min_p=float(knobs["min_p"]), min_tokens_to_keep=1))
    out = procs(torch.from_numpy(input_ids), torch.from_numpy(logits.copy()))
    return out.numpy().astype(np.float32)


def knobs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0) -> dict:
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty)


def main() -> None:
    rng = np.random.default_rng(20240607)

    def cont(b, v, scale):
        return (rng.standard_normal((b, v)) * scale).astype(np.float32)

    def bf16(b, v, scale):  # coarse values -> many exact ties
        x = torch.from_numpy(rng.standard_normal((b, v)).astype(np.float32) * scale)
        return x.to(torch.bfloat16).to(torch.float32).numpy()

    cases = [
        ("rep_penalty", cont(4, 256, 3.0), knobs(repetition_penalty=1.3)),
        ("rep_reward", cont(4, 256, 3.0), knobs(repetition_penalty=0.7)),
        ("temperature", cont(4, 256, 2.0), knobs(temperature=0.7)),
        ("top_k_ties", bf16(8, 512, 0.5), knobs(top_k=7)),
        ("top_k_int_ties", rng.integers(-3, 3, size=(8, 64)).astype(np.float32), knobs(top_k=5)),
        ("top_k_1_int_ties", rng.integers(0, 2, size=(4, 32)).astype(np.float32), knobs(top_k=1)),
        ("top_k_min_p_int_ties", rng.integers(-4, 2, size=(8, 64)).astype(np.float32),
         knobs(temperature=0.5, top_k=3, min_p=0.3)),
        ("top_k_gt_v", cont(2, 16, 1.0), knobs(top_k=40)),
        ("top_p_skewed", cont(8, 512, 4.0), knobs(top_p=0.9)),
        ("top_p_flat", cont(8, 512, 0.5), knobs(top_p=0.5)),
        ("top_p_tiny", cont(8, 512, 4.0), knobs(top_p=0.01)),
        ("min_p", cont(8, 512, 2.0), knobs(min_p=0.1)),
        ("k_then_p", cont(8, 1024, 3.0), knobs(top_k=50, top_p=0.8)),
        ("flint_defaults", cont(8, 4096, 3.0), knobs(top_k=20, top_p=0.95)),
        ("everything", cont(8, 2048, 3.0),
         knobs(temperature=0.6, top_k=40, top_p=0.85, min_p=0.05, repetition_penalty=1.2)),
        ("p_then_min_p", cont(8, 1024, 2.0), knobs(temperature=1.3, top_p=0.9, min_p=0.2,
                                                   repetition_penalty=1.1)),
    ]
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, (name, logits, kn) in enumerate(cases):
        b, v = logits.shape
        input_ids = rng.integers(0, v, size=(b, 24)).astype(np.int64)
        arrays[f"{i}_logits"] = logits
        arrays[f"{i}_input_ids"] = input_ids
        arrays[f"{i}_expected"] = hf_process(logits, input_ids, kn)
        meta.append(dict(name=name, **kn))
    arrays["meta"] = np.array(json.dumps(
        {"transformers": transformers.__version__, "torch": torch.__version__, "cases": meta}))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
