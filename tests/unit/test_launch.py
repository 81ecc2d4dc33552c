"""launch.sh's command line, the checks `dstk train` makes before training, and a pp = 1 run in a
world of one (train -> checkpoint -> export -> HF reload; refusing another model's checkpoint)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference import eval_reference
from toolkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"


def dry_run(*args):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(REPO / "launch.sh"), *args], capture_output=True, text=True, env=env, cwd=REPO)


def test_dry_run_prints_the_deepspeed_command(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = dry_run("--num-gpus", "2", "--config", str(cfg), "--dry-run", "--", "--model", "tiny-gpt2", "--steps", "5")
    assert run.returncode == 0, run.stderr
    assert "-m deepspeed.launcher.runner --num_gpus 2 --master_port " in run.stdout  # a free port
    assert (f"--log_level error --module toolkit.train --config {cfg} "
            "--model tiny-gpt2 --steps 5") in run.stdout


def test_node_rank_without_ssh_writes_a_hostfile_and_passes_the_master(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = dry_run("--num-nodes", "2", "--num-gpus", "1", "--node-rank", "1", "--master-addr", "10.0.0.1",
                  "--master-port", "29555", "--config", str(cfg), "--dry-run", "--", "--model", "m")
    assert run.returncode == 0, run.stderr
    assert "--num_nodes 2 --num_gpus 1 --no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29555" in run.stdout
    hostfile = run.stdout.split("--hostfile ")[1].split()[0]
    assert Path(hostfile).read_text() == "node0 slots=1\nnode1 slots=1\n"


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "2", "--", "--model", "m"], "--config FILE is required"),
    (["--config", "/nonexistent.json"], "does not exist"),
    (["--config", "{cfg}", "--node-rank", "0"], "--node-rank needs --master-addr"),
    (["--config", "{cfg}", "--launcher", "ssh"], "--launcher must be"),
    (["--config", "{cfg}", "--model", "m"], "unknown option --model"),
])
def test_bad_launch_options_are_refused(tmp_path, args, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = dry_run(*[a.format(cfg=cfg) for a in args])
    assert run.returncode == 2 and message in run.stderr


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
    from toolkit.train import hf
    from toolkit.topology import Topology
    from toolkit.train.pipe import pipeline_module

    tok = hf.byte_tokenizer()
    model = hf.build_model("tiny-gpt2", hf.load_config("tiny-gpt2", tok, "causal-lm"),
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

    from toolkit.train import data, hf
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
    from tests.conftest import child_env
    from toolkit.cli.validate import check_file

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, **section}))
    result = subprocess.run([sys.executable, "-m", "toolkit.train", "--config", str(cfg), "--model",
                             str(tmp_path / "no-model"), "--data", str(CORPUS),
                             "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO,
                            env=child_env(), timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and fragment in result.stderr
    expected = [f"{p['severity']}: {p['path']}: {p['message']}" for p in check_file(str(cfg), 1, strict=True)["problems"]
                if p["severity"] == "error"]
    assert expected and all(line in result.stderr for line in expected)
    assert "no-model" not in result.stderr and not (tmp_path / "run").exists()
