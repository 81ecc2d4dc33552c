"""A checkpoint directory really incomplete is refused, naming its missing tensors as its files name them
(issue 40), and one that is complete under any spelling transformers reads is not: from the names alone at
`train --check` (models.weights.source.expert_holes: a hole in a layer's numbered experts), against the model on
the ranks (check_complete: every tensor of the model's body has its sources, through transformers' conversion
mapping). And a model class without the asked-for attention kernel is refused with the flag that runs it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from models.weights.source import check_complete, check_directory, expert_holes
from tests.moe_models import MOE_TYPES
from toolkit.errors import ConfigError, UnusableInput


def skeleton_of(folder: Path, task: str = "causal-lm"):
    from transformers import AutoConfig

    import models

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return models.auto_class(task, config)._from_config(config, dtype=torch.float32)


def rewritten(source: Path, folder: Path, edit) -> Path:
    """A copy of `source` whose model.safetensors holds edit({name: tensor})."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    save_file(edit(load_file(source / "model.safetensors")), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_expert_holes_are_found_from_the_names_alone():
    names = [f"model.layers.{i}.mlp.experts.{e}.{w}.weight" for i in range(2) for e in range(4) for w in ("w1", "w2")]
    assert expert_holes(names) == []
    hole = "model.layers.1.mlp.experts.2.w1.weight"
    assert expert_holes(set(names) - {hole}) == [hole]
    skipped = [n for n in names if ".experts.1." not in n or ".layers.0." not in n]  # expert 1 of layer 0, whole
    assert expert_holes(skipped) == ["model.layers.0.mlp.experts.1.w1.weight", "model.layers.0.mlp.experts.1.w2.weight"]
    assert expert_holes(["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]) == []


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_a_saved_moe_checkpoint_is_complete(moe_dirs, model_type):
    check_directory(moe_dirs.get(model_type))
    check_complete(moe_dirs.get(model_type), skeleton_of(moe_dirs.get(model_type)))


@pytest.mark.parametrize("drop, check_sees_it", [
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight", True),  # one expert's tensor: a hole in the names
    (".1.block_sparse_moe.experts.3.", False),  # the last expert whole: only the model knows there were 4
    ("model.layers.0.self_attn.q_proj.weight", False),  # a plain tensor
])
def test_a_checkpoint_lacking_a_tensor_is_refused_naming_it(moe_dirs, tmp_path, drop, check_sees_it):
    model = rewritten(moe_dirs.get("mixtral"), tmp_path / "model",
                      lambda t: {k: v for k, v in t.items() if drop not in k})
    named = [k for k in _names(moe_dirs.get("mixtral")) if drop in k]
    with pytest.raises(UnusableInput) as refused:
        check_complete(model, skeleton_of(model))
    assert f"model.safetensors lacks {len(named)} tensor(s) that its config.json's model needs" in str(refused.value)
    assert all(n in str(refused.value) for n in named), (named, str(refused.value))
    if check_sees_it:
        with pytest.raises(UnusableInput, match=f"lacks 1 tensor.* their layer have: {named[0]}; the checkpoint is"):
            check_directory(model)
    else:
        check_directory(model)


def _names(folder: Path) -> list:
    from tests.moe_models import disk_keys

    return sorted(disk_keys(folder))


def test_a_tensor_left_out_of_the_index_is_refused(moe_dirs, tmp_path):
    """The shard still holds it, but the index is what a loader looks names up in."""
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    AutoModelForCausalLM.from_pretrained(moe_dirs.get("mixtral")).save_pretrained(model, max_shard_size="200KB")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    drop = "model.layers.0.block_sparse_moe.experts.2.w2.weight"
    del index["weight_map"][drop]
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    for check in (check_directory, lambda m: check_complete(m, skeleton_of(m))):
        with pytest.raises(UnusableInput, match=f"model.safetensors.index.json lacks 1 tensor.*: {drop}; "):
            check(model)


def test_other_spellings_and_heads_are_not_refused(moe_dirs, saved_models, tmp_path):
    """Not refused: the model's own (fused) names, BERT's legacy LayerNorm gamma/beta, a tied embedding stored under
    the head's name alone, an untied head missing (a head may be absent: initialised as from_pretrained does)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from toolkit.train import hf

    mixtral = moe_dirs.get("mixtral")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(mixtral / "config.json", fused)
    save_file({k: v.contiguous() for k, v in AutoModelForCausalLM.from_pretrained(mixtral).state_dict().items()},
              fused / "model.safetensors", metadata={"format": "pt"})
    bert = tmp_path / "bert"
    hf.builtin_model("tiny-bert", task="masked-lm").save_pretrained(bert)
    legacy = rewritten(bert, tmp_path / "legacy", lambda t: {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in t.items()})
    assert any(k.endswith("LayerNorm.gamma") for k in _names(legacy))
    gpt2 = saved_models.get("tiny-gpt2")  # tied: save_pretrained keeps transformer.wte.weight
    tied = rewritten(gpt2, tmp_path / "tied", lambda t: {("lm_head.weight" if k == "transformer.wte.weight" else k): v
                                                         for k, v in t.items()})
    headless = rewritten(mixtral, tmp_path / "headless",
                         lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    for folder, task in ((fused, "causal-lm"), (legacy, "masked-lm"), (tied, "causal-lm"), (headless, "causal-lm")):
        check_directory(folder)
        check_complete(folder, skeleton_of(folder, task))


def test_a_class_without_the_attention_kernel_is_refused_with_the_flag_that_runs_it(moe_dirs):
    from transformers import AutoConfig

    from toolkit.train import hf

    config = AutoConfig.from_pretrained(moe_dirs.get("gpt_oss"))
    config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match=r"^--attention sdpa: transformers' GptOssForCausalLM has no sdpa attention "
                                          r"\(_supports_sdpa is False\); pass --attention eager$"):
        hf.check_model_class(str(moe_dirs.get("gpt_oss")), config, "causal-lm")
    config._attn_implementation = "eager"
    hf.check_model_class(str(moe_dirs.get("gpt_oss")), config, "causal-lm")


def test_experts_that_lack_a_leaf_in_every_layer_are_no_hole():
    """longcat_flash's zero-computation experts (the last ones) have gate/up but no down_proj, in every layer, as
    save_pretrained writes them: not a hole (the sweep once called its own saved checkpoint incomplete); the same
    expert lacking it in one layer only is."""
    from models.weights.source import expert_holes

    names = [f"model.layers.{layer}.mlp.experts.{e}.{leaf}.weight" for layer in (0, 1) for e in range(6)
             for leaf in ("gate_proj", "up_proj", "down_proj") if e < 4 or leaf != "down_proj"]
    assert expert_holes(names) == []
    assert expert_holes([n for n in names if n != "model.layers.1.mlp.experts.2.up_proj.weight"]) == [
        "model.layers.1.mlp.experts.2.up_proj.weight"]
