"""The one place a process group starts: launcher environment, device, backend, free ports.

    from toolkit.distributed import process_group
    process_group.init()        # under any launcher, or by hand (then a world of one)
    ...
    process_group.shutdown()    # at the end of a training process

Launchers tell ranks apart through the environment. The deepspeed launcher (pdsh/ssh runner) and
torchrun set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*; DeepSpeed's openmpi and slurm runners (mpirun,
srun) do not. Under mpirun `deepspeed.init_distributed` discovers them through mpi4py: rank and size
from MPI, MASTER_ADDR = the first address of `hostname -I` on rank 0, MASTER_PORT = the port it is
given (here MASTER_PORT, else 29500); when MASTER_ADDR is given (launch.sh --master-addr), init() fills
the rest from OpenMPI's variables instead (openmpi_env) and no discovery runs. DeepSpeed reads no slurm
variable: under srun it tries mpi4py too, which needs an MPI built with slurm support (Debian's OpenMPI
aborts in MPI_Init when it sees srun's variables; without mpi4py, an ImportError). So under slurm
(SLURM_PROCID, no torch or OpenMPI variable; srun's PMI_RANK/PMIX_RANK when equal to it) init() fills
RANK/LOCAL_RANK/WORLD_SIZE from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS and MASTER_ADDR from the first
host of the step's node list (slurm_env).
A world of one is assumed only when no launcher variable at all is present; filling RANK=0 under
mpirun would turn N ranks into N independent runs writing the same output folder.

On a machine without CUDA: DeepSpeed's CPU accelerator and gloo. With CUDA: this rank's GPU is
cuda:(local rank % visible GPUs), selected before NCCL starts (else every rank of a node opens GPU 0).
"""

import itertools
import os
import re
import socket

from toolkit.distributed.agreement import agree, patient_group  # noqa: F401  patient_group: read from here too
from toolkit.errors import ConfigError

# Variables that mean "a launcher started this process as one rank of many", first match wins.
LAUNCHER_VARS = {
    "RANK": "torchrun / deepspeed",
    "OMPI_COMM_WORLD_RANK": "OpenMPI",
    "PMI_RANK": "MPICH / Intel MPI",
    "PMIX_RANK": "PMIx",
    "MV2_COMM_WORLD_RANK": "MVAPICH",
    "SLURM_PROCID": "slurm",
}
# Local rank (the rank's place on its node) as each launcher names it; DSTK_NODE_LOCAL_RANK is select_gpu's
# copy of it where LOCAL_RANK was made a device index.
LOCAL_RANK_VARS = ("DSTK_NODE_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                   "SLURM_LOCALID")
# The node's process count, as each launcher names it (DeepSpeed's launcher: LOCAL_SIZE; torchrun: LOCAL_WORLD_SIZE).
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
WORLD_OF_ONE = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
DEFAULT_PORT = 29500  # DeepSpeed's and torch's default rendezvous port


def free_port() -> int:
    """A TCP port nobody listens on now, for a rendezvous (rank 0's store): drawn at random outside the kernel's
    ephemeral range. Every outgoing connection on the machine (gloo's and NCCL's, of every run) takes its local
    port from that range, and binding port 0 hands out one of them: such a port can be taken by a connection
    before rank 0 listens on it, and two launches that ask at the same moment may be handed the same one."""
    import random

    low, high = ephemeral_ports()
    spans = [(start, end) for start, end in ((20000, low - 1), (high + 1, 65535)) if end - start >= 1000]
    spans = spans or [(1024, 65535)]  # the ephemeral range covers nearly every port: draw from all of them
    draw = random.SystemRandom()  # not the `random` a run seeds: every rank and test would draw the same
    for _ in range(100):
        start, end = draw.choices(spans, weights=[end - start + 1 for start, end in spans])[0]
        port = draw.randint(start, end)  # every port of the spans alike
        if port != DEFAULT_PORT and listenable(port):
            return port
    with socket.socket() as s:  # 100 ports in use: let the kernel choose one
        s.bind(("", 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple:
    """The kernel's range of local ports for outgoing connections (Linux: /proc; elsewhere IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(n) for n in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def listenable(port: int) -> bool:
    """Whether a server could listen on `port` of every address now."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def port_taken(port: int) -> Exception:
    """Rank 0 could not listen on the rendezvous port: the refusal, naming --master-port."""
    from toolkit.errors import PortTaken

    if os.environ.get("DSTK_PORT_PICKED") == str(port):  # launch.sh drew it, and draws another (exit PortTaken's code)
        taken = PortTaken(f"the master port {port} that launch.sh drew was taken before rank 0 listened on it: "
                          "launch.sh draws another")
        taken.severity = "note"  # nothing for the user to do
        return taken
    return PortTaken(f"the master port {port} is in use on {socket.gethostname()} (EADDRINUSE: another run or "
                     "service listens there): pass another --master-port to launch.sh (or MASTER_PORT to your launcher); "
                     "without one launch.sh draws a free port")


def launcher(env=None) -> str | None:
    """The launcher that started this process (from its variables), or None when started by hand. An srun
    task is slurm's also where srun's MPI plugin (MpiDefault=pmix or pmi2) adds PMIX_RANK / PMI_RANK: they
    then equal SLURM_PROCID (an MPI launcher that srun started per node, such as MPICH's hydra, numbers its
    ranks otherwise, and its PMI_SIZE is not SLURM_NTASKS)."""
    env = os.environ if env is None else env
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" not in env and _srun_task(env):
        return "slurm"
    return next((name for var, name in LAUNCHER_VARS.items() if var in env), None)


def _srun_task(env) -> bool:
    procid = env.get("SLURM_PROCID")
    return (procid is not None and all(env[var] == procid for var in ("PMI_RANK", "PMIX_RANK") if var in env)
            and env.get("PMI_SIZE", env.get("SLURM_NTASKS")) == env.get("SLURM_NTASKS"))


def env_rank(env=None) -> int:
    """This process's global rank as its launcher set it (0 when started by hand). Readable before any
    process group exists: what decides that only rank 0 prints a refusal every rank reaches."""
    env = os.environ if env is None else env
    return next((int(env[var]) for var in LAUNCHER_VARS if env.get(var, "").isdigit()), 0)


def env_world_size(env=None) -> int | None:
    """The world size the launcher announced, or None (by hand: 1 once init() runs; unknown launcher)."""
    env = os.environ if env is None else env
    if launcher(env) is None:
        return 1
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def local_rank(env=None) -> int:
    """This process's index on its node (0 when no launcher says otherwise)."""
    env = os.environ if env is None else env
    return next((int(env[var]) for var in LOCAL_RANK_VARS if env.get(var, "").isdigit()), 0)


def expand_nodelist(nodelist: str):
    """Host names of a slurm node list, in order: "gpu[01-03,7],login" -> gpu01 gpu02 gpu03 gpu7 login.
    Ranges keep their zero padding; several bracket groups in one name multiply out. Lazy, so the
    first host of a node[0-9999] list costs nothing."""
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts = re.split(r"\[([^\]]*)\]", name)  # text, group, text, group, ..., text
        choices = [[p] if i % 2 == 0 else list(_expand_group(p)) for i, p in enumerate(parts)]
        yield from ("".join(combo) for combo in itertools.product(*choices))


def _expand_group(group: str):
    """The inside of one bracket: "01-03,7" -> 01 02 03 7."""
    for item in group.split(","):
        low, _, high = item.partition("-")
        if not high:
            yield low
        else:
            yield from (str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))


def slurm_env(env=None) -> dict:
    """RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for a task that srun started. Task 0 runs on
    the step's first host (slurm's default block distribution). The port: MASTER_PORT if set, else one
    derived from the job id, the same for every task of a job and different for most jobs sharing a node."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if env_world_size(env) is None or not (nodelist or env.get("MASTER_ADDR")):
        raise ConfigError("a slurm task needs SLURM_NTASKS and SLURM_NODELIST (or MASTER_ADDR) to find its world; "
                          "start it with srun")
    job = env.get("SLURM_JOB_ID", "")
    port = DEFAULT_PORT + int(job) % 1000 if job.isdigit() else DEFAULT_PORT
    return dict(RANK=env["SLURM_PROCID"], LOCAL_RANK=str(local_rank(env)), WORLD_SIZE=str(env_world_size(env)),
                MASTER_ADDR=env.get("MASTER_ADDR") or next(expand_nodelist(nodelist)),
                MASTER_PORT=env.get("MASTER_PORT") or str(port))


def subnet_of(host: str) -> str | None:
    """The IPv4 network (CIDR) of this machine's interface that holds `host` (its own address, or a peer on
    the same subnet), from `ip -o -4 addr`: for mpirun's btl_tcp_if_include, where a subnet names the right
    interface on every node whatever it is called there. None when `host` does not resolve, is reached
    through a gateway, or `ip` is missing."""
    import ipaddress
    import subprocess

    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
        shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    for line in shown.splitlines():
        words = line.split()
        if "inet" in words:
            network = ipaddress.ip_interface(words[words.index("inet") + 1]).network
            if address in network:
                return str(network)
    return None


def openmpi_env(env=None) -> dict:
    """RANK/LOCAL_RANK/WORLD_SIZE (and MASTER_PORT) from OpenMPI's variables, for ranks told MASTER_ADDR
    (launch.sh --launcher openmpi --master-addr): with all five set, DeepSpeed skips its MPI discovery, which
    would replace MASTER_ADDR by the first address of `hostname -I` on rank 0 (and needs mpi4py)."""
    env = os.environ if env is None else env
    return dict(RANK=env["OMPI_COMM_WORLD_RANK"], LOCAL_RANK=env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                WORLD_SIZE=env["OMPI_COMM_WORLD_SIZE"], MASTER_PORT=env.get("MASTER_PORT", str(DEFAULT_PORT)))


def prepare(cpu: bool = False) -> None:
    """Before DeepSpeed starts: its CPU accelerator when there is no CUDA (or `cpu`), and the
    `deepspeed_shm_comm` op off. That op serves only inference all-reduce on CPU, and loading it
    JIT-compiles C++ for minutes on a fresh machine."""
    import torch

    if cpu or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def share_cpu_threads() -> int:
    """CPU ranks without OMP_NUM_THREADS (the bare `deepspeed` launcher sets none): each of the node's N
    processes takes cores / N intra-op threads, as launch.sh does, instead of every rank using every core
    (N x oversubscribed: ~6x slower at 2 ranks on 2 cores). Returns the threads this rank uses."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        local = next((int(os.environ[v]) for v in LOCAL_SIZE_VARS if os.environ.get(v, "").isdigit()), 1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, local)))
    return torch.get_num_threads()


def init(cpu: bool = False, verbose: bool = False, alone: bool = False, timeout=None):
    """Start this rank's process group through DeepSpeed (a no-op when one exists); returns
    torch.distributed. cpu=True: gloo on CPU even where CUDA exists. alone=True: a world of one
    whatever launcher variables say (in-process checks such as `dstk parity`, which would otherwise
    wait for the other ranks of an `sbatch -n 8` allocation that never start). timeout: a datetime.timedelta
    for the group's collectives, else DeepSpeed's (10 minutes, DEEPSPEED_TIMEOUT).

    Started through `deepspeed.init_distributed`, not torch's: DeepSpeed's config code reads the
    world size from deepspeed.comm and silently takes 1 when that was not initialised."""
    import torch
    import torch.distributed as tdist

    if tdist.is_initialized():
        return tdist
    picked = alone or (launcher() is None and "MASTER_PORT" not in os.environ)
    if alone:
        os.environ.update(WORLD_OF_ONE, MASTER_PORT=str(free_port()))
    elif launcher() is None:  # started by hand: a world of one on a free port
        for key, value in WORLD_OF_ONE.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif launcher() == "slurm":  # DeepSpeed reads no SLURM_* variable (see the module docstring)
        for key, value in slurm_env().items():
            os.environ.setdefault(key, value)
    elif launcher() == "OpenMPI" and "MASTER_ADDR" in os.environ:  # launch.sh --master-addr: no MPI discovery
        for key, value in openmpi_env().items():
            os.environ.setdefault(key, value)
    cpu = cpu or os.environ.get("DS_ACCELERATOR") == "cpu"  # a CPU run asked for on a machine with GPUs
    prepare(cpu)
    use_cuda = torch.cuda.is_available() and not cpu
    if use_cuda:
        select_gpu()
    else:
        share_cpu_threads()
    import deepspeed

    # under mpirun DeepSpeed's MPI discovery sets MASTER_PORT to distributed_port: keep the launcher's
    port = int(os.environ.get("MASTER_PORT", DEFAULT_PORT))
    for tries_left in (2, 1, 0):
        try:
            deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", distributed_port=port,
                                       verbose=verbose, **({"timeout": timeout} if timeout is not None else {}))
            break
        except RuntimeError as exc:  # torch's DistNetworkError included
            if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
                raise
            if not (picked and tries_left):
                raise port_taken(port) from None
            port = free_port()  # a world of one on a port drawn here: taken meanwhile, draw another
            os.environ["MASTER_PORT"] = str(port)
    if use_cuda:  # WORLD's first NCCL collective, before any engine: see _print_devices
        _print_devices(tdist)
    return tdist


def select_gpu() -> int:
    """Make cuda:(local rank % visible GPUs) this rank's device; returns its index. DeepSpeed takes
    LOCAL_RANK as the device index (the engine's set_device, PipelineModule's .to(cuda:LOCAL_RANK)), so
    where they differ (each rank sees one GPU) LOCAL_RANK becomes the index, and the rank's place on its
    node stays readable through local_rank() (DSTK_NODE_LOCAL_RANK): who tokenizes once per node."""
    import torch

    node_local = local_rank()
    index = cuda_index(node_local, torch.cuda.device_count())
    torch.cuda.set_device(index)
    if index != node_local:
        os.environ.update(DSTK_NODE_LOCAL_RANK=str(node_local), LOCAL_RANK=str(index))
    return index


def cuda_index(local: int, visible: int) -> int:
    """The CUDA device of the rank with local rank `local` when it sees `visible` devices. A scheduler
    that shows each task only its own GPU (slurm --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank) makes
    every rank see one device, cuda:0, whatever its local rank: local % visible. Ranks that outnumber the
    node's GPUs would share one, which NCCL refuses: said here, before it fails inside NCCL."""
    if visible < 1:
        raise ConfigError("CUDA is available but torch.cuda.device_count() is 0; check CUDA_VISIBLE_DEVICES")
    return local % visible


def engine_args():
    """`args` for deepspeed.initialize: on a GPU, the device init() selected (device_rank). Without it
    DeepSpeed's engine selects cuda:LOCAL_RANK itself (engine._set_distributed_vars), which does not exist
    where each rank sees one GPU (local rank 5 of a node, cuda:0 its only device). None on CPU."""
    import argparse

    import torch

    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return None
    return argparse.Namespace(device_rank=torch.cuda.current_device())


def device_line(devices: list) -> str:
    """One line naming each rank's GPU, for `devices` = [(host, local rank, cuda index, visible
    devices, CUDA_VISIBLE_DEVICES or None)] by global rank; ranks of one host sharing a GPU are flagged."""
    parts, seen = [], {}
    for rank, (host, local, index, visible, mask) in enumerate(devices):
        shown = f" of CUDA_VISIBLE_DEVICES={mask}" if mask is not None else f" of {visible}"
        parts.append(f"rank {rank} ({host} local {local}) -> cuda:{index}{shown}")
        seen.setdefault((host, mask, index), []).append(rank)
    shared = [ranks for ranks in seen.values() if len(ranks) > 1]
    line = "dstk: GPUs: " + "; ".join(parts)
    if shared:
        line += f"; WARNING: ranks {shared} share a GPU (NCCL refuses that): fewer ranks per node, or more GPUs"
    return line


def _print_devices(tdist) -> None:
    """Rank 0 prints which GPU every rank took, once. Its all_gather is also WORLD's first NCCL collective, made
    with every rank present. This matters where torch makes communicators lazily, because DeepSpeed binds no
    device_id there (2.6.0 < torch < 2.7.1, i.e. torch 2.7.0). Without it, DualPipeV's first batch_isend_irecv
    would make WORLD's communicator, which needs every rank; from pp 3 on, stage 2 would be waiting in a blocking
    recv of shapes that stage 1 sends only after that batch (docs/deepspeed.md, "DualPipeV on NCCL"). Keep this
    unconditional on GPUs."""
    import torch

    mine = (socket.gethostname(), local_rank(), torch.cuda.current_device(), torch.cuda.device_count(),
            os.environ.get("CUDA_VISIBLE_DEVICES"))
    devices = [None] * tdist.get_world_size()
    tdist.all_gather_object(devices, mine)
    if tdist.get_rank() == 0:
        print(device_line(devices), flush=True)


def all_reduce_sum(values, device, group=None) -> list:
    """The sums of `values` (numbers, or a tensor) over every rank of `group` (None: the world), as floats.
    Every tensor dstk hands a collective is made here or in all_gather_rows, on `device` (the engine's):
    NCCL takes only tensors on the current GPU (a CPU tensor fails there, while gloo accepts it), and fp64
    keeps counts and sums of bf16 losses exact."""
    import torch
    import torch.distributed as tdist

    summed = torch.as_tensor(values, dtype=torch.float64).to(device).reshape(-1)
    tdist.all_reduce(summed, group=group)
    return summed.tolist()


def all_gather_rows(values: list, device) -> list:
    """Every rank's `values` (numbers, the same count on each), as a list of rows in global rank order:
    one all_gather of fp64 tensors on `device` (see all_reduce_sum)."""
    import torch
    import torch.distributed as tdist

    mine = torch.as_tensor(values, dtype=torch.float64).to(device).reshape(-1)
    rows = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(rows, mine)
    return torch.stack(rows).tolist()


SHARED_WAIT = 10.0  # seconds a rank looks for rank 0's marker (NFS clients may cache a directory that long)


def shared_with_rank0(directory) -> list:
    """[(host, sees it)] per global rank, for a file rank 0 writes into `directory` (created there): all
    True when the directory is one folder for the whole world (a shared file system), False on a node whose
    `directory` is its own disk. A rank that does not see the file looks again for SHARED_WAIT seconds."""
    import secrets
    import time
    from pathlib import Path

    import torch.distributed as tdist

    group, directory = patient_group(), Path(directory)
    box = [secrets.token_hex(8)]
    with agree(f"writing into {directory}", name_ranks=False):  # rank 0 may fail alone (read-only): before a broadcast
        if tdist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f".dstk-shared-{box[0]}").write_text(box[0])
    tdist.broadcast_object_list(box, src=0, group=group)
    marker, deadline = directory / f".dstk-shared-{box[0]}", time.monotonic() + SHARED_WAIT
    while not (seen := marker.name in _listing(directory)) and time.monotonic() < deadline:
        time.sleep(0.5)
    views = [None] * tdist.get_world_size()
    tdist.all_gather_object(views, (socket.gethostname(), seen), group=group)
    if tdist.get_rank() == 0:
        marker.unlink(missing_ok=True)
    return views


def _listing(directory) -> list:
    try:
        return os.listdir(directory)  # a directory read, which revalidates an NFS client's cached entries
    except OSError:
        return []


def once_per_node(work, what: str, shared_dir=None) -> tuple:
    """(work()'s result, True) on the rank that ran it; (None, False) on the others, once it is done. One rank
    per node runs `work` (its local rank 0) while the others wait, however long (patient_group: a download or
    a tokenizing pass outlasts the process group's timeout); with `shared_dir`, global rank 0 alone where that
    folder is one for every node (shared_with_rank0: nodes writing the same files at once would race). A
    failure there is every rank's (toolkit.distributed.agreement): a refusal (ConfigError, UnusableInput) is
    raised on every rank with the same message; another failure is raised as it is there and as a RankFailed
    naming `what` on the others. Without a process group: work() here."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return work(), True
    shared = shared_dir is not None and all(seen for _, seen in shared_with_rank0(shared_dir))
    mine = (tdist.get_rank() if shared else local_rank()) == 0
    result = None
    with agree(what, name_ranks=False):
        if mine:
            result = work()
    return result, mine


def shutdown() -> None:
    """End of a training process: tear the process group down explicitly. Left to interpreter exit,
    gloo's threads can abort a rank after a successful run ("terminate called without an active
    exception", exit -6). Only a process entry calls this: an in-process caller keeps its group."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
