"""Research API: `forward(..., capture=...)`, gradients through `forward`, and `flint_jax.research`.

Most checks use the tiny_c golden checkpoint in fp32 (XLA path): 5 MoE layers, 9 experts top-4,
3 heads, sliding window 3, and the transformers oracle's hidden states and router outputs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flint_jax
from flint_jax import research
from flint_jax.model import CAPTURABLE

from conftest import golden


@pytest.fixture(scope="module")
def tiny_c(fp32_models):
    return fp32_models["tiny_c"]


@pytest.fixture(scope="module")
def gold():
    return golden("tiny_c")


@pytest.fixture(scope="module")
def batch(gold):
    """The golden ids [2, 19] with row 1 cut to 13 tokens (right padding after it)."""
    ids = np.asarray(gold["input_ids"], np.int32)
    return ids, np.array([19, 13], np.int32)


@pytest.fixture(scope="module")
def captured(tiny_c, batch):
    ids, lengths = batch
    return flint_jax.forward(tiny_c, ids, lengths=lengths, capture=CAPTURABLE)


def _valid(lengths, t):
    return np.arange(t)[None, :] < np.asarray(lengths)[:, None]


# ---- capture ---------------------------------------------------------------------------------

def test_capture_shapes(tiny_c, batch, captured):
    cfg = tiny_c.config
    ids, _ = batch
    b, t = ids.shape
    logits, cap = captured
    n_l, n_moe = cfg.num_hidden_layers, len(cfg.moe_layers)
    assert logits.shape == (b, t, cfg.vocab_size) and logits.dtype == jnp.float32
    assert cap["hidden_states"].shape == (n_l + 1, b, t, cfg.hidden_size)
    assert cap["router_scores"].shape == (n_moe, b, t, cfg.num_experts)
    assert cap["router_ids"].shape == (n_moe, b, t, cfg.num_experts_per_tok)
    assert cap["router_ids"].dtype == jnp.int32
    assert cap["router_weights"].shape == (n_moe, b, t, cfg.num_experts_per_tok)
    assert cap["sink_mass"].shape == (n_l, b, t, cfg.num_attention_heads)
    # A single sequence drops the batch axis everywhere.
    lo1, cap1 = flint_jax.forward(tiny_c, ids[0, :7], capture=("sink_mass", "router_ids"))
    assert lo1.shape == (7, cfg.vocab_size)
    assert cap1["sink_mass"].shape == (n_l, 7, cfg.num_attention_heads)
    assert cap1["router_ids"].shape == (n_moe, 7, cfg.num_experts_per_tok)
    with pytest.raises(ValueError, match="cannot capture"):
        flint_jax.forward(tiny_c, ids, capture=("attention_maps",))


def test_capture_matches_oracle(batch, captured, gold):
    """Valid positions agree with transformers (row 1's first 13 tokens see only themselves)."""
    _, lengths = batch
    logits, cap = captured
    valid = _valid(lengths, logits.shape[1])
    np.testing.assert_allclose(np.asarray(logits)[valid], gold["logits"][valid], atol=2e-5, rtol=1e-5)
    hs = np.asarray(cap["hidden_states"])
    np.testing.assert_allclose(hs[:, valid], gold["hidden_states"][:, valid], atol=2e-5, rtol=1e-5)
    scores = np.asarray(cap["router_scores"])[:, valid]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-gold["router_logits"][:, valid])), atol=2e-6)
    np.testing.assert_array_equal(np.asarray(cap["router_ids"])[:, valid],
                                  gold["router_topk_idx"][:, valid])
    np.testing.assert_allclose(np.asarray(cap["router_weights"])[:, valid],
                               gold["router_topk_weight"][:, valid], atol=2e-6)


def test_capture_consistency(tiny_c, batch, captured):
    ids, lengths = batch
    cfg = tiny_c.config
    logits, cap = captured
    scores = np.asarray(cap["router_scores"])
    rids = np.asarray(cap["router_ids"])
    w = np.asarray(cap["router_weights"])
    # router_ids are the top-k of router_scores, by descending score.
    _, top = jax.lax.top_k(jnp.asarray(scores), cfg.num_experts_per_tok)
    np.testing.assert_array_equal(rids, np.asarray(top))
    picked = np.take_along_axis(scores, rids, axis=-1)
    assert np.all(np.diff(picked, axis=-1) <= 0)
    # router_weights are the renormalised selected scores.
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    assert np.all((scores > 0) & (scores < 1))
    # Sink mass is a probability strictly inside (0, 1) at valid positions (a padded position
    # past a sliding window sees no key at all: mass 1 there).
    sm = np.asarray(cap["sink_mass"])
    valid = _valid(lengths, ids.shape[1])
    assert np.all(np.isfinite(sm)) and np.all((sm >= 0) & (sm <= 1))
    assert np.all((sm[:, valid] > 0) & (sm[:, valid] < 1))
    # hidden_states[0] are the embedding rows of the ids (no scaling).
    emb = np.asarray(tiny_c.state["model"]["embed_tokens"]["weight"][...])
    np.testing.assert_array_equal(np.asarray(cap["hidden_states"][0]), emb[ids])
    # Asking for captures does not change the logits.
    plain = flint_jax.forward(tiny_c, ids, lengths=lengths)
    np.testing.assert_allclose(np.asarray(plain)[valid], np.asarray(logits)[valid],
                               rtol=1e-6, atol=1e-6)


def test_sink_mass_first_position(tiny_c, batch, captured):
    """At position 0 each head sees one key (itself): mass = 1 / (1 + exp(s00 - sink))."""
    cfg = tiny_c.config
    ids, _ = batch
    _, cap = captured
    module = tiny_c.module
    hs = cap["hidden_states"]
    for l, layer in enumerate(module.model.layers):
        x = layer.input_layernorm(hs[l][:, :1])
        q, k, _ = layer.self_attn.qkv(x, jnp.zeros((ids.shape[0], 1), jnp.int32))
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        k = jnp.repeat(k, g, axis=2)  # head h reads KV head h // g
        s = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), -1)[:, 0] * cfg.head_dim ** -0.5
        want = 1.0 / (1.0 + jnp.exp(s - layer.self_attn.sinks[...][None]))
        np.testing.assert_allclose(np.asarray(cap["sink_mass"][l][:, 0]), np.asarray(want),
                                   rtol=1e-5, atol=1e-7)
    sm = research.sink_mass(tiny_c, ids[0])
    assert sm.shape == (cfg.num_hidden_layers, ids.shape[1], cfg.num_attention_heads)
    np.testing.assert_allclose(np.asarray(sm), np.asarray(cap["sink_mass"][:, 0]), rtol=1e-6)


# ---- research helpers ---------------------------------------------------------------------------

def test_logit_lens(tiny_c, batch, captured):
    cfg = tiny_c.config
    ids, _ = batch
    lens = research.logit_lens(tiny_c, ids[0])
    assert lens.shape == (cfg.num_hidden_layers + 1, ids.shape[1], cfg.vocab_size)
    assert lens.dtype == jnp.float32
    # The last row is the model's own logits.
    np.testing.assert_allclose(np.asarray(lens[-1]), np.asarray(captured[0][0]), rtol=1e-5, atol=1e-5)
    # Row 0 reads the embeddings through the final norm and the head.
    m = tiny_c.module
    emb = m.model.embed_tokens(jnp.asarray(ids[0]))
    row0 = m.lm_head(m.model.norm(emb), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(lens[0]), np.asarray(row0), rtol=1e-5, atol=1e-5)
    last = research.logit_lens(tiny_c, ids[0], positions=-1)
    assert last.shape == (cfg.num_hidden_layers + 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(last), np.asarray(lens[:, -1]), rtol=1e-6, atol=1e-6)
    some = research.logit_lens(tiny_c, ids, positions=[0, 5])
    assert some.shape == (cfg.num_hidden_layers + 1, 2, 2, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(some[:, 0]), np.asarray(lens[:, [0, 5]]), rtol=1e-5, atol=1e-5)
    # Ranks and probabilities of the final prediction.
    top = int(np.argmax(lens[-1, -1]))
    rank, prob = research.token_rank_prob(last, top)
    assert rank.shape == prob.shape == (cfg.num_hidden_layers + 1,)
    assert rank[-1] == 0
    p = jax.nn.softmax(last, -1)[:, top]
    np.testing.assert_allclose(prob, np.asarray(p), rtol=1e-5)
    np.testing.assert_array_equal(rank, np.sum(np.asarray(last) > np.asarray(last)[:, top:top + 1], -1))


def test_router_entropy(tiny_c, batch, captured):
    cfg = tiny_c.config
    ids, lengths = batch
    _, cap = captured
    h = research.router_entropy(tiny_c, ids, lengths=lengths)
    assert h.shape == (len(cfg.moe_layers), *ids.shape)
    s = np.asarray(cap["router_scores"], np.float64)
    p = s / s.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(h), -(p * np.log(p)).sum(-1), rtol=1e-5)
    assert np.all(h <= math.log(cfg.num_experts) + 1e-6) and np.all(h > 0)
    hk = research.router_entropy(tiny_c, ids, lengths=lengths, over="topk")
    assert np.all(hk <= math.log(cfg.num_experts_per_tok) + 1e-6) and np.all(hk >= 0)
    # Bounds are reached where they should be.
    np.testing.assert_allclose(research.scores_entropy(jnp.full((3, 9), 0.3)), math.log(9), rtol=1e-6)
    np.testing.assert_allclose(research.topk_entropy(jnp.array([1.0, 0.0, 0.0])), 0.0, atol=1e-7)
    with pytest.raises(ValueError, match="over"):
        research.router_entropy(tiny_c, ids, over="logits")


def _usage_by_hand(model, rows, t=16):
    """Counts [L_moe, E] and summed score entropies [L_moe] from one causal forward of the rows
    followed by junk tokens, without `lengths`: by causality the first len(row) positions are
    those of the row alone, and only they are counted."""
    cfg = model.config
    ids = np.full((len(rows), t), 5, np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    _, cap = flint_jax.forward(model, ids, capture=CAPTURABLE)
    valid = _valid([len(r) for r in rows], t)
    sel = np.asarray(cap["router_ids"])[:, valid]
    counts = np.stack([np.bincount(x.reshape(-1), minlength=cfg.num_experts) for x in sel])
    ent = np.asarray(research.scores_entropy(cap["router_scores"]))[:, valid].sum(1)
    return counts, ent


def test_expert_usage_counts_and_padding(tiny_c, gold):
    cfg = tiny_c.config
    ids = np.asarray(gold["input_ids"], np.int32)
    rows = [ids[0, :16].tolist(), ids[1, :11].tolist(), ids[1, 4:9].tolist()]
    n_tok = sum(len(r) for r in rows)
    # batch_size 2: a batch of 16 + 11 tokens, then 5 tokens beside a zero-length filler row.
    usage = research.expert_usage(tiny_c, rows, batch_size=2)
    assert usage.layers == cfg.moe_layers and usage.tokens == n_tok
    assert usage.top_k == cfg.num_experts_per_tok and usage.num_experts == cfg.num_experts
    assert usage.counts.shape == (len(cfg.moe_layers), cfg.num_experts)
    np.testing.assert_array_equal(usage.counts.sum(1), n_tok * cfg.num_experts_per_tok)
    np.testing.assert_allclose(usage.fraction.sum(1), 1.0)
    assert np.all(usage.imbalance >= 1.0)
    # Padding is not counted: same counts as each row's own positions.
    counts, ent = _usage_by_hand(tiny_c, rows)
    np.testing.assert_array_equal(usage.counts, counts)
    np.testing.assert_allclose(usage.entropy, ent / n_tok, rtol=1e-5)
    assert np.all(usage.entropy <= usage.max_entropy[0] + 1e-6)
    assert np.all((usage.topk_entropy >= 0) & (usage.topk_entropy <= usage.max_entropy[1] + 1e-6))
    # Another batch size (all rows in one batch) gives the same result.
    other = research.expert_usage(tiny_c, rows, batch_size=8)
    np.testing.assert_array_equal(other.counts, usage.counts)
    np.testing.assert_allclose(other.entropy, usage.entropy, rtol=1e-5)
    np.testing.assert_allclose(other.topk_entropy, usage.topk_entropy, rtol=1e-5)
    # A padded [B, T] array with lengths counts the same tokens (junk after the lengths).
    padded = np.full((3, 19), 7, np.int32)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    other = research.expert_usage(tiny_c, padded, lengths=[len(r) for r in rows])
    np.testing.assert_array_equal(other.counts, usage.counts)


def test_expert_usage_errors(tiny_c):
    with pytest.raises(ValueError, match="batch_size"):
        research.expert_usage(tiny_c, [[1, 2, 3]], batch_size=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        research.expert_usage(tiny_c, [[1, 2, 10_000]])
    with pytest.raises(ValueError, match="tokenizer"):
        research.expert_usage(tiny_c, "text needs a tokenizer")


def test_expert_usage_text(fp32_models):
    """Strings are tokenized (tiny_a has a tokenizer) and every token counted."""
    model = fp32_models["tiny_a"]
    texts = ["Hello world.", "What is the weather?"]
    usage = research.expert_usage(model, texts)
    n_tok = sum(len(model.tokenizer.encode(t)) for t in texts)
    assert usage.tokens == n_tok
    np.testing.assert_array_equal(usage.counts.sum(1), n_tok * model.config.num_experts_per_tok)
    assert usage.layers == model.config.moe_layers == (2, 3, 4, 5)


# ---- gradients through forward ------------------------------------------------------------------

def test_grad_through_forward_matches_finite_differences(tiny_c):
    """jax.grad of a smooth loss w.r.t. the state vs a central difference along random directions.

    The loss is the mean next-token cross-entropy over the valid positions of a right-padded
    batch. Top-k routing is piecewise constant in the parameters: the loss is smooth only while
    every token keeps its experts, so for each direction we take the largest step in (1e-3, 5e-4,
    2.5e-4) at which the routing at theta +- eps*v equals the routing at theta (checked via
    `capture=("router_ids",)`). The model computes in fp32 (router, softmax and norms are fp32 by
    design, so float64 is not available); the central difference then has O(eps^2) truncation
    error, hence rtol 5e-3, and rounding noise of at least the spacing of fp32 values at |L|
    (9.5e-7 at L = 8.7) over 2 eps: the difference quotient moves in steps of 4.8e-4 at eps 1e-3,
    which for the sinks' small directional derivative (~0.05) is 1% by itself, so the absolute
    tolerance is three such steps.
    Directions: all parameters (x2), router weights, sinks, embeddings, routed experts; each leaf
    perturbed proportionally to its RMS.
    """
    cfg = tiny_c.config
    rng = np.random.default_rng(0)
    t = 12
    ids = rng.integers(0, cfg.vocab_size, (2, t)).astype(np.int32)
    lengths = np.array([t, 9], np.int32)
    valid = _valid(lengths, t)
    mask = jnp.asarray(valid[:, 1:] & valid[:, :-1], jnp.float32)

    def loss_and_routing(state):
        lo, cap = flint_jax.forward(tiny_c, ids, lengths=lengths, params=state,
                                    capture=("router_ids",))
        lp = jax.nn.log_softmax(lo[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(lp, jnp.asarray(ids)[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask), cap["router_ids"]

    # One compiled function for the gradient and the loss evaluations (saves a compile).
    vg = jax.jit(jax.value_and_grad(loss_and_routing, has_aux=True))

    def f(state):
        return vg(state)[0]

    (l0, r0), grad = vg(tiny_c.state)
    assert np.isfinite(float(l0))
    g_leaves = jax.tree.leaves(grad)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in g_leaves)

    flat, treedef = jax.tree_util.tree_flatten_with_path(tiny_c.state)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    leaves = [leaf for _, leaf in flat]

    def routing_key(r):
        return np.sort(np.asarray(r), axis=-1)[:, valid]

    def direction(seed, part):
        r = np.random.default_rng(seed)
        out = []
        for p, leaf in zip(paths, leaves):
            if part is None or part in p:
                rms = float(jnp.sqrt(jnp.mean(jnp.square(leaf))))
                out.append(jnp.asarray(r.standard_normal(leaf.shape), jnp.float32) * rms)
            else:
                out.append(jnp.zeros_like(leaf))
        return out

    checked = 0
    for seed, part in enumerate([None, None, "'gate'", "'sinks'", "'embed_tokens'", "'experts'"]):
        v = direction(100 + seed, part)
        assert any(float(jnp.max(jnp.abs(x))) > 0 for x in v), part
        gv = sum(float(jnp.vdot(g, x)) for g, x in zip(g_leaves, v))
        for eps in (1e-3, 5e-4, 2.5e-4):
            plus = jax.tree.unflatten(treedef, [a + eps * x for a, x in zip(leaves, v)])
            minus = jax.tree.unflatten(treedef, [a - eps * x for a, x in zip(leaves, v)])
            lp, rp = f(plus)
            lm, rm = f(minus)
            key0 = routing_key(r0)
            if np.array_equal(routing_key(rp), key0) and np.array_equal(routing_key(rm), key0):
                fd = (float(lp) - float(lm)) / (2 * eps)
                fd_step = float(np.spacing(np.float32(l0))) / (2 * eps)   # fp32 resolution
                assert abs(gv - fd) <= 5e-3 * abs(gv) + 3 * fd_step, (part, eps, gv, fd, fd_step)
                checked += 1
                break
    assert checked >= 5, f"routing changed within every step for {6 - checked} directions"
