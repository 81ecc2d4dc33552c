"""A model name means the same model in every command: one registry (toolkit.plan.arch.BUILTINS)."""

from dataclasses import replace

import pytest

from toolkit.errors import ConfigError
from toolkit.plan.arch import BUILTINS, arch_from_config, load_arch
from toolkit.train import hf

SHAPE = ("model_type", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "max_positions", "tied")


@pytest.mark.parametrize("name", ["tiny-gpt2", "small-gpt2", "tiny-llama", "tiny-bert", "gpt2", "qwen2.5-0.5b"])
def test_train_builds_the_architecture_partition_and_plan_estimate(name):
    tok = hf.byte_tokenizer()
    trained = arch_from_config(hf.builtin_config(name, tok).to_dict(), name=name)
    planned = replace(load_arch(name), vocab=len(tok))
    assert {k: getattr(trained, k) for k in SHAPE} == {k: getattr(planned, k) for k in SHAPE}
    assert trained.vocab == len(tok)


def test_parity_means_the_registry_model_by_a_registry_name():
    from toolkit.train.parity import small_model

    model = small_model("tiny-llama", registry=True)
    arch = BUILTINS["tiny-llama"]
    assert (model.config.hidden_size, model.config.intermediate_size, model.config.num_hidden_layers) == \
        (arch.hidden, arch.intermediate, arch.layers)


def test_an_unknown_name_lists_the_registry():
    with pytest.raises(ConfigError, match=r"--model 'gpt3' is neither a local HF directory nor a built-in "
                                          r"architecture \(gpt2, gpt2-medium"):
        hf.check_model_name("gpt3")


def test_a_folder_without_config_json_is_refused_in_one_message_everywhere(tmp_path):
    """`dstk train --model`, `dstk parity MODEL` and models.pipeline_layers ask one function
    (models.weights.source.check_model_folder), so a folder that is no HF model reads the same in each."""
    import models
    from toolkit.errors import UnusableInput
    from toolkit.train.parity import load_model

    said = []
    for flag, call in (("--model", hf.check_model_name), ("MODEL", load_model), ("model", models.pipeline_layers)):
        with pytest.raises(UnusableInput) as refused:
            call(str(tmp_path))
        said.append(str(refused.value).removeprefix(f"{flag} "))
    assert said == [f"{tmp_path}: no config.json in this directory, so it is not a HF model directory (one written "
                    "by save_pretrained)"] * 3
