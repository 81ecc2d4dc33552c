"""toolkit.distributed.process_group's reading of launcher environments (no process group): which launcher, rank, world
size and local rank each sets, and what a slurm task's rendezvous is derived from."""

import os

import pytest

from toolkit.distributed import process_group
from toolkit.errors import ConfigError

TORCHRUN = dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="8", MASTER_ADDR="10.0.0.1", MASTER_PORT="29501")
MPIRUN = dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_SIZE="6")
SRUN = dict(SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_NTASKS="4", SLURM_NODELIST="gpu[07-08]", SLURM_JOB_ID="4242")


@pytest.mark.parametrize("env, name", [
    ({}, None),
    ({"PATH": "/bin", "MASTER_PORT": "1234"}, None),  # a stray MASTER_PORT is no launcher
    (TORCHRUN, "torchrun / deepspeed"),
    (MPIRUN, "OpenMPI"),
    (SRUN, "slurm"),
    ({**SRUN, **MPIRUN}, "OpenMPI"),  # mpirun inside a slurm allocation: every rank inherits SLURM_PROCID=0
    ({**SRUN, "PMIX_RANK": "2"}, "slurm"),  # srun --mpi=pmix (MpiDefault=pmix): still srun's task
    ({**SRUN, "PMI_RANK": "2", "PMI_SIZE": "4"}, "slurm"),  # srun --mpi=pmi2
    ({**SRUN, "PMI_RANK": "5", "PMI_SIZE": "8"}, "MPICH / Intel MPI"),  # hydra's ranks, its proxies started by srun
    ({**SRUN, "SLURM_PROCID": "0", "PMI_RANK": "0", "PMI_SIZE": "8"}, "MPICH / Intel MPI"),  # its rank 0 too
    ({"PMIX_RANK": "3"}, "PMIx"),
    ({**SRUN, **TORCHRUN}, "torchrun / deepspeed"),  # the deepspeed launcher inside a slurm job
    ({"PMI_RANK": "1"}, "MPICH / Intel MPI"),
])
def test_launcher_is_read_from_its_variables(env, name):
    assert process_group.launcher(env) == name


@pytest.mark.parametrize("env, rank, world, local", [
    ({}, 0, 1, 0),
    (TORCHRUN, 3, 8, 1),
    (MPIRUN, 5, 6, 1),
    (SRUN, 2, 4, 0),
    ({**SRUN, "SLURM_LOCALID": "3"}, 2, 4, 3),
    ({**SRUN, **MPIRUN}, 5, 6, 1),
    ({"PMIX_RANK": "1"}, 1, None, 0),  # a launcher that names no size: unknown, not 1
])
def test_rank_world_size_and_local_rank_before_any_process_group(env, rank, world, local):
    assert (process_group.env_rank(env), process_group.env_world_size(env), process_group.local_rank(env)) == (rank, world, local)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("gpu[08-10,3],login", ["gpu08", "gpu09", "gpu10", "gpu3", "login"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("rack[1-2]-n[7-8]", ["rack1-n7", "rack1-n8", "rack2-n7", "rack2-n8"]),
    ("x-1,x-2", ["x-1", "x-2"]),  # a dash outside brackets is part of the name
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_slurm_nodelist_expands_in_order(nodelist, hosts):
    assert list(process_group.expand_nodelist(nodelist)) == hosts


def test_first_host_of_a_huge_nodelist_is_read_lazily():
    assert next(process_group.expand_nodelist("node[000000-999999]")) == "node000000"


def test_slurm_env_gives_deepspeed_everything_it_would_otherwise_ask_mpi_for():
    assert process_group.slurm_env(SRUN) == dict(RANK="2", LOCAL_RANK="0", WORLD_SIZE="4", MASTER_ADDR="gpu07",
                                        MASTER_PORT=str(29500 + 4242 % 1000))


def test_slurm_env_prefers_the_steps_nodes_and_the_users_master():
    step = {**SRUN, "SLURM_STEP_NODELIST": "gpu[08]"}  # srun -N1 inside a 2-node job
    assert process_group.slurm_env(step)["MASTER_ADDR"] == "gpu08"
    mine = process_group.slurm_env({**SRUN, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "4000"})
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.1.1.1", "4000")
    no_job = dict(SRUN)
    del no_job["SLURM_JOB_ID"]
    assert process_group.slurm_env(no_job)["MASTER_PORT"] == "29500"


@pytest.mark.parametrize("missing", ["SLURM_NODELIST", "SLURM_NTASKS"])
def test_slurm_env_without_its_world_is_refused(missing):
    env = {k: v for k, v in SRUN.items() if k != missing}
    with pytest.raises(ConfigError, match="start it with srun"):
        process_group.slurm_env(env)


@pytest.mark.parametrize("local, visible, index", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (3, 2, 1)])
def test_a_rank_takes_its_local_rank_modulo_the_gpus_it_sees(local, visible, index):
    """slurm --gpus-per-task=1 (or CUDA_VISIBLE_DEVICES per rank) shows each rank one GPU, cuda:0: local
    rank 5 there must not ask for cuda:5."""
    assert process_group.cuda_index(local, visible) == index


def test_no_visible_gpu_is_refused_by_name():
    with pytest.raises(ConfigError, match="device_count"):
        process_group.cuda_index(0, 0)


def test_the_device_line_names_each_ranks_gpu_and_flags_a_shared_one():
    own = [("n1", 0, 0, 1, "4"), ("n1", 1, 0, 1, "5"), ("n2", 0, 0, 2, None), ("n2", 1, 1, 2, None)]
    line = process_group.device_line(own)
    assert line.startswith("dstk: GPUs: rank 0 (n1 local 0) -> cuda:0 of CUDA_VISIBLE_DEVICES=4;")
    assert "rank 3 (n2 local 1) -> cuda:1 of 2" in line and "WARNING" not in line
    shared = process_group.device_line([("n1", 0, 0, 1, None), ("n1", 1, 0, 1, None)])  # two ranks, one GPU each sees
    assert shared.endswith("WARNING: ranks [[0, 1]] share a GPU (NCCL refuses that): fewer ranks per node, or more GPUs")


def test_the_engine_gets_the_gpu_init_selected_not_cuda_local_rank(monkeypatch):
    """No GPU here: CUDA is faked (is_available, current_device) to show what deepspeed.initialize gets, and
    DeepSpeed's engine is checked to take args.device_rank over LOCAL_RANK."""
    import inspect

    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert process_group.engine_args() is None  # CPU: DeepSpeed's own choice (its CPU accelerator ignores the index)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # slurm --gpus-per-task=1: one GPU visible
    assert process_group.engine_args().device_rank == 0
    assert "args.device_rank if args is not None" in inspect.getsource(DeepSpeedEngine._set_distributed_vars)


@pytest.mark.parametrize("visible, device, local_env", [(1, 0, "0"), (8, 5, "5")])
def test_select_gpu_makes_local_rank_the_device_deepspeed_will_use(monkeypatch, visible, device, local_env):
    """No GPU here: torch.cuda's device count and set_device are faked. Local rank 5 seeing one GPU takes
    cuda:0, and LOCAL_RANK becomes 0 for DeepSpeed (its engine and PipelineModule read it as a device
    index); local_rank() still says 5 (who prepares data once per node)."""
    import torch

    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv("DSTK_NODE_LOCAL_RANK", raising=False)
    assert process_group.select_gpu() == device and chosen == [device]
    assert os.environ["LOCAL_RANK"] == local_env and process_group.local_rank() == 5


def test_openmpi_ranks_told_the_master_address_need_no_mpi_discovery():
    """launch.sh --launcher openmpi --master-addr passes MASTER_ADDR: RANK, LOCAL_RANK, WORLD_SIZE and
    MASTER_PORT come from OpenMPI's variables, so DeepSpeed (which discovers only when one of the five is
    missing) keeps that address instead of rank 0's `hostname -I`."""
    env = {**MPIRUN, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29555"}
    assert process_group.openmpi_env(env) == dict(RANK=MPIRUN["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=MPIRUN["OMPI_COMM_WORLD_SIZE"],
                                         LOCAL_RANK=MPIRUN.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"), MASTER_PORT="29555")


def test_the_subnet_of_a_host_names_mpiruns_interface():
    assert process_group.subnet_of("127.0.0.1") == process_group.subnet_of("localhost") == "127.0.0.0/8"
    assert process_group.subnet_of("no-such-host.invalid") is None


@pytest.mark.parametrize("env, share", [
    ({"LOCAL_SIZE": "2"}, 2),  # the bare deepspeed launcher: no OMP_NUM_THREADS
    ({"LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun-style
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1"}, None),  # set by the user or launch.sh: kept
])
def test_cpu_ranks_share_the_cores_when_no_launcher_set_threads(monkeypatch, env, share):
    import torch

    before = torch.get_num_threads()
    for var in (*process_group.LOCAL_SIZE_VARS, "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    try:
        got = process_group.share_cpu_threads()
        assert got == (max(1, cores // share) if share else cores)
    finally:
        torch.set_num_threads(before)
