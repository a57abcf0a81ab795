"""The checkpoint's tokenizer (`tokenizer.json` via `tokenizers`) and its chat template.

The chat template comes from `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`, else flint_jax's built-in GLM-4.7-style template (`chat_format`). It is rendered
with `apply_chat_template` semantics (jinja2 sandbox, `trim_blocks`, `lstrip_blocks`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np


class Tokenizer:
    """A thin wrapper: `encode`, `decode`, special-token ids and `apply_chat_template`."""

    def __init__(self, tokenizer, config: dict | None = None, chat_template: str | None = None,
                 source: str = "tokenizer"):
        self._tok = tokenizer
        self.config = config or {}
        self.source = source
        self._chat_template = chat_template

    @classmethod
    def from_dir(cls, directory: str) -> "Tokenizer | None":
        """Loads `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`); None if absent."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer as HFTokenizer
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from None
        config = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
        template = None
        jinja = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        return cls(tok, config, template, source=path)

    # ---- special tokens ------------------------------------------------------------------
    def _token_str(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self._token_str("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self._token_str("bos_token")

    @property
    def pad_token_id(self) -> int:
        pad = self._token_str("pad_token")
        tid = self.token_id(pad) if pad else None
        return 0 if tid is None else tid

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str:
        if self._chat_template is None:
            from flint_jax.chat_format import DEFAULT_CHAT_TEMPLATE
            return DEFAULT_CHAT_TEMPLATE
        return self._chat_template

    @property
    def has_own_chat_template(self) -> bool:
        return self._chat_template is not None

    def stop_token_ids(self) -> list[int]:
        """GLM-4.7 stop tokens present in the vocabulary: end-of-text, `<|user|>`, `<|observation|>`."""
        ids = []
        for tok in (self.eos_token, "<|endoftext|>", "<|user|>", "<|observation|>"):
            tid = self.token_id(tok) if tok else None
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tokenize: bool = False, **kwargs):
        """Renders messages (and OpenAI-style tool schemas) like transformers' method."""
        from flint_jax.chat_format import render_chat_template
        text = render_chat_template(
            self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking, bos_token=self.bos_token, eos_token=self.eos_token,
            **kwargs)
        return self.encode(text) if tokenize else text
