"""Stages balanced by compute and memory together (issue 40, the planner): the least slowest stage among the
splits whose every stage fits (toolkit.plan.cost.partition.fitting_split) is exact against brute force; on a
DeepSeek-V3-shaped model, whose first three blocks are dense and light, the FLOPs split and the memory split
differ and the chosen one fits while staying near the FLOPs optimum; `dstk plan` uses it where the FLOPs
split does not fit a layout's GPU, and records it in the config it emits."""

import itertools
import json
import random

import pytest

from tests.invoke import invoke_dstk
from tests.unit.test_plan_moe_published import DEEPSEEK_V2_LITE
from toolkit.plan.arch import load_arch
from toolkit.plan.cost.layers import layer_costs
from toolkit.plan.cost.partition import fitting_split, partition_layers, stage_memory_cost, stage_sums
from toolkit.plan.layouts.planner import PlanRequest, estimate_layout, make_plan
from toolkit.plan.layouts.report import layout_config, render_text


def _brute(weights, pp, fits):
    """The least largest stage over every split whose stages all fit, or None."""
    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        parts = [0, *cuts, n]
        if all(fits(s, parts[s], parts[s + 1]) for s in range(pp)):
            value = max(stage_sums(weights, parts))
            best = value if best is None else min(best, value)
    return best


def test_fitting_split_is_exact_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        pp = rng.randint(1, min(4, n))
        weights = [rng.randint(0, 9) for _ in range(n)]
        bytes_ = [rng.randint(1, 9) for _ in range(n)]
        limit = rng.randint(1, 60)

        def fits(s, i, j):  # stage s keeps pp - s micro-batches in flight, as 1F1B
            return sum(bytes_[i:j]) * (pp - s) <= limit

        parts, best = fitting_split(weights, pp, fits), _brute(weights, pp, fits)
        if best is None:
            assert parts is None
            continue
        assert len(parts) == pp + 1 and all(a < b for a, b in zip(parts, parts[1:]))
        assert all(fits(s, parts[s], parts[s + 1]) for s in range(pp))
        assert max(stage_sums(weights, parts)) == best


@pytest.fixture(scope="module")
def deepseek():
    costs = layer_costs(load_arch("deepseek-v3"), 4096)
    memory = stage_memory_cost(costs, 8, 8)  # what `dstk partition` counts: states + pp - s micro-batches in flight

    def peak(parts):
        return max(memory(s, parts[s], parts[s + 1]) for s in range(8))

    def slowest(parts):
        return max(stage_sums([c.flops for c in costs], parts))

    return costs, peak, slowest


def test_deepseek_v3_split_fits_memory_near_the_flops_optimum(deepseek):
    costs, peak, slowest = deepseek
    flops, memory = partition_layers(costs, 8, "compute"), partition_layers(costs, 8, "memory")
    # the dense blocks 0-2 hold 0.6B parameters each, an MoE block 11.5B at the same FLOPs: the memory split
    # gives stage 0 (embedding + dense blocks) more blocks than the FLOPs split does
    assert flops != memory and memory[1] > flops[1]
    assert peak(memory) < peak(flops) and slowest(memory) > 1.2 * slowest(flops)
    limit = 0.99 * peak(flops)  # a GPU 1% short of the FLOPs split's heaviest stage
    chosen = partition_layers(costs, 8, "compute", memory_limit=limit)
    assert peak(chosen) <= limit < peak(flops)
    assert slowest(chosen) < 1.03 * slowest(flops)  # the memory split pays 25%; this one 3%
    # no split is both faster and within the limit: moving any one boundary by a layer either way
    for s, step in itertools.product(range(1, 8), (-1, 1)):
        moved = chosen[:s] + [chosen[s] + step] + chosen[s + 1:]
        if moved[s - 1] < moved[s] < moved[s + 1] and peak(moved) <= limit:
            assert slowest(moved) >= slowest(chosen)


def test_no_split_within_the_limit_falls_back_to_the_memory_split(deepseek):
    costs, peak, _ = deepseek
    memory = partition_layers(costs, 8, "memory")
    assert partition_layers(costs, 8, "compute", memory_limit=peak(memory) - 1) == memory


def test_partition_cli_gpu_mem(deepseek):
    _, peak, _ = deepseek
    flops_peak = peak(partition_layers(deepseek[0], 8, "compute"))
    limit = int(0.99 * flops_peak)
    result = invoke_dstk(["partition", "deepseek-v3", "--pp", "8", "--seq-len", "4096", "--gpu-mem",
                          f"{limit}B", "--json"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {s["method"]: s for s in report["splits"]}
    assert report["splits"][0]["peak_memory_bytes"] <= limit < rows["compute (FLOPs only)"]["peak_memory_bytes"]
    assert rows["memory"]["imbalance"] > report["splits"][0]["imbalance"] > rows["compute (FLOPs only)"]["imbalance"]
    assert sum(s["active_params"] for s in report["stages"]) == report["active_params"] < report["params"]
    text = invoke_dstk(["partition", "deepseek-v3", "--pp", "8", "--seq-len", "4096", "--gpu-mem", f"{limit}B"])
    assert "dstk compute within the limit" in text.stdout and "active" in text.stdout
    refused = invoke_dstk(["partition", "gpt2", "--pp", "2", "--method", "memory", "--gpu-mem", "8GiB"])
    assert refused.returncode == 1 and "--gpu-mem limits the stages of --method compute" in refused.stderr


def test_plan_takes_the_split_that_fits_and_emits_it(tmp_path):
    """DeepSeek-V2-Lite (15.7B, first block dense) on 8 A100-80GB without expert parallelism (with it pp 1 x dp 8 x
    ep 8 is faster): its fastest layout, pp 4 x dp 2, fits only with a split other than the FLOPs split."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    result = make_plan(PlanRequest(model=str(tmp_path), gpu="a100-80gb", gpus_per_node=8, gbs=64, seq_len=4096,
                                   expert_parallel=False))
    best = result.best[0]
    assert best.fits and best.flops_parts is not None and best.parts != best.flops_parts
    assert 1 < best.split_cost < 1.01
    assert best.flops_parts == partition_layers(layer_costs(load_arch(str(tmp_path)), 4096), best.layout.pp)
    # the same layout with the FLOPs split does not fit; estimate_layout finds the split that does
    assert not estimate_layout(result.request, best.layout, parts=best.flops_parts).fits
    assert estimate_layout(result.request, best.layout).parts == best.parts
    assert "not the FLOPs-balanced" in render_text(result)
    assert layout_config(result)["pipeline"]["parts"] == best.parts
    out = tmp_path / "ds.json"  # the config training reads: the recorded split, which validates for the model
    invoke_dstk(["plan", "--model", str(tmp_path), "--gpu", "a100-80gb", "--gbs", "64", "--seq-len", "4096",
                 "--no-ep", "--emit-config", str(out)])
    assert json.loads(out.read_text())["pipeline"]["parts"] == best.parts
    assert invoke_dstk(["validate", str(out), "--world-size", "8", "--model", str(tmp_path)]).returncode == 0


def test_train_splits_a_deepseek_pipeline_by_the_cost_model():
    """dstk train's split (choose_parts): the planner's costs now describe DeepSeek's layer list, so the compute
    split is used, not the parameter-count fallback the refused model type got."""
    import transformers

    import models
    from tests.unit.test_plan_moe import _config
    from toolkit.distributed.pipeline import choose_parts

    config = transformers.AutoConfig.for_model(**_config("deepseek_v3"))
    spec = models.pipeline_layers(transformers.AutoModelForCausalLM.from_config(config))
    parts, fallback = choose_parts(spec, 2, {"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2}},
                                   seq_len=32)
    assert fallback is None and parts == partition_layers(layer_costs(_arch_of(config), 32), 2)


def _arch_of(config):
    from toolkit.plan.arch import arch_from_config

    return arch_from_config(config.to_dict(), config.model_type)
