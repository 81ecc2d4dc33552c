"""The checks `dstk train` makes before training, and a pp = 1 run in a world of one (train -> checkpoint
-> export -> HF reload; refusing another model's checkpoint). launch.sh's command line:
tests/commands/test_launch_sh.py."""

import json
from pathlib import Path

import pytest

from tests.reference import eval_reference
from toolkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"


def test_config_from_another_topology_or_world_is_refused(tmp_path):
    from toolkit.train.runner import read_checked_config

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "pipeline": {"stages": 2}}))
    assert read_checked_config(str(cfg), world_size=4, pp=None)[1] == 2
    with pytest.raises(ConfigError, match="made for another topology"):
        read_checked_config(str(cfg), world_size=4, pp=4)
    with pytest.raises(ConfigError, match="world size 3 is not divisible by pp 2"):
        read_checked_config(str(cfg), world_size=3, pp=None)


def test_more_stages_than_pipeline_layers_is_refused():
    from models.weights import loading
    from toolkit.train import hf
    from toolkit.distributed.topology import Topology
    from toolkit.distributed.pipeline import pipeline_module

    tok = hf.byte_tokenizer()
    model = loading.build_model("tiny-gpt2", hf.load_config("tiny-gpt2", tok, "causal-lm"),
                                     "causal-lm", 0)
    with pytest.raises(ConfigError, match="pp 8 is more stages than the model's 7 pipeline layers"):
        pipeline_module(model, "causal-lm", Topology(8, 8), {})


def _args(tmp_path, zero, **kw):
    from toolkit.train.runner import TrainArgs

    cfg = tmp_path / f"ds{zero}.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "zero_optimization": {"stage": zero}, "gradient_clipping": 0.0,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}))
    return TrainArgs(**dict(dict(model="tiny-gpt2", data=str(CORPUS), config=str(cfg), out=str(tmp_path / "run"),
                                 seq_len=32, steps=4, save_every=2, progress=False), **kw))


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_pp1_run_checkpoints_and_its_export_reloads_with_the_engines_eval_loss(ds_world1, tmp_path, zero):
    from transformers import AutoModelForCausalLM

    from toolkit import data

    from toolkit.train import hf
    from toolkit.train.runner import run

    summary = run(_args(tmp_path, zero))
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step4" and summary["last_loss"] < summary["first_loss"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()
    held = data.prepare(data.DataOptions(str(CORPUS), 32), hf.byte_tokenizer()).eval
    assert abs(eval_reference(model, held) - summary["eval_loss"]) < 1e-5  # the whole eval split, token-weighted


def test_resuming_another_models_checkpoint_is_refused(ds_world1, tmp_path):
    from toolkit.train.runner import run

    run(_args(tmp_path, 0, steps=2, export=False))
    with pytest.raises(ConfigError, match=r"written by another run \(model: checkpoint 'tiny-gpt2', now 'tiny-llama'\)"):
        run(_args(tmp_path, 0, model="tiny-llama", resume=True, steps=4))


@pytest.mark.parametrize("section, fragment", [
    ({"zero_optimisation": {"stage": 2}}, 'unknown key "zero_optimisation": did you mean "zero_optimization"?'),
    ({"bf16": {"enable": True}}, 'unknown key "enable": did you mean "enabled"?'),
    ({"gradient_accumulation_steps": "auto"}, '"gradient_accumulation_steps" is "auto"'),
])
def test_train_refuses_what_validate_rejects_before_building_anything(tmp_path, section, fragment):
    """`python -m toolkit.train` (what every launcher starts) with a config `dstk validate --strict` rejects:
    the same problem lines, exit 1, no traceback. --model does not exist: the config is checked
    first, so nothing was loaded or built."""
    from tests.unit.test_train_refusals import train_entry
    from toolkit.cli.validate import check_file

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, **section}))
    result = train_entry(["--config", str(cfg), "--model", str(tmp_path / "no-model"), "--data", str(CORPUS),
                          "--out", str(tmp_path / "run")])
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and fragment in result.stderr
    expected = [f"{p['severity']}: {p['path']}: {p['message']}" for p in check_file(str(cfg), 1, strict=True)["problems"]
                if p["severity"] == "error"]
    assert expected and all(line in result.stderr for line in expected)
    assert "no-model" not in result.stderr and not (tmp_path / "run").exists()
