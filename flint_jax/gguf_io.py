"""Flint GGUF files: tensor names (GGUF <-> HF), validated lazy reading, checks against a config,
writing.

Names (``FLINT_SPEC.md`` section 5). Per layer ``N`` (HF prefix ``model.layers.N.``):

====================================  ==========================================
GGUF                                  HF
====================================  ==========================================
``blk.N.attn_norm.weight``            ``input_layernorm.weight``
``blk.N.ffn_norm.weight``             ``post_attention_layernorm.weight``
``blk.N.attn_{q,k}_norm.weight``      ``self_attn.{q,k}_norm.weight``
``blk.N.attn_sinks.weight``           ``self_attn.softmax_offset`` (alias in: ``self_attn.sinks``)
``blk.N.attn_{q,k,v}.weight``         ``self_attn.{q,k,v}_proj.weight``
``blk.N.attn_output.weight``          ``self_attn.o_proj.weight``
``blk.N.ffn_{gate,up,down}.weight``   dense ``mlp.{gate,up,down}_proj.weight``
``blk.N.ffn_{g,u,d}_shexp.weight``    ``mlp.shared_expert.{gate,up,down}_proj.weight``
``blk.N.ffn_gate_inp.weight``         ``mlp.gate.weight`` (router)
``blk.N.ffn_{g,u,d}_exps.weight``     ``mlp.experts.{gate,up,down}_proj.weight``: the stack
                                      ``[E, out, in]`` of the per-expert
                                      ``mlp.experts.{e}.*_proj.weight`` (alias in: HF's fused
                                      ``mlp.experts.down_proj``; the fused ``gate_up_proj``
                                      is ``concat([gate, up], axis=1)``, two GGUF tensors)
====================================  ==========================================

plus ``token_embd.weight`` / ``output_norm.weight`` / ``output.weight`` <->
``model.embed_tokens.weight`` / ``model.norm.weight`` / ``lm_head.weight``.
The F32 tensor scale of an NVFP4 tensor ``X.weight`` is ``X.scale``: the weight's name without
``.weight`` (``blk.3.attn_q.scale``, ``output.scale``; ``[1]``, or ``[E]`` per expert for
``*_exps``; absent means 1.0) <-> HF ``Y.weight_scale_2`` (ModelOpt's name). This is the name
llama.cpp's loader and vLLM's GGUF adapter look up. An activation scale ``X.input_scale`` (same
shapes) <-> HF ``Y.input_scale`` is read and checked; W4A16 does not use it. Files written by
flint_jax 0.1 name the tensor scale ``X.weight.scale`` (``LEGACY_SCALE_SUFFIX``): they are still
read, with a warning; a file holding both names for one weight is refused.

Data as numpy (``FlintGGUF.array``; numpy shapes, i.e. ggml ``tensor.shape`` reversed):
F32 float32 ``[...]``; BF16 ml_dtypes.bfloat16 ``[..., K]``; NVFP4 raw blocks uint8
``[..., N, K/64*36]`` (see ``flint_jax.nvfp4``). Everything stays memory-mapped until used.

Writing (checked by reading back, see tests): gguf 0.19's ``GGUFWriter.add_tensor`` accepts
``raw_dtype=GGMLQuantizationType.NVFP4`` with uint8 block bytes and records the element
shape (``quant_shape_from_byte_shape``: ``[..., N, K/64*36]`` bytes -> ``[..., N, K]``),
written in ggml order ``(K, N, ...)``; ``GGUFReader`` then gives ``tensor.shape == (K, N, ...)``
and ``tensor.data`` uint8 ``[..., N, K/64*36]`` again. BF16 is written from bfloat16 (or uint16)
arrays with ``raw_dtype=BF16`` (shape kept, 2 bytes each) and read back as uint8 ``[..., 2K]``.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderTensor

from flint_jax import hf_io, nvfp4
from flint_jax.config import FlintConfig

F32 = GGMLQuantizationType.F32
BF16 = GGMLQuantizationType.BF16
NVFP4 = GGMLQuantizationType.NVFP4
ALLOWED_TYPES = (F32, BF16, NVFP4)
PREC_A4_KEY = "general.tensor_extra.prec_a4"
SCALE_SUFFIX = ".scale"                  # X.weight -> X.scale (llama.cpp, vLLM)
INPUT_SCALE_SUFFIX = ".input_scale"      # X.weight -> X.input_scale
LEGACY_SCALE_SUFFIX = ".weight.scale"    # X.weight -> X.weight.scale (flint_jax 0.1 wrote these)
DEFAULT_ARCH = "flint"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-layer GGUF suffix -> HF suffix (after "blk.N." / "model.layers.N.").
_ATTN_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_sinks.weight": "self_attn.softmax_offset",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_DENSE_NAMES = {f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_LAYER_NAMES = {**_ATTN_NAMES, **_DENSE_NAMES, **_MOE_NAMES}
_LAYER_NAMES_INV = {v: k for k, v in _LAYER_NAMES.items()}
_HF_ALIASES = {"self_attn.sinks": "self_attn.softmax_offset", "mlp.experts.down_proj": "mlp.experts.down_proj.weight"}
# Weights that may be NVFP4 (and so may have ".scale" / ".input_scale" companions): the linear
# layers.
_NOT_NVFP4 = {"token_embd.weight", "ffn_gate_inp.weight", "attn_sinks.weight"}

_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


class GGUFError(ValueError):
    """A GGUF file or tensor that flint_jax refuses; the message names file and tensor."""


# --- names ----------------------------------------------------------------------------------


def _split_scale(name: str, suffix: str) -> tuple[str, bool]:
    return (name[: -len(suffix)], True) if name.endswith(suffix) else (name, False)


def _weight_base(weight_name: str) -> str:
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a GGUF weight name (X.weight)")
    return weight_name[: -len(".weight")]


def scale_name(weight_name: str) -> str:
    """The tensor scale's name of an NVFP4 weight: ``blk.3.attn_q.weight`` -> ``blk.3.attn_q.scale``."""
    return _weight_base(weight_name) + SCALE_SUFFIX


def input_scale_name(weight_name: str) -> str:
    """The activation scale's name: ``blk.3.attn_q.weight`` -> ``blk.3.attn_q.input_scale``."""
    return _weight_base(weight_name) + INPUT_SCALE_SUFFIX


def legacy_scale_name(weight_name: str) -> str:
    """The tensor scale's name in files of flint_jax 0.1: ``X.weight`` -> ``X.weight.scale``."""
    return weight_name + SCALE_SUFFIX


def companion_of(gguf_name: str) -> tuple[str, str] | None:
    """``(weight name, kind)`` if ``gguf_name`` is a companion of an NVFP4 weight, else None.

    kind: ``"scale"`` (``X.scale``), ``"legacy_scale"`` (``X.weight.scale``) or
    ``"input_scale"`` (``X.input_scale``).
    """
    if gguf_name.endswith(LEGACY_SCALE_SUFFIX):
        return gguf_name[: -len(SCALE_SUFFIX)], "legacy_scale"
    if gguf_name.endswith(INPUT_SCALE_SUFFIX):
        return gguf_name[: -len(INPUT_SCALE_SUFFIX)] + ".weight", "input_scale"
    if gguf_name.endswith(SCALE_SUFFIX):
        return gguf_name[: -len(SCALE_SUFFIX)] + ".weight", "scale"
    return None


def is_companion(gguf_name: str) -> bool:
    """Whether a GGUF tensor is a scale companion (not a weight of the model)."""
    return companion_of(gguf_name) is not None


def may_be_nvfp4(gguf_name: str) -> bool:
    """Whether a GGUF weight name is a linear layer (NVFP4 allowed, ``.scale`` allowed)."""
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    suffix = m.group(2) if m else gguf_name
    return suffix not in _NOT_NVFP4 and not suffix.endswith("norm.weight")


def gguf_to_hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name; ``X.scale`` (and the legacy ``X.weight.scale``) ->
    ``Y.weight_scale_2``, ``X.input_scale`` -> ``Y.input_scale``.

    Raises ValueError for a name that is not part of a Flint GGUF file.
    """
    companion = companion_of(gguf_name)
    base = companion[0] if companion else gguf_name
    if companion and not may_be_nvfp4(base):
        raise ValueError(f"{gguf_name!r}: only NVFP4 linear weights have a tensor scale")
    if base in _GLOBAL_NAMES:
        hf = _GLOBAL_NAMES[base]
    else:
        m = _GGUF_LAYER_RE.fullmatch(base)
        if not m or m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"{gguf_name!r} is not a Flint GGUF tensor name")
        hf = f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    if companion is None:
        return hf
    return hf + "_scale_2" if companion[1] != "input_scale" else hf[: -len("weight")] + "input_scale"


def hf_to_gguf_name(hf_name: str) -> str:
    """HF name -> GGUF tensor name; ``Y.weight_scale_2`` -> ``X.scale``, ``Y.input_scale`` ->
    ``X.input_scale``.

    Accepts the aliases ``self_attn.sinks`` and the fused ``mlp.experts.down_proj``. Per-expert
    names and the fused ``gate_up_proj`` have no single GGUF tensor: ValueError.
    """
    base, is_scale = _split_scale(hf_name, "_scale_2")
    is_input = not is_scale and hf_name.endswith(".input_scale")
    if is_input:
        base = hf_name[: -len("input_scale")] + "weight"
    if base in _GLOBAL_NAMES.values():
        gguf = {v: k for k, v in _GLOBAL_NAMES.items()}[base]
    else:
        m = _HF_LAYER_RE.fullmatch(base)
        suffix = m and _HF_ALIASES.get(m.group(2), m.group(2))
        if not m or suffix not in _LAYER_NAMES_INV:
            hint = ""
            if m and re.fullmatch(r"mlp\.experts\.(\d+\.\w+_proj\.weight|gate_up_proj)", m.group(2)):
                hint = " (GGUF stores experts stacked: blk.N.ffn_{gate,up,down}_exps.weight [E, out, in])"
            raise ValueError(f"{hf_name!r} has no Flint GGUF tensor name{hint}")
        gguf = f"blk.{int(m.group(1))}.{_LAYER_NAMES_INV[suffix]}"
    if is_scale or is_input:
        if not may_be_nvfp4(gguf):
            raise ValueError(f"{hf_name!r}: only NVFP4 linear weights have a tensor scale")
        return scale_name(gguf) if is_scale else input_scale_name(gguf)
    return gguf


def flint_gguf_names(num_layers: int, dense_layers: Iterable[int]) -> list[str]:
    """The GGUF weight names of a Flint model (scale companions excluded), in file order."""
    dense = set(dense_layers)
    names = ["token_embd.weight"]
    for i in range(num_layers):
        names += [f"blk.{i}.{s}" for s in _ATTN_NAMES]
        names += [f"blk.{i}.{s}" for s in (_DENSE_NAMES if i in dense else _MOE_NAMES)]
    return names + ["output_norm.weight", "output.weight"]


# --- reading --------------------------------------------------------------------------------


def find_gguf_config(path: str | os.PathLike) -> str | None:
    """The directory beside a `.gguf` file when it holds `config.json` (the layout `flint-jax
    synth --format gguf` and `flint-jax quantize` write, and a GGUF put into the BF16 repo's
    directory), else None. The tokenizer files are taken from the same directory."""
    d = os.path.dirname(os.path.abspath(os.fspath(path)))
    return d if os.path.isfile(os.path.join(d, "config.json")) else None



class _FlintReader(GGUFReader):
    """GGUFReader that checks each tensor's type, row length and extent before mapping it."""

    def __init__(self, path: Path):
        self._path = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise GGUFError(f"{self._path}: tensor {name!r} has unknown GGML type id {int(raw_type[0])}") from None
            if qtype not in ALLOWED_TYPES:
                raise GGUFError(
                    f"{self._path}: tensor {name!r} has GGML type {qtype.name}; "
                    "Flint GGUF files hold only NVFP4 (40), BF16 and F32"
                )
            block, type_size = GGML_QUANT_SIZES[qtype]
            if len(dims) and int(dims[0]) % block:
                raise GGUFError(
                    f"{self._path}: tensor {name!r} ({qtype.name}) has row length {int(dims[0])}, "
                    f"not a multiple of {block}"
                )
            start = start_offs + int(offset[0])
            end = start + int(np.prod(dims, dtype=np.int64)) * type_size // block
            if end > size:
                raise GGUFError(
                    f"{self._path}: file is truncated: tensor {name!r} needs bytes {start}..{end}, "
                    f"the file has {size}"
                )
        super()._build_tensors(start_offs, fields)


class FlintGGUF:
    """A validated, memory-mapped Flint GGUF file (``open_gguf``).

    Attributes:
      path: the file.
      reader: the underlying ``gguf.GGUFReader``.
      metadata: ``{key: value}`` of the file's key/value section (strings, numbers, lists).
      tensors: ``{gguf_name: gguf ReaderTensor}`` in file order (``.tensor_type``,
        ``.shape`` in ggml order, ``.data`` a read-only memmap).
    """

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self.reader = reader
        self.metadata: dict[str, Any] = {
            k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")
        }
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}

    def __iter__(self) -> Iterator[tuple[str, ReaderTensor]]:
        """Yield ``(hf_name, tensor)`` in file order, lazily (no tensor data is read).

        Scale companions come as ``*.weight_scale_2`` / ``*.input_scale``; see
        ``gguf_to_hf_name``.
        """
        for name, t in self.tensors.items():
            yield gguf_to_hf_name(name), t

    def __contains__(self, gguf_name: str) -> bool:
        return gguf_name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def _tensor(self, gguf_name: str) -> ReaderTensor:
        if gguf_name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {gguf_name!r}")
        return self.tensors[gguf_name]

    def array(self, gguf_name: str) -> np.ndarray:
        """Tensor data as a numpy view (numpy shape; see module docstring for dtypes)."""
        t = self._tensor(gguf_name)
        if t.tensor_type == BF16:
            return t.data.view(ml_dtypes.bfloat16)
        return t.data

    @property
    def weights(self) -> dict[str, ReaderTensor]:
        """``{gguf_name: tensor}`` of the model's weights, scale companions left out."""
        return {n: t for n, t in self.tensors.items() if not is_companion(n)}

    def scale_tensor_name(self, gguf_name: str) -> str | None:
        """The name under which this file stores the tensor scale of ``gguf_name`` (``X.scale``,
        or ``X.weight.scale`` in files of flint_jax 0.1), or None when it has none."""
        for name in (scale_name(gguf_name), legacy_scale_name(gguf_name)):
            if name in self.tensors:
                return name
        return None

    def tensor_scale(self, gguf_name: str) -> np.ndarray:
        """float32 ``[1]`` or ``[E]``: the tensor scale of an NVFP4 tensor (``X.scale``), else ``[1.0]``."""
        self._tensor(gguf_name)
        name = self.scale_tensor_name(gguf_name)
        if name is None:
            return np.ones(1, np.float32)
        return np.array(self.tensors[name].data, np.float32).reshape(-1)

    def input_scale(self, gguf_name: str) -> np.ndarray | None:
        """float32 ``[1]`` or ``[E]``: the activation scale ``X.input_scale``, or None. flint_jax
        runs NVFP4 weight-only (W4A16, activations in BF16), so nothing applies it."""
        self._tensor(gguf_name)
        t = self.tensors.get(input_scale_name(gguf_name))
        return None if t is None else np.array(t.data, np.float32).reshape(-1)


class LegacyScaleNameWarning(UserWarning):
    """A GGUF file names its tensor scales ``X.weight.scale`` (flint_jax 0.1), not ``X.scale``."""


def _check_file(path: Path, ck: FlintGGUF) -> None:
    """Flint-level checks: FP4-activation flag, names, scale companions."""
    flag = ck.metadata.get(PREC_A4_KEY)
    if flag:
        raise GGUFError(
            f"{path}: {PREC_A4_KEY} is set (FP4 activations, W4A4); flint_jax runs NVFP4 "
            "weight-only (W4A16) and refuses this file"
        )
    legacy = []
    for name, t in ck.tensors.items():
        try:
            gguf_to_hf_name(name)
        except ValueError as e:
            raise GGUFError(f"{path}: {e}") from None
        companion = companion_of(name)
        if companion is None:
            continue
        base, kind = companion
        what = "activation scale" if kind == "input_scale" else "tensor scale"
        owner = ck.tensors.get(base)
        if owner is None or owner.tensor_type != NVFP4:
            raise GGUFError(f"{path}: {what} {name!r} has no NVFP4 tensor {base!r}")
        n_exp = owner.data.shape[0] if owner.data.ndim == 3 else 1
        if t.tensor_type != F32 or t.n_elements not in (1, n_exp):
            raise GGUFError(
                f"{path}: {what} {name!r} must be F32 with 1 or {n_exp} elements, "
                f"got {t.tensor_type.name} shape {tuple(int(d) for d in t.shape)}"
            )
        if kind == "legacy_scale":
            if scale_name(base) in ck.tensors:
                raise GGUFError(
                    f"{path}: {base!r} has two tensor scales, {scale_name(base)!r} and {name!r}; "
                    "keep one (the standard name is X.scale)"
                )
            legacy.append(name)
    if legacy:
        warnings.warn(
            f"{path}: {len(legacy)} tensor scales use flint_jax 0.1's names (e.g. {legacy[0]!r}); "
            "flint_jax reads them, but llama.cpp and vLLM look for X.scale and would use 1.0 "
            "(re-export with `flint-jax quantize` from the BF16 checkpoint)",
            LegacyScaleNameWarning, stacklevel=3)


def open_gguf(path: str | Path) -> FlintGGUF:
    """Open and validate a Flint GGUF file (memory-mapped; tensor data is not read).

    Raises FileNotFoundError, or ``GGUFError`` (a ValueError) naming the file (and tensor)
    for: a corrupt or truncated header, truncated tensor data, an unknown or non-Flint tensor
    type or name, an NVFP4 row length not a multiple of 64, a bad scale companion (or two
    names for one tensor scale), or the
    ``general.tensor_extra.prec_a4`` flag. 0xFF block scales are found when a tensor is decoded
    (``flint_jax.nvfp4.gguf_to_kernel`` / ``validate_gguf_blocks``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = _FlintReader(path)
    except GGUFError:
        raise
    except Exception as e:  # GGUFReader raises many kinds on a damaged header
        raise GGUFError(f"{path}: not a valid GGUF file (corrupt or truncated header): {e!r}") from e
    ck = FlintGGUF(path, reader)
    _check_file(path, ck)
    return ck


def is_gguf(path: str | os.PathLike) -> bool:
    """A `.gguf` name, or a file that starts with the GGUF magic (False when unreadable)."""
    path = os.fspath(path)
    if path.endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# --- a Flint file against its config ----------------------------------------------------------


def param_name(hf_name: str) -> str:
    """HF name (``gguf_to_hf_name``'s canonical one) -> flint_jax parameter name."""
    return re.sub(r"self_attn\.softmax_offset$", "self_attn.sinks", hf_name)


def gguf_expected(cfg: FlintConfig) -> dict[str, tuple[int, ...]]:
    """GGUF weight names of `cfg` (file order, scale companions excluded) -> numpy element
    shapes (`[E, out, in]` for the `*_exps` stacks)."""
    params = hf_io.expected_params(cfg)
    out = {}
    for g in flint_gguf_names(cfg.num_hidden_layers, cfg.dense_layers):
        hf = gguf_to_hf_name(g)
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate|up|down)_proj\.weight", hf)
        if m:
            e, two_i, d = params[m.group(1) + ".gate_up_proj"]
            out[g] = (e, d, two_i // 2) if m.group(2) == "down" else (e, two_i // 2, d)
        else:
            out[g] = params[param_name(hf)]
    return out


def elem_shape(t: ReaderTensor) -> tuple[int, ...]:
    """A tensor's element shape in numpy order (ggml's ``t.shape`` reversed)."""
    return tuple(int(d) for d in reversed([int(x) for x in t.shape]))


def check_config(ck: FlintGGUF, cfg: FlintConfig, path: str) -> dict[str, ReaderTensor]:
    """Names, shapes and types of a Flint GGUF file against `cfg`; raises ``GGUFError`` naming
    `path` and the first wrong tensor. Returns ``ck.weights`` ({name: tensor})."""
    expected = gguf_expected(cfg)
    weights = ck.weights
    for name in weights:
        if name not in expected:
            hint = ""
            m = re.match(r"blk\.(\d+)\.(.+)", name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                hint = f" (the config has {cfg.num_hidden_layers} layers)"
            elif m and int(m.group(1)) in cfg.moe_layers and not re.search("exps|shexp|inp", name):
                hint = f" (layer {m.group(1)} is a MoE layer in the config)"
            elif m and int(m.group(1)) in cfg.dense_layers:
                hint = f" (layer {m.group(1)} is a dense layer in the config)"
            raise GGUFError(f"{path}: unexpected tensor {name!r}{hint}")
    for name, shape in expected.items():
        if name not in weights:
            raise GGUFError(f"{path}: missing tensor {name!r}")
        t = weights[name]
        got = elem_shape(t)
        if got != tuple(shape):
            hint = ""
            if name.endswith("_exps.weight") and got[0] != shape[0]:
                hint = f" (the config has {cfg.num_experts} experts)"
            elif name in ("token_embd.weight", "output.weight") and got[0] != shape[0]:
                hint = f" (the config has vocab_size {cfg.vocab_size})"
            elif name.endswith("ffn_gate_inp.weight") and got[0] != shape[0]:
                hint = f" (the config has {cfg.num_experts} experts)"
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(got)}, expected "
                            f"{list(shape)} for this config{hint}")
        if t.tensor_type == NVFP4 and not may_be_nvfp4(name):
            raise GGUFError(f"{path}: tensor {name!r} is NVFP4; flint_jax keeps embeddings, the "
                            "router, norms and sinks in BF16/F32")
    return weights


def read_gguf_tensor(ck: FlintGGUF, name: str) -> np.ndarray:
    """One GGUF tensor read into fresh memory (not through the file-wide memmap, whose touched
    pages would stay resident and count as this process's memory for the whole conversion).
    NVFP4: uint8 `[..., N, K/64*36]`; BF16: bfloat16 `[..., K]`; F32: float32."""
    t = ck.tensors[name]
    raw = np.fromfile(ck.path, dtype=np.uint8, count=int(t.n_bytes), offset=int(t.data_offset))
    if raw.size != int(t.n_bytes):
        raise GGUFError(f"{ck.path}: file is truncated: tensor {name!r} needs {t.n_bytes} "
                        f"bytes from offset {t.data_offset}")
    arr = raw.view(t.data.dtype).reshape(t.data.shape)
    if t.tensor_type == BF16:
        arr = arr.view(ml_dtypes.bfloat16)
    return arr


def stacked_tensor_scale(ck: FlintGGUF, name: str, n_exp: int | None) -> np.ndarray:
    """fp32 tensor scale: `[]` for one matrix, `[E]` for an expert stack (missing = 1.0)."""
    s = ck.tensor_scale(name)
    if n_exp is None:
        return s.reshape(())
    return np.broadcast_to(s, (n_exp,)).astype(np.float32) if s.size == 1 else s.astype(np.float32)



# --- writing --------------------------------------------------------------------------------


def _value_type(key: str, value: Any) -> tuple[Any, GGUFValueType]:
    """Python metadata value -> (value, GGUF type); ``(value, GGUFValueType)`` passes through."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value), GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if 0 <= v < 2**32:
            return v, GGUFValueType.UINT32
        return v, GGUFValueType.INT32 if -(2**31) <= v < 2**31 else GGUFValueType.INT64
    if isinstance(value, (float, np.floating)):
        return float(value), GGUFValueType.FLOAT32
    if isinstance(value, str):
        return value, GGUFValueType.STRING
    if isinstance(value, (list, tuple)) and value:
        return list(value), GGUFValueType.ARRAY
    raise ValueError(f"metadata {key!r}: cannot store {type(value).__name__} {value!r} in GGUF")


def _prepare(name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Validate one tensor for ``write_gguf``; return the array to write."""
    gguf_to_hf_name(name)  # raises on a non-Flint name
    if qtype == F32:
        if array.dtype != np.float32:
            raise ValueError(f"tensor {name!r}: F32 needs a float32 array, got {array.dtype}")
    elif qtype == BF16:
        if array.dtype not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)):
            raise ValueError(f"tensor {name!r}: BF16 needs a bfloat16 (or uint16 bits) array, got {array.dtype}")
    elif qtype == NVFP4:
        if not may_be_nvfp4(name) or is_companion(name):
            raise ValueError(f"tensor {name!r} cannot be NVFP4 in a Flint file")
        nvfp4.validate_gguf_blocks(array, name)
    else:
        raise ValueError(f"tensor {name!r}: GGML type {qtype.name} is not F32, BF16 or NVFP4")
    if is_companion(name) and (qtype != F32 or array.ndim != 1):
        raise ValueError(f"tensor scale {name!r} must be a 1-D F32 array, got {qtype.name} {array.shape}")
    return array


def write_gguf(
    path: str | Path,
    tensors: Iterable[tuple[str, np.ndarray, GGMLQuantizationType | int]],
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a Flint GGUF file.

    Args:
      path: output file.
      tensors: ``(gguf_name, array, ggml_type)``, consumed once, in file order. Arrays use
        numpy shapes: F32 float32 ``[...]``; BF16 bfloat16 (or uint16 bits) ``[..., K]``;
        NVFP4 (type 40) raw blocks uint8 ``[..., N, K/64*36]``. Each array is copied to a
        spool file beside ``path`` as soon as it is seen, so a generator producing one
        tensor at a time keeps memory bounded (disk needs about twice the file size).
      metadata: ``{key: value}``; bool, int (UINT32 when it fits), float (FLOAT32), str, list,
        or an explicit ``(value, gguf.GGUFValueType)``. ``general.architecture`` defaults to
        ``"flint"``.
    Raises ValueError naming the tensor for a non-Flint name, a wrong dtype / type, or bad
    NVFP4 blocks (shape, 0xFF scale).
    """
    path = Path(path)
    meta = dict(metadata or {})
    arch = meta.pop("general.architecture", DEFAULT_ARCH)
    writer = GGUFWriter(path, arch=arch, use_temp_file=True)
    # The spool lives beside the output (not in /tmp, which may be too small for 20+ GB).
    writer.temp_file = tempfile.TemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".spool")
    started = False
    try:
        for key, value in meta.items():
            v, vtype = _value_type(key, value)
            writer.add_key_value(key, v, vtype)
        for name, array, qtype in tensors:
            qtype = GGMLQuantizationType(int(qtype))
            writer.add_tensor(name, _prepare(name, np.asarray(array), qtype), raw_dtype=qtype)
        started = True
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        if started:
            path.unlink(missing_ok=True)  # never leave a half-written file behind
        raise
    finally:
        if writer.temp_file is not None and not writer.temp_file.closed:
            writer.temp_file.close()
        writer.close()
    return path


def nvfp4_tensors(
    gguf_name: str, raw: np.ndarray, tensor_scale: np.ndarray | float | None = None
) -> list[tuple[str, np.ndarray, GGMLQuantizationType]]:
    """``write_gguf`` entries of one NVFP4 weight: the blocks and (if given) its tensor scale
    ``X.scale``.

    ``tensor_scale`` is reshaped to float32 ``[1]`` or ``[E]``.
    """
    out = [(gguf_name, raw, NVFP4)]
    if tensor_scale is not None:
        out.append((scale_name(gguf_name), np.asarray(tensor_scale, np.float32).reshape(-1), F32))
    return out


__all__ = [
    "GGUFError", "FlintGGUF", "open_gguf", "write_gguf", "nvfp4_tensors",
    "gguf_to_hf_name", "hf_to_gguf_name", "flint_gguf_names", "may_be_nvfp4",
    "find_gguf_config", "is_gguf", "gguf_expected", "check_config", "read_gguf_tensor",
    "scale_name", "input_scale_name", "legacy_scale_name", "companion_of",
    "is_companion",
    "LegacyScaleNameWarning",
    "F32", "BF16", "NVFP4", "PREC_A4_KEY",
]
