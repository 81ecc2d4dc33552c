"""Sequence parallelism refused in fresh `dstk train --check` processes (what launch.sh runs before any rank):
one message naming the numbers and the fix, a non-zero exit, no traceback, and nothing heavier than the
config and the model's config read (no torch, deepspeed or transformers). pp x sp that works passes."""

import pytest

from tests.configs import ds_config, write_config
from tests.conftest import run_cli_fresh
from tests.unit.test_train_refusals import CORPUS


def check(tmp_path, model: str, cfg: dict, world: int, *args):
    path = write_config(tmp_path / "ds.json", cfg)
    return run_cli_fresh(["train", "--check", "--world-size", str(world), "--model", model, "--data", str(CORPUS),
                          "--config", str(path), "--out", str(tmp_path / "run"), *args])


SP2 = {"sequence_parallel_size": 2}


@pytest.mark.parametrize("model, cfg, world, args, words", [
    ("tiny-llama", ds_config(1, 1, **SP2), 2, ["--seq-len", "32", "--attention", "eager"],
     ["--attention eager with sp 2", "use --attention sdpa"]),
    ("tiny-llama", ds_config(1, 1, sequence_parallel_size=3), 3, ["--seq-len", "33"],
     ["sp 3 does not divide num_attention_heads 4", "use sp one of 2, 4"]),
    ("tiny-llama", ds_config(1, 1, **SP2), 2, ["--seq-len", "33"],
     ["seq-len 33 is not divisible by sp 2", "--seq-len 32 or 34"]),
    ("tiny-gpt2", ds_config(1, 2, pp=2, **SP2), 4, ["--seq-len", "32"],
     ["model_type gpt2 adds learned positions in its pipeline embedding layer", "use pp 1 with sp 2, or sp 1"]),
    ("tiny-llama", ds_config(1, 1, tp=2, **SP2), 4, ["--seq-len", "32"],
     ['"sequence_parallel_size" 2 with "autotp_size" 2', '"autotp_size": 1']),
    ("tiny-llama", ds_config(1, 1, **SP2), 3, ["--seq-len", "32"],
     ["world size 3 is not divisible by pp(1) * sp(2) = 2"]),
])
def test_sp_mistakes_are_refused_before_any_rank(tmp_path, model, cfg, world, args, words):
    result, heavy = check(tmp_path, model, cfg, world, *args)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for word in words:
        assert word in result.stderr, result.stderr[-3000:]
    assert result.stderr.count(words[0]) == 1  # once
    assert not {"torch", "deepspeed", "transformers"} & set(heavy), heavy


def test_sp_inside_pipeline_stages_passes_the_check(tmp_path):
    result, heavy = check(tmp_path, "tiny-llama", ds_config(2, 2, pp=2, **SP2), 4, "--seq-len", "32")
    assert result.returncode == 0 and "fit to train" in result.stdout, result.stderr[-3000:]
    assert not {"torch", "deepspeed", "transformers"} & set(heavy), heavy


def test_an_moe_router_aux_loss_is_refused_under_sp(tmp_path):
    """A slice's router shares are not the sequence's: the aux loss would not be one process's."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from toolkit.train.hf import byte_tokenizer

    model = tmp_path / "moe"
    MixtralForCausalLM(MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=257, max_position_embeddings=256,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=True)).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    result, _ = check(tmp_path, str(model), ds_config(1, 1, **SP2), 2, "--seq-len", "32")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "output_router_logits is true" in result.stderr and "set output_router_logits false" in result.stderr
