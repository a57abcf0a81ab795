"""Train the small Flint that ships as flint_jax's embedded default (`flint_jax/demo_model/`).

    python tools/train_demo.py --work .train_demo --out flint_jax/demo_model            # H200
    python tools/train_demo.py --work .train_demo --stop-after 1851 --out flint_jax/demo_model \
        --plot docs/demo_model_loss.png       # the shipped checkpoint (run 200), any host
    python tools/train_demo.py --work .train_demo --minutes 90 --batch 8 --seq 512 ...  # CPU

Stages, each cached in `--work` so a run resumes where it stopped (Ctrl-C saves first):

1. **Tokenizer**: byte-level BPE (`--vocab`, default 4096) with the GLM-4.7 special tokens, trained
   on the training split of the data below (`flint_jax.demo_data`).
2. **Tokens**: the training and held-out standard-library files, tokenized once (uint16 arrays).
3. **Training** with `optax` AdamW (warm-up, cosine decay, clipping) through the model's own
   differentiable XLA path (`FlintForCausalLM.__call__` on an empty cache), fp32 weights. Each
   batch row is, with probability `--chat-fraction`, generated chat transcripts packed end to end,
   else a window of the code stream; batches are a function of the step (resuming replays none).
   **Expert balance**: the routers have no selection bias (Flint's checkpoint has none), so the
   load is kept even by a Switch-style auxiliary loss, `E * sum_e f_e P_e` averaged over the MoE
   layers (`f_e`: share of the k slots sent to expert e, so the f_e sum to 1; `P_e`: mean
   normalised sigmoid score, also summing to 1; 1 when the load is even), weighted `--balance`
   (default 0.01); the held-out expert load is logged.
4. **Export** (`--out`): a transformers-format checkpoint (config, safetensors shards of at most
   16 MiB with `model.safetensors.index.json`, tokenizer, chat template, generation config,
   README), BF16 weights with the routers and sinks in fp32, plus `train_log.json` (the loss curve
   and the expert load) and, with `--plot`, the loss curve as a PNG.

The model (`demo_config()`) has every feature of Flint at small size: two dense first layers,
MoE layers with sigmoid top-k and a shared expert, sliding-window (RoPE) and full (NoPE) layers,
sinks, QK norm, GQA; its sizes are ones the Pallas decode kernels run (BF16 and NVFP4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flint_jax import demo_data  # noqa: E402

SHARD_BYTES = 16 * 2**20


def demo_config(vocab_size: int = 4096, eos: tuple[int, ...] = (), size: str = "demo"):
    """The demo model's shapes (`eos`: ids of `<|endoftext|>`, `<|user|>`, `<|observation|>`);
    `size="tiny"`: the same layer pattern at toy sizes (tests)."""
    from flint_jax.config import FlintConfig
    if size == "tiny":
        return demo_config(vocab_size, eos).replace(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, sliding_window=9)
    return FlintConfig(
        eos_token_id=tuple(eos), pad_token_id=eos[0] if eos else None, vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, mlp_only_layers=(0, 1),
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, sliding_window=129, max_position_embeddings=8192,
        rope_theta=10000.0)


# ---- tokenizer and tokens --------------------------------------------------------------------

def train_tokenizer(vocab: int, n_chats: int = 20000, max_files: int | None = None):
    from flint_jax.demo import train_bpe_tokenizer

    def texts():
        for i, (_, text) in enumerate(demo_data.code_texts("train")):
            if max_files is not None and i >= max_files:
                break
            yield text
        for i in range(n_chats):
            yield demo_data.chat_transcript(random.Random(i))

    return train_bpe_tokenizer(texts(), vocab)


def code_tokens(tok, split: str, max_files: int | None = None) -> np.ndarray:
    eot = tok.token_to_id(demo_data.EOT)
    texts = [text for _, text in demo_data.code_texts(split)][:max_files]
    out = []
    for enc in tok.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, np.uint16)


def chat_row(tok, rng: random.Random, length: int) -> np.ndarray:
    ids: list[int] = []
    while len(ids) < length:
        ids.extend(tok.encode(demo_data.chat_transcript(rng)).ids)
    return np.asarray(ids[:length], np.int32)


def make_batch(tok, code: np.ndarray, step: int, batch: int, seq: int, chat_fraction: float,
               seed: int) -> np.ndarray:
    """Batch of step `step`: int32 [batch, seq + 1], a function of (seed, step) only."""
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for _ in range(batch):
        if rng.random() < chat_fraction:
            rows.append(chat_row(tok, random.Random(rng.randrange(demo_data.EVAL_SEED_BASE)), seq + 1))
        else:
            start = rng.randrange(len(code) - seq - 1)
            rows.append(code[start:start + seq + 1].astype(np.int32))
    return np.stack(rows)


def eval_batches(tok, code_eval: np.ndarray, seq: int, n_rows: int = 16):
    """Fixed held-out batches: {"code": [n, seq+1], "chat": [n, seq+1]}."""
    stride = max(1, (len(code_eval) - seq - 1) // n_rows)
    code = np.stack([code_eval[i * stride:i * stride + seq + 1].astype(np.int32)
                     for i in range(n_rows)])
    chat = np.stack([chat_row(tok, random.Random(demo_data.EVAL_SEED_BASE + 10_000 + i), seq + 1)
                     for i in range(n_rows)])
    return {"code": code, "chat": chat}


# ---- model and loss ---------------------------------------------------------------------------

def build(cfg, seed: int):
    import jax.numpy as jnp
    from flax import nnx
    from flint_jax.model import FlintForCausalLM, use_blocked_experts
    model = FlintForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    use_blocked_experts(model)  # ragged_dot's CPU form computes every expert for every row
    return nnx.split(model)


def loss_parts(graphdef, params, tokens, cfg):
    """tokens int32 [B, T+1] -> (mean next-token cross-entropy, balance loss, expert load [Lm, E])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flint_jax.cache import cache_shapes
    model = nnx.merge(graphdef, params)
    b, t1 = tokens.shape
    t = t1 - 1
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, b, t, jnp.float32))
    logits, _, cap = model(tokens[:, :-1], cache, jnp.full((b,), t, jnp.int32), logits="all",
                           capture=("router_scores", "router_ids"))
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    scores, ids = cap["router_scores"], cap["router_ids"]  # [Lm, B, T, E], [Lm, B, T, k]
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    load = jnp.mean(jnp.sum(jax.nn.one_hot(ids, e), axis=-2), axis=(1, 2)) / k  # [Lm, E], sums to 1
    probs = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=(1, 2))
    balance = e * jnp.mean(jnp.sum(jax.lax.stop_gradient(load) * probs, axis=-1))
    return ce, balance, load


def make_steps(graphdef, cfg, optimizer, balance_weight: float):
    import jax

    def loss_fn(params, tokens):
        ce, bal, load = loss_parts(graphdef, params, tokens, cfg)
        return ce + balance_weight * bal, (ce, bal, load)

    def train_step(params, opt_state, tokens):
        (_, (ce, bal, load)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        gnorm = jax.numpy.sqrt(sum(jax.numpy.sum(g * g) for g in jax.tree.leaves(grads)))
        return params, opt_state, {"ce": ce, "balance": bal, "grad_norm": gnorm}

    def eval_step(params, tokens):
        ce, bal, load = loss_parts(graphdef, params, tokens, cfg)
        return ce, load

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_step)


def make_optimizer(lr: float, steps: int, warmup: int):
    import optax
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1,
                                   mask=lambda p: _decay_mask(p)))


def _decay_mask(params):
    import jax
    # Decay matrices only (norm weights, sinks: no).
    return jax.tree.map(lambda x: x.ndim >= 2, params)


# ---- state on disk -----------------------------------------------------------------------------

def save_state(path: str, params, opt_state, meta: dict) -> None:
    import jax
    leaves = jax.tree.leaves((params, opt_state))
    tmp = path + ".tmp.npz"
    np.savez(tmp, *[np.asarray(x) for x in leaves])
    with open(path + ".tmp.json", "w") as f:
        json.dump(meta, f)
    os.replace(tmp, path + ".npz")
    os.replace(path + ".tmp.json", path + ".json")


def load_state(path: str, params, opt_state):
    import jax
    import jax.numpy as jnp
    if not os.path.exists(path + ".npz"):
        return None
    with np.load(path + ".npz") as z:
        leaves = [jnp.asarray(z[f"arr_{i}"]) for i in range(len(z.files))]
    treedef = jax.tree.structure((params, opt_state))
    if treedef.num_leaves != len(leaves):
        raise SystemExit(f"{path}.npz: {len(leaves)} arrays, the model and optimizer have "
                         f"{treedef.num_leaves}; was it written for another --config? Use a new --work")
    params, opt_state = jax.tree.unflatten(treedef, leaves)
    with open(path + ".json") as f:
        return params, opt_state, json.load(f)


# ---- export ------------------------------------------------------------------------------------

def export(out: str, cfg, params, graphdef, tok, log: dict) -> None:
    """Writes the transformers-format checkpoint (BF16; routers and sinks fp32) into `out`."""
    import ml_dtypes
    from flax import nnx
    from flint_jax.demo import write_tokenizer_files
    from flint_jax.hf_io import hf_tensors_of_state, write_safetensors
    from flint_jax.output_path import staging
    model = nnx.merge(graphdef, params)
    named = {".".join(str(p) for p in path): np.asarray(var.get_value())
             for path, var in nnx.to_flat_state(nnx.state(model))}
    tensors = []
    for name, arr in hf_tensors_of_state(cfg, named):
        keep_fp32 = name.endswith(".mlp.gate.weight") or name.endswith(".self_attn.softmax_offset")
        tensors.append((name, np.ascontiguousarray(arr.astype(np.float32 if keep_fp32 else ml_dtypes.bfloat16))))
    shards, cur, size = [], [], 0
    for name, arr in tensors:
        if cur and size + arr.nbytes > SHARD_BYTES - 2**16:  # room for the header
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, arr))
        size += arr.nbytes
    shards.append(cur)
    with staging(out, overwrite=True) as tmp:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(tmp, fname), dict(shard), {"format": "pt"})
            for name, arr in shard:
                weight_map[name] = fname
                total += arr.nbytes
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        d = cfg.to_dict()
        d["dtype"] = "bfloat16"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(d, f, indent=2)
        write_tokenizer_files(tmp, tok, cfg, sampling={"temperature": 0.7, "top_p": 0.95, "top_k": 20})
        with open(os.path.join(tmp, "train_log.json"), "w") as f:
            json.dump(log, f)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(model_card(cfg, log))


def model_card(cfg, log: dict) -> str:
    last = log["eval"][-1] if log.get("eval") else {}
    n_params = log.get("params", 0)
    return f"""# flint-demo: a small trained Flint

The embedded default of flint_jax: a {n_params / 1e6:.1f}M-parameter Flint ({cfg.num_hidden_layers}
layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, vocabulary
{cfg.vocab_size}) trained by `tools/train_demo.py` on the Python standard library's source and on
generated GLM-4.7 chats (arithmetic, string and list questions, short Python functions, calls to four
made-up tools). It completes Python plausibly, follows the chat format and picks the right tool; how
often its arguments and answers are the right ones is in flint_jax's docs/demo_model.md (Quality).
It knows nothing else. Not a general assistant.

- Steps: {log.get("step")} x {log.get("tokens_per_step")} tokens ({log.get("device")}, {log.get("train_seconds", 0) / 60:.0f} min).
- Held-out loss (nats/token): code {last.get("code", float("nan")):.3f}, chat {last.get("chat", float("nan")):.3f}.
- Command: `{log.get("command", "")}`

Weights: BF16, routers and sinks fp32, transformers' `FlintForCausalLM` layout (per-expert tensors).
"""


# ---- main --------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=".train_demo", help="state directory (tokenizer, tokens, "
                   "optimizer state); a run resumes from it")
    p.add_argument("--out", default=None, help="export the checkpoint here at the end "
                   "(e.g. flint_jax/demo_model)")
    p.add_argument("--steps", type=int, default=2500, help="total optimizer steps (schedule length)")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop (and save) after this much training time in this run")
    p.add_argument("--batch", type=int, default=64, help="rows per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--balance", type=float, default=0.01, help="weight of the expert-balance loss")
    p.add_argument("--chat-fraction", type=float, default=0.7)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--size", default="demo", choices=["demo", "tiny"],
                   help="model size: the shipped demo's, or toy sizes for tests")
    p.add_argument("--max-files", type=int, default=None,
                   help="use only the first N files of each split (tests)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and save) after N steps in this run")
    p.add_argument("--export-only", action="store_true",
                   help="write --out (and --plot) from the saved state, without training")
    p.add_argument("--plot", default=None, help="write the loss curve PNG here (needs matplotlib)")
    args = p.parse_args(argv)

    import jax
    os.makedirs(args.work, exist_ok=True)
    tok_path = os.path.join(args.work, "tokenizer.json")
    from tokenizers import Tokenizer
    if os.path.exists(tok_path):
        tok = Tokenizer.from_file(tok_path)
    else:
        print("[train_demo] training the tokenizer ...", flush=True)
        tok = train_tokenizer(args.vocab, 20000 if args.max_files is None else 200, args.max_files)
        tok.save(tok_path + ".tmp")
        os.replace(tok_path + ".tmp", tok_path)
    toks = {}
    for split in ("train", "eval"):
        path = os.path.join(args.work, f"code_{split}.npy")
        if not os.path.exists(path):
            print(f"[train_demo] tokenizing the {split} files ...", flush=True)
            np.save(path + ".tmp.npy", code_tokens(tok, split, args.max_files))
            os.replace(path + ".tmp.npy", path)
        toks[split] = np.load(path)
    print(f"[train_demo] code tokens: train {len(toks['train']):,}, held out {len(toks['eval']):,}",
          flush=True)

    eos = tuple(tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>"))
    cfg = demo_config(tok.get_vocab_size(), eos, args.size)
    graphdef, params = build(cfg, args.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    optimizer = make_optimizer(args.lr, args.steps, args.warmup)
    opt_state = optimizer.init(params)
    state_path = os.path.join(args.work, "state")
    log = {"train": [], "eval": [], "step": 0, "train_seconds": 0.0}
    loaded = load_state(state_path, params, opt_state)
    if loaded is not None:
        params, opt_state, log = loaded
        print(f"[train_demo] resumed at step {log['step']}", flush=True)
    if args.export_only:
        if loaded is None or not (args.out or args.plot):
            raise SystemExit(f"--export-only needs a saved state in {args.work} and --out or --plot")
        if args.plot:
            plot_loss(log, args.plot)
        if args.out:
            export(args.out, cfg, params, graphdef, tok, log)
            print(f"[train_demo] wrote {args.out} (step {log['step']})", flush=True)
        return
    # The run's own settings (an --export-only call leaves the saved ones alone).
    log.update(params=n_params, tokens_per_step=args.batch * args.seq, device=jax.devices()[0].device_kind,
               command="python tools/train_demo.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    train_step, eval_step = make_steps(graphdef, cfg, optimizer, args.balance)
    evals = eval_batches(tok, toks["eval"], args.seq)

    def evaluate(step, params):
        row = {"step": step}
        loads = []
        for name, batch in evals.items():
            ces = []
            for i in range(0, len(batch), 8):
                ce, load = eval_step(params, batch[i:i + 8])
                ces.append(float(ce))
                loads.append(np.asarray(load))
            row[name] = float(np.mean(ces))
        load = np.mean(loads, axis=0)  # [Lm, E], each row sums to 1
        row["load_max_over_mean"] = float(np.max(load) * cfg.num_experts)
        row["load_min_over_mean"] = float(np.min(load) * cfg.num_experts)
        row["load"] = load.round(4).tolist()
        log["eval"].append(row)
        print(f"[train_demo] step {step}: held-out code {row['code']:.3f}, chat {row['chat']:.3f}, "
              f"expert load max/mean {row['load_max_over_mean']:.2f} "
              f"min/mean {row['load_min_over_mean']:.2f}", flush=True)

    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True
        print("[train_demo] interrupted: saving at the end of this step", flush=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _train_loop(args, log, tok, toks, cfg, graphdef, params, opt_state, train_step, evaluate,
                    state_path, stop, n_params)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train_loop(args, log, tok, toks, cfg, graphdef, params, opt_state, train_step, evaluate,
                state_path, stop, n_params):
    if log["step"] == 0:
        print(f"[train_demo] {n_params / 1e6:.2f}M parameters on {log['device']}; compiling ...",
              flush=True)
    t_run = time.time()
    t_last, step0 = time.time(), log["step"]
    step_last = step0
    while log["step"] < args.steps and not stop["now"]:
        step = log["step"]
        batch = make_batch(tok, toks["train"], step, args.batch, args.seq, args.chat_fraction, args.seed)
        params, opt_state, m = train_step(params, opt_state, batch)
        log["step"] = step + 1
        if (step + 1) % 10 == 0 or step == 0:
            m = {k: float(v) for k, v in m.items()}
            now = time.time()
            log["train_seconds"] += now - t_last
            # tokens/s over the steps since the last line (the first line's includes the compile)
            rate = (step + 1 - step_last) * args.batch * args.seq / max(now - t_last, 1e-9)
            t_last, step_last = now, step + 1
            log["train"].append({"step": step + 1, **m})
            print(f"[train_demo] step {step + 1}/{args.steps}: loss {m['ce']:.3f} balance "
                  f"{m['balance']:.3f} |g| {m['grad_norm']:.2f} ({rate:,.0f} tokens/s)", flush=True)
        t_pause = time.time()   # evaluations and saves: left out of the next tokens/s
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1, params)
        if (step + 1) % args.save_every == 0:
            save_state(state_path, params, opt_state, log)
        t_last += time.time() - t_pause
        if args.stop_after is not None and log["step"] - step0 >= args.stop_after:
            break
        if args.minutes is not None and time.time() - t_run > 60 * args.minutes:
            print(f"[train_demo] {args.minutes} min reached", flush=True)
            break
    if not log["eval"] or log["eval"][-1]["step"] != log["step"]:
        evaluate(log["step"], params)
    save_state(state_path, params, opt_state, log)
    if args.out:
        export(args.out, cfg, params, graphdef, tok, log)
        print(f"[train_demo] wrote {args.out}", flush=True)
    if args.plot:
        try:
            plot_loss(log, args.plot)
        except ImportError as e:   # a GPU image without matplotlib: the log has the curve
            print(f"[train_demo] no loss plot ({e}); make it later with --export-only --plot",
                  flush=True)


def plot_loss(log: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = log["train"]
    steps = np.array([r["step"] for r in tr])
    ce = np.array([r["ce"] for r in tr])
    ax.plot(steps, ce, lw=0.8, alpha=0.6, label="training batch")
    ev = log["eval"]
    for key in ("code", "chat"):
        ax.plot([r["step"] for r in ev], [r[key] for r in ev], marker="o", ms=3, label=f"held-out {key}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, min(10.0, float(np.max(ce)) + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"flint-demo training ({log.get('device', '')}, "
                 f"{log.get('tokens_per_step', 0)} tokens/step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
