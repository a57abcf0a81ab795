"""The embedded default model, and a random-weight one for format tests. No download.

* **The trained demo** (`TRAINED_DIR`, inside the package): a 12M-parameter Flint trained by
  `tools/train_demo.py` on the Python standard library and generated GLM-4.7 chats with tool
  calls; a transformers-format checkpoint (config, safetensors shards, tokenizer, chat template,
  generation config). `flint_jax.load(flint_jax.demo.TRAINED_DIR)` or `demo_model()`; the CLI's
  model name `demo`. It completes Python, answers in the chat format and calls its made-up tools
  (`flint_jax.demo_data.DEMO_TOOLS`); docs/demo_model.md has its quality table.
* **The random demo** (`random_checkpoint()`, CLI name `demo-random`): written once into
  `~/.cache/flint_jax/demo-v1` or `$FLINT_JAX_DEMO_DIR`: the `tiny` preset (6 layers, hidden 128,
  8 experts, window 9) with random weights and a tokenizer trained on a paragraph below. Its text
  is meaningless; it exists so that format and scale tests have a model of their own.
"""

from __future__ import annotations

import json
import os
import tempfile

DEMO_VERSION = "demo-v1"
TRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")
"""The shipped trained checkpoint (part of the package: an installed wheel has it)."""
DEMO_VOCAB = 512

_CORPUS = """Flint is a mixture-of-experts language model. Each token is routed to six of 256
experts, and a shared expert sees every token. Sliding-window layers attend to the last 512 tokens;
full-attention layers see the whole context. This small model has random weights: it exercises the
code, not the knowledge. The weather today is sunny with a chance of rain in the afternoon.
What is the capital of France? Paris. Write a function that adds two numbers. def add(a, b):
    return a + b
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Tools: get_weather(city="Paris", unit="celsius").
"""


def default_dir() -> str:
    base = os.environ.get("FLINT_JAX_DEMO_DIR")
    if base:
        return base
    return os.path.join(os.path.expanduser("~"), ".cache", "flint_jax", DEMO_VERSION)


def train_bpe_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer with the GLM-4.7 special tokens, trained on `texts` (an iterable
    of str; deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from flint_jax.chat_format import SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int = DEMO_VOCAB):
    """The random-weight demo's tokenizer: `train_bpe_tokenizer` on a short built-in text."""
    return train_bpe_tokenizer([_CORPUS] * 4, vocab_size)


def write_tokenizer_files(directory: str, tok, cfg, sampling: dict | None = None) -> None:
    """Writes `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` and
    `generation_config.json` (eos = `<|endoftext|>`, `<|user|>`, `<|observation|>`) beside a model."""
    from flint_jax.chat_format import DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKENS
    eos = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
                   "model_max_length": cfg.max_position_embeddings}, f, indent=2)
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(DEFAULT_CHAT_TEMPLATE)
    sampling = sampling or {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, **sampling, "eos_token_id": eos, "pad_token_id": eos[0]},
                  f, indent=2)


def demo_checkpoint() -> str:
    """The trained demo checkpoint's directory (`TRAINED_DIR`)."""
    if not os.path.exists(os.path.join(TRAINED_DIR, "config.json")):
        raise FileNotFoundError(
            f"{TRAINED_DIR}: the trained demo checkpoint is missing from this installation; "
            "reinstall flint-jax, or make it with `python tools/train_demo.py --out "
            f"{TRAINED_DIR}`")
    return TRAINED_DIR


def random_checkpoint(directory: str | None = None, *, seed: int = 0, overwrite: bool = False) -> str:
    """Writes the random-weight demo checkpoint (if absent) and returns its directory."""
    directory = directory or default_dir()
    if os.path.exists(os.path.join(directory, "model.safetensors")) and not overwrite:
        return directory
    import jax.numpy as jnp
    from flax import nnx

    from flint_jax.chat_format import DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKENS
    from flint_jax.config import preset
    from flint_jax.hf_io import save_hf_module

    tok = build_tokenizer()
    eos = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    cfg = preset("tiny", vocab_size=DEMO_VOCAB, eos_token_id=tuple(eos),
                 pad_token_id=eos[0])
    from flint_jax.model import FlintForCausalLM
    module = FlintForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    parent = os.path.dirname(os.path.abspath(directory)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    save_hf_module(module, tmp)
    write_tokenizer_files(tmp, tok, cfg)
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write("# flint_jax demo checkpoint\n\nA small Flint (the `tiny` preset) with RANDOM "
                "weights, written by `flint_jax.demo`. It generates meaningless text; it exists "
                "to exercise the code.\n")
    if os.path.exists(directory):
        import shutil
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def demo_model(**load_kwargs):
    """`flint_jax.load` of the trained demo checkpoint (`load`'s keyword arguments)."""
    from flint_jax.loading import load
    return load(demo_checkpoint(), **load_kwargs)


def random_model(**load_kwargs):
    """`flint_jax.load` of the random-weight demo checkpoint (written first if needed)."""
    from flint_jax.loading import load
    return load(random_checkpoint(), **load_kwargs)
