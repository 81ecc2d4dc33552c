"""What `dstk train` refuses under tensor parallelism (tensor_parallel.autotp_size > 1) before any engine is
built: a model AutoTP has no plan for, a tp that does not divide the heads or the MLP, LoRA with tp, and a
resume that would move a run into or out of tp. (The tp runs themselves: tests/distributed/test_tensor_parallel.py.)"""

import json

import pytest

from toolkit.errors import ConfigError
from toolkit.train import hf


def _config(model: str):
    return hf.load_config(model, hf.byte_tokenizer(), "causal-lm")


def test_a_model_with_a_tp_plan_and_divisible_heads_is_accepted():
    hf.check_tensor_parallel(_config("tiny-llama"), 2)  # 4 heads, 2 kv heads, MLP 176


@pytest.mark.parametrize("model, tp, words", [
    ("tiny-gpt2", 2, "autotp_size 2: gpt2 .model_type .gpt2.. has no AutoTP plan: its HF config has no"),
    ("tiny-llama", 4, "autotp_size 4: tp 4 does not divide llama.s num_key_value_heads \\(2\\)"),
])
def test_what_autotp_cannot_shard_is_refused_naming_the_numbers(model, tp, words):
    with pytest.raises(ConfigError, match=words):
        hf.check_tensor_parallel(_config(model), tp)


def test_lora_with_tensor_parallelism_is_refused_before_the_process_group(tmp_path):
    from tests.unit.test_launch import _args
    from toolkit.train.runner import check

    args = _args(tmp_path, 1, lora=True)
    cfg = json.loads(open(args.config).read())
    cfg["tensor_parallel"] = {"autotp_size": 2}
    (tmp_path / "tp.json").write_text(json.dumps(cfg))
    args.config = str(tmp_path / "tp.json")
    with pytest.raises(ConfigError, match="--lora with tensor_parallel.autotp_size 2"):
        check(args, 2)


@pytest.mark.parametrize("saved_tp, now_tp", [(2, 1), (1, 2)])
def test_a_resume_that_moves_into_or_out_of_tensor_parallelism_is_refused(tmp_path, saved_tp, now_tp):
    from toolkit.checkpoint.manifest import check_resumable

    (tmp_path / "dstk").mkdir()
    saved = {"model": "m", "pp": 1, "dp": 2, "tp": saved_tp, "zero_stage": 1, "portable": True}
    (tmp_path / "dstk" / "manifest.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match="only `dstk export` merges"):
        check_resumable(tmp_path, {**saved, "tp": now_tp, "dp": 4 // now_tp})
