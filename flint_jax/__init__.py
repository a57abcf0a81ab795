"""flint_jax: Flint (Recursive's 40B mixture-of-experts LLM) in JAX, Flax NNX and Pallas.

    import flint_jax
    model = flint_jax.load("path/to/flint")            # HF dir, converted checkpoint or .gguf
    text = flint_jax.generate(model, "Hello", max_new_tokens=32)
    logits = flint_jax.forward(model, ids)             # fp32 [B, T, vocab]
    reply = flint_jax.chat(model, [{"role": "user", "content": "Hi"}])
    flint_jax.convert.convert("path/to/flint", "flint-jax-bf16")   # a flint_jax checkpoint

The first call for new shapes compiles (a notice goes to the `flint_jax` logger at INFO);
`text.stats` holds the call's time to first token and tokens/s.
"""

__version__ = "0.1.0"

# Public name -> the module that defines it. Everything loads on first use (PEP 562), so that
# `import flint_jax` (and the `flint-jax` command's start, which Ctrl-C may interrupt) does not
# import jax until a name that needs it is touched.
_LAZY = {
    "chat": "chat_api", "parse_assistant": "chat_format", "FlintConfig": "config",
    "preset": "config", "Flint": "decode", "GeneratedText": "decode",
    "GenerationOutput": "decode", "GenerationStats": "decode",
    "MaxNewTokensClampedWarning": "decode", "StreamEvent": "decode", "forward": "decode",
    "generate": "decode", "from_module": "loading", "load": "loading",
    "SamplingParams": "sampling", "expert_usage": "research", "logit_lens": "research",
    "router_entropy": "research", "sink_mass": "research", "token_rank_prob": "research",
    "ExpertUsage": "research",
}


def __getattr__(name):
    import importlib
    if name == "convert":   # the module: convert.convert(src, dst)
        return importlib.import_module("flint_jax.convert")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"flint_jax.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flint_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"convert"})


__all__ = ["Flint", "FlintConfig", "GeneratedText", "GenerationOutput", "GenerationStats",
           "MaxNewTokensClampedWarning", "SamplingParams",
           "StreamEvent", "chat", "convert", "expert_usage", "forward", "from_module", "generate",
           "load", "logit_lens", "parse_assistant", "preset", "router_entropy", "sink_mass"]
