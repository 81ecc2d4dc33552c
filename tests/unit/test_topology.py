import pytest

from toolkit.errors import ConfigError
from toolkit.distributed.topology import Topology, config_batch, resolve_batch
from toolkit.plan.schedule import bubble_fraction


def test_coords_follow_deepspeed_pipe_data_order():
    # PipeDataParallelTopology(num_pp=2, num_dp=2): axes (pipe, data) -> ranks 0,1 on stage 0
    topo = Topology(world_size=4, pp=2)
    assert topo.dp == 2
    assert [topo.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(topo.rank(*topo.coords(r)) == r for r in range(4))


def test_coords_match_deepspeed_topology():
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    ds = PipeDataParallelTopology(num_pp=4, num_dp=2)
    topo = Topology(world_size=8, pp=4)
    for rank in range(8):
        c = ds.get_coord(rank)
        assert topo.coords(rank) == (c.pipe, c.data)


def test_world_not_divisible_shows_arithmetic():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by pp\(4\)"):
        Topology(world_size=6, pp=4)


def test_resolve_batch_derives_gas_and_gbs():
    assert resolve_batch(dp=2, mbs=2, gbs=64).gas == 16
    assert resolve_batch(dp=2, mbs=2, gas=3).gbs == 12


def test_resolve_batch_refuses_non_dividing_global_batch():
    with pytest.raises(ConfigError, match=r"global batch 30 is not divisible by mbs\(2\) \* dp\(4\) = 8; use --gbs 24 or 32"):
        resolve_batch(dp=4, mbs=2, gbs=30)


def test_resolve_batch_refuses_inconsistent_triplet():
    with pytest.raises(ConfigError, match=r"global batch 10 != mbs\(2\) \* gas\(2\) \* dp\(2\) = gbs\(8\)"):
        resolve_batch(dp=2, mbs=2, gbs=10, gas=2)


@pytest.mark.parametrize("pp,m,expected", [(1, 8, 0.0), (4, 4, 3 / 7), (2, 15, 1 / 16)])
def test_bubble_fraction(pp, m, expected):
    assert bubble_fraction(pp, m) == pytest.approx(expected)


@pytest.mark.parametrize("cfg,dp,expected", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, 4, (2, 8)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 4, (4, 4)),
    ({"train_batch_size": 64}, 4, (16, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (3, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (3, 2)),
])
def test_config_batch_derives_like_deepspeed(cfg, dp, expected):
    batch = config_batch(cfg, dp)
    assert (batch.mbs, batch.gas) == expected and batch.gbs == batch.mbs * batch.gas * dp


def test_config_batch_names_json_keys_and_refuses_auto():
    with pytest.raises(ConfigError, match=r'"train_batch_size" 30 is not divisible by '
                                          r'"train_micro_batch_size_per_gpu"\(2\) \* dp\(4\) = 8; use "train_batch_size": 24 or 32'):
        config_batch({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2}, 4)
    with pytest.raises(ConfigError, match=r'"train_micro_batch_size_per_gpu" must be a positive integer, got \'auto\''):
        config_batch({"train_micro_batch_size_per_gpu": "auto"}, 1)
    with pytest.raises(ConfigError, match='set "train_batch_size" or "train_micro_batch_size_per_gpu"'):
        config_batch({}, 1)
