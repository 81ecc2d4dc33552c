"""World = pp * dp (* tp), rank <-> coordinates, and batch arithmetic: computed here, once.

Vocabulary: pp pipeline stages, dp data-parallel replicas, tp tensor parallel, mbs micro-batch per
GPU, gas gradient accumulation steps (= micro-batches per step in a pipeline), gbs global batch.
DeepSpeed's invariant: train_batch_size (gbs) == mbs * gas * dp, with dp = world / (pp * tp).
"""

from dataclasses import dataclass

from toolkit.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """How the world's ranks are laid out. Ranks are ordered like DeepSpeed's
    PipeDataParallelTopology: axes (pipe, data), the data axis varying fastest."""

    world_size: int
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("world_size", "pp", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % (self.pp * self.tp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by pp({self.pp}) * tp({self.tp}) = "
                f"{self.pp * self.tp}; use a world size that is a multiple of {self.pp * self.tp} "
                f"or a pp that divides {self.world_size} ({', '.join(map(str, divisors(self.world_size)))})"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, dp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} outside world of {self.world_size}")
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp

    def rank(self, stage: int, dp_rank: int) -> int:
        return (stage * self.dp + dp_rank) * self.tp

    def describe(self) -> str:
        parts = [f"pp({self.pp})", f"dp({self.dp})"] + ([f"tp({self.tp})"] if self.tp > 1 else [])
        return " * ".join(parts) + f" = world({self.world_size})"


@dataclass(frozen=True)
class Batch:
    """mbs * gas * dp == gbs, checked on construction."""

    mbs: int
    gas: int
    dp: int

    @property
    def gbs(self) -> int:
        return self.mbs * self.gas * self.dp

    def describe(self) -> str:
        return f"mbs({self.mbs}) * gas({self.gas}) * dp({self.dp}) = gbs({self.gbs})"


def solve_batch(dp: int, mbs: int, gbs: int | None = None, gas: int | None = None) -> Batch:
    """Derive the missing one of gbs / gas from mbs and dp; refuse numbers that do not divide."""
    _positive("mbs", mbs)
    if gbs is None and gas is None:
        gas = 1
    if gas is not None:
        _positive("gas", gas)
        batch = Batch(mbs, gas, dp)
        if gbs is not None and gbs != batch.gbs:
            raise ConfigError(
                f"global batch {gbs} != {batch.describe()}; drop one of --gbs/--gas "
                f"or set --gbs {batch.gbs}"
            )
        return batch
    _positive("gbs", gbs)
    per_step = mbs * dp
    if gbs % per_step:
        lower, upper = (gbs // per_step) * per_step, (gbs // per_step + 1) * per_step
        closest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ConfigError(
            f"global batch {gbs} is not divisible by mbs({mbs}) * dp({dp}) = {per_step}; "
            f"use --gbs {closest}, or a micro-batch that divides {gbs // dp if gbs % dp == 0 else gbs}"
        )
    return Batch(mbs, gbs // per_step, dp)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle share of a 1F1B step: (p-1)/(m+p-1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
