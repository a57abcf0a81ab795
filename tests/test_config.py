"""FlintConfig: HF defaults, vLLM field names, derived maps and refusals."""

import json

import pytest

from flint_jax.config import ConfigError, FlintConfig, kv_cache_bytes, preset


def test_hf_defaults_give_the_flint_layer_map():
    cfg = FlintConfig()
    assert len(cfg.full_layers) == 14 and len(cfg.sliding_layers) == 35
    assert cfg.full_layers == (0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48)
    assert cfg.rope_layers == cfg.sliding_layers
    assert cfg.dense_layers == (0, 1) and len(cfg.moe_layers) == 47
    assert cfg.ring_size == 576 and cfg.num_groups == 8
    counts = cfg.param_count()
    assert round(counts["total"] / 1e9, 3) == 39.785
    assert round(counts["active"] / 1e9, 3) == 2.515


def test_kv_cache_sizes_match_the_spec():
    sizes = kv_cache_bytes(FlintConfig(), batch=1, length=262144)
    assert sizes["full"] == 7 * 2**30  # 28 KiB per token
    assert sizes["full"] // 262144 == 28 * 1024
    assert 35 * 2**20 < sizes["sliding"] < 40 * 2**20


def test_minimal_hf_config_and_round_trip(tmp_path):
    d = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 7,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    cfg = FlintConfig.from_dict(d)
    assert cfg.rope_theta == 500.0
    assert cfg.full_layers == (0, 1, 5, 6)
    path = tmp_path / "config.json"
    cfg.to_json(path)
    again = FlintConfig.from_json(path)
    assert again == cfg
    assert json.loads(path.read_text())["no_rope_layer_indices"] == [0, 1, 5, 6]


def test_vllm_field_names():
    d = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
         "rope_theta": 1234.0, "no_rope_layer_indices": [0, 1, 5],
         "router_score_function": "sigmoid", "use_sliding_window": True}
    cfg = FlintConfig.from_dict(d)
    assert cfg.rope_theta == 1234.0 and cfg.full_layers == (0, 1, 5)
    allfull = FlintConfig.from_dict({**d, "use_sliding_window": False,
                                     "no_rope_layer_indices": list(range(6))})
    assert allfull.sliding_layers == ()


@pytest.mark.parametrize("change, match", [
    ({"no_rope_layer_indices": [0, 1]}, "no_rope_layer_indices"),
    ({"router_score_function": "softmax"}, "router_score_function"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"layer_types": ["full_attention"] * 5}, "layer_types has 5 entries"),
    ({"layer_types": ["full_attention"] * 5 + ["chunked"]}, "layer_types may hold only"),
    ({"num_experts_per_tok": 300}, "exceeds num_experts"),
    ({"mlp_only_layers": [9]}, "outside 0..5"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
    ({"hidden_size": -4}, "hidden_size must be a positive integer"),
])
def test_bad_configs_are_refused(change, match):
    d = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
    d.update(change)
    with pytest.raises(ConfigError, match=match):
        FlintConfig.from_dict(d)


def test_missing_field_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="missing required field 'hidden_size'"):
        FlintConfig.from_dict({"vocab_size": 10, "num_hidden_layers": 2, "num_attention_heads": 2})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        FlintConfig.from_json(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        FlintConfig.from_json(tmp_path / "nowhere")


def test_presets():
    assert preset("flint") == FlintConfig()
    tiny = preset("tiny")
    assert tiny.hidden_size % 64 == 0
    with pytest.raises(ConfigError, match="unknown config preset"):
        preset("huge")
