"""What `dstk` does in a fresh interpreter: the fast commands import no heavy package (torch, deepspeed,
transformers: tests.conftest.run_cli_fresh), and a refusal or a huge input started from scratch is one
clean line, quickly. This pytest process has those packages imported already, so these need a child.
Each command's output and refusals are checked in-process in the tests/unit file named in each section."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli_fresh
from tests.unit.test_partition_cli import dstk as partition
from tests.unit.test_plan_moe import MIXTRAL_8X7B, MIXTRAL_8X7B_CONFIG, _config, _hf_model
from tests.unit.test_tp_config import tp_config
from toolkit.plan.arch import arch_from_config
from toolkit.plan.cost.layers import layer_costs

# tests/unit/test_cli.py


@pytest.mark.parametrize("args", [["--help"], ["generate-config", "--world-size", "2"], ["validate", "--help"],
                                  ["generate-config", "--help"], ["schema"]])
def test_fast_commands_import_no_heavy_package(args):
    result, heavy = run_cli_fresh(args)
    assert heavy == [], result.stderr[-2000:]


def test_validate_imports_no_heavy_package(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    result, heavy = run_cli_fresh(["validate", str(path)])
    assert heavy == [] and "valid" in result.stdout, result.stderr[-2000:]


def test_train_check_of_a_model_directory_imports_no_heavy_package(tmp_path, saved_models):
    """launch.sh runs `dstk train --check` in a fresh interpreter before any rank: the model folder's config.json
    and safetensors headers are read without torch (it cost every launch from a directory ~2 s)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}))
    corpus = Path(__file__).resolve().parents[2] / "toolkit" / "corpus" / "corpus.txt"
    result, heavy = run_cli_fresh(["train", "--check", "--world-size", "1", "--config", str(cfg), "--model",
                                   str(saved_models.get("tiny-llama")), "--data", str(corpus), "--out", str(tmp_path / "run")])
    assert result.returncode == 0 and "are fit to train on 1 process(es)" in result.stdout, result.stderr[-2000:]
    assert heavy == []
    result, heavy = run_cli_fresh(["train", "--check", "--world-size", "1", "--config", str(cfg), "--model",
                                   str(saved_models.get("tiny-llama")), "--data", str(corpus), "--out", str(tmp_path / "run"),
                                   "--streaming", "--steps", "4", "--eval-fraction", "0"])
    assert result.returncode == 0 and "are fit to train on 1 process(es)" in result.stdout, result.stderr[-2000:]
    assert heavy == []  # --streaming's checks (toolkit.data.stream.check_streamable) too


# tests/unit/test_schema.py


def test_loading_imports_no_torch_and_is_fast():
    code = ("import sys, time; t = time.perf_counter()\n"
            "from toolkit.config.schema import load_schema; from toolkit.config.validate import check_schema\n"
            "check_schema({'train_batch_size': 8, 'zero_optimization': {'stag': 1}})\n"
            "print(time.perf_counter() - t, [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert out[1].strip() == "[]"
    assert float(out[0]) < 2.0  # about 0.3 s on a busy 2-core machine, most of it importing jsonschema


# tests/unit/test_tp_config.py


def test_validate_refusals_in_a_fresh_process_import_nothing_heavy(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(tp_config(train_batch_size=32)))
    result, heavy = run_cli_fresh(["validate", str(path), "--world-size", "8", "--model", "llama-2-7b"])
    assert "Traceback" not in result.stderr and "runtime/config.py:471" in result.stderr
    assert heavy == []


# tests/unit/test_partition_cli.py


def test_json_report_and_no_heavy_imports():
    result, heavy = run_cli_fresh(['partition', 'llama-3.2-1b', '--pp', '4', '--seq-len', '2048', '--json'])
    assert heavy == [], result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["num_layers"] == 16 + 3 and report["params"] == 1_235_814_400
    assert [s["method"] for s in report["splits"]] == ["compute", "parameters", "uniform"]
    assert sum(s["layers"] for s in report["stages"]) == 19
    dstk_split, ds_params = report["splits"][0], report["splits"][1]
    assert dstk_split["imbalance"] <= ds_params["imbalance"]
    assert sum(s["params"] for s in report["stages"]) >= report["params"]  # + the tied head's copy


def test_lora_report_says_rank_and_trainable_count_and_imports_no_heavy_package():
    result, heavy = run_cli_fresh(['partition', 'llama-2-7b', '--pp', '4', '--seq-len', '1024', '--lora', '16',
                                   '--json'])
    assert heavy == [], result.stderr[-2000:]
    report = json.loads(result.stdout)
    adapters = 39_976_960  # Llama-2-7b, r=16 on all 7 projections (peft's count)
    assert report["lora_r"] == 16 and report["trainable_params"] == adapters
    assert report["params"] == 6_738_415_616 + adapters
    assert sum(s["trainable"] for s in report["stages"]) == adapters
    full = json.loads(partition("llama-2-7b", "--pp", "4", "--seq-len", "1024", "--json").stdout)
    assert full["lora_r"] is None and full["trainable_params"] == full["params"] == 6_738_415_616
    for lora_stage, full_stage in zip(report["stages"], full["stages"]):  # a frozen base: weights only
        assert lora_stage["memory_bytes"] < 0.6 * full_stage["memory_bytes"]
        assert lora_stage["flops"] < 0.75 * full_stage["flops"]  # no weight gradients for the base
    text = partition("llama-2-7b", "--pp", "4", "--lora", "16")
    assert text.returncode == 0 and "LoRA r=16 on every block linear: 40.0M trainable parameters" in text.stdout


# tests/unit/test_plan.py


def test_plan_for_a_builtin_imports_no_heavy_package():
    result, heavy = run_cli_fresh(['plan', '--model', 'gpt2', '--gpu', 'l4', '--gbs', '8', '--gpus-per-node', '2'])
    assert heavy == [] and "#1 pp=" in result.stdout, result.stderr[-2000:]


# tests/unit/test_plan_lora.py


def test_plan_with_lora_imports_no_heavy_package():
    result, heavy = run_cli_fresh(["plan", "--model", "gpt2", "--gpu", "l4", "--gbs", "8", "--gpus-per-node", "2",
                                   "--lora", "8"])
    assert heavy == [] and "LoRA r=8" in result.stdout, result.stderr[-2000:]


# tests/unit/test_plan_moe.py


def test_plan_cli_reads_a_mixtral_directory_without_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    result, heavy = run_cli_fresh(["plan", "--model", str(tmp_path), "--gpu", "h100-sxm", "--gpus-per-node", "8",
                                   "--nodes", "2", "--gbs", "64", "--seq-len", "4096"])
    assert heavy == [] and result.returncode == 0, result.stderr[-2000:]
    assert "46,702,792,704 parameters, 12,879,925,248 active per token" in result.stdout
    result, _ = run_cli_fresh(["plan", "--model", str(tmp_path), "--gpu", "h100-sxm", "--gbs", "64", "--json"])
    report = json.loads(result.stdout)
    assert (report["params"], report["active_params"]) == (MIXTRAL_8X7B, 12_879_925_248)


def test_partition_cli_balances_dense_and_moe_blocks(tmp_path):
    cfg = _config("qwen2_moe", num_hidden_layers=8, mlp_only_layers=[])  # blocks 1, 3, 5, 7 sparse
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result, heavy = run_cli_fresh(["partition", str(tmp_path), "--pp", "2", "--seq-len", "128", "--json"])
    assert heavy == [] and result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    arch = arch_from_config(cfg, "q")
    assert report["params"] == arch.num_params() == sum(p.numel() for p in _hf_model(cfg).parameters())
    costs = layer_costs(arch, 128)
    assert costs[2].flops != costs[1].flops  # block.1 (MoE) and block.0 (dense) cost differently
    assert sum(s["flops"] for s in report["stages"]) == pytest.approx(sum(c.flops for c in costs))
    assert report["splits"][0]["imbalance"] <= report["splits"][1]["imbalance"]


# tests/unit/test_refusals_parity.py


def test_no_traceback_in_a_fresh_interpreter(tmp_path):
    for args in ([str(tmp_path)], ["gpt2", "--seq-len", "100000"]):
        result = subprocess.run([sys.executable, "-m", "toolkit.cli", "parity", *args], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "error: " in result.stderr and result.stdout == ""


# tests/unit/test_refusals_plan.py


def test_a_huge_global_batch_in_a_fresh_interpreter_is_quick():
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "plan", "--model", "gpt2", "--gpu", "a100-80gb",
                             "--gbs", "100000000000000"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr and "#1 pp=" in result.stdout
    assert time.perf_counter() - start < 10  # was unbounded: divisors(gbs) counted to 10**14


# --json: the JSON alone on stdout, in a fresh process (where `import deepspeed` prints its accelerator line)


@pytest.mark.parametrize("args", [
    ["partition", "tiny-gpt2", "--pp", "2", "--method", "profile", "--reps", "1", "--json"],  # imports deepspeed
    ["schedule", "--pp", "2", "--gas", "4", "--json"],
    ["plan", "--model", "gpt2", "--gpu-mem", "24GiB", "--gpus-per-node", "2", "--gbs", "32", "--seq-len", "512",
     "--json"],
])
def test_json_output_is_the_json_alone(args):
    import os

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed then says what it chose
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", *args], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    json.loads(result.stdout)  # nothing else on stdout
    if args[0] == "partition":
        assert "Setting accelerator to CPU" in result.stderr  # it still shows, where logs go


def test_json_stdout_keeps_out_what_the_work_prints_at_any_level():
    """Python prints and writes to file descriptor 1 (a C library's printf) during a --json command
    land on stderr; only echo_json reaches stdout."""
    code = ("import os, click; from toolkit import cli\n"
            "@click.command('noisy')\n@click.option('--json', 'as_json', is_flag=True)\n"
            "def noisy(as_json):\n    print('python noise'); os.write(1, b'fd noise\\n'); cli.echo_json({'ok': 1})\n"
            "cli.COMMANDS['noisy'] = ('__main__:noisy', 'a command that prints')\n"
            "cli.main(['noisy', '--json'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"ok": 1}
    assert "python noise" in result.stderr and "fd noise" in result.stderr
