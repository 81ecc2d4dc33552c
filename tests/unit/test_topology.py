import pytest

from toolkit.errors import ConfigError
from toolkit.topology import Topology, bubble_fraction, solve_batch


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


def test_solve_batch_derives_gas_and_gbs():
    assert solve_batch(dp=2, mbs=2, gbs=64).gas == 16
    assert solve_batch(dp=2, mbs=2, gas=3).gbs == 12


def test_solve_batch_refuses_non_dividing_global_batch():
    with pytest.raises(ConfigError, match=r"global batch 30 is not divisible by mbs\(2\) \* dp\(4\) = 8; use --gbs 24 or 32"):
        solve_batch(dp=4, mbs=2, gbs=30)


def test_solve_batch_refuses_inconsistent_triplet():
    with pytest.raises(ConfigError, match=r"global batch 10 != mbs\(2\) \* gas\(2\) \* dp\(2\) = gbs\(8\)"):
        solve_batch(dp=2, mbs=2, gbs=10, gas=2)


@pytest.mark.parametrize("pp,m,expected", [(1, 8, 0.0), (4, 4, 3 / 7), (2, 15, 1 / 16)])
def test_bubble_fraction(pp, m, expected):
    assert bubble_fraction(pp, m) == pytest.approx(expected)
