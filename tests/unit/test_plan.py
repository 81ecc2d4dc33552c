"""toolkit.plan.layouts.planner and `dstk plan`: every layout is legal, the ranking is sane, bad input is refused."""

import json

import pytest

from toolkit.cli import main
from toolkit.errors import ConfigError
from toolkit.plan.gpus import GiB, get_gpu, parse_size
from toolkit.plan.memory.rank import model_state_bytes
from toolkit.plan.layouts.planner import PlanRequest, make_plan

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def one_b():
    return make_plan(PlanRequest(model="llama-3.2-1b", gpus_per_node=8, gpu="a100-80gb", gbs=256, seq_len=2048))


def test_1b_on_8x80gb_recommends_a_layout_that_fits(one_b):
    best = one_b.best[0]
    assert best.fits and best.memory <= 0.9 * 80 * GiB and best.layout.pp * best.layout.dp == 8
    assert one_b.reasons[0].startswith("fastest")
    # a 1.2B model needs no pipeline and no offload on 80 GB cards
    assert best.layout.pp == 1 and best.layout.offload == "none"


def test_ranking_is_by_step_time_and_every_layout_is_legal(one_b):
    times = [e.step_time for e in one_b.fitting]
    assert times == sorted(times)
    for e in one_b.fitting:
        lay = e.layout
        assert lay.mbs * lay.gas * lay.dp == 256 and 16 % lay.pp == 0  # pp divides the 16 blocks
        assert lay.pp == 1 or lay.zero <= 1  # the PipelineEngine refuses ZeRO-2/3
        if lay.schedule == "dualpipev":  # tests/unit/test_plan_dualpipev.py
            assert lay.gas >= 2 * lay.pp and len(e.parts) == 2 * lay.pp + 1
            continue
        assert e.bubble == pytest.approx((lay.pp - 1) / (lay.gas + lay.pp - 1))


def test_pipeline_reports_its_heaviest_stage(one_b):
    from toolkit.plan.arch import load_arch
    from toolkit.plan.cost.layers import layer_costs
    from toolkit.plan.cost.partition import stage_sums

    e = next(e for e in one_b.fitting if e.layout.pp == 4 and e.layout.zero == 0 and not e.layout.checkpointing)
    # embedding on stage 0, the tied head on stage 3: each stage holds its own copy
    params = stage_sums([c.params for c in layer_costs(load_arch("llama-3.2-1b"), 2048)], e.parts)
    states = [model_state_bytes(p, e.layout.dp, 0, "bf16", pipeline=True).peak for p in params]
    assert e.states.peak == states[e.stage] and len(e.parts) == 5
    assert sum(params) > 1_235_814_400  # the untied copy of the 262M-parameter embedding counts twice


def test_70b_on_one_24gb_gpu_fits_nowhere_and_names_the_closest(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    result = make_plan(PlanRequest(model=str(tmp_path), gpus_per_node=1, gpu="rtx-4090", gbs=8, seq_len=4096))
    assert result.fitting == [] and result.closest is not None and result.closest.excess > 0
    code, out, _ = run(capsys, "--model", str(tmp_path), "--gpus-per-node", "1", "--gpu-mem", "24GiB", "--gbs", "8")
    assert code == 1 and "Nothing fits. Closest:" in out and "exceeds" in out


def test_more_memory_per_gpu_never_fits_fewer_layouts():
    fits = [len(make_plan(PlanRequest(model="gpt2", gpus_per_node=2, gpu_mem=mem * GiB, gbs=16)).fitting)
            for mem in (4, 16, 64)]
    assert fits == sorted(fits) and fits[0] < fits[-1]


def test_json_and_emit_config(tmp_path, capsys):
    out_file = tmp_path / "ds.json"
    code, out, err = run(capsys, "--model", "gpt2", "--gpu", "h100", "--gpus-per-node", "4", "--gbs", "32",
                         "--json", "--emit-config", str(out_file))
    assert code == 0, err
    best = json.loads(out)["best"][0]
    cfg = json.loads(out_file.read_text())
    assert cfg["train_batch_size"] == 32 and cfg["pipeline"]["stages"] == best["layout"]["pp"]
    assert cfg["zero_optimization"]["stage"] == best["layout"]["zero"]
    assert cfg["train_micro_batch_size_per_gpu"] == best["layout"]["mbs"] and cfg["bf16"]["enabled"] is True


@pytest.mark.parametrize("args,needle", [
    (["--gbs", "0", "--gpu", "a100"], "--gbs must be a positive integer"),
    (["--gbs", "8", "--gpu", "a100", "--gpus-per-node", "-2"], "--gpus-per-node must be a positive integer"),
    (["--gbs", "8", "--gpu-mem", "0GiB"], "--gpu-mem '0GiB' must be a positive size"),
    (["--gbs", "8", "--gpu-mem", "lots"], "expected a size"),
    (["--gbs", "8", "--gpu", "a100-80"], "Did you mean 'a100-80gb'"),
    # 16 GPUs: pp divides them and gpt2's 12 blocks bound it (1, 2, 4, 8), so dp is 16, 8, 4 or 2: 7 is none's multiple
    (["--gbs", "7", "--gpu", "a100-80gb", "--gpus-per-node", "16"], "--gbs 7: no layout can form it"),
    (["--gbs", "8", "--gpu", "a100-80gb", "--seq-len", "4096"], "exceeds gpt2's max_positions"),
])
def test_bad_input_exits_nonzero_with_a_clear_message(capsys, args, needle):
    code, _, err = run(capsys, "--model", "gpt2", *args)
    assert code != 0 and needle in err and "Traceback" not in err


def test_without_gpu_and_gbs_it_plans_an_h100_and_one_sequence_per_gpu_and_says_so(capsys):
    code, out, err = run(capsys, "--model", "gpt2", "--gpus", "2")
    assert code == 0 and "assumed: --gpu h100-sxm, --gbs 2 (one sequence per GPU)" in err
    assert "on 1 x 2 h100-sxm" in out and "gbs 2," in out


def test_a_rotary_model_plans_past_its_positions_and_says_what_that_takes(capsys):
    code, out, _ = run(capsys, "--model", "llama-3-8b", "--gpus", "1", "--seq-len", "524288", "--rows", "full")
    assert "--seq-len 524288 is past llama-3-8b's 8192 positions: planned as a long-context variant" in out
    assert code == 0 and "long sequences: tiled loss, tiled MLP, checkpoints in host memory" in out, out


def test_where_the_mask_of_padded_rows_is_what_does_not_fit_it_says_so_and_plans_whole_documents(capsys):
    """The issue's own command: at 524288 tokens sdpa's (seq x seq) mask of padded or packed rows (512 GiB in bf16)
    fits no H100; the plan names it and shows what fits with rows of one whole document, exiting 1 (as asked,
    nothing fits)."""
    code, out, _ = run(capsys, "--model", "llama-3-8b", "--gpus", "1", "--seq-len", "524288")
    closest, whole = out.split("Nothing fits. Closest:")[1].split("With rows that are each one whole document")
    assert code == 1 and "attention mask 512 GiB" in closest and "--rows full, --attention flash_attention_2" in closest
    assert "layouts that fit: 1. Fastest:" in whole and "mask" not in whole.split("Fastest:")[1]
    assert "long sequences: tiled loss, tiled MLP, checkpoints in host memory" in whole
    code, out, _ = run(capsys, "--model", "llama-3-8b", "--gpus", "1", "--seq-len", "524288", "--attention",
                       "flash_attention_2")
    assert code == 0 and "whole document" not in out and "attention mask" not in out


def test_v100_has_no_bf16():
    with pytest.raises(ConfigError, match="no bf16"):
        make_plan(PlanRequest(model="gpt2", gpus_per_node=2, gpu="v100-32gb", gbs=8))


def test_sizes_and_presets():
    assert parse_size("80GiB") == 80 * GiB and parse_size("24GB") == 24 * 10**9 and parse_size("16") == 16 * GiB
    assert get_gpu("H100").name == "h100-sxm" and get_gpu("h200").memory > 139 * GiB


def run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err
