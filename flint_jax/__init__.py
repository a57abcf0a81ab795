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

from flint_jax.chat_api import chat
from flint_jax.chat_format import parse_assistant
from flint_jax.config import FlintConfig, preset
from flint_jax.decode import (Flint, GeneratedText, GenerationOutput, GenerationStats,
                              MaxNewTokensClampedWarning, StreamEvent, forward, generate)
from flint_jax.loading import from_module, load
from flint_jax.sampling import SamplingParams
from flint_jax import convert  # noqa: E402  (the module: convert.convert(src, dst))

__version__ = "0.1.0"


def __getattr__(name):
    # Heavier or optional parts load on first use.
    if name in ("expert_usage", "logit_lens", "router_entropy", "sink_mass", "token_rank_prob",
                "ExpertUsage"):
        from flint_jax import research
        return getattr(research, name)
    raise AttributeError(f"module 'flint_jax' has no attribute {name!r}")


__all__ = ["Flint", "FlintConfig", "GeneratedText", "GenerationOutput", "GenerationStats",
           "MaxNewTokensClampedWarning", "SamplingParams",
           "StreamEvent", "chat", "convert", "expert_usage", "forward", "from_module", "generate",
           "load", "logit_lens", "parse_assistant", "preset", "router_entropy", "sink_mass"]
