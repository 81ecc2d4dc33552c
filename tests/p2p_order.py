"""Does a pipeline's order of sends, receives and collectives finish on NCCL? A model of NCCL's matching, run on
each rank's program: the units it issues, in order (docs/deepspeed.md, "DualPipeV on NCCL", gives the reasons).

    programs = dualpipev_programs(pp=4, gas=8)        # what DeepSpeed's DualPipeVEngine issues, per global rank
    stuck(programs)                                   # {} : every rank ran its last unit
    stuck(programs, comms="lazy", world_ready=False)  # {rank: (unit index, unit)} where ranks wait on each other

A program is a list of units, each a dict: {"kind": "send"|"recv", "ops": [op]} for a blocking send or receive,
{"kind": "batch", "ops": [op, ...]} for one batch_isend_irecv, {"kind": "coll", "name": ..., "group": [ranks]}
for a collective; an op is [direction ("send"|"recv"), peer (global rank), what] (what: a label or a size;
the two ends of one transfer must agree on it). The rules:
- a rank runs its units one at a time, in order: DeepSpeed waits on every request before it issues the next
  unit, and on NCCL each operation's stream waits for the compute stream, which waits for the last operation;
- the k-th send from a to b on a communicator meets b's k-th receive from a there; it completes only when both
  units are running (NCCL and gloo both hold a send until the receive is posted, gloo by its recv-ready
  notification, NCCL for any message its buffers cannot take);
- the ops of one unit progress together (NCCL: "calls within a group ... should never block each other"),
  a unit ends when all its ops have met theirs; a collective ends when every rank of its group is at it.
Communicators (comms): "eager" (torch's init_process_group with device_id, which DeepSpeed passes on CUDA; gloo
matches the same way): every op of a process group on that group's one communicator. "lazy" (no device_id):
a blocking send/recv on a 2-rank communicator of its own pair, a batch on the group's communicator; the first
op on a communicator first creates it, with every one of its ranks present (a collective). world_ready: WORLD's
communicator was made before the programs start (dstk's process_group.init does it with its device all_gather).
"""

from collections import Counter, defaultdict

WORLD = "world"


def stuck(programs: list, comms: str = "eager", world_ready: bool = True) -> dict:
    """{rank: (index, unit)} of the ranks that never finish, waiting at that unit; {} when all do. Raises
    ValueError when the two ends of a transfer disagree (a unit that would corrupt data or fail on its own)."""
    progs = [_with_creation(p, r, len(programs), comms, world_ready) for r, p in enumerate(programs)]
    ends = []  # per rank, per unit: [(meeting point, direction, what)]
    for r, prog in enumerate(progs):
        counts = Counter()
        ends.append([_keys(unit, r, counts, comms, len(progs)) for unit in prog])
    _check_ends(ends)
    pc = _run([[[point for point, _, _ in unit] for unit in per_rank] for per_rank in ends])
    return {r: (pc[r], progs[r][pc[r]]) for r in range(len(progs)) if pc[r] < len(progs[r])}


def _run(keys: list) -> list:
    """How far each rank gets (its index of the first unit it never finishes) when a rank's running unit ends
    once every meeting point of it has been held, at one time, by as many ranks as it needs (_ends)."""
    pc, done = [0] * len(keys), set()
    while True:
        posted = defaultdict(set)  # meeting point -> ranks whose running unit holds it
        for r, units in enumerate(keys):
            for point in units[pc[r]] if pc[r] < len(units) else ():
                posted[point].add(r)
        moved = False
        for r, units in enumerate(keys):
            if pc[r] < len(units):
                done.update((r, point) for point in units[pc[r]] if len(posted[point]) == _ends(point))
                if all((r, point) in done for point in units[pc[r]]):
                    pc[r], moved = pc[r] + 1, True
        if not moved:
            return pc


def _comm(unit: dict, rank: int, peer: int | None, comms: str, world: int) -> tuple:
    """(communicator, its ranks) that a unit's op (with `peer`) uses: its process group's ("comm": the group's
    name, default WORLD; "group": its ranks, default all), or under lazy communicators a blocking send or recv's
    pair."""
    group = tuple(unit.get("group") or range(world))
    name = unit.get("comm") or (WORLD if len(group) == world else group)  # unnamed: one group per set of ranks
    if comms == "lazy" and unit["kind"] in ("send", "recv"):
        pair = (min(rank, peer), max(rank, peer))
        return ("pair", name, *pair), pair
    return name, group


def _with_creation(program: list, rank: int, world: int, comms: str, world_ready: bool) -> list:
    """Under lazy communicators, the program with a creating collective before each communicator's first use."""
    if comms == "eager":
        return list(program)
    made, out = {WORLD} if world_ready else set(), []
    for unit in program:
        peers = [op[1] for op in unit.get("ops", [])] or [None]
        for comm, group in dict.fromkeys(_comm(unit, rank, peer, comms, world) for peer in peers):
            if comm not in made:
                made.add(comm)
                out.append({"kind": "coll", "name": f"create {comm}", "comm": comm, "group": list(group),
                            "create": True})
        out.append(unit)
    return out


def _keys(unit: dict, rank: int, counts: Counter, comms: str, world: int) -> list:
    """The meeting points of a unit's ops, each (point, direction, what): point (comm, src, dst, k) for the k-th
    transfer from src to dst on a communicator, ("coll" | "create", comm, k, group size) for the k-th collective
    there (direction and what None). counts: this rank's tally so far, updated."""
    if unit["kind"] == "coll":
        comm, group = _comm(unit, rank, None, comms, world)
        channel = ("create" if unit.get("create") else "coll", comm)
        counts[channel] += 1
        return [((*channel, counts[channel], len(group)), None, None)]
    found = []
    for direction, peer, what in unit["ops"]:
        comm, _ = _comm(unit, rank, peer, comms, world)
        src, dst = (rank, peer) if direction == "send" else (peer, rank)
        counts[(comm, src, dst, direction)] += 1
        found.append(((comm, src, dst, counts[(comm, src, dst, direction)]), direction, what))
    return found


def _ends(point: tuple) -> int:
    """How many ranks hold a meeting point at once when it is met: a collective's group; a transfer: 2."""
    return point[-1] if point[0] in ("create", "coll") else 2


def _check_ends(keys: list) -> None:
    """Each transfer's send and receive agree on what travels."""
    ends = defaultdict(dict)
    for r, per_unit in enumerate(keys):
        for i, unit_keys in enumerate(per_unit):
            for point, direction, what in unit_keys:
                if direction is not None:
                    ends[point][direction] = (what, r, i)
    for point, both in ends.items():
        if len(both) == 2 and both["send"][0] != both["recv"][0]:
            raise ValueError(f"transfer {point}: sent {both['send']}, received as {both['recv']}")


def dualpipev_programs(pp: int, gas: int, dp: int = 1, acts: int = 2, batches: int = 1,
                       forward_only: bool = False) -> list:
    """Per global rank (stage * dp + replica, DeepSpeed's PipeDataParallelTopology), the units DeepSpeed 0.19.8's
    DualPipeVEngine issues: the engine's p2p warm-up (PipelineEngine.__init__), then `batches` runs of
    DualPipeVSchedule(gas, pp, stage) as dualpipev.py executes it (a phase's first SendActivation / RecvActivation
    sends / receives the shapes with a blocking p2p.send / p2p.recv, `_send_tensor_meta`; every other transfer is
    queued and sent at the next CommitP2P as one batch_isend_irecv), each batch followed by its collectives: the
    gradients' all-reduce over the stage's dp group, the loss broadcast over the pipeline. acts: tensors a stage
    sends (dstk: hidden states and int64 document ids; one of them floating: one gradient)."""
    from deepspeed.runtime.pipe import schedule as ds

    programs = []
    for rank in range(pp * dp):
        stage, replica = divmod(rank, dp)
        units, shaped = _warm_up(stage, pp, dp, replica), set()  # shaped: (direction, phase) whose shapes went
        for _ in range(batches):
            units += [{"kind": "coll", "name": "barrier"}] if forward_only else []  # eval_batch's, on WORLD
            queue = []
            for cmd in (c for step in ds.DualPipeVSchedule(gas, pp, stage, forward_only).steps() for c in step):
                if isinstance(cmd, ds.CommitP2P) and queue:
                    units.append({"kind": "batch", "ops": queue})
                    queue = []
                elif isinstance(cmd, (ds.SendActivation, ds.RecvActivation, ds.SendGrad, ds.RecvGrad)):
                    direction, peer, what = _transfer(cmd, ds, stage * dp + replica, dp, acts)
                    if what != ["grad"] and (direction, cmd.phase) not in shaped:  # _send/_recv_tensor_meta
                        shaped.add((direction, cmd.phase))
                        units.append({"kind": direction, "ops": [[direction, peer, "meta"]]})
                    queue += [[direction, peer, label] for label in what]
            units += _tail(stage, pp, dp, replica, forward_only)
        programs.append(units)
    return programs


def _transfer(cmd, ds, rank: int, dp: int, acts: int) -> tuple:
    """(direction, peer, what travels) of a Send/Recv instruction: phase 0's activations go to the next stage,
    phase 1's to the previous one, gradients the other way."""
    ahead = dp if cmd.phase == 0 else -dp  # the global rank of the phase's next stage, relative to this one
    return {ds.SendActivation: ("send", rank + ahead, [f"act{i}" for i in range(acts)]),
            ds.RecvActivation: ("recv", rank - ahead, [f"act{i}" for i in range(acts)]),
            ds.SendGrad: ("send", rank - ahead, ["grad"]),
            ds.RecvGrad: ("recv", rank + ahead, ["grad"])}[type(cmd)]


def _warm_up(stage: int, pp: int, dp: int, replica: int) -> list:
    """PipelineEngine.__init__'s "just send a 0": even stages send on then receive, odd ones the other way."""
    nxt = [{"kind": "send", "ops": [["send", (stage + 1) * dp + replica, "zero"]]}] if stage < pp - 1 else []
    prv = [{"kind": "recv", "ops": [["recv", (stage - 1) * dp + replica, "zero"]]}] if stage > 0 else []
    return nxt + prv if stage % 2 == 0 else prv + nxt


def _tail(stage: int, pp: int, dp: int, replica: int, forward_only: bool) -> list:
    """A batch's collectives after its schedule: ReduceGrads (dp > 1) and the loss broadcast from stage 0."""
    reduce = [{"kind": "coll", "name": "all_reduce", "group": [stage * dp + d for d in range(dp)]}]
    bcast = [{"kind": "coll", "name": "broadcast", "group": [s * dp + replica for s in range(pp)]}]
    return (reduce if dp > 1 and not forward_only else []) + bcast
