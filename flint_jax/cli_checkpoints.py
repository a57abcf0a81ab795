"""Checkpoint commands of the `flint-jax` CLI: convert, quantize, inspect, synth.

`flint_jax.cli` calls `register(subparsers)`; this module also runs on its own:
`python -m flint_jax.cli_checkpoints convert SRC DST`.

Examples (paths are local: download the published checkpoints first, e.g.
`hf download RecursiveSI/flint --local-dir /hf/flint`; hub IDs are not fetched):
    flint-jax convert /hf/flint /data/flint-jax-bf16
    flint-jax convert flint-nvfp4.gguf /data/flint-jax-nvfp4 --hf-config /hf/flint
    flint-jax quantize /hf/flint /data/flint-nvfp4.gguf
    flint-jax inspect flint-nvfp4.gguf --config /hf/flint
    flint-jax synth /tmp/flint-synth --format gguf --config flint --layers 4

Errors of known kinds (bad or mismatched checkpoints, existing outputs, I/O errors) print one
line `flint-jax <cmd>: error: <message>` on stderr and exit 1; `--debug` shows the traceback.
The writing commands (convert, quantize, synth) share `flint_jax.output_path`: destinations that
are or hold an input or the working directory are refused, output is written beside DST and
renamed in when complete, and Ctrl-C (SIGINT) or SIGTERM stops them within about a second with
one line, `flint-jax <cmd>: interrupted (nothing written)`, exit status 130 (143), no temporary
left behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXAMPLES = [
    "flint-jax convert /hf/flint /data/flint-jax-bf16",
    "flint-jax convert flint-nvfp4.gguf /data/flint-jax-nvfp4 --hf-config /hf/flint",
    "flint-jax quantize /hf/flint /data/flint-nvfp4.gguf",
    "flint-jax inspect /data/flint-jax-nvfp4",
    "flint-jax synth /tmp/flint-synth --format hf --config flint --layers 2 --experts 16",
]


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _guard(cmd: str, fn, writes: bool = False):
    """Runs a command handler: known errors become one line on stderr and exit status 1. For a
    writing command, SIGINT / SIGTERM stop the writers, remove the temporary output and end the
    process with one line (`flint_jax.output_path.interrupt_handler`)."""
    from flint_jax import output_path

    def run(args) -> int:
        with output_path.interrupt_handler(f"flint-jax {cmd}", enabled=writes and not _debug(args)):
            return guarded(args)

    def guarded(args) -> int:
        try:
            return fn(args)
        except BrokenPipeError:  # `flint-jax inspect ... | head`: stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
        except KeyboardInterrupt:
            if _debug(args):
                raise
            return output_path.interrupted(f"flint-jax {cmd}", writes)
        except (ValueError, OSError) as e:
            if output_path.interrupt_requested():  # a writer stopped by the interrupt
                return output_path.interrupted(f"flint-jax {cmd}")
            if _debug(args):
                raise
            msg = str(e) or type(e).__name__
            if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
                msg = f"{e.filename}: {msg}"
            print(f"flint-jax {cmd}: error: {_one_line(msg)}", file=sys.stderr)
            return 1
        except Exception as e:  # a bug: still one line, the traceback with --debug
            if output_path.interrupt_requested():
                return output_path.interrupted(f"flint-jax {cmd}")
            if _debug(args):
                raise
            print(f"flint-jax {cmd}: internal error: {type(e).__name__}: {_one_line(e)} "
                  "(--debug shows the traceback)", file=sys.stderr)
            return 1

    return run


def _human(n) -> str:
    from flint_jax.config import human_bytes
    return human_bytes(n)


# ---- handlers --------------------------------------------------------------------------------------

def cmd_convert(args) -> int:
    from flint_jax import checkpoint, convert
    t0 = time.time()
    dst = convert.convert(args.src, args.dst, hf_config=args.hf_config, overwrite=args.overwrite,
                          progress=not args.quiet, dtype=args.dtype, mixed=args.mixed,
                          workers=args.workers)
    m = checkpoint.read_manifest(dst)
    print(f"wrote {dst}: {m['num_params']} tensors, {_human(m['nbytes'])}, quant={m['quant']}, "
          f"weights {m['dtype']}, in {time.time() - t0:.1f} s")
    for note in m.get("notes") or ():
        print(f"note: {note}")
    return 0


def cmd_quantize(args) -> int:
    from flint_jax import quantize
    t0 = time.time()
    if not args.quiet:
        print(quantize.format_table([]), flush=True)

    def row(r):
        if not args.quiet:
            from tqdm.auto import tqdm
            tqdm.write(quantize.format_row(r), file=sys.stdout)  # above the progress bar
            sys.stdout.flush()

    rows = quantize.quantize(args.hf_dir, args.out, overwrite=args.overwrite, workers=args.workers,
                             on_tensor=row, progress=not args.quiet)
    gguf = quantize.output_gguf(args.out)
    nv = [r for r in rows if r["type"] == "NVFP4"]
    worst = max(nv, key=lambda r: r["rel_rms_err"]) if nv else None
    mean = sum(r["rel_rms_err"] for r in nv) / len(nv) if nv else 0.0
    print(f"wrote {gguf}: {len(rows)} tensors ({len(nv)} NVFP4), "
          f"{_human(os.path.getsize(gguf))}, in {time.time() - t0:.1f} s; "
          f"relative RMS error mean {mean:.4f}"
          + (f", worst {worst['rel_rms_err']:.4f} ({worst['name']})" if worst else ""))
    beside = quantize.writes_directory(args.out)   # config.json beside the file: found on its own
    print(f"convert with: flint-jax convert {gguf} DST"
          + ("" if beside else f" --hf-config {args.hf_dir}"))
    return 0


def cmd_inspect(args) -> int:
    import json
    from flint_jax import inspect_ckpt
    r = inspect_ckpt.inspect(args.path, args.config, check_blocks=args.check_blocks)
    if args.json:
        print(json.dumps({
            "path": r.path, "kind": r.kind, "n_tensors": r.n_tensors, "nbytes": r.nbytes,
            "metadata": r.metadata, "config": r.config_source, "ok": r.ok, "problems": r.problems,
            "notes": r.notes, "tensors": [[t.name, t.dtype, list(t.shape), t.nbytes, t.count]
                                          for t in r.tensors]}, indent=1, default=str))
    else:
        print(inspect_ckpt.format_report(r, None if args.all else 80))
    return 0 if (r.ok or r.config_source is None) else 1


def cmd_synth(args) -> int:
    from flint_jax import synth
    t0 = time.time()
    info = synth.synth(args.out, fmt=args.format, config=args.config, layers=args.layers,
                       experts=args.experts, vocab=args.vocab, seed=args.seed, fused=args.fused,
                       tokenizer=not args.no_tokenizer, overwrite=args.overwrite,
                       workers=args.workers, progress=not args.quiet)
    cfg = info["config"]
    print(f"wrote {info['path']}: {args.format}, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_experts} experts, vocab {cfg.vocab_size}, "
          f"{info['tensors']} tensors, {_human(info['bytes'])}, in {time.time() - t0:.1f} s")
    if args.format == "gguf":
        print(f"convert with: flint-jax convert {info['path']} DST   (config.json beside it is found)")
    return 0


# ---- registration ----------------------------------------------------------------------------------

def _common(p):
    # SUPPRESS: no default here, so `flint-jax --debug convert ...` (the main parser's flag)
    # is not overwritten by this subparser's default.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show full tracebacks (also FLINT_JAX_DEBUG=1)")


LOCAL_ONLY = ("Paths are local: a hub ID (RecursiveSI/flint) is not fetched. Download the\n"
              "published checkpoints first, e.g. with huggingface_hub's CLI:\n"
              "  hf download RecursiveSI/flint --local-dir /hf/flint")


def _gguf_config_beside(fn):
    """A GGUF source without --hf-config takes config.json and the tokenizer from its own
    directory when config.json is there (`gguf_io.find_gguf_config`)."""

    def run(args) -> int:
        src = str(args.src)
        if args.hf_config is None and os.path.isfile(src):
            from flint_jax.gguf_io import find_gguf_config
            from flint_jax.gguf_io import is_gguf
            if src.endswith(".gguf") or is_gguf(src):
                args.hf_config = find_gguf_config(src)
        return fn(args)

    return run


def _debug(args) -> bool:
    return bool(getattr(args, "debug", False) or os.environ.get("FLINT_JAX_DEBUG"))


def register(subparsers) -> None:
    """Adds `convert`, `quantize`, `inspect` and `synth` to an argparse subparsers object."""
    from flint_jax.convert import DTYPES, MIXED

    p = subparsers.add_parser(
        "convert", help="HF directory or NVFP4 GGUF -> flint_jax (orbax) checkpoint",
        description="Converts a HF BF16 directory, or an NVFP4 GGUF file (with the config.json "
                    "beside it, or --hf-config), into a flint_jax checkpoint that flint_jax.load "
                    "restores straight onto a mesh.",
        epilog="examples:\n  " + "\n  ".join(EXAMPLES[:2]) + "\n\n" + LOCAL_ONLY,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a local HF checkpoint directory or .gguf file")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite; never the "
                               "source, --hf-config or a directory holding them)")
    p.add_argument("--hf-config", metavar="DIR",
                   help="for a GGUF source: the BF16 repo directory (config.json, tokenizer); "
                        "default the .gguf file's own directory when config.json is there")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST (once the new one is complete)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="stored weight dtype: as in the source (auto), bf16 or f32")
    p.add_argument("--mixed", choices=MIXED, default="refuse",
                   help="a GGUF with both NVFP4 and BF16 linear layers: refuse, quantize the BF16 "
                        "ones, or dequantize the NVFP4 ones")
    p.add_argument("--workers", type=int, default=None,
                   help="tensors prepared ahead in threads (default min(4, cores))")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _common(p)
    p.set_defaults(func=_guard("convert", _gguf_config_beside(cmd_convert), writes=True))

    p = subparsers.add_parser(
        "quantize", help="BF16 HF directory -> NVFP4 GGUF (prints error statistics)",
        description="Quantizes every linear layer to NVFP4 (fp32 tensor scale per tensor and per\n"
                    "expert, E4M3 per 16 values, nearest E2M1) into a Flint GGUF file.\n\n"
                    "OUT ending in .gguf: that one file; its config and tokenizer stay in HF_DIR\n"
                    "  (pass --hf-config HF_DIR wherever the file is used).\n"
                    "Any other OUT: a directory usable on its own: OUT/model.gguf plus HF_DIR's\n"
                    "  config.json, generation_config.json and tokenizer files\n"
                    "  (then: flint-jax convert OUT/model.gguf DST).",
        epilog="examples:\n  flint-jax quantize /hf/flint /data/flint-nvfp4       # directory\n"
               "  flint-jax quantize /hf/flint /data/flint-nvfp4.gguf  # one file",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", help="a local HF checkpoint directory (BF16)")
    p.add_argument("out", help="output: a .gguf file, or a directory for model.gguf with its "
                               "config and tokenizer (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (once the new one is complete)")
    p.add_argument("--workers", type=int, default=None,
                   help="tensors quantized ahead in threads (default min(4, cores))")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar and no per-tensor table")
    _common(p)
    p.set_defaults(func=_guard("quantize", cmd_quantize, writes=True))

    p = subparsers.add_parser(
        "inspect", help="list a checkpoint's tensors and check it against a config",
        description="HF directory, GGUF file or flint_jax checkpoint: tensors, types, shapes, "
                    "bytes, metadata, and what is missing, unexpected or mis-shaped. Exit status "
                    "1 when it does not match the config.")
    p.add_argument("path", help="HF directory, .gguf file or converted checkpoint")
    p.add_argument("--config", metavar="DIR", help="config.json (or its directory) to check "
                   "against; default the checkpoint's own (for a .gguf file: the config.json "
                   "beside it)")
    p.add_argument("--all", action="store_true", help="list every tensor row")
    p.add_argument("--check-blocks", action="store_true",
                   help="GGUF: read every NVFP4 tensor and check its block scales (no 0xFF)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _common(p)
    p.set_defaults(func=_guard("inspect", cmd_inspect))

    p = subparsers.add_parser(
        "synth", help="write a random-weight checkpoint (HF or NVFP4 GGUF) at any scale",
        description="Random Flint checkpoints in the real formats with realistic values, streamed "
                    "(little memory at any size). GGUF: OUT/model.gguf plus OUT/config.json.")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf",
                   help="hf: safetensors + config.json (default); gguf: OUT/model.gguf (NVFP4) "
                        "with OUT/config.json beside it")
    p.add_argument("--config", default="tiny",
                   help="a preset (flint, tiny, tiny-gqa8, small) or a config.json path")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--experts", type=int, default=None, help="override num_experts")
    p.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument("--fused", action="store_true", help="HF: fused expert tensors")
    p.add_argument("--no-tokenizer", action="store_true", help="do not write a tokenizer")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (once the new one is complete)")
    p.add_argument("--workers", type=int, default=None,
                   help="tensors generated ahead in threads (default min(8, cores))")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _common(p)
    p.set_defaults(func=_guard("synth", cmd_synth, writes=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flint-jax", description="flint_jax checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
