"""Where convert / quantize / synth may write, and what an interrupt leaves (issue 39).

- Refusals: DST is or contains the source, --hf-config, --config, a file of an input (a HF cache
  snapshot's symlinked blobs too), or the working directory or one of its parents: one line,
  nothing touched, with or without --overwrite.
- A fuzz-style sweep: every writing command against a tree of decoy files, over many spellings of
  DST, with and without --overwrite: no file outside DST changes, refusals change nothing at all.
- --overwrite replaces DST only once the new output is complete (a failure keeps the old one).
- Modes follow the umask; stale temporaries of a killed run are removed (or named) by the next.
- quantize writes a self-contained directory (model.gguf + config + tokenizer) unless OUT ends
  in .gguf; its progress bar moves inside a tensor.
- A real SIGINT in a subprocess at several points of convert (and of quantize and synth): exit
  within ~2 s, status 130, one line, no traceback, no temporary left.
"""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from flint_jax import checkpoint, cli_checkpoints, convert, nvfp4, output_path, quantize, synth

GOLDEN = pathlib.Path(__file__).parent / "golden"
REPO = pathlib.Path(__file__).parent.parent
TINY = GOLDEN / "tiny_a"


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
    """Every entry under root (symlinks not followed): type, mode, inode, and for files size and
    mtime (a rewrite or a replacement changes them) or for links the target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p), st.st_ino)
            elif os.path.isdir(p):
                out[rel] = ("dir", st.st_mode, st.st_ino)
            else:
                out[rel] = ("file", st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def run_cli(argv, capsys):
    rc = cli_checkpoints.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.err


@pytest.fixture(scope="module")
def gguf_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "g"
    quantize.quantize(TINY, out)
    return out


# ---- the refusal rules (output_path.check) -------------------------------------------------------

def test_check_rules(tmp_path, monkeypatch):
    src = tmp_path / "outer" / "hf"
    shutil.copytree(TINY, src)
    work = tmp_path / "outer" / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    ins = [("the source", str(src))]
    refused = {
        str(src): "the destination is the source",
        str(src) + "/": "the destination is the source",
        str(src / "model.safetensors"):
            "the destination is model.safetensors, a file of the source",
        str(tmp_path / "outer"): "the destination contains the source",
        str(tmp_path): "the destination contains the source",
        ".": "the destination is the working directory",
        "..": "the destination contains the source",  # (and the working directory)
    }
    for dst, msg in refused.items():
        for ow in (False, True):
            with pytest.raises(output_path.DestinationError, match=re.escape(msg)):
                output_path.check(dst, inputs=ins, overwrite=ow)
    with pytest.raises(output_path.DestinationError, match="contains the working directory"):
        output_path.check(str(tmp_path / "outer"), overwrite=True)
    # A HF cache: the snapshot's files are symlinks into blobs/; DST=blobs holds the real data.
    cache = tmp_path / "cache"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snap").mkdir()
    (cache / "blobs" / "abc").write_text("weights")
    os.symlink("../blobs/abc", cache / "snap" / "model.safetensors")
    with pytest.raises(output_path.DestinationError, match="contains model.safetensors, a file of"):
        output_path.check(str(cache / "blobs"), inputs=[("the source", str(cache / "snap"))],
                          overwrite=True)
    # A DST beside the source (a sibling) is fine; one that exists needs --overwrite and the
    # same kind of output.
    assert output_path.check(str(tmp_path / "outer" / "new/"), inputs=ins) == str(
        tmp_path / "outer" / "new")
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match=r"f: already exists \(pass --overwrite"):
        output_path.check(str(tmp_path / "f"), inputs=ins)
    with pytest.raises(output_path.DestinationError, match="exists and is a file"):
        output_path.check(str(tmp_path / "f"), inputs=ins, overwrite=True, kind="dir")
    with pytest.raises(output_path.DestinationError, match="exists and is a directory"):
        output_path.check(str(cache), inputs=ins, overwrite=True, kind="file")
    with pytest.raises(FileNotFoundError, match="parent directory"):
        output_path.check(str(tmp_path / "nope" / "x"))


def test_issue_cases_refused(tmp_path, monkeypatch, capsys, gguf_bundle):
    """The issue's three reports: each one line, exit 1, nothing touched."""
    outer = tmp_path / "outer"
    shutil.copytree(TINY, outer / "hf")
    shutil.copytree(gguf_bundle, tmp_path / "g")
    (tmp_path / "sibling.txt").write_text("keep")
    work = outer / "hf"
    before = snapshot(tmp_path)
    cases = [
        (["convert", outer / "hf", outer, "--overwrite", "-q"], "contains the source"),
        (["convert", tmp_path / "g" / "model.gguf", tmp_path / "g", "--hf-config", tmp_path / "g",
          "--overwrite", "-q"], "contains the source"),
        (["convert", tmp_path / "g" / "model.gguf", tmp_path / "x", "--hf-config", tmp_path / "g",
          "-q"], None),  # fine: a new sibling
    ]
    for argv, msg in cases:
        rc, err = run_cli(argv, capsys)
        if msg is None:
            assert rc == 0, err
            shutil.rmtree(tmp_path / "x")
            continue
        assert rc == 1 and err.count("\n") == 1 and msg in err and "Traceback" not in err, err
    monkeypatch.chdir(work)
    for dst in ("..", ".", "../..", str(tmp_path)):
        rc, err = run_cli(["synth", dst, "--overwrite", "-q"], capsys)
        assert rc == 1 and err.count("\n") == 1, err
        assert "working directory" in err or "contains --config" in err, err
    assert snapshot(tmp_path) == before


# ---- the fuzz-style sweep ------------------------------------------------------------------------

def make_tree(root: pathlib.Path, bundle: pathlib.Path):
    """Decoys and inputs: hf/ (a HF checkpoint), g/ (a GGUF bundle), link -> hf, notes/ (a
    decoy directory), decoy.txt, old.gguf (a decoy file), work/ (the working directory)."""
    shutil.copytree(TINY, root / "hf")
    shutil.copytree(bundle, root / "g")
    (root / "notes" / "sub").mkdir(parents=True)
    (root / "notes" / "a.txt").write_text("a")
    (root / "notes" / "sub" / "b.bin").write_bytes(b"\0\1\2")
    (root / "decoy.txt").write_text("decoy")
    (root / "old.gguf").write_bytes(b"GGUF-not-really")
    (root / "work").mkdir()
    (root / "work" / "w.txt").write_text("w")
    os.symlink("hf", root / "link")


COMMANDS = {
    # name: (argv with {D} for DST, the inputs' top-level names under root)
    "convert-hf": (["convert", "../hf", "{D}", "-q"], {"hf", "link"}),
    "convert-gguf": (["convert", "../g/model.gguf", "{D}", "--hf-config", "../link", "-q"],
                     {"g", "hf", "link"}),
    "quantize": (["quantize", "../link", "{D}", "-q"], {"hf", "link"}),
    "synth": (["synth", "{D}", "--config", "../hf/config.json", "--layers", "1", "-q"],
              {"hf", "link"}),
}
# DST spellings (relative to work/, or absolute via {R}) -> the top-level entry of root they name
# ("" = root itself, "." = work, None = a new path outside every input).
DSTS = {
    ".": ".", "./": ".", "..": "", "{R}": "", "../work": ".", "{R}/work/../work": ".",
    "../hf": "hf", "../hf/": "hf", "../hf/./": "hf", "../hf/config.json": "hf",
    "../hf/model.safetensors": "hf", "../hf/tokenizer.json": "hf", "../link": "link",
    "{R}/link/": "link", "../g": "g",
    "../g/model.gguf": "g", "../g/config.json": "g", "../notes": "notes",
    "../hf/../notes": "notes", "../notes/sub": "notes", "../decoy.txt": "decoy.txt",
    "../old.gguf": "old.gguf", "../new": None, "new-here": None, "../notes/sub/new.gguf": None,
}


def expected_refusal(cmd: str, key: str | None, dst_abs: str, overwrite: bool, root) -> bool:
    inputs = COMMANDS[cmd][1]
    if key in ("", "."):
        return True  # the working directory or its parent
    if key in inputs:
        return True  # an input, a file of one, or a link to one
    if not os.path.lexists(dst_abs):
        return False
    if not overwrite:
        return True
    is_dir_out = cmd != "quantize" or not dst_abs.rstrip("/").endswith(".gguf")
    return is_dir_out != os.path.isdir(dst_abs)  # replaced by the same kind only


def test_fuzz_writing_commands_touch_only_dst(tmp_path, monkeypatch, capsys, gguf_bundle):
    n_ok = n_refused = 0
    for cmd, (argv, _) in COMMANDS.items():
        root = tmp_path / cmd
        root.mkdir()
        make_tree(root, gguf_bundle)
        monkeypatch.chdir(root / "work")
        for spelled, key in DSTS.items():
            for ow in (False, True):
                dst = spelled.replace("{R}", str(root))
                dst_abs = os.path.normpath(os.path.join(root / "work", dst))
                refuse = expected_refusal(cmd, key, dst_abs, ow, root)
                before = snapshot(root)
                args = [a.replace("{D}", dst) for a in argv] + (["--overwrite"] if ow else [])
                rc, err = run_cli(args, capsys)
                after = snapshot(root)
                what = f"{cmd} DST={spelled} overwrite={ow}: rc={rc} {err!r}"
                if refuse:
                    n_refused += 1
                    assert rc == 1 and err.count("\n") == 1, what
                    assert err.startswith(f"flint-jax {argv[0]}: error: "), what
                    assert "Traceback" not in err, what
                    assert after == before, what  # nothing at all, DST included
                    continue
                n_ok += 1
                assert rc == 0, what
                rel = os.path.relpath(dst_abs, root)
                inside = lambda p: p == rel or p.startswith(rel + os.sep)  # noqa: E731
                assert {p: v for p, v in before.items() if not inside(p)} == \
                    {p: v for p, v in after.items() if not inside(p)}, what
                assert os.path.lexists(dst_abs), what
                # Put the tree back for the next case.
                shutil.rmtree(root)
                root.mkdir()
                make_tree(root, gguf_bundle)
                monkeypatch.chdir(root / "work")
    assert n_refused > 100 and n_ok > 20, (n_refused, n_ok)


# ---- overwrite, modes, stale temporaries ---------------------------------------------------------

def test_overwrite_keeps_old_until_complete(tmp_path, monkeypatch):
    dst = tmp_path / "out"
    convert.convert(GOLDEN / "tiny_c", dst, progress=False)
    before = snapshot(dst)
    bad = tmp_path / "bad"
    shutil.copytree(TINY, bad)
    (bad / "model.safetensors").write_bytes((TINY / "model.safetensors").read_bytes()[:-5000])
    with pytest.raises(ValueError, match="truncated"):
        convert.convert(bad, dst, progress=False, overwrite=True)
    from conftest import disk_fills_after
    with monkeypatch.context() as m:
        disk_fills_after(m, 3)
        with pytest.raises(ValueError, match="No space left"):
            convert.convert(TINY, dst, progress=False, overwrite=True)
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out"]
    convert.convert(TINY, dst, progress=False, overwrite=True)
    assert checkpoint.read_manifest(str(dst))["source"]["path"] == str(TINY.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out"]


def test_temporary_that_cannot_be_removed_is_named(tmp_path, monkeypatch, capsys):
    def fail(directory, tensors, workers=2):
        os.makedirs(directory)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint, "write_params", fail)
    monkeypatch.setattr(output_path, "remove", lambda path: None)  # e.g. a read-only mount
    rc, err = run_cli(["convert", TINY, tmp_path / "out", "-q"], capsys)
    left = [p for p in tmp_path.iterdir()]
    assert rc == 1 and len(left) == 1 and left[0].name.startswith(".out.tmp-")
    assert f"could not remove the temporary {left[0]}" in err and "Input/output error" in err


def test_modes_follow_umask(tmp_path):
    old = os.umask(0o027)
    try:
        convert.convert(TINY, tmp_path / "conv", progress=False)
        quantize.quantize(TINY, tmp_path / "q.gguf")
        quantize.quantize(TINY, tmp_path / "qdir")
        synth.synth(tmp_path / "s", config="tiny", layers=1)
    finally:
        os.umask(old)
    seen = 0
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        for name in dirnames:
            assert os.stat(os.path.join(dirpath, name)).st_mode & 0o777 == 0o750, name
        for name in filenames:
            assert os.stat(os.path.join(dirpath, name)).st_mode & 0o777 == 0o640, name
            seen += 1
    assert seen > 10


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_temporaries_swept(tmp_path, capsys):
    host = output_path._host_tag()
    dst = tmp_path / "out"
    pid = dead_pid()
    stale_tmp = tmp_path / f".out.tmp-{host}-{pid}-abcdefgh"
    (stale_tmp / "params").mkdir(parents=True)
    stale_old = tmp_path / f".out.old-{host}-{pid}-abcdefgh"
    stale_old.mkdir()
    (stale_old / "flint_jax.json").write_text("{}")
    other_host = tmp_path / f".out.tmp-{'0' * 6 if host != '0' * 6 else '1' * 6}-{pid}-abcdefgh"
    other_host.mkdir()
    legacy = tmp_path / ".out.tmp-k2j4l5m6"
    legacy.mkdir()
    convert.convert(GOLDEN / "tiny_c", dst, progress=False)
    err = capsys.readouterr().err
    assert not stale_tmp.exists() and f"removed {stale_tmp}" in err
    # The only copy of an old DST (an --overwrite interrupted between its renames) is kept.
    assert stale_old.exists() and f"{stale_old} holds the previous" in err
    assert other_host.exists() and legacy.exists() and str(legacy) in err
    # Once DST exists, a dead run's set-aside old copy is garbage.
    convert.convert(GOLDEN / "tiny_c", dst, progress=False, overwrite=True)
    assert not stale_old.exists() and f"removed {stale_old}" in capsys.readouterr().err


# ---- quantize: a self-contained directory, progress inside a tensor ------------------------------

def test_quantize_directory_is_self_contained(tmp_path, gguf_bundle):
    names = sorted(p.name for p in gguf_bundle.iterdir())
    assert names == sorted(["model.gguf", "config.json", "generation_config.json", "tokenizer.json",
                            "tokenizer_config.json"])
    assert quantize.output_gguf(gguf_bundle) == str(gguf_bundle / "model.gguf")
    assert quantize.output_gguf(str(tmp_path / "x.gguf")) == str(tmp_path / "x.gguf")
    # Moved away from its source, it converts with its own config and tokenizer.
    moved = tmp_path / "moved"
    shutil.copytree(gguf_bundle, moved)
    dst = convert.convert(moved / "model.gguf", tmp_path / "conv", hf_config=moved, progress=False)
    assert checkpoint.read_manifest(dst)["quant"] is True
    tok = (tmp_path / "conv" / "tokenizer.json").read_bytes()
    assert tok == (TINY / "tokenizer.json").read_bytes()


def test_quantize_progress_moves_inside_tensors(monkeypatch):
    import tqdm.auto

    class Bar:
        made = []

        def __init__(self, total, **kw):
            self.total, self.updates = total, []
            Bar.made.append(self)

        def update(self, n):
            self.updates.append(n)

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rows = quantize.quantize(TINY, os.path.join(d, "x.gguf"), progress=True, workers=1)
    bar, = Bar.made
    n_nv = sum(r["type"] == "NVFP4" for r in rows)
    assert sum(bar.updates) == bar.total  # every source byte, once
    from flint_jax import hf_io
    ck = hf_io.HFCheckpoint(str(TINY))
    assert bar.total == sum(int(np.prod(ck.shape(n))) * np.dtype(ck.dtype(n)).itemsize
                            for n in ck.names())
    # Each tensor: read, written; each NVFP4 one also: quantized, checked (row chunks).
    assert len(bar.updates) >= 2 * len(rows) + 2 * n_nv, (len(bar.updates), len(rows), n_nv)
    # quantize_nvfp4's row callback: several chunks, same result as without it.
    monkeypatch.setattr(nvfp4, "_CHUNK_BYTES", 4096)
    w = np.random.default_rng(0).standard_normal((3, 64, 128)).astype(np.float32)
    seen = []
    got = nvfp4.quantize_nvfp4(w, on_rows=lambda d, t: seen.append((d, t)))
    want = nvfp4.quantize_nvfp4(w)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert len(seen) > 3 and seen[-1] == (192, 192) and seen == sorted(seen)
    # quantization_error over row chunks: the whole-array statistics.
    q, sc, ts = got
    seen.clear()
    stats = nvfp4.quantization_error(w, q, sc, ts, on_rows=lambda d, t: seen.append((d, t)))
    err = (w - nvfp4.dequantize_kernel_np(q, sc) * ts[:, None, None]).astype(np.float64)
    assert stats["max_abs_err"] == np.abs(err).max()
    assert stats["rel_rms_err"] == pytest.approx(np.sqrt(np.mean(err ** 2) / np.mean(
        w.astype(np.float64) ** 2)), rel=1e-12)
    assert len(seen) > 3 and seen[-1] == (192, 192)


# ---- a real SIGINT in a subprocess ---------------------------------------------------------------

@pytest.fixture(scope="module")
def mid_src(tmp_path_factory):
    """A ~300 MB HF checkpoint: converting it takes a second or two."""
    out = tmp_path_factory.mktemp("mid") / "mid"
    synth.synth(out, config="small", layers=24, experts=64)
    return out


class Watched:
    """A CLI subprocess whose stderr is read as it comes (the progress bar's percentages)."""

    def __init__(self, argv, cwd):
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
        self.p = subprocess.Popen([sys.executable, "-m", "flint_jax.cli", *map(str, argv)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
        self.err = b""
        self.pct = -1
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=self.p.stdout.read, daemon=True).start()

    def _read(self):
        while chunk := os.read(self.p.stderr.fileno(), 65536):
            with self.cond:
                self.err += chunk
                found = re.findall(rb"(\d+)%\|", self.err[-4096:])
                if found:
                    self.pct = int(found[-1])
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_pct(self, pct, timeout=60):
        with self.cond:
            ok = self.cond.wait_for(lambda: self.pct >= pct or self.p.poll() is not None, timeout)
        assert ok and self.p.poll() is None, f"finished before {pct}%: {self.err[-500:]!r}"

    def interrupt(self, sig=signal.SIGINT):
        t0 = time.monotonic()
        self.p.send_signal(sig)
        self.p.wait(timeout=30)
        dt = time.monotonic() - t0
        # stderr to its end (the process has exited): a fixed pause could miss the last line
        # when the reader thread lags on a loaded machine.
        self.reader.join(timeout=30)
        with self.cond:
            text = self.err.decode(errors="replace")
        return self.p.returncode, dt, text


def after_bars(text: str, bar: str) -> list[str]:
    """stderr without the progress bar's redraws."""
    parts = re.split(r"[\r\n]", text)
    return [p for p in parts if p.strip() and not p.lstrip().startswith(bar)]


def no_leftovers(parent: pathlib.Path, name: str):
    left = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.") or p.name == name]
    assert not left, f"left behind: {left}"


@pytest.mark.parametrize("pct", [0, 10, 45, 80])
def test_sigint_during_convert(mid_src, tmp_path, pct):
    dst = tmp_path / "x"
    w = Watched(["convert", mid_src, dst], tmp_path)
    w.wait_pct(pct)
    rc, dt, err = w.interrupt()
    lines = after_bars(err, "convert x:")
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    assert dt < 2.0, dt
    written = re.fullmatch(r"flint-jax convert: interrupted \((.+) was written\)",
                           lines[-1] if len(lines) == 1 else "")
    if written:
        # On a loaded machine the conversion can finish (rename into place) before the signal is
        # handled: then the CLI says so, and x must be the complete checkpoint, nothing beside it.
        from flint_jax import inspect_ckpt
        assert rc == 130 and os.path.samefile(written[1], dst), (rc, lines)
        report = inspect_ckpt.inspect(dst)
        assert report.ok, report.problems
        assert checkpoint.read_manifest(str(dst))["source"]["path"] == str(mid_src.resolve())
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".x.")] == []
        return
    assert rc == 130 and lines == ["flint-jax convert: interrupted (nothing written)"], (
        rc, lines, err[-1500:])
    no_leftovers(tmp_path, "x")


@pytest.mark.parametrize("delay", [0.4, 1.0, 2.0])
def test_sigint_while_starting(mid_src, tmp_path, delay):
    """Ctrl-C while the command starts (jax still importing, nothing written yet): one line,
    status 130, no traceback, nothing left."""
    dst = tmp_path / "x"
    w = Watched(["convert", mid_src, dst], tmp_path)
    time.sleep(delay)
    assert w.p.poll() is None
    rc, dt, err = w.interrupt()
    lines = after_bars(err, "convert x:")
    assert "Traceback" not in err, err[-3000:]
    # "flint-jax: interrupted" before the arguments are parsed, then with the command's name
    assert rc == 130 and len(lines) == 1 and re.fullmatch(
        r"flint-jax( convert)?: interrupted( \(nothing written\))?", lines[0]), (rc, lines)
    assert dt < 2.0, dt
    no_leftovers(tmp_path, "x")


def test_sigint_during_quantize_and_synth(mid_src, tmp_path):
    w = Watched(["quantize", mid_src, tmp_path / "q"], tmp_path)
    w.wait_pct(20)
    rc, dt, err = w.interrupt()
    lines = [ln for ln in after_bars(err, "quantize q:") if not ln.startswith(("blk.", "token_"))]
    assert rc == 130 and lines == ["flint-jax quantize: interrupted (nothing written)"], (rc, lines)
    assert dt < 2.0 and "Traceback" not in err
    no_leftovers(tmp_path, "q")
    w = Watched(["synth", tmp_path / "s", "--config", "small", "--layers", "24", "--experts", "64"],
                tmp_path)
    w.wait_pct(30)
    rc, dt, err = w.interrupt(signal.SIGTERM)
    assert rc == 143 and after_bars(err, "synth s:") == ["flint-jax synth: interrupted (nothing "
                                                         "written)"], (rc, err[-2000:])
    assert dt < 2.0 and "Traceback" not in err
    no_leftovers(tmp_path, "s")


def test_killed_convert_is_swept_next_time(mid_src, tmp_path, capsys):
    dst = tmp_path / "x"
    w = Watched(["convert", mid_src, dst], tmp_path)
    w.wait_pct(30)
    w.p.kill()
    w.p.wait(timeout=30)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".x.tmp-")]
    assert len(left) == 1 and any(left[0].iterdir())  # orbax's partial params
    convert.convert(GOLDEN / "tiny_c", dst, progress=False)
    assert f"removed {left[0]}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_interrupt_line_after_an_open_bar_gets_its_own_line(capsys):
    """A KeyboardInterrupt outside the signal handler (a command that writes nothing, stderr not
    silenced) while a progress bar holds the line: the one line starts on a line of its own."""
    from tqdm.auto import tqdm
    bar = tqdm(total=10, desc="loading", file=sys.stderr)
    bar.update(4)
    bar.refresh()
    try:
        assert output_path.interrupted("flint-jax demo", writes=False) == 130
    finally:
        bar.close()
    err = capsys.readouterr().err
    assert "\nflint-jax demo: interrupted\n" in err, repr(err[-300:])
