"""Flint's configuration: `config.json` (HF or vLLM field names) <-> a frozen dataclass.

The dataclass is hashable, so it can ride through `jax.jit` as a static argument. Derived layer
maps (full vs sliding attention, RoPE or not, dense vs MoE, cache slots) are computed once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


class ConfigError(ValueError):
    """A config.json that flint_jax refuses (the message names the field and value)."""


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """HF rule: full attention on layers 0, 1, every `i % 4 == 1` and the last; sliding elsewhere."""
    return tuple(
            FULL if i < 2 or i % 4 == 1 or i == num_layers - 1 else SLIDING for i in range(num_layers)
    )


@dataclasses.dataclass(frozen=True)
class FlintConfig:
    """Flint's architecture (spec section 2). Defaults are the real model's sizes."""

    vocab_size: int = 150144
    hidden_size: int = 2048
    num_hidden_layers: int = 49
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 6144
    mlp_only_layers: tuple[int, ...] = (0, 1)
    num_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 1024
    norm_topk_prob: bool = True
    router_score_function: str = "sigmoid"
    sliding_window: int = 513
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    decoder_sparse_step: int = 1  # HF: a layer is MoE iff (i + 1) % step == 0 (and not dense)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(self.mlp_only_layers)))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._validate()

    # ---- validation -------------------------------------------------------------------------
    def _validate(self):
        def need(cond, msg):
            if not cond:
                raise ConfigError(f"config: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                                  "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size",
                                  "sliding_window", "max_position_embeddings", "decoder_sparse_step"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(len(self.layer_types) == self.num_hidden_layers,
                  f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                  f"{self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
        need(not bad, f"layer_types may hold only {FULL!r} and {SLIDING!r}, got {bad[0]!r}" if bad else "")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
                  f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                  f"num_key_value_heads ({self.num_key_value_heads})")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        need(self.num_experts_per_tok <= self.num_experts,
                  f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        need(not bad_layers, f"mlp_only_layers holds layer {bad_layers[0] if bad_layers else ''} "
                  f"outside 0..{self.num_hidden_layers - 1}")
        need(self.router_score_function == "sigmoid",
                  f"router_score_function must be 'sigmoid' for Flint, got {self.router_score_function!r}")
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(not self.attention_bias, "attention_bias=true is not Flint (no attention biases)")
        need(not self.tie_word_embeddings,
                  "tie_word_embeddings=true is not Flint (it has a separate lm_head.weight)")
        need(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")

    # ---- derived maps -----------------------------------------------------------------------
    @functools.cached_property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @functools.cached_property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @functools.cached_property
    def rope_layers(self) -> tuple[int, ...]:
        """RoPE is applied on sliding layers only; full-attention layers use no positional encoding."""
        return self.sliding_layers

    @functools.cached_property
    def no_rope_layer_indices(self) -> tuple[int, ...]:
        return self.full_layers

    @functools.cached_property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

    @functools.cached_property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe(i))

    @functools.cached_property
    def cache_index(self) -> tuple[int, ...]:
        """Layer `i` -> its index among the full layers or among the sliding layers."""
        full = {l: j for j, l in enumerate(self.full_layers)}
        slide = {l: j for j, l in enumerate(self.sliding_layers)}
        return tuple(full[i] if i in full else slide[i] for i in range(self.num_hidden_layers))

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA): head `h` reads KV head `h // num_groups`."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def ring_size(self) -> int:
        """Sliding layers' ring-buffer slots: the window rounded up to a multiple of 64."""
        return -(-self.sliding_window // 64) * 64

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_moe(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def param_count(self) -> dict[str, int]:
        """Total and active-per-token parameter counts."""
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2 + 2 * hd + h
        dense = 3 * d * self.intermediate_size
        expert = 3 * d * self.moe_intermediate_size
        shared = 3 * d * self.shared_expert_intermediate_size
        router = self.num_experts * d
        # The embedding lookup reads one row per token: it does not count as active.
        total = 2 * self.vocab_size * d + d
        active = self.vocab_size * d + d
        for i in range(self.num_hidden_layers):
            total += attn + 2 * d
            active += attn + 2 * d
            if self.is_moe(i):
                total += router + shared + self.num_experts * expert
                active += router + shared + self.num_experts_per_tok * expert
            else:
                total += dense
                active += dense
        return {"total": total, "active": active}

    # ---- JSON -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "FlintConfig":
        """Builds a config from HF (`FlintConfig`) or vLLM field names.

        Absent `layer_types` / `mlp_only_layers` follow the HF rules. `no_rope_layer_indices`, when
        given, must equal the full-attention layers; `use_sliding_window=false` makes every layer full.
        """
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing required field {missing[0]!r}")
        for k in known:
            if k in d and d[k] is not None:
                kw[k] = d[k]
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            kw["rope_theta"] = float(rope["rope_theta"])
            if rope.get("rope_type", "default") not in ("default", None):
                raise ConfigError(f"{source}: rope_type {rope['rope_type']!r} is not supported (Flint uses "
                                                    "'default')")
        if "num_key_value_heads" not in kw:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
        if "head_dim" not in kw:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        if d.get("use_sliding_window") is False and "layer_types" not in kw:
            kw["layer_types"] = (FULL,) * kw["num_hidden_layers"]
        if "mlp_only_layers" in kw:
            kw["mlp_only_layers"] = tuple(kw["mlp_only_layers"])
        eos = d.get("eos_token_id")
        kw["eos_token_id"] = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        try:
            cfg = cls(**kw)
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {str(e).removeprefix('config: ')}") from None
        if d.get("no_rope_layer_indices") is not None:
            given = tuple(sorted(d["no_rope_layer_indices"]))
            if given != cfg.full_layers:
                raise ConfigError(
                        f"{source}: no_rope_layer_indices {list(given)} disagrees with the full-attention "
                        f"layers {list(cfg.full_layers)}; Flint applies RoPE exactly on the sliding layers")
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "FlintConfig":
        """Reads `config.json` (a file, or a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=path)

    def to_dict(self) -> dict[str, Any]:
        """HF `FlintConfig` fields (plus vLLM's explicit lists), loadable by transformers and vLLM."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        eos = list(self.eos_token_id)
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["no_rope_layer_indices"] = list(self.full_layers)
        d["model_type"] = "flint"
        d["architectures"] = ["FlintForCausalLM"]
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def replace(self, **changes) -> "FlintConfig":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = ()
        if "num_hidden_layers" in changes and "mlp_only_layers" not in changes:
            n = changes["num_hidden_layers"]
            changes["mlp_only_layers"] = tuple(i for i in self.mlp_only_layers if i < n)
        return dataclasses.replace(self, **changes)


# ---- presets --------------------------------------------------------------------------------

def _tiny(**kw) -> FlintConfig:
    base = dict(vocab_size=512, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=192, mlp_only_layers=(0, 1),
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=128, sliding_window=9,
                            max_position_embeddings=4096)
    base.update(kw)
    return FlintConfig(**base)


PRESETS = {
        # The real model (spec section 2).
        "flint": FlintConfig,
        # Small models for tests and the embedded demo; every linear input dim is a multiple of 64.
        "tiny": lambda: _tiny(),
        "tiny-gqa8": lambda: _tiny(num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                                                              num_hidden_layers=7, mlp_only_layers=(0,), sliding_window=17),
        "small": lambda: _tiny(vocab_size=4096, hidden_size=256, num_hidden_layers=8,
                                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                                      intermediate_size=512, num_experts=16, num_experts_per_tok=4,
                                                      moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                                      sliding_window=65, max_position_embeddings=16384),
}


def preset(name: str, **overrides) -> FlintConfig:
    """A named config: `flint` (real sizes), `tiny`, `tiny-gqa8`, `small`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown config preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg


def kv_cache_bytes(cfg: FlintConfig, batch: int, length: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes of the KV cache: full layers grow with `length`, sliding layers hold a fixed ring."""
    per_slot = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    full = len(cfg.full_layers) * batch * length * per_slot
    ring = len(cfg.sliding_layers) * batch * cfg.ring_size * per_slot
    return {"full": full, "sliding": ring, "total": full + ring}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def round_up(x: int, m: int) -> int:
    return int(math.ceil(x / m) * m)
