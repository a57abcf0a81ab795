"""Write the oracle golden fixtures under ``tests/golden/`` (tiny random Flint checkpoints + outputs).

The oracle is HF transformers' ``FlintForCausalLM`` (``transformers/models/flint``). flint_jax cannot
import torch, so its parity tests read the files this script commits. CI never runs this script.

Regenerate (from the repository root, with the oracle environment: Python 3.11, torch, transformers
>= 5.21 with ``models/flint``, tokenizers, safetensors, numpy)::

    /tmp/venv311/bin/python tools/make_goldens.py

Everything is deterministic (fixed seeds, single-threaded torch, fixed file metadata): two runs on
the same machine write byte-identical files (check with ``sha256sum -c`` or ``git status``).
``tests/golden/oracle_info.json`` records the versions that produced the committed files.

Fixtures (each ``tests/golden/<name>/`` holds ``config.json``, ``generation_config.json``,
``model.safetensors`` written by ``save_pretrained`` and ``golden.npz``):

* ``tiny_a``: HF default layer rule (6 layers: full 0, 1, 5; sliding 2, 3, 4), dense layers [0, 1] +
  MoE, GQA group 2 (4 heads, 2 KV heads, head_dim 32), sliding_window 7 < T = 24. Every linear
  layer's input dim is a multiple of 64 (hidden 128, q/o dim 128, intermediate 128, experts and shared
  expert 64) so NVFP4 can be tested on it. Carries a byte-level BPE tokenizer with the GLM-4.7
  special tokens (``tokenizer.json``, ``tokenizer_config.json``); eos ids = ``<|endoftext|>``,
  ``<|user|>``, ``<|observation|>``.
* ``tiny_a_fused``: the same weights as ``tiny_a`` in the other checkpoint layout: fused experts
  (``mlp.experts.gate_up_proj`` [E, 2I, D], gate rows first; ``mlp.experts.down_proj`` [E, D, I]),
  sinks named ``self_attn.sinks``, two shards + ``model.safetensors.index.json``. Its goldens are
  ``tiny_a``'s (no npz of its own); this script checks that transformers loads it to identical logits.
* ``tiny_b``: GQA group 8 (8 heads, 1 KV head, head_dim 16, hidden 64), explicit ``layer_types``
  starting with a sliding layer, one dense layer in the middle (``mlp_only_layers=[2]``),
  ``rope_theta`` 500, sliding_window 9, 12 experts top-3.
* ``tiny_c``: GQA group 1 (3 heads = 3 KV heads, head_dim 14), no dense layer
  (``mlp_only_layers=[]``), odd sizes (hidden 57, vocab 263, 9 experts top-4, moe_intermediate 19,
  shared 27), default layer rule for 5 layers (full 0, 1, 4; sliding 2, 3), sliding_window 3.

Weights: every tensor except the routers (``mlp.gate.weight``) and sinks is rounded to bf16 first
and stored in bf16; router weights and sinks are fp32 in memory and on disk (transformers'
``_keep_in_fp32_modules_strict``). All goldens come from the float32 eager model holding exactly
those values (the checkpoint reloaded with ``dtype=torch.float32``), so a loader that upcasts the
bf16 checkpoint to fp32 sees bit-identical weights. Norm weights are ``1 + 0.3 N(0,1)``, sinks
``N(0, 1)``, linear weights ``N(0, 1/fan_in)`` (std 0.088-0.25), embeddings ``N(0, 1)``, lm_head
``N(0, 2.5^2/D)``, routers ``N(0, 1.5^2/D)``.

``golden.npz`` keys (B = 2):

* ``input_ids`` [B, T] int64, random tokens; ``logits`` [B, T, V] f32 (one full forward, no cache,
  no attention mask).
* ``hidden_states`` [L+1, B, T, D] f32: embeddings, then the residual stream after each decoder
  layer (before the final norm); ``final_hidden`` [B, T, D] f32 after ``model.norm``.
* ``moe_layers`` [n_moe] int64; ``router_logits`` [n_moe, B, T, E] f32 (pre-sigmoid);
  ``router_topk_idx`` [n_moe, B, T, k] int64 and ``router_topk_weight`` [n_moe, B, T, k] f32 as the
  HF router returns them (descending score order, weights normalised).
* ``greedy_prompt`` [T0] int64; ``greedy_tokens`` [N] int64 from ``model.generate(do_sample=False,
  max_new_tokens=N)`` with the KV cache; eos stopping is disabled by setting the in-memory
  ``generation_config.eos_token_id = None`` (the checkpoint keeps its eos ids), so exactly N tokens
  come out and each is the plain argmax. ``greedy_logits`` [N, V] f32 are the raw logits of each
  generation step. The script checks them against one uncached forward of prompt + tokens.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import FlintConfig, FlintForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "golden"

BATCH = 2
N_NEW = 40

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]
TOKENIZER_MODEL_VOCAB = 360  # BPE vocab (256 bytes + merges); specials take ids 360..376; config vocab 384

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Flint is a mixture-of-experts language model with sliding window attention and attention sinks.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "The weather in Paris is sunny, and the temperature is 21 degrees.",
    "Tokenizers split text into pieces; the model predicts the next piece.",
    "Numbers like 12345 and 3.14159 appear in text, as do symbols: @#$%^&*().",
    "A tool call names a function and its arguments, then the tool responds.",
    "the model thinks before it answers, and the answer follows the thinking.",
    "JAX compiles Python functions with XLA for accelerators such as GPUs and TPUs.",
]

# Tiny configs: only the fields that differ from FlintConfig's defaults.
CONFIGS: dict[str, dict] = {
    "tiny_a": dict(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=6,  # default rule: full 0, 1, 5; sliding 2, 3, 4
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=7,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        # eos ids and pad set below from the tokenizer
    ),
    "tiny_b": dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        mlp_only_layers=[2],
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=9,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        moe_intermediate_size=16,
        shared_expert_intermediate_size=40,
        num_experts=12,
        num_experts_per_tok=3,
        max_position_embeddings=4096,
    ),
    "tiny_c": dict(
        vocab_size=263,
        hidden_size=57,
        intermediate_size=43,  # unused: no dense layer
        num_hidden_layers=5,  # default rule: full 0, 1, 4; sliding 2, 3
        mlp_only_layers=[],
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=14,
        sliding_window=3,
        moe_intermediate_size=19,
        shared_expert_intermediate_size=27,
        num_experts=9,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    ),
}

# Per-fixture seeds and sequence lengths.
RUNS = {
    "tiny_a": dict(seed=1001, seq_len=24, prompt_len=None),  # prompt from the tokenizer
    "tiny_b": dict(seed=2002, seq_len=28, prompt_len=7),
    "tiny_c": dict(seed=3003, seq_len=19, prompt_len=5),
}

GREEDY_TEXT = "[gMASK]<sop><|user|>Hello world, what is the weather?<|assistant|></think>"


def set_determinism() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def build_tokenizer():
    """Byte-level BPE trained on CORPUS plus the GLM-4.7 special tokens (ids after the BPE vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_MODEL_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_MODEL_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens(SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert ids["<|endoftext|>"] == TOKENIZER_MODEL_VOCAB, ids
    assert sorted(ids.values()) == list(range(TOKENIZER_MODEL_VOCAB, TOKENIZER_MODEL_VOCAB + len(SPECIAL_TOKENS)))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    return fast, ids


def check_tokenizer(tok_dir: Path, ids: dict[str, int]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for text in ["Hello world!", "  leading spaces and\ttabs\nnewlines", "unicode: caf\u00e9 \u2013 \u65e5\u672c", "x=1+2"]:
        enc = tok.encode(text, add_special_tokens=False)
        assert tok.decode(enc) == text, (text, enc, tok.decode(enc))
    enc = tok.encode(GREEDY_TEXT, add_special_tokens=False)
    for t in ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "</think>"]:
        assert ids[t] in enc, t
    assert tok.decode(enc) == GREEDY_TEXT
    assert tok.eos_token_id == ids["<|endoftext|>"]


def randomise(model: FlintForCausalLM, seed: int) -> None:
    """Overwrite every parameter with seeded values; round all but routers and sinks to bf16."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("norm.weight"):  # input/post_attention layernorm, q_norm, k_norm, model.norm
                v = 1.0 + 0.3 * torch.randn(shape, generator=g)
            elif name.endswith("self_attn.sinks"):
                v = torch.randn(shape, generator=g)
            elif name.endswith("mlp.gate.weight"):  # router
                v = torch.randn(shape, generator=g) * (1.5 / cfg.hidden_size**0.5)
            elif name == "model.embed_tokens.weight":
                v = torch.randn(shape, generator=g)
            elif name == "lm_head.weight":
                v = torch.randn(shape, generator=g) * (2.5 / cfg.hidden_size**0.5)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                v = torch.randn(shape, generator=g) / shape[-1] ** 0.5  # [E, out, in]
            elif name.endswith(".weight") and p.dim() == 2:  # nn.Linear [out, in]
                v = torch.randn(shape, generator=g) / shape[-1] ** 0.5
            else:
                raise ValueError(f"unhandled parameter {name} {tuple(shape)}")
            if not (name.endswith("mlp.gate.weight") or name.endswith("self_attn.sinks")):
                v = v.to(torch.bfloat16).to(torch.float32)
            p.copy_(v.to(p.dtype))


def fp32_only(name: str) -> bool:
    return name.endswith("mlp.gate.weight") or name.endswith("self_attn.sinks")


def load(path: Path) -> FlintForCausalLM:
    m = FlintForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    m.eval()
    return m


def save_bf16(model: FlintForCausalLM, path: Path) -> None:
    """save_pretrained with bf16 weights, fp32 routers and sinks."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not fp32_only(name):
                p.data = p.data.to(torch.bfloat16)
    m.config.dtype = torch.bfloat16
    m.save_pretrained(str(path), safe_serialization=True)


def capture(model: FlintForCausalLM, input_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """One uncached forward with hooks on embeddings, decoder layers, routers and the final norm."""
    cfg = model.config
    inner = model.model
    B, T = input_ids.shape
    hidden: list[torch.Tensor] = []
    routers: list[tuple] = []
    final: list[torch.Tensor] = []
    hooks = [inner.embed_tokens.register_forward_hook(lambda m, i, o: hidden.append(o.detach().clone()))]
    moe_layers = []
    for idx, layer in enumerate(inner.layers):
        hooks.append(layer.register_forward_hook(lambda m, i, o: hidden.append((o[0] if isinstance(o, tuple) else o).detach().clone())))
        if hasattr(layer.mlp, "gate"):
            moe_layers.append(idx)
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, i, o: routers.append(tuple(t.detach().clone() for t in o))))
    hooks.append(inner.norm.register_forward_hook(lambda m, i, o: final.append(o.detach().clone())))
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False)
    for h in hooks:
        h.remove()
    assert len(hidden) == cfg.num_hidden_layers + 1 and len(routers) == len(moe_layers) and len(final) == 1
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    res = {
        "input_ids": input_ids.numpy().astype(np.int64),
        "logits": out.logits.float().numpy(),
        "hidden_states": torch.stack(hidden).float().numpy(),
        "final_hidden": final[0].float().numpy(),
        "moe_layers": np.array(moe_layers, dtype=np.int64),
    }
    if moe_layers:
        res["router_logits"] = torch.stack([r[0].reshape(B, T, E) for r in routers]).float().numpy()
        res["router_topk_weight"] = torch.stack([r[1].reshape(B, T, k) for r in routers]).float().numpy()
        res["router_topk_idx"] = torch.stack([r[2].reshape(B, T, k) for r in routers]).numpy().astype(np.int64)
    return res


def greedy(model: FlintForCausalLM, prompt: torch.Tensor) -> dict[str, np.ndarray]:
    gen_model = model
    saved_eos = gen_model.generation_config.eos_token_id
    gen_model.generation_config.eos_token_id = None  # no eos stopping: exactly N_NEW plain-argmax tokens
    try:
        with torch.no_grad():
            out = gen_model.generate(
                prompt[None],
                attention_mask=torch.ones_like(prompt[None]),
                do_sample=False,
                max_new_tokens=N_NEW,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
    finally:
        gen_model.generation_config.eos_token_id = saved_eos
    seq = out.sequences[0]
    toks = seq[prompt.shape[0] :]
    assert toks.shape[0] == N_NEW, toks.shape
    step_logits = torch.stack([l[0] for l in out.logits]).float()
    # The cached generation must equal one uncached forward of prompt + tokens (and be plain argmax).
    with torch.no_grad():
        full = model(input_ids=seq[None], use_cache=False).logits[0, prompt.shape[0] - 1 : -1].float()
    assert torch.equal(step_logits.argmax(-1), toks), "generate() is not plain greedy"
    assert torch.equal(full.argmax(-1), toks), "cached and uncached greedy disagree"
    cache_err = (step_logits - full).abs().max().item()
    assert cache_err < 1e-4, cache_err
    top2 = full.topk(2, dim=-1).values
    return {
        "greedy_prompt": prompt.numpy().astype(np.int64),
        "greedy_tokens": toks.numpy().astype(np.int64),
        "greedy_logits": step_logits.numpy(),
        "_cache_err": cache_err,
        "_min_margin": (top2[:, 0] - top2[:, 1]).min().item(),
    }


def stats(name: str, g: dict, greedy_out: dict, cfg: FlintConfig) -> dict:
    logits = g["logits"]
    s = {
        "logits_std": float(logits.std()),
        "logits_token_std_mean": float(logits.std(-1).mean()),
        "mean_max_prob": float(torch.softmax(torch.from_numpy(logits), -1).max(-1).values.mean()),
        "greedy_distinct_tokens": int(len(set(greedy_out["greedy_tokens"].tolist()))),
        "greedy_min_top2_margin": greedy_out["_min_margin"],
        "generate_vs_forward_max_abs": greedy_out["_cache_err"],
        "hidden_rms_per_layer": [float(np.sqrt((h**2).mean())) for h in g["hidden_states"]],
    }
    if "router_logits" in g:
        scores = torch.sigmoid(torch.from_numpy(g["router_logits"]))
        srt = scores.sort(-1, descending=True).values
        k = cfg.num_experts_per_tok
        s["router_min_gap_k_vs_k+1"] = float((srt[..., k - 1] - srt[..., k]).min())
        s["router_distinct_topk_sets_per_layer"] = [
            len({tuple(sorted(r)) for r in layer.reshape(-1, k).tolist()}) for layer in g["router_topk_idx"]
        ]
    print(f"[{name}] " + json.dumps(s))
    return s


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez(path, **{k: v for k, v in sorted(arrays.items()) if not k.startswith("_")})


def write_fused_variant(src: Path, dst: Path) -> None:
    """tiny_a's weights with fused experts, `self_attn.sinks`, two shards + index."""
    tensors = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in tensors.items():
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = v
        elif k.endswith("self_attn.softmax_offset"):
            out[k.replace("self_attn.softmax_offset", "self_attn.sinks")] = v
        else:
            out[k] = v
    for prefix, per in experts.items():
        E = len(per)
        assert sorted(per) == list(range(E))
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], 0) for e in range(E)]
        ).contiguous()
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(E)]).contiguous()
    names = sorted(out)
    # shard 1: embeddings and the first half of the layers; shard 2: the rest
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]

    def shard_of(n: str) -> int:
        if n.startswith("model.layers."):
            return 1 if int(n.split(".")[2]) < n_layers // 2 else 2
        return 1 if n == "model.embed_tokens.weight" else 2

    dst.mkdir(parents=True)
    weight_map, total = {}, 0
    for s in (1, 2):
        fname = f"model-0000{s}-of-00002.safetensors"
        part = {n: out[n] for n in names if shard_of(n) == s}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)


def check_disk_dtypes(path: Path) -> dict[str, str]:
    dtypes = {}
    files = sorted(path.glob("*.safetensors"))
    for fpath in files:
        with safe_open(str(fpath), "pt") as f:
            for k in f.keys():
                dt = f.get_slice(k).get_dtype()
                want = "F32" if (k.endswith("mlp.gate.weight") or k.endswith("softmax_offset") or k.endswith("self_attn.sinks")) else "BF16"
                assert dt == want, (k, dt)
                dtypes[k] = dt
    return dtypes


def main() -> None:
    set_determinism()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in [*CONFIGS, "tiny_a_fused"]:
        if (OUT / name).exists():
            shutil.rmtree(OUT / name)

    summary = {}
    tok_ids = None
    for name, fields in CONFIGS.items():
        run = RUNS[name]
        fields = dict(fields)
        tokenizer = None
        if name == "tiny_a":
            tokenizer, tok_ids = build_tokenizer()
            eos = [tok_ids["<|endoftext|>"], tok_ids["<|user|>"], tok_ids["<|observation|>"]]
            fields.update(eos_token_id=eos, pad_token_id=tok_ids["<|endoftext|>"])
        cfg = FlintConfig(**fields)
        torch.manual_seed(run["seed"])
        model = FlintForCausalLM._from_config(
            cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        assert model.config._experts_implementation == "eager" and model.config._attn_implementation == "eager"
        randomise(model, run["seed"])
        model.eval()
        if name == "tiny_a":
            model.generation_config.eos_token_id = fields["eos_token_id"]
            model.generation_config.pad_token_id = fields["pad_token_id"]

        d = OUT / name
        save_bf16(model, d)
        check_disk_dtypes(d)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(d))
            check_tokenizer(d, tok_ids)

        # Goldens from the reloaded checkpoint (fp32); must equal the in-memory model exactly.
        loaded = load(d)
        sd_mem, sd_disk = model.state_dict(), loaded.state_dict()
        assert sd_mem.keys() == sd_disk.keys()
        for k in sd_mem:
            assert sd_disk[k].dtype == torch.float32 and torch.equal(sd_mem[k], sd_disk[k]), k

        g = torch.Generator().manual_seed(run["seed"] + 1)
        input_ids = torch.randint(0, cfg.vocab_size, (BATCH, run["seq_len"]), generator=g)
        golden = capture(loaded, input_ids)
        with torch.no_grad():
            assert torch.equal(model(input_ids=input_ids, use_cache=False).logits, torch.from_numpy(golden["logits"]))
        if name == "tiny_a":
            from transformers import AutoTokenizer

            prompt = torch.tensor(AutoTokenizer.from_pretrained(str(d)).encode(GREEDY_TEXT, add_special_tokens=False))
        else:
            prompt = torch.randint(0, cfg.vocab_size, (run["prompt_len"],), generator=g)
        gr = greedy(loaded, prompt)
        golden.update(gr)
        write_npz(d / "golden.npz", golden)
        summary[name] = stats(name, golden, gr, cfg)

        if name == "tiny_a":
            v = OUT / "tiny_a_fused"
            write_fused_variant(d, v)
            check_disk_dtypes(v)
            fused = load(v)
            for k, t in fused.state_dict().items():
                assert torch.equal(t, sd_mem[k]), k
            with torch.no_grad():
                lf = fused(input_ids=input_ids, use_cache=False).logits
            assert torch.equal(lf, torch.from_numpy(golden["logits"])), "fused variant logits differ"
            print("[tiny_a_fused] transformers loads it to bit-identical weights and logits")

    info = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "script": "tools/make_goldens.py",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "dtype": "float32 (weights bf16-rounded except routers and sinks)",
        "n_new_tokens": N_NEW,
        "stats": summary,
    }
    (OUT / "oracle_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
