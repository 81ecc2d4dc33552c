"""World = pp * dp * sp * tp, rank <-> coordinates, and batch arithmetic: computed here, once.

Vocabulary: pp pipeline stages, dp data-parallel replicas, tp tensor parallel, mbs micro-batch per
GPU, gas gradient accumulation steps (= micro-batches per step in a pipeline), gbs global batch.
DeepSpeed's invariant: train_batch_size (gbs) == mbs * gas * dp, with dp = world / (pp * tp).
With AutoTP (tp > 1) DeepSpeed 0.19 checks train_batch_size against mbs * gas * WORLD instead
(runtime/config.py:471, asserted at :602; parsed before the tp groups exist), so such configs leave
train_batch_size out and dstk computes gbs = mbs * gas * dp itself. `tp_of(cfg)` reads tp from a config.
With Ulysses sequence parallelism (sp > 1, "sequence_parallel_size") the sp ranks of a group share
their rows, each holding 1/sp of the sequence: dp = world / (pp * sp * tp), and DeepSpeed checks
train_batch_size against mbs * gas * (world / sp) (runtime/config.py:461-469). `sp_of(cfg)` reads sp.
"""

from dataclasses import dataclass

from toolkit.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """How the world's ranks are laid out. Ranks are ordered like DeepSpeed's
    PipeDataParallelTopology: axes (pipe, data), the data axis varying fastest; with AutoTP (tp > 1,
    pp = 1) a tensor axis inside that, as DeepSpeed's (data_parallel, tensor_parallel) mesh
    (utils/groups.py _init_tp_mesh_device): tp groups are runs of tp consecutive ranks. With Ulysses
    (sp > 1, tp = 1; inside each pipeline stage too) sp groups are runs of sp consecutive ranks, as DeepSpeed's
    runtime/sequence_parallel/parallel_state_sp.py builds them: rank = dp_rank * sp + sp_rank."""

    world_size: int
    pp: int = 1
    tp: int = 1
    sp: int = 1

    def __post_init__(self):
        for name in ("world_size", "pp", "tp", "sp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % (self.pp * self.tp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by pp({self.pp}) * tp({self.tp}) = "
                f"{self.pp * self.tp}; use a world size that is a multiple of {self.pp * self.tp} "
                f"or a {'pp * tp' if self.tp > 1 else 'pp'} that divides {self.world_size} "
                f"({', '.join(map(str, divisors(self.world_size)))})"
            )
        if self.sp > 1 and self.world_size % (self.pp * self.tp * self.sp):
            raise ConfigError(f"world size {self.world_size} is not divisible by {self.model_product()} = "
                              f"{self.pp * self.tp * self.sp}; use an sp that divides "
                              f"{self.world_size // (self.pp * self.tp)} or a world size that is a multiple of "
                              f"{self.pp * self.tp * self.sp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp * self.sp)

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, dp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} outside world of {self.world_size}")
        return rank // (self.dp * self.sp * self.tp), (rank // (self.tp * self.sp)) % self.dp

    def sp_rank(self, rank: int) -> int:
        """Which 1/sp slice of its group's sequences a global rank holds (0 without sp)."""
        return (rank // self.tp) % self.sp

    def rank(self, stage: int, dp_rank: int, sp_rank: int = 0) -> int:
        return ((stage * self.dp + dp_rank) * self.sp + sp_rank) * self.tp

    def model_product(self) -> str:
        """pp(..) * sp(..) * tp(..), the factors that divide the world besides dp (sp, tp only when > 1)."""
        return " * ".join([f"pp({self.pp})"] + [f"{k}({v})" for k, v in (("sp", self.sp), ("tp", self.tp)) if v > 1])

    def describe(self) -> str:
        parts = [f"pp({self.pp})", f"dp({self.dp})"] + [f"{k}({v})" for k, v in (("sp", self.sp), ("tp", self.tp))
                                                       if v > 1]
        return " * ".join(parts) + f" = world({self.world_size})"


@dataclass(frozen=True)
class Batch:
    """mbs * gas * dp == gbs."""

    mbs: int
    gas: int
    dp: int

    @property
    def gbs(self) -> int:
        return self.mbs * self.gas * self.dp

    def describe(self) -> str:
        return f"mbs({self.mbs}) * gas({self.gas}) * dp({self.dp}) = gbs({self.gbs})"


@dataclass(frozen=True)
class BatchNames:
    """How messages name the three numbers: CLI flags or DeepSpeed's JSON keys."""

    gbs: str
    mbs: str
    gas: str
    set_gbs: str  # the fix that sets the global batch: "--gbs" / '"train_batch_size":'
    product: str  # how the product mbs * gas * dp is shown: "gbs({})" / "{}"


FLAGS = BatchNames("global batch", "mbs", "gas", "--gbs", "gbs({})")
JSON_KEYS = BatchNames('"train_batch_size"', '"train_micro_batch_size_per_gpu"', '"gradient_accumulation_steps"',
                       '"train_batch_size":', "{}")
DEEPSPEED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch(dp: int, mbs: int | None = None, gas: int | None = None, gbs: int | None = None,
                  names: BatchNames = FLAGS) -> Batch:
    """The batch from any of gbs / mbs / gas, deriving the missing ones as DeepSpeed does
    (runtime/config.py _set_batch_related_parameters: gas defaults to 1), but refusing numbers
    that do not divide where DeepSpeed would floor them and fail later."""
    for key, value in (("gbs", gbs), ("mbs", mbs), ("gas", gas)):
        if value is not None:
            _positive(getattr(names, key), value)
    if gbs is None and mbs is None:
        raise ConfigError(f"set {names.gbs} or {names.mbs}: DeepSpeed needs one of them")
    if gbs is None:
        return Batch(mbs, gas or 1, dp)
    if mbs is not None and gas is not None:
        if gbs != mbs * gas * dp:
            raise ConfigError(f"{names.gbs} {gbs} != {names.mbs}({mbs}) * {names.gas}({gas}) * dp({dp}) = "
                              f"{names.product.format(mbs * gas * dp)}; set {names.set_gbs} {mbs * gas * dp} "
                              f"or leave out one of the three")
        return Batch(mbs, gas, dp)
    known, name = (mbs, names.mbs) if mbs is not None else (gas or 1, names.gas)
    per_step = known * dp
    if gbs % per_step:
        lower, upper = (gbs // per_step) * per_step, (gbs // per_step + 1) * per_step
        closest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ConfigError(f"{names.gbs} {gbs} is not divisible by {name}({known}) * dp({dp}) = {per_step}; use "
                          f"{names.set_gbs} {closest}, or a {name} that divides {gbs // dp if gbs % dp == 0 else gbs}")
    return Batch(mbs, gbs // per_step, dp) if mbs is not None else Batch(gbs // per_step, known, dp)


def tp_of(cfg: dict) -> int:
    """Tensor-parallel size of a DeepSpeed config: "tensor_parallel": {"autotp_size": N}, else 1.
    DeepSpeed reads 0 (its default) as off, like 1 (runtime/tensor_parallel/config.py TPTrainingConfig).
    Raises ConfigError for a value DeepSpeed could not use (not an integer, negative)."""
    section = cfg.get("tensor_parallel")
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise ConfigError(f'"tensor_parallel" must be an object like {{"autotp_size": 2}}, got {section!r}')
    size = section.get("autotp_size", 0)
    if size is None:
        return 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f'"tensor_parallel.autotp_size" must be an integer >= 0 (0 or 1: off), got {size!r}')
    return max(size, 1)


def sp_of(cfg: dict) -> int:
    """Sequence-parallel size of a DeepSpeed config: "sequence_parallel_size", else 1. Raises
    ConfigError for a value DeepSpeed could not use."""
    size = cfg.get("sequence_parallel_size")
    if size is None:
        return 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f'"sequence_parallel_size" must be an integer >= 1 (1: off), got {size!r}')
    return size


def ep_of(cfg: dict) -> int:
    """Expert-parallel size of a DeepSpeed config: "expert_parallel": {"enabled": true, "autoep_size": N}
    (DeepSpeed's AutoEP), else 1; a section that is not enabled is ignored by DeepSpeed
    (module_inject/auto_ep_config.py validate_autoep_config returns early). ep lies inside dp: each group of
    ep consecutive data-parallel ranks shares one copy of the experts. Raises ConfigError for a value
    DeepSpeed could not use."""
    section = cfg.get("expert_parallel")
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise ConfigError(f'"expert_parallel" must be an object like {{"enabled": true, "autoep_size": 2}}, '
                          f"got {section!r}")
    if section.get("enabled") is not True:
        return 1
    size = section.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f'"expert_parallel.autoep_size" must be an integer >= 1, got {size!r}')
    return size


def config_batch(cfg: dict, dp: int) -> Batch:
    """The batch a DeepSpeed config dict gives `dp` replicas (values must be numbers, not "auto")."""
    gbs, mbs, gas = (cfg.get(k) for k in DEEPSPEED_KEYS)
    return resolve_batch(dp, mbs=mbs, gas=gas, gbs=gbs, names=JSON_KEYS)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
