"""Bad input to convert / quantize / load: each a clear one-line error naming the file and tensor,
a non-zero exit from the CLI, no traceback unless --debug, and nothing left behind."""

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

import flint_jax
from flint_jax import checkpoint, cli_checkpoints, convert, gguf_io, hf_io, quantize

GOLDEN = pathlib.Path(__file__).parent / "golden"
REPO = pathlib.Path(__file__).parent.parent
ERRORS = (ValueError, OSError)


def assert_clean(dst: pathlib.Path):
    """No DST, no temporary directory or file beside it."""
    assert not dst.exists(), f"{dst} left behind"
    left = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert not left, f"temporary files left behind: {left}"


def convert_fails(src, dst, match, **kw):
    dst = pathlib.Path(dst)
    with pytest.raises(ERRORS, match=match) as e:
        convert.convert(src, dst, progress=False, **kw)
    assert "\n" not in str(e.value)
    assert_clean(dst)
    return str(e.value)


def hf_copy(tmp_path, name="tiny_a", mutate=None, config=None) -> pathlib.Path:
    """A copy of a golden HF checkpoint; `mutate(tensors)` edits {name: array} before writing;
    `config(dict)` edits config.json."""
    src = GOLDEN / name
    out = tmp_path / f"{name}-bad"
    shutil.copytree(src, out)
    if mutate is not None:
        ck = hf_io.HFCheckpoint(str(src))
        tensors = {n: np.array(ck.get(n)) for n in ck.names()}
        mutate(tensors)
        hf_io.write_safetensors(str(out / "model.safetensors"), tensors)
    if config is not None:
        d = json.loads((out / "config.json").read_text())
        config(d)
        (out / "config.json").write_text(json.dumps(d))
    return out


# ---- HF ----------------------------------------------------------------------------------------------

def test_truncated_safetensors(tmp_path):
    src = hf_copy(tmp_path)
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-5000])
    msg = convert_fails(src, tmp_path / "out", r"model\.safetensors: truncated: tensor '[\w.]+' ends at")
    assert str(f) in msg


def test_corrupt_safetensors_header(tmp_path):
    src = hf_copy(tmp_path)
    f = src / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"\x00garbage{{{{\xff\xfe\x00\x01"
    f.write_bytes(bytes(data))
    convert_fails(src, tmp_path / "out", r"model\.safetensors: corrupt safetensors header")
    f.write_bytes(struct.pack("<Q", 10**12) + bytes(data[8:]))  # header length beyond the file
    convert_fails(src, tmp_path / "out", r"corrupt safetensors header \(header length")


def test_missing_shard(tmp_path):
    src = tmp_path / "fused"
    shutil.copytree(GOLDEN / "tiny_a_fused", src)
    (src / "model-00002-of-00002.safetensors").unlink()
    convert_fails(src, tmp_path / "out", r"shard 'model-00002-of-00002\.safetensors' .* is missing")


def test_missing_tensor(tmp_path):
    src = hf_copy(tmp_path, mutate=lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"))
    convert_fails(src, tmp_path / "out", r"missing tensor 'model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight'")
    (tmp_path / "b").mkdir()
    src2 = hf_copy(tmp_path / "b", mutate=lambda t: t.pop("model.layers.2.self_attn.softmax_offset"))
    convert_fails(src2, tmp_path / "out", r"missing tensor for 'model\.layers\.2\.self_attn\.sinks'")


def test_unexpected_tensor(tmp_path):
    def add(t):
        t["model.layers.3.mlp.gate.e_score_correction_bias"] = np.zeros(8, np.float32)
    src = hf_copy(tmp_path, mutate=add)
    convert_fails(src, tmp_path / "out",
                  r"model\.safetensors: unexpected tensor 'model\.layers\.3\.mlp\.gate\.e_score_correction_bias' "
                  r"\(Flint's router has no selection bias\)")


def test_wrong_shape_and_dtype(tmp_path):
    def shape(t):
        t["model.layers.1.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"][:127]
    convert_fails(hf_copy(tmp_path, mutate=shape), tmp_path / "out",
                  r"tensor 'model\.layers\.1\.self_attn\.q_proj\.weight' has shape \[127, 128\], expected \[128, 128\]")
    (tmp_path / "d").mkdir()

    def dtype(t):
        t["model.norm.weight"] = np.ones(128, np.int32)
    convert_fails(hf_copy(tmp_path / "d", mutate=dtype), tmp_path / "out",
                  r"tensor 'model\.norm\.weight' has dtype int32, expected bf16, f16 or f32")


@pytest.mark.parametrize("field,value,match", [
    ("num_hidden_layers", 5, r"unexpected tensor 'model\.layers\.5\..*' \(the config has 5 layers\)"),
    ("num_hidden_layers", 7, r"missing tensor .*model\.layers\.6\."),
    ("num_experts", 4, r"unexpected tensor 'model\.layers\.\d\.mlp\.experts\.4\..*' \(the config has 4 experts"),
    ("vocab_size", 400, r"tensor 'model\.embed_tokens\.weight' has shape \[384, 128\], expected \[400, 128\]"),
])
def test_config_disagrees_hf(tmp_path, field, value, match):
    def edit(d):
        d[field] = value
        d.pop("layer_types", None)
    convert_fails(hf_copy(tmp_path, config=edit), tmp_path / "out", match)


def test_bad_config(tmp_path):
    convert_fails(hf_copy(tmp_path, config=lambda d: d.update(hidden_act="gelu")), tmp_path / "out",
                  r"config\.json: hidden_act must be 'silu'")


def test_dst_exists_and_overwrite(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    with pytest.raises(FileExistsError, match=r"out: already exists \(pass --overwrite"):
        convert.convert(GOLDEN / "tiny_c", dst, progress=False)
    assert (dst / "keep").exists()
    convert.convert(GOLDEN / "tiny_c", dst, progress=False, overwrite=True)
    assert not (dst / "keep").exists() and checkpoint.is_converted(str(dst))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_write_error_midway(tmp_path, monkeypatch, capsys):
    """The disk fills after a few tensors: one line naming DST and a tensor, nothing left."""
    from conftest import disk_fills_after
    calls = disk_fills_after(monkeypatch, 3)
    dst = tmp_path / "out"
    msg = convert_fails(GOLDEN / "tiny_a", dst, r"out: writing the checkpoint failed at tensor "
                                                r"'[\w.]+': OSError: \[Errno 28\] No space left")
    assert calls["n"] > 3
    calls["n"] = 0
    rc = cli_checkpoints.main(["convert", str(GOLDEN / "tiny_a"), str(dst), "-q"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("flint-jax convert: error: ") and "No space left on device" in err
    assert_clean(dst)


def test_unwritable_destination(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FileNotFoundError, match="parent directory"):
        convert.convert(GOLDEN / "tiny_c", blocker / "out", progress=False)


def test_quantize_row_length_not_multiple_of_64(tmp_path):
    out = tmp_path / "c.gguf"
    with pytest.raises(quantize.QuantizeError,
                       match=r"tensor 'blk\.0\.attn_q\.weight': row length 57 is not a multiple of 64"):
        quantize.quantize(GOLDEN / "tiny_c", out)
    assert_clean(out)


def test_quantize_errors(tmp_path):
    out = tmp_path / "a.gguf"
    out.write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        quantize.quantize(GOLDEN / "tiny_a", out)
    src = hf_copy(tmp_path, mutate=lambda t: t.pop("lm_head.weight"))
    with pytest.raises(hf_io.CheckpointError, match=r"missing tensor for 'lm_head\.weight'"):
        quantize.quantize(src, tmp_path / "b.gguf")
    assert_clean(tmp_path / "b.gguf")


# ---- GGUF --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny_a.gguf"
    quantize.quantize(GOLDEN / "tiny_a", path)
    return path


def entries(path):
    ck = gguf_io.open_gguf(path)
    return [(n, np.array(ck.array(n)), t.tensor_type) for n, t in ck.tensors.items()]


def write(path, ents, meta=None):
    gguf_io.write_gguf(path, ents, meta)
    return path


HF_CFG = str(GOLDEN / "tiny_a")


def test_gguf_truncated(tmp_path, good_gguf):
    bad = tmp_path / "t.gguf"
    data = good_gguf.read_bytes()
    bad.write_bytes(data[:-3000])
    msg = convert_fails(bad, tmp_path / "out", r"t\.gguf: file is truncated: tensor 'output\.weight",
                        hf_config=HF_CFG)
    assert str(bad) in msg
    bad.write_bytes(data[:200])  # inside the header
    convert_fails(bad, tmp_path / "out", r"t\.gguf: not a valid GGUF file", hf_config=HF_CFG)


def test_gguf_corrupt_header(tmp_path, good_gguf):
    data = bytearray(good_gguf.read_bytes())
    data[8:16] = struct.pack("<Q", 2**40)  # tensor count
    bad = tmp_path / "h.gguf"
    bad.write_bytes(bytes(data))
    convert_fails(bad, tmp_path / "out", r"h\.gguf: not a valid GGUF file \(corrupt or truncated header\)",
                  hf_config=HF_CFG)


def test_gguf_missing_unexpected_shape_dtype(tmp_path, good_gguf):
    ents = entries(good_gguf)
    miss = write(tmp_path / "m.gguf", [e for e in ents if not e[0].startswith("blk.3.ffn_up_exps")])
    convert_fails(miss, tmp_path / "out", r"m\.gguf: missing tensor 'blk\.3\.ffn_up_exps\.weight'",
                  hf_config=HF_CFG)
    extra = [e for e in ents if e[0].startswith("blk.5.attn_norm")][0]
    unexp = write(tmp_path / "u.gguf", ents + [("blk.6.attn_norm.weight", extra[1], extra[2])])
    convert_fails(unexp, tmp_path / "out",
                  r"u\.gguf: unexpected tensor 'blk\.6\.attn_norm\.weight' \(the config has 6 layers\)",
                  hf_config=HF_CFG)
    shp = [(n, a[:64] if n == "blk.1.attn_q.weight" else a, t) for n, a, t in ents]
    shp = write(tmp_path / "s.gguf", shp)
    convert_fails(shp, tmp_path / "out",
                  r"s\.gguf: tensor 'blk\.1\.attn_q\.weight' has shape \[64, 128\], expected \[128, 128\]",
                  hf_config=HF_CFG)
    # An F16 tensor (not a Flint type): gguf's own writer, our reader refuses it.
    w = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), arch="flint")
    w.add_tensor("blk.0.attn_norm.weight", np.ones(128, np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    convert_fails(tmp_path / "f16.gguf", tmp_path / "out",
                  r"f16\.gguf: tensor 'blk\.0\.attn_norm\.weight' has GGML type F16", hf_config=HF_CFG)


def test_gguf_scale_byte_ff(tmp_path, good_gguf):
    """0xFF is found while the tensor is repacked, mid-conversion: cleaned up, named."""
    bad = tmp_path / "ff.gguf"
    shutil.copy(good_gguf, bad)
    t = gguf_io.open_gguf(bad).tensors["blk.4.ffn_down_exps.weight"]
    row_bytes = t.data.shape[-1]
    off = int(t.data_offset) + (3 * t.data.shape[1] + 5) * row_bytes + 2  # expert 3, row 5, sub-block 2
    with open(bad, "r+b") as f:
        f.seek(off)
        f.write(b"\xff")
    convert_fails(bad, tmp_path / "out",
                  r"ff\.gguf: tensor 'blk\.4\.ffn_down_exps\.weight': invalid UE4M3 block scale 0xFF "
                  r"at row \(3, 5\), block 0 \(sub-block 2", hf_config=HF_CFG)
    with pytest.raises(ValueError, match="0xFF"):
        flint_jax.load(bad, hf_config=HF_CFG)


def test_gguf_prec_a4(tmp_path, good_gguf):
    bad = write(tmp_path / "a4.gguf", entries(good_gguf), {gguf_io.PREC_A4_KEY: True})
    convert_fails(bad, tmp_path / "out", r"a4\.gguf: general\.tensor_extra\.prec_a4 is set",
                  hf_config=HF_CFG)


def test_gguf_row_length_not_multiple_of_64(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "r.gguf"), arch="flint")
    # (a float32 carrier: gguf takes raw_shape as the element shape, 128 x 96 -> 6912 bytes)
    w.add_tensor("blk.0.attn_q.weight", np.zeros(128 * 96 // 64 * 36 // 4, np.float32),
                 raw_shape=(128, 96), raw_dtype=gguf_io.NVFP4)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    convert_fails(tmp_path / "r.gguf", tmp_path / "out",
                  r"r\.gguf: tensor 'blk\.0\.attn_q\.weight' \(NVFP4\) has row length 96, not a multiple of 64",
                  hf_config=HF_CFG)


@pytest.mark.parametrize("field,value,match", [
    ("num_hidden_layers", 5, r"unexpected tensor 'blk\.5\..*' \(the config has 5 layers\)"),
    ("num_hidden_layers", 8, r"missing tensor 'blk\.6\."),
    ("num_experts", 16, r"tensor 'blk\.2\.ffn_gate_inp\.weight' has shape \[8, 128\], expected \[16, 128\] "
                        r"for this config \(the config has 16 experts\)"),
    ("vocab_size", 512, r"tensor 'token_embd\.weight' has shape \[384, 128\], expected \[512, 128\] "
                        r"for this config \(the config has vocab_size 512\)"),
])
def test_config_disagrees_gguf(tmp_path, good_gguf, field, value, match):
    def edit(d):
        d[field] = value
        d.pop("layer_types", None)
    cfg_dir = hf_copy(tmp_path, config=edit)
    convert_fails(good_gguf, tmp_path / "out", match, hf_config=str(cfg_dir))


def test_gguf_needs_hf_config(tmp_path, good_gguf):
    convert_fails(good_gguf, tmp_path / "out", r"tiny_a\.gguf: a GGUF file holds no usable config "
                                               r"and no config.json lies beside it; pass hf_config "
                                               r"\(--hf-config DIR\)")
    with pytest.raises(ValueError, match="hf_config"):
        flint_jax.load(good_gguf)


# ---- converted checkpoints ----------------------------------------------------------------------------

def test_converted_config_disagrees_and_bad_manifest(tmp_path):
    dst = tmp_path / "conv"
    convert.convert(GOLDEN / "tiny_c", dst, progress=False)
    d = json.loads((dst / "config.json").read_text())
    d["num_hidden_layers"] = 4
    d.pop("layer_types"), d.pop("no_rope_layer_indices")
    (dst / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"conv: unexpected tensor 'model\.layers\.4\..*' "
                                         r"\(config\.json has 4 layers\)"):
        flint_jax.load(dst)
    m = json.loads((dst / "flint_jax.json").read_text())
    m["format_version"] = 99
    (dst / "flint_jax.json").write_text(json.dumps(m))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"format_version 99"):
        flint_jax.load(dst)
    with pytest.raises(convert.ConvertError, match="already a flint_jax checkpoint"):
        convert.convert(dst, tmp_path / "again", progress=False)


def test_converted_params_damaged(tmp_path):
    dst = tmp_path / "conv"
    convert.convert(GOLDEN / "tiny_c", dst, progress=False)
    shutil.rmtree(dst / "params")
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"conv/params: no orbax parameter directory"):
        flint_jax.load(dst)


# ---- the CLI in a subprocess --------------------------------------------------------------------------

def cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "flint_jax.cli_checkpoints", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=180)


def check_error_line(rc, err, cmd, match):
    import re
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"flint-jax {cmd}: error: ") and re.search(match, lines[0]), lines
    assert "Traceback" not in err


def test_cli_subprocess_errors(tmp_path, good_gguf):
    src = hf_copy(tmp_path)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5000])
    a4 = write(tmp_path / "a4.gguf", entries(good_gguf), {gguf_io.PREC_A4_KEY: True})
    cases = [
        (("convert", src, tmp_path / "o1", "-q"), r"model\.safetensors: truncated: tensor '[\w.]+'"),
        (("convert", a4, tmp_path / "o2", "--hf-config", HF_CFG, "-q"), "a4.gguf: .*prec_a4 is set"),
    ]
    for args, match in cases:
        r = cli(*args)
        check_error_line(r.returncode, r.stderr, args[0], match)
    for d in (tmp_path / "o1", tmp_path / "o2"):
        assert_clean(d)
    r = cli("convert", a4, tmp_path / "o3", "--hf-config", HF_CFG, "-q", "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "GGUFError" in r.stderr
    assert_clean(tmp_path / "o3")
    # inspect reports a mismatch (exit 1) without an error line.
    (tmp_path / "x").mkdir()
    bad = hf_copy(tmp_path / "x", config=lambda d: d.update(vocab_size=400))
    r = cli("inspect", bad)
    assert r.returncode == 1 and "verdict: INVALID" in r.stdout and not r.stderr.strip()
    assert "expected [400, 128]" in r.stdout


def test_cli_in_process_errors(tmp_path, capsys):
    exists = tmp_path / "exists"
    exists.mkdir()
    cases = [
        (("convert", GOLDEN / "tiny_c", exists, "-q"), "exists: already exists"),
        (("quantize", GOLDEN / "tiny_c", tmp_path / "c.gguf"), "row length 57 is not a multiple of 64"),
        (("inspect", tmp_path / "nope"), "nope: no such file or directory"),
        (("synth", tmp_path / "s", "--config", "nope"), "config 'nope' is neither a preset"),
        (("convert", GOLDEN / "tiny_a", tmp_path / "o", "--hf-config", GOLDEN / "tiny_b", "-q"),
         "hf_config applies to GGUF sources"),
    ]
    for args, match in cases:
        rc = cli_checkpoints.main([str(a) for a in args])
        check_error_line(rc, capsys.readouterr().err, args[0], match)
    assert_clean(tmp_path / "c.gguf")
    assert_clean(tmp_path / "s")
