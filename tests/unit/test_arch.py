"""Built-in architectures have the published sizes: parameter counts equal the HF model's (built on
the meta device); local directories are read from config.json; bad names fail with a hint."""

import json

import pytest

from toolkit.plan.arch import BUILTINS, arch_from_config, build_hf_model, load_arch, to_hf_config
from toolkit.errors import ConfigError, UnusableInput

# Published totals (model cards / HF num_parameters) for a few, as an anchor independent of HF code.
PUBLISHED = {"gpt2": 124_439_808, "llama-3-8b": 8_030_261_248, "llama-2-7b": 6_738_415_616,
             "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768, "bert-base": 109_514_298,
             "mixtral-8x7b": 46_702_792_704}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_param_count_equals_hf_model_on_meta(name):
    arch = BUILTINS[name]
    model = build_hf_model(arch, device="meta")
    assert arch.num_params() == sum(p.numel() for p in model.parameters())
    if name in PUBLISHED:
        assert arch.num_params() == PUBLISHED[name]


def test_published_dimensions_spot_checks():
    llama = load_arch("llama-3.2-1b")
    assert (llama.hidden, llama.layers, llama.heads, llama.kv_heads, llama.vocab, llama.tied) == (2048, 16, 32, 8, 128256, True)
    assert load_arch("gpt2-xl").num_pipeline_layers == 48 + 3
    assert load_arch("bert-large").num_pipeline_layers == 24 + 2
    assert load_arch("GPT2-small") is BUILTINS["gpt2"]  # alias, case-insensitive


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert", "qwen2.5-0.5b"])
def test_directory_config_round_trip(tmp_path, name):
    arch = BUILTINS[name]
    to_hf_config(arch).save_pretrained(tmp_path)  # config.json only, as HF writes it (defaults dropped)
    loaded = load_arch(str(tmp_path))
    assert loaded.num_params() == arch.num_params()
    assert (loaded.hidden, loaded.layers, loaded.kv_heads, loaded.tied, loaded.gated_mlp) == \
        (arch.hidden, arch.layers, arch.kv_heads, arch.tied, arch.gated_mlp)
    assert load_arch(str(tmp_path / "config.json")).num_params() == arch.num_params()


def test_unknown_name_suggests_builtin():
    with pytest.raises(ConfigError, match="Did you mean 'llama-3.2-1b'") as info:
        load_arch("llama-3.2-1")
    assert not isinstance(info.value, UnusableInput)


def test_missing_path_and_bad_directories(tmp_path):
    with pytest.raises(UnusableInput, match="no such directory"):
        load_arch("./no/such/model")
    with pytest.raises(UnusableInput, match="config.json: no such file"):
        load_arch(str(tmp_path))  # a directory without config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnusableInput, match="not valid JSON"):
        load_arch(str(tmp_path))
    with pytest.raises(ConfigError, match="has no 'num_hidden_layers'"):
        arch_from_config({"model_type": "llama", "hidden_size": 64}, "x")
    with pytest.raises(ConfigError, match="heads.*kv_heads"):
        arch_from_config(json.loads(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                "num_attention_heads": 4, "num_key_value_heads": 3,
                                                "intermediate_size": 8, "vocab_size": 10,
                                                "max_position_embeddings": 16})), "x")
