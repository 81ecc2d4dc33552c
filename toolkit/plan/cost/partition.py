"""Contiguous splits of a pipeline layer list into pp stages.

A split is DeepSpeed's `parts`: pp+1 boundaries, stage s holds layers parts[s]:parts[s+1].

    costs = layer_costs(load_arch("gpt2"), seq_len=512)
    parts = partition_layers(costs, pp=4)                     # dstk: balanced by compute
    parts = partition_layers(costs, pp=4, method="parameters")  # what DeepSpeed does by default

Methods:
  compute      exact split minimising the slowest stage's forward+backward FLOPs (default); given a memory
               limit, among the splits whose every stage fits it (below)
  memory       exact split minimising the largest stage memory: model states + activations of the
               micro-batches 1F1B keeps in flight there (min(pp - s, micro_batches) on stage s) + the
               loss's peak on the head's stage
  profile      exact split over measured per-layer times (pass `times`; toolkit.plan.cost.profile measures)
  parameters   DeepSpeed's: partition_balanced over parameter counts (a tied head counts its copy)
  uniform      DeepSpeed's: partition_uniform over the layer count
  type:REGEX   DeepSpeed's: partition_balanced over 1 for layers whose typename matches REGEX
The exact methods find the least possible bottleneck by dynamic programming over (stage, boundary),
O(pp * n^2); among the splits reaching it they take the one with least sum of squared stage costs,
so the other stages are as even as they can be too. DeepSpeed's partition_balanced instead
minimises (largest - smallest) stage, which is not the same as minimising the largest.

Compute and memory together (`memory_limit`; `dstk plan` gives every layout its GPU's usable bytes): an MoE
block holds all E experts but runs k of them per token, so its parameters and its FLOPs no longer go
together. DeepSeek-V3: a dense block's MLP is 3*h*18432 = 396M parameters, an MoE block's 256 + 1 experts of
3*h*2048 are 11.3G, yet per token both run 2*3*h*18432 = 0.79 GFLOP (8 routed + 1 shared expert of 2048 =
18432 wide; the router adds 2*h*256 = 3.7 MFLOP): 28x the parameters for the same compute. Balanced by
FLOPs alone, the stage holding the three dense blocks gets as many blocks as the others, so the others hold
more experts than memory balance would give them; balanced by memory alone, the dense stage takes more
blocks and FLOPs, and the pipeline runs at its pace. The rule:

    minimise  max_s F_s   subject to   M_s <= C  for every stage s

F_s: stage s's forward + backward FLOPs per micro-batch (a pipeline step takes (gas + pp - 1) x the slowest
stage's time, so the largest F_s is what time pays); M_s: its bytes (model states + the activations of the
micro-batches in flight + the loss's peak); C: the limit. Memory is a constraint, not a cost: a stage
under C costs nothing for being fuller, so when the FLOPs split fits it is the answer, and otherwise the
answer is the least slowest stage any fitting split reaches (exact: the dynamic programme above with a
stage that does not fit costing infinity). When no split fits, `memory` (least max_s M_s) is taken, the
closest any split comes. Each stage's bytes grow with its layers, so for stage s starting at layer i the
fitting stops are i+1..reach(s, i), found by one pass over the layers per stage (O(pp * n) memory
evaluations).
"""

import re

from toolkit.plan.cost.layers import LayerCost
from toolkit.errors import ConfigError

METHODS = ("compute", "memory", "profile", "parameters", "uniform", "type:REGEX")


def partition_layers(costs: list[LayerCost], pp: int, method: str = "compute", times=None,
                     micro_batches: int | None = None, memory_limit: int | None = None) -> list[int]:
    """Boundaries (len pp+1) of the split `method` picks for these layers. memory_limit (bytes per stage, as
    method "memory" counts them): "compute" takes the least slowest stage among the splits that fit it, or
    the "memory" split when none does (module docstring)."""
    check_stages(len(costs), pp)
    method = method.strip()
    memory = stage_memory_cost(costs, pp, micro_batches or pp)
    if method == "compute" and memory_limit is not None:
        fitted = fitting_split([c.flops for c in costs], pp, lambda s, i, j: memory(s, i, j) <= memory_limit)
        return fitted if fitted is not None else split(len(costs), pp, memory)
    if method == "compute":
        return min_bottleneck_split([c.flops for c in costs], pp)
    if method == "memory":
        return split(len(costs), pp, memory)
    if method == "profile":
        if times is None or len(times) != len(costs):
            raise ConfigError(f"method 'profile' needs one measured time per layer ({len(costs)}), "
                              f"got {None if times is None else len(times)}; see toolkit.plan.cost.profile.profile_layers")
        return min_bottleneck_split(list(times), pp)
    if method == "parameters":
        return partition_balanced([c.params for c in costs], pp)
    if method == "uniform":
        return partition_uniform(len(costs), pp)
    if method.lower().startswith("type:"):
        return partition_balanced(_type_weights(costs, method[5:]), pp)
    raise ConfigError(f"--method {method!r} is not one of {', '.join(METHODS)}")


def check_stages(num_layers: int, pp: int) -> None:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"--pp must be a positive integer, got {pp!r}")
    if pp > num_layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {num_layers} pipeline layers; "
                          f"every stage needs at least one layer: use --pp {num_layers} or less")


def _type_weights(costs, regex: str) -> list[int]:
    try:
        pattern = re.compile(regex, re.IGNORECASE)  # DeepSpeed: regex.compile(..., IGNORECASE).search
    except re.error as exc:
        raise ConfigError(f"--method type:{regex}: not a valid regular expression ({exc})") from exc
    weights = [1 if pattern.search(c.typename) else 0 for c in costs]
    if not any(weights):
        names = sorted({c.typename for c in costs})
        raise ConfigError(f"--method type:{regex} matches no layer; layer types are {', '.join(names)}")
    return weights


def stage_memory_cost(costs, pp, micro_batches):
    """cost(stage, start, stop): bytes of a stage holding layers start:stop, as method "memory" counts them (model
    states, the activations of min(pp - stage, micro_batches) micro-batches in flight, the loss's peak)."""
    states = _prefix([c.state_bytes for c in costs])
    acts = _prefix([c.act_bytes for c in costs])
    peaks = _prefix([c.peak_bytes for c in costs])  # only the head has one (its loss): once on its stage

    def cost(stage, start, stop):
        in_flight = min(pp - stage, micro_batches)  # 1F1B: warm-up forwards before the first backward
        return states[stop] - states[start] + in_flight * (acts[stop] - acts[start]) + peaks[stop] - peaks[start]

    return cost


def _prefix(values) -> list:
    sums = [0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def stage_sums(weights, parts) -> list:
    """Per-stage totals of per-layer weights under the split `parts`."""
    return [sum(weights[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]


def imbalance(weights, parts) -> float:
    """Slowest stage over the mean stage (1.0 is perfect balance)."""
    sums = stage_sums(weights, parts)
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean else 1.0


def min_bottleneck_split(weights, pp: int) -> list[int]:
    """Exact contiguous split of non-negative per-layer weights minimising the largest stage sum."""
    prefix = _prefix(weights)
    return split(len(weights), pp, lambda stage, start, stop: prefix[stop] - prefix[start])


def split(n: int, pp: int, cost) -> list[int]:
    """Exact split of n layers into pp non-empty stages minimising max_s cost(s, start, stop);
    ties broken by least sum of squared stage costs, then by earliest boundaries."""
    limit = _least_bottleneck(n, pp, cost)
    return _least_squares_within(n, pp, cost, limit + abs(limit) * 1e-12)


def fitting_split(weights, pp: int, fits) -> list[int] | None:
    """Exact split minimising the largest stage sum of `weights` among the splits whose every stage fits;
    None when none does. fits(stage, start, stop) -> bool must hold for every sub-range of a range it holds
    for (a stage's bytes grow with its layers)."""
    n, inf = len(weights), float("inf")
    check_stages(n, pp)
    reach, starts = [], [0]  # reach[s]: {start: last stop of a fitting stage s}, over the starts stage s can have
    for s in range(pp):
        reach.append(_reach(starts, s, fits, stop=n - (pp - 1 - s)))  # later stages need a layer each
        starts = sorted({j for i, last in reach[s].items() for j in range(i + 1, last + 1)})
        if not starts:
            return None
    if starts[-1] != n:
        return None
    prefix = _prefix(weights)

    def cost(s, i, j):
        return prefix[j] - prefix[i] if j <= reach[s].get(i, -1) else inf

    limit = _least_bottleneck(n, pp, cost)
    return _least_squares_within(n, pp, cost, limit + abs(limit) * 1e-12)


def _reach(starts: list, stage: int, fits, stop: int) -> dict:
    """For each start i (ascending), the largest stop j <= `stop` with fits(stage, i, j); i when not even layer
    i fits. Non-decreasing in i, so one pass over the layers: O(n) calls."""
    out, j = {}, 0
    for i in starts:
        j = max(j, i)
        while j < stop and fits(stage, i, j + 1):
            j += 1
        out[i] = j
    return out


def _least_bottleneck(n: int, pp: int, cost) -> float:
    """The least max_s cost(s, start, stop) over splits of n layers into pp non-empty stages (inf: none)."""
    check_stages(n, pp)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp)]  # best[s][j]: least bottleneck of layers :j on stages 0..s
    for j in range(1, n - pp + 2):
        best[0][j] = cost(0, 0, j)
    for s in range(1, pp):
        for j in range(s + 1, n - pp + s + 2):
            best[s][j] = min(max(best[s - 1][i], cost(s, i, j)) for i in range(s, j))
    return best[pp - 1][n]


def _least_squares_within(n, pp, cost, limit) -> list[int]:
    """Among splits whose every stage costs <= limit, the one with least sum of squared costs."""
    inf = float("inf")
    acc = [[inf] * (n + 1) for _ in range(pp + 1)]  # acc[s][j]: layers :j on stages 0..s-1
    back = [[0] * (n + 1) for _ in range(pp + 1)]
    acc[0][0] = 0.0
    for s in range(1, pp + 1):
        for j in range(s, n - pp + s + 1):
            for i in range(s - 1, j):
                c = cost(s - 1, i, j)
                if c <= limit and acc[s - 1][i] + c * c < acc[s][j]:
                    acc[s][j], back[s][j] = acc[s - 1][i] + c * c, i
    parts = [n]
    for s in range(pp, 0, -1):
        parts.append(back[s][parts[-1]])
    return parts[::-1]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's runtime/utils.py partition_uniform: equal counts, the first stages take the rest."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights, num_parts: int) -> list[int]:
    """DeepSpeed's runtime/utils.py partition_balanced, step for step (same float sums, same ties):
    a DP minimising (largest - smallest) stage, keeping the last k on ties."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0] + [float(x) for x in _prefix(weights)[1:]]
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                if dp_cost[i][j] >= max_sum - min_sum:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = max_sum - min_sum, max_sum, min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]
