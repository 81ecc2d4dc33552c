"""Config generation: the numbers, the refusals (each naming the flag, the arithmetic and the fix)."""

import json

import pytest

from toolkit.config.generate import build_config, write_config
from toolkit.config.options import GenerateOptions
from toolkit.errors import ConfigError


def test_hybrid_layout_from_the_design_doc():
    cfg = build_config(GenerateOptions(strategy="hybrid", world_size=8, pp=4, mbs=2, gbs=64, zero=1, precision="bf16"))
    assert cfg["train_batch_size"] == 64
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 16  # 64 / (2 * dp 2)
    assert cfg["pipeline"] == {"stages": 4, "partition_method": "compute"}
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["stage"] == 1


def test_nodes_times_gpus_gives_world():
    cfg = build_config(GenerateOptions(nodes=2, gpus_per_node=4, mbs=1, gas=2))
    assert cfg["train_batch_size"] == 16


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=6, pp=4), r"world size 6 is not divisible by pp\(4\)"),
    (dict(world_size=8, pp=2, mbs=2, gbs=30), r"global batch 30 is not divisible by mbs\(2\) \* dp\(4\) = 8"),
    (dict(world_size=8, pp=2, zero=2), r"--zero 2 with pp=2: DeepSpeed's PipelineEngine refuses"),
    (dict(world_size=2, zero=2, offload_param="cpu"), r"--offload-param cpu needs --zero 3"),
    (dict(world_size=2, zero=0, offload_optimizer="cpu"), r"--offload-optimizer cpu needs --zero >= 1"),
    (dict(world_size=2, zero=3, offload_param="nvme"), r"nvme needs --nvme-path"),
    (dict(world_size=2, precision="fp16", cpu=True), r"--cpu with fp16"),
    (dict(world_size=2, loss_scale=128.0), r"--loss-scale only apply to fp16"),
    (dict(strategy="dp", world_size=4, pp=2), r"--strategy dp means pp = 1"),
    (dict(strategy="pp", world_size=4, pp=2), r"--strategy pp means dp = 1"),
    (dict(strategy="hybrid", world_size=2, pp=2), r"--strategy hybrid needs pp > 1 and dp > 1"),
    (dict(world_size=4, pp=2, hf=True), r"--hf .* cannot drive a pipeline"),
    (dict(world_size=2, scheduler="WarmupDecayLR"), r"needs --total-steps"),
    (dict(world_size=2, optimizer="Lamb", cpu=True), r"Lamb .* not implemented on DeepSpeed's CPU backend"),
    (dict(world_size=0), r"--world-size must be an integer >= 1, got 0"),
    (dict(world_size=2, mbs=-1), r"--mbs must be an integer >= 1, got -1"),
])
def test_refusals_name_the_flag_and_the_numbers(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_config(GenerateOptions(**kwargs))


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as exc:
        build_config(GenerateOptions(world_size=4, pp=2, zero=3, precision="fp16", cpu=True, optimizer="Lamb"))
    text = str(exc.value)
    assert text.startswith("3 problem(s)")
    assert "--zero 3" in text and "--cpu with fp16" in text and "Lamb" in text


def test_cpu_mode_uses_torch_adam():
    cfg = build_config(GenerateOptions(world_size=2, cpu=True))
    assert cfg["optimizer"]["params"]["torch_adam"] is True


def test_hf_mode_writes_auto_where_the_trainer_fills():
    cfg = build_config(GenerateOptions(world_size=8, zero=3, hf=True, precision="bf16", scheduler="WarmupDecayLR"))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert cfg[key] == "auto"
    assert cfg["optimizer"]["params"]["lr"] == "auto"
    assert cfg["scheduler"]["params"]["total_num_steps"] == "auto"
    assert cfg["bf16"]["enabled"] == "auto"
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "ds.json"
    write_config({"a": 1}, str(path))
    with pytest.raises(ConfigError, match="exists; pass --force"):
        write_config({"a": 2}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}
    write_config({"a": 2}, str(path), force=True)
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]  # no temp files left behind


def test_write_refuses_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        write_config({}, str(tmp_path / "nope" / "ds.json"))


def test_partition_is_recorded_in_the_pipeline_section(tmp_path):
    from toolkit.config.generate import record_partition
    from toolkit.config.rules import check_rules

    path = tmp_path / "ds.json"
    write_config(build_config(GenerateOptions(world_size=4, pp=4, mbs=1, gas=8)), str(path))
    record_partition(str(path), 4, "compute", [0, 5, 9, 14, 15])
    cfg = json.loads(path.read_text())
    assert cfg["pipeline"] == {"stages": 4, "partition_method": "compute", "parts": [0, 5, 9, 14, 15]}
    assert check_rules(cfg, world_size=4) == []
    with pytest.raises(ConfigError, match=r'"pipeline.stages" 4 but --pp is 2'):
        record_partition(str(path), 2, "compute", [0, 9, 15])
    assert json.loads(path.read_text()) == cfg  # nothing half-written


def test_clipping_off_is_written_explicitly():
    # DeepSpeed clips at norm 1.0 when "gradient_clipping" is absent (runtime/constants.py)
    assert build_config(GenerateOptions(world_size=1, gradient_clipping=0.0))["gradient_clipping"] == 0.0


def test_gpu_default_is_torchs_fused_adamw_and_deepspeeds_jit_built_optimizers_are_opt_ins():
    params = build_config(GenerateOptions(world_size=2))["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    assert "torch_adam" not in build_config(GenerateOptions(world_size=2, fused_adam=True))["optimizer"]["params"]
    offload = build_config(GenerateOptions(world_size=2, zero=2, offload_optimizer="cpu"))  # DeepSpeedCPUAdam
    assert "torch_adam" not in offload["optimizer"]["params"]


@pytest.mark.parametrize("kwargs, why", [(dict(cpu=True), "--cpu: FusedAdam is a CUDA op"),
                                         (dict(optimizer="SGD"), "--optimizer SGD is not Adam/AdamW"),
                                         (dict(zero=1, offload_optimizer="cpu"), "uses DeepSpeedCPUAdam")])
def test_fused_adam_where_it_cannot_apply_is_refused(kwargs, why):
    with pytest.raises(ConfigError, match=f"--fused-adam .*{why}.*; drop --fused-adam"):
        build_config(GenerateOptions(world_size=2, fused_adam=True, **kwargs))
