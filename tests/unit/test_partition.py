"""The partitioner: exact against brute force, DeepSpeed's methods equal DeepSpeed's functions, and
the GPT-2 split the issue describes."""

import itertools
import os
import random

import pytest

from toolkit.plan.arch import load_arch
from toolkit.plan.cost.layers import layer_costs
from toolkit.errors import ConfigError
from toolkit.plan.cost.partition import (imbalance, min_bottleneck_split, partition_balanced, partition_layers,
                               partition_uniform, split, stage_sums)


def _brute_force(n, pp, cost):
    """Least bottleneck over every way to cut n layers into pp non-empty contiguous stages."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        parts = [0, *cuts, n]
        best = min(best, max(cost(s, parts[s], parts[s + 1]) for s in range(pp)))
    return best


def _random_weights(rng, n):
    kind = rng.choice(["int", "float", "spiky"])
    if kind == "int":
        return [rng.randint(0, 20) for _ in range(n)]
    if kind == "float":
        return [rng.random() * 100 for _ in range(n)]
    return [rng.choice([0.1, 1.0, 1.0, 5.0]) for _ in range(n)]  # like embed / blocks / head


def test_exact_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 11)
        pp = rng.randint(1, n)
        w = _random_weights(rng, n)
        parts = min_bottleneck_split(w, pp)
        assert parts[0] == 0 and parts[-1] == n and len(parts) == pp + 1
        assert all(a < b for a, b in zip(parts, parts[1:]))  # no empty stage
        assert max(stage_sums(w, parts)) == pytest.approx(
            _brute_force(n, pp, lambda s, i, j: sum(w[i:j])), rel=1e-12)


def test_stage_dependent_costs_exact():
    """The memory method's cost depends on the stage (1F1B keeps pp - s micro-batches on stage s)."""
    rng = random.Random(1)
    for _ in range(100):
        n, pp = rng.randint(2, 9), rng.randint(1, 4)
        pp = min(pp, n)
        states, acts = _random_weights(rng, n), _random_weights(rng, n)

        def cost(s, i, j):
            return sum(states[i:j]) + (pp - s) * sum(acts[i:j])

        parts = split(n, pp, cost)
        got = max(cost(s, parts[s], parts[s + 1]) for s in range(pp))
        assert got == pytest.approx(_brute_force(n, pp, cost), rel=1e-12)


def test_ties_prefer_evener_stages():
    # bottleneck 10 is forced by the last layer; the other stages should still be even
    assert min_bottleneck_split([1, 1, 1, 1, 1, 1, 10], 3) == [0, 3, 6, 7]


@pytest.fixture(scope="module")
def ds_utils():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import utils

    return utils


def test_deepspeed_functions_reproduced(ds_utils):
    rng = random.Random(2)
    for _ in range(300):
        n, m = rng.randint(1, 14), rng.randint(1, 9)
        w = _random_weights(rng, n)
        assert partition_balanced(w, m) == ds_utils.partition_balanced(w, m), (w, m)
        assert partition_uniform(n, m) == ds_utils.partition_uniform(n, m), (n, m)


def test_gpt2_parameters_split_is_deepspeeds_0_6_6_0(ds_utils):
    costs = layer_costs(load_arch("gpt2"), 512)
    parts = partition_layers(costs, 4, "parameters")
    assert parts == ds_utils.partition_balanced([c.params for c in costs], 4)
    assert stage_sums([c.kind == "block" for c in costs], parts) == [0, 6, 6, 0]
    compute = partition_layers(costs, 4)  # dstk's default
    flops = [c.flops for c in costs]
    assert imbalance(flops, compute) < 1.2 < 1.4 < imbalance(flops, parts)
    assert imbalance(flops, compute) <= imbalance(flops, partition_layers(costs, 4, "uniform"))


def test_type_regex_like_deepspeed(ds_utils):
    costs = layer_costs(load_arch("llama-3.2-1b"), 1024)
    parts = partition_layers(costs, 4, "type:decoderblock")  # case-insensitive search, as DeepSpeed
    binary = [int(c.typename == "DecoderBlock") for c in costs]
    assert parts == ds_utils.partition_balanced(binary, 4)
    assert stage_sums(binary, parts) == [4, 4, 4, 4]


def test_errors():
    costs = layer_costs(load_arch("tiny-gpt2"), 64)  # 7 layers
    with pytest.raises(ConfigError, match="--pp 8 is more stages than the model's 7 pipeline layers"):
        partition_layers(costs, 8)
    with pytest.raises(ConfigError, match="--pp must be a positive integer, got 0"):
        partition_layers(costs, 0)
    with pytest.raises(ConfigError, match="not one of compute, memory"):
        partition_layers(costs, 2, "params")
    with pytest.raises(ConfigError, match="matches no layer; layer types are FinalNorm, GPT2BlockStage"):
        partition_layers(costs, 2, "type:Decoder")
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        partition_layers(costs, 2, "type:(")
    with pytest.raises(ConfigError, match="'profile' needs one measured time per layer \\(7\\)"):
        partition_layers(costs, 2, "profile", times=[1.0])
