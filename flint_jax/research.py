"""Research helpers: expert usage, router entropy, logit lens and attention-sink mass.

Everything here is built on `flint_jax.forward(model, ids, capture=...)`, which returns the fp32
logits together with per-layer arrays stacked along a leading layer axis:

    hidden_states   [L+1, B, T, D]   the residual stream: embeddings first, then after each layer
                                     (before the final norm), in the model's dtype
    router_scores   [L_moe, B, T, E] sigmoid router scores s_e (fp32)
    router_ids      [L_moe, B, T, k] the experts each token is sent to (int32, by descending score)
    router_weights  [L_moe, B, T, k] their mixing weights s[ids] / sum(s[ids]) (fp32)
    sink_mass       [L, B, T, H]     probability each query head puts on its attention sink (fp32)

(for a single sequence `[T]` the batch axis is dropped). `L_moe` counts the MoE layers only;
their indices are `model.config.moe_layers`. `forward(..., params=state)` is differentiable with
respect to `state`, so `jax.grad` works through every function below that takes it.

Router entropy (in nats) is defined two ways, per token:

* `"scores"`: of the sigmoid scores normalised over all E experts, `p_e = s_e / sum_e' s_e'`;
  at most `ln E`. Sigmoid scores are not a distribution, so this measures how peaked the router's
  preferences are overall; random routers sit close to `ln E`.
* `"topk"`: of the k mixing weights actually used (the renormalised top-k scores); at most `ln k`.
  Low means one selected expert dominates the token's output.

Padding (right padding with `lengths`) is never counted by `expert_usage`; the per-token functions
return values at padded positions too, which are meaningless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax.decode import _as_rows, _check_rows, bucket_length, forward
from flint_jax.decode import Flint
from flint_jax.model import CAPTURABLE

F32 = jnp.float32

# Every helper captures everything (one compiled forward per input shape serves them all; the
# captured arrays are smaller than the logits for Flint's sizes).
_ALL = tuple(CAPTURABLE)

__all__ = ["ExpertUsage", "expert_usage", "logit_lens", "router_entropy", "scores_entropy",
           "sink_mass", "token_rank_prob", "topk_entropy"]


# ---- entropies (pure functions of captured arrays) ------------------------------------------

def scores_entropy(scores: jax.Array) -> jax.Array:
    """Entropy (nats) of sigmoid router scores normalised over experts: `[..., E] -> [...]`."""
    s = jnp.asarray(scores, F32)
    p = s / jnp.sum(s, axis=-1, keepdims=True)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)


def topk_entropy(weights: jax.Array) -> jax.Array:
    """Entropy (nats) of the top-k mixing weights, renormalised to sum to 1: `[..., k] -> [...]`."""
    return scores_entropy(weights)


# ---- per-token functions of one batch ---------------------------------------------------------

def router_entropy(model: Flint, ids, *, lengths=None, over: str = "scores") -> jax.Array:
    """Per-token router entropy of every MoE layer.

    Args:
      ids: int token ids `[T]` or `[B, T]` (right-padded, with `lengths`).
      over: "scores" (normalised sigmoid scores over all experts, max `ln E`) or "topk" (the
        renormalised top-k weights, max `ln k`); see the module docstring.
    Returns: f32 `[L_moe, T]` (or `[L_moe, B, T]`), layers in `model.config.moe_layers` order.
    """
    if over not in ("scores", "topk"):
        raise ValueError(f"over must be 'scores' or 'topk', got {over!r}")
    if not model.config.moe_layers:
        raise ValueError("this model has no MoE layers")
    name = "router_scores" if over == "scores" else "router_weights"
    _, cap = forward(model, ids, lengths=lengths, capture=_ALL)
    return scores_entropy(cap[name])


def sink_mass(model: Flint, ids, *, lengths=None) -> jax.Array:
    """Attention-sink mass: f32 `[L, T, H]` (or `[L, B, T, H]`), in (0, 1).

    Entry `[l, t, h]` is the softmax probability query head `h` of layer `l` gives to the learned
    sink logit at position `t` (`exp(sink_h) / (exp(sink_h) + sum_j exp(s_tj))`), i.e. how much of
    its attention it declines to spend on any key.
    """
    _, cap = forward(model, ids, lengths=lengths, capture=_ALL)
    return cap["sink_mass"]


def _head_fn(model: Flint):
    """jit(state, h [..., D]) -> f32 logits [..., V]: the model's final norm then lm_head."""
    def build():
        from flax import nnx
        graphdef = model.graphdef

        def run(state, h):
            m = nnx.merge(graphdef, state)
            return m.lm_head(m.model.norm(h), out_dtype=F32)

        return jax.jit(run)
    return model.jitted(("research.head",), build)


def logit_lens(model: Flint, ids, *, lengths=None, positions=None) -> jax.Array:
    """The logit lens: the final norm (`model.norm`) and `lm_head` applied to every layer's
    residual stream.

    Args:
      ids: int token ids `[T]` or `[B, T]`.
      positions: None (all positions), an int (one position; that axis is dropped, e.g. -1 for
        the last token) or a sequence of ints.
    Returns: f32 `[L+1, T, V]` (`[L+1, B, T, V]` for a batch; T replaced by the selected
      positions). Row 0 reads the embeddings, row `l+1` the output of layer `l`; row `L` equals
      `forward`'s logits. Memory is `(L+1) * B * T * V * 4` bytes: select positions for real
      checkpoints (Flint: 50 rows x 150,144 tokens = 30 MB per position).
    """
    _, cap = forward(model, ids, lengths=lengths, capture=_ALL)
    h = cap["hidden_states"]  # [L+1, (B,) T, D]
    if positions is not None:
        h = jnp.take(h, jnp.asarray(positions, jnp.int32), axis=h.ndim - 2)
    return _head_fn(model)(model.state, h)


def token_rank_prob(lens_logits: jax.Array, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Rank and probability of given tokens in logit-lens rows.

    lens_logits: f32 `[..., V]` (e.g. `logit_lens(...)` `[L+1, T, V]`); tokens: int, broadcast
    against `lens_logits.shape[:-1]` (e.g. `[T]` the next tokens, or a scalar).
    Returns (rank int `[...]`: how many tokens have a strictly larger logit, 0 = top-1;
    prob f32 `[...]`: softmax probability).
    """
    lg = jnp.asarray(lens_logits, F32)
    tok = jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), lg.shape[:-1])
    own = jnp.take_along_axis(lg, tok[..., None], axis=-1)
    rank = jnp.sum(lg > own, axis=-1)
    prob = jnp.exp(own[..., 0] - jax.nn.logsumexp(lg, axis=-1))
    return np.asarray(rank), np.asarray(prob)


# ---- expert usage over a corpus -------------------------------------------------------------

@dataclasses.dataclass
class ExpertUsage:
    """How a corpus was routed.

    Attributes:
      counts: int64 `[L_moe, E]`: how many (token, slot) selections each expert got per MoE layer;
        each row sums to `tokens * top_k`.
      layers: the MoE layer indices (the rows of `counts`), `model.config.moe_layers`.
      tokens: tokens counted (padding excluded).
      top_k: experts per token.
      entropy: f32 `[L_moe]`: mean over tokens of the entropy (nats) of the normalised sigmoid
        scores (`scores_entropy`, max `ln E`).
      topk_entropy: f32 `[L_moe]`: mean over tokens of the entropy of the renormalised top-k
        weights (`topk_entropy`, max `ln k`).
    """
    counts: np.ndarray
    layers: tuple[int, ...]
    tokens: int
    top_k: int
    entropy: np.ndarray
    topk_entropy: np.ndarray

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def fraction(self) -> np.ndarray:
        """f64 `[L_moe, E]`: share of each layer's selections per expert (rows sum to 1)."""
        return self.counts / max(1, self.tokens * self.top_k)

    @property
    def imbalance(self) -> np.ndarray:
        """f64 `[L_moe]`: max load over mean load per layer (1 = perfectly balanced)."""
        return self.fraction.max(axis=1) * self.num_experts if self.counts.size else np.zeros(0)

    @property
    def max_entropy(self) -> tuple[float, float]:
        """(ln E, ln k): the upper bounds of `entropy` and `topk_entropy`."""
        return float(np.log(self.num_experts)), float(np.log(self.top_k))

    def __repr__(self):
        return (f"ExpertUsage({len(self.layers)} MoE layers x {self.num_experts} experts, "
                f"top_k={self.top_k}, {self.tokens} tokens)")


def expert_usage(model: Flint, texts_or_ids, *, batch_size: int = 8, lengths=None) -> ExpertUsage:
    """Counts expert selections and router entropy over a corpus.

    Args:
      texts_or_ids: a string, a list of strings (tokenized without special tokens), token ids
        `[T]` or `[B, T]`, or a list of id rows of different lengths.
      batch_size: rows per forward pass; rows are right-padded (lengths bucketed to powers of two)
        and the padding is not counted.
      lengths: optional `[B]` valid tokens per row when passing a padded `[B, T]` array.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cfg = model.config
    rows, _, _ = _as_rows(texts_or_ids, model.tokenizer)
    if lengths is not None:
        lengths = np.asarray(lengths).reshape(-1)
        if len(lengths) != len(rows):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(rows)} rows")
        if np.any(lengths < 0) or any(int(n) > len(r) for n, r in zip(lengths, rows)):
            raise ValueError("lengths must lie in 0 .. the row length")
        rows = [r[:int(n)] for r, n in zip(rows, lengths)]
        rows = [r for r in rows if r]
    _check_rows(model, rows, 0)
    n_layers, e, k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
    counts = np.zeros((n_layers, e), np.int64)
    ent_sum = np.zeros(n_layers, np.float64)
    topk_sum = np.zeros(n_layers, np.float64)
    tokens = int(sum(len(r) for r in rows))
    if n_layers and rows:
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths together
        bsz = min(batch_size, len(rows))
        for start in range(0, len(order), bsz):
            batch = [rows[i] for i in order[start:start + bsz]]
            t = bucket_length(max(len(r) for r in batch), model.max_length, minimum=16)
            ids = np.zeros((bsz, t), np.int32)
            lens = np.zeros((bsz,), np.int32)  # rows past the end of the corpus: length 0
            for b, r in enumerate(batch):
                ids[b, :len(r)] = r
                lens[b] = len(r)
            _, cap = forward(model, ids, lengths=lens, capture=_ALL)
            valid = np.arange(t)[None, :] < lens[:, None]  # [B, T]
            sel = np.asarray(cap["router_ids"])[:, valid]  # [L_moe, N, k]
            for l in range(n_layers):
                counts[l] += np.bincount(sel[l].reshape(-1), minlength=e)
            ent_sum += np.asarray(scores_entropy(cap["router_scores"]), np.float64)[:, valid].sum(1)
            topk_sum += np.asarray(topk_entropy(cap["router_weights"]), np.float64)[:, valid].sum(1)
    denom = max(1, tokens)
    return ExpertUsage(counts=counts, layers=tuple(cfg.moe_layers), tokens=tokens, top_k=k,
                       entropy=(ent_sum / denom).astype(np.float32),
                       topk_entropy=(topk_sum / denom).astype(np.float32))
