"""`flint-jax synth`: random-weight Flint checkpoints at any scale, in the real formats.

    flint-jax synth /tmp/flint-hf --format hf --config flint --layers 4
    flint-jax synth /tmp/flint-gguf --format gguf --config flint        # ~22 GB, 49 layers

* `--format hf`: OUT/config.json, generation_config.json, a byte-level tokenizer (when the vocab
  holds one), and safetensors shards (`model-0000k-of-0000N.safetensors`, one per layer plus the
  embeddings and the head, with `model.safetensors.index.json`), transformers' names: per-expert
  tensors (or `--fused`), sinks as `self_attn.softmax_offset`, bf16 weights, fp32 router/sinks.
* `--format gguf`: OUT/model.gguf, an NVFP4 GGUF file in Flint's naming (every linear layer NVFP4
  with an `X.scale` tensor scale, BF16 embeddings, F32 norms / router / sinks), plus OUT/config.json and the
  tokenizer, so that `flint-jax convert OUT/model.gguf DST` finds them.

Values are realistic and never zero: bf16 weights come from a 65,536-entry table of Gaussian
quantiles (std 0.02 for linear layers, 1.0 for the embeddings), norms are `1 + 0.1 N(0, 1)`,
the router `N(0, 0.5/sqrt(D))` in fp32. NVFP4 blocks are written directly (no quantizer): code
bytes and E4M3 block-scale bytes are drawn from tables of bytes of a real NVFP4 quantization of
Gaussian data, and tensor scales make the decoded weights' std 0.02 (per expert, jittered).

Everything streams: each tensor is generated when its turn comes to be written (a few ahead in
threads), so memory stays at a few tensors for any model size. Deterministic for a seed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import ml_dtypes
import numpy as np

from flint_jax import checkpoint
from flint_jax.config import PRESETS, FlintConfig, preset

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
LINEAR_STD = 0.02
EMBED_STD = 1.0
FORMATS = ("hf", "gguf")
GGUF_NAME = "model.gguf"


class SynthError(ValueError):
    """Bad synth arguments (the message says which)."""


# ---- config ---------------------------------------------------------------------------------------

def resolve_config(spec: str | FlintConfig = "tiny", *, layers: int | None = None,
                   experts: int | None = None, vocab: int | None = None) -> FlintConfig:
    """A preset name (`flint`, `tiny`, ...), a config.json path (or its directory), or a config;
    then the overrides (`layers` keeps the HF layer rule; `experts` also caps top-k)."""
    if isinstance(spec, FlintConfig):
        cfg = spec
    elif spec in PRESETS:
        cfg = preset(spec)
    elif os.path.exists(spec):
        cfg = FlintConfig.from_json(spec)
    else:
        raise SynthError(f"config {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                         "config.json path")
    changes: dict[str, Any] = {}
    if layers is not None:
        if layers < 1:
            raise SynthError(f"--layers must be positive, got {layers}")
        changes["num_hidden_layers"] = layers
    if experts is not None:
        if experts < 1:
            raise SynthError(f"--experts must be positive, got {experts}")
        changes["num_experts"] = experts
        changes["num_experts_per_tok"] = min(cfg.num_experts_per_tok, experts)
    if vocab is not None:
        changes["vocab_size"] = vocab
    return cfg.replace(**changes) if changes else cfg


# ---- random values ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gauss_lut(std: float) -> np.ndarray:
    """65,536 bf16 Gaussian quantiles `std * Phi^-1((i + 0.5) / 65536)` as uint16 bits (no zero)."""
    inv = NormalDist().inv_cdf
    z = np.array([inv((i + 0.5) / 65536) for i in range(65536)], np.float64) * std
    return z.astype(np.float32).astype(BF16).view(np.uint16)


def gauss_bf16(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    """bf16 values distributed like N(0, std^2) (never zero), one table lookup per value."""
    r = rng.integers(0, 65536, size=shape, dtype=np.uint16)
    return _gauss_lut(float(std))[r].view(BF16)


@functools.lru_cache(maxsize=1)
def _nvfp4_tables() -> tuple[np.ndarray, np.ndarray, float]:
    """(code bytes [256], UE4M3 scale bytes [256], tensor scale for std 1): bytes of a real
    NVFP4 quantization of N(0, 1) data (ModelOpt recipe)."""
    from flint_jax import nvfp4
    w = np.random.default_rng(1234).standard_normal((256, 1024)).astype(np.float32)
    q, s, ts = nvfp4.quantize_nvfp4(w)
    raw = nvfp4.kernel_to_gguf(q, s).reshape(256, 16, 36)
    rng = np.random.default_rng(99)
    codes = rng.choice(raw[:, :, 4:].reshape(-1), 256, replace=False)
    scales = rng.choice(raw[:, :, :4].reshape(-1), 256, replace=False)
    # The decoded std of table-drawn blocks, to turn a target std into a tensor scale.
    vals = nvfp4.E2M1_VALUES[np.concatenate([codes & 15, codes >> 4])]
    sc = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    unit = float(np.sqrt(np.mean(vals.astype(np.float64) ** 2) * np.mean(sc.astype(np.float64) ** 2)))
    return codes.astype(np.uint8), scales.astype(np.uint8), 1.0 / unit


def nvfp4_blocks(rng: np.random.Generator, shape) -> np.ndarray:
    """Random GGUF NVFP4 blocks for an element shape `[..., N, K]` (K % 64 == 0): uint8
    `[..., N, K/64*36]` (never 0xFF, never all-zero scales)."""
    codes, scales, _ = _nvfp4_tables()
    *lead, k = shape
    r = rng.integers(0, 256, size=(*lead, k // 64, 36), dtype=np.uint8)
    out = codes[r]
    out[..., :4] = scales[r[..., :4]]
    return out.reshape(*lead, k // 64 * 36)


def nvfp4_tensor_scale(rng: np.random.Generator, n_exp: int | None, std: float = LINEAR_STD):
    """F32 `[1]` or `[E]` tensor scale giving decoded values of about `std` (experts jittered)."""
    unit = _nvfp4_tables()[2] * std
    if n_exp is None:
        return np.array([unit], np.float32)
    return (unit * rng.uniform(0.8, 1.25, n_exp)).astype(np.float32)


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index)])


def _value(name: str, shape, dtype, rng, d: int) -> np.ndarray:
    """A realistic random tensor for a HF (or flint_jax) tensor name."""
    if name.endswith(("softmax_offset", "sinks")):
        return rng.standard_normal(shape).astype(F32)
    if name.endswith("mlp.gate.weight"):
        return (rng.standard_normal(shape) * (0.5 / np.sqrt(d))).astype(F32)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32).astype(dtype)
    std = EMBED_STD if "embed_tokens" in name else LINEAR_STD
    arr = gauss_bf16(rng, shape, std)
    return arr if dtype == BF16 else arr.astype(dtype)


# ---- streaming safetensors ----------------------------------------------------------------------

class SafetensorsStreamWriter:
    """A safetensors file whose tensor list is known up front, written one tensor at a time."""

    def __init__(self, path: str, specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        from flint_jax.hf_io import _NP_TO_ST
        self.path, self.specs, self._next = path, list(specs), 0
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dt, shape in self.specs:
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            header[name] = {"dtype": _NP_TO_ST[np.dtype(dt)], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)))
        self.f.write(blob)

    def write(self, name: str, arr: np.ndarray):
        exp_name, dt, shape = self.specs[self._next]
        if name != exp_name or arr.dtype != np.dtype(dt) or tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} {arr.dtype}{list(arr.shape)} written "
                             f"where {exp_name!r} {np.dtype(dt)}{list(shape)} is planned")
        np.ascontiguousarray(arr).tofile(self.f)
        self._next += 1

    def close(self):
        self.f.close()
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: only {self._next} of {len(self.specs)} tensors written")


def hf_tensor_specs(cfg: FlintConfig, fused: bool = False) -> list[list[tuple[str, np.dtype, tuple]]]:
    """transformers' tensors of `cfg`, grouped by shard: [embeddings], one per layer, [norm, head]."""
    from flint_jax.hf_io import expected_params
    params = expected_params(cfg)
    shards: list[list] = [[("model.embed_tokens.weight", BF16, params["model.embed_tokens.weight"])]]
    mi = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shard = []
        for name, shape in params.items():
            if not name.startswith(p):
                continue
            if name.endswith(".self_attn.sinks"):
                shard.append((name[: -len("sinks")] + "softmax_offset", F32, shape))
            elif name.endswith("mlp.gate.weight"):
                shard.append((name, F32, shape))
            elif name.endswith("experts.gate_up_proj") and not fused:
                e, _, d = shape
                for x in range(e):
                    shard.append((f"{p}mlp.experts.{x}.gate_proj.weight", BF16, (mi, d)))
                    shard.append((f"{p}mlp.experts.{x}.up_proj.weight", BF16, (mi, d)))
            elif name.endswith("experts.down_proj") and not fused:
                e, d, _ = shape
                for x in range(e):
                    shard.append((f"{p}mlp.experts.{x}.down_proj.weight", BF16, (d, mi)))
            else:
                shard.append((name, BF16, shape))
        shards.append(sorted(shard, key=lambda s: _natural(s[0])))
    shards.append([("model.norm.weight", BF16, params["model.norm.weight"]),
                   ("lm_head.weight", BF16, params["lm_head.weight"])])
    return shards


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ---- writers -------------------------------------------------------------------------------------

def _write_meta(cfg: FlintConfig, out: str, tokenizer: bool = True) -> FlintConfig:
    """config.json, generation_config.json, and (vocab >= 300) a byte-level tokenizer."""
    eos: list[int] = list(cfg.eos_token_id)
    if tokenizer and cfg.vocab_size >= 300:
        from flint_jax import demo
        from flint_jax.chat_format import DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKENS
        tok = demo.build_tokenizer(vocab_size=min(cfg.vocab_size, demo.DEMO_VOCAB))
        tok.save(os.path.join(out, "tokenizer.json"))
        eos = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                       "pad_token": "<|endoftext|>",
                       "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
                       "model_max_length": cfg.max_position_embeddings}, f, indent=2)
        with open(os.path.join(out, "chat_template.jinja"), "w") as f:
            f.write(DEFAULT_CHAT_TEMPLATE)
        cfg = cfg.replace(eos_token_id=tuple(eos), pad_token_id=eos[0])
    d = cfg.to_dict()
    d["dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    gen = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    if eos:
        gen["eos_token_id"] = eos
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    return cfg


def _bar(total: int, desc: str, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                dynamic_ncols=True)


def write_hf(cfg: FlintConfig, out: str, *, seed: int = 0, fused: bool = False,
             workers: int = 2, progress: bool = False, name: str | None = None) -> dict:
    shards = hf_tensor_specs(cfg, fused)
    n = len(shards)
    total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(dt).itemsize
                for sh in shards for _, dt, s in sh)
    bar = _bar(total, f"synth {name or os.path.basename(out)}", progress)
    weight_map = {}
    items = [(j, k, spec) for j, (k, spec) in
             enumerate((k, spec) for k, sh in enumerate(shards) for spec in sh)]
    d = cfg.hidden_size

    def produce(item):
        j, _, (name, dt, shape) = item
        return _value(name, shape, np.dtype(dt), _rng(seed, j), d)

    writers: dict[int, SafetensorsStreamWriter] = {}
    try:
        for (_, k, (name, dt, shape)), arr in zip(items, checkpoint.ordered_map(produce, items,
                                                                             workers)):
            if k not in writers:
                fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                writers[k] = SafetensorsStreamWriter(os.path.join(out, fname), shards[k])
                if k - 1 in writers:
                    writers.pop(k - 1).close()
            writers[k].write(name, arr)
            weight_map[name] = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            if bar is not None:
                bar.update(arr.nbytes)
            del arr
        for w in writers.values():
            w.close()
    finally:
        for w in writers.values():
            w.f.close()
        if bar is not None:
            bar.close()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return {"format": "hf", "files": n, "tensors": len(items), "bytes": total}


def write_gguf(cfg: FlintConfig, path: str, *, seed: int = 0, workers: int = 2,
               progress: bool = False, name: str | None = None) -> dict:
    from flint_jax import gguf_io
    from flint_jax.quantize import gguf_metadata, plan_specs, write_gguf_stream

    def src_dtype(g):
        return BF16 if g == "token_embd.weight" else F32

    specs = plan_specs(cfg, src_dtype)
    weights = [s for s in specs if not gguf_io.is_companion(s.name)]
    total = sum(s.nbytes for s in specs)
    bar = _bar(total, f"synth {name or os.path.basename(path)}", progress)
    d = cfg.hidden_size

    def produce(j):
        s = weights[j]
        rng = _rng(seed, j)
        if s.qtype == gguf_io.NVFP4:
            n_exp = s.shape[0] if len(s.shape) == 3 else None
            return [(s.name, nvfp4_blocks(rng, s.shape)),
                    (gguf_io.scale_name(s.name), nvfp4_tensor_scale(rng, n_exp))], None
        hf = gguf_io.gguf_to_hf_name(s.name)
        return [(s.name, _value(hf, s.shape, s.data_dtype, rng, d))], None

    def done(j, arrays, _):
        if bar is not None:
            bar.update(sum(a.nbytes for _, a in arrays))

    meta = gguf_metadata(cfg, "flint-synth", **{"flint.synth.seed": int(seed)})
    try:
        write_gguf_stream(path, specs, meta, produce, list(range(len(weights))), workers=workers,
                          on_item=done)
    finally:
        if bar is not None:
            bar.close()
    return {"format": "gguf", "files": 1, "tensors": len(specs), "bytes": total}


def synth(out: str, *, fmt: str = "hf", config: str | FlintConfig = "tiny",
          layers: int | None = None, experts: int | None = None, vocab: int | None = None,
          seed: int = 0, fused: bool = False, tokenizer: bool = True, overwrite: bool = False,
          workers: int | None = None, progress: bool = False) -> dict:
    """Writes a random-weight checkpoint directory `out` (module docstring). Returns a summary
    {"format", "path", "files", "tensors", "bytes", "config": FlintConfig}."""
    if fmt not in FORMATS:
        raise SynthError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fused and fmt != "hf":
        raise SynthError("--fused applies to --format hf (GGUF stacks experts anyway)")
    from flint_jax import output_path
    config_path = config if isinstance(config, (str, os.PathLike)) and config not in PRESETS \
        else None
    inputs = [("--config", config_path)]
    out = output_path.check(out, inputs=inputs, overwrite=overwrite, kind="dir")
    cfg = resolve_config(config, layers=layers, experts=experts, vocab=vocab)
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with output_path.staging(out, inputs=inputs, overwrite=overwrite, kind="dir") as tmp:
        cfg = _write_meta(cfg, tmp, tokenizer)
        if fmt == "hf":
            name = os.path.basename(out)  # (the progress bar's, not the temporary's)
            info = write_hf(cfg, tmp, seed=seed, fused=fused, workers=workers, progress=progress,
                            name=name)
            path = out
        else:
            info = write_gguf(cfg, os.path.join(tmp, GGUF_NAME), seed=seed, workers=workers,
                              progress=progress, name=os.path.basename(out))
            path = os.path.join(out, GGUF_NAME)
    return {**info, "path": path, "dir": out, "config": cfg}


__all__ = ["SafetensorsStreamWriter", "SynthError", "gauss_bf16", "hf_tensor_specs",
           "nvfp4_blocks", "nvfp4_tensor_scale", "resolve_config", "synth"]
