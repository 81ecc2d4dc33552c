"""Rank 0's progress: the opening block (describe: what the run is, every rank counting its parameters; start_lines,
with StartClock's "ready after"), then per step a line
in OUT/metrics.jsonl, a bar on a terminal or a plain line in a log file, and the experiment trackers
(--report-to)."""

import json
from pathlib import Path

from toolkit.train.report.summary import run_throughput


class StartClock:
    """Wall-clock marks from the launch to the first step (rank 0's "ready after" line): launch.sh's start
    (DSTK_LAUNCHED_AT), this process's start (/proc), then each phase's end as the run marks it."""

    def __init__(self):
        import os
        import time

        launched = os.environ.get("DSTK_LAUNCHED_AT")
        self.marks = [("launch", float(launched) if launched else None), ("launcher", _process_start()),
                      ("imports", time.time())]

    def mark(self, phase: str) -> None:
        import time

        self.marks.append((phase, time.time()))

    def phases(self) -> dict:
        """{phase: seconds it took}, and "total" from the first known mark."""
        known = [(name, at) for name, at in self.marks if at is not None]
        out = {name: round(at - before, 2) for (_, before), (name, at) in zip(known, known[1:])}
        return {**out, "total": round(known[-1][1] - known[0][1], 2)}


def _process_start():
    """This process's start, wall clock (Linux: /proc/self/stat's starttime after /proc/stat's btime)."""
    import os

    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def describe(args, cfg: dict, topo, batch, engine, record: dict, start: int, steps: int, resume) -> dict:
    """What the run is, for rank 0's opening block and the summary: model, dtype, layout, batch,
    parameters (counted over the world: a collective, every rank calls it), LoRA, resume."""
    from toolkit.train.engine import dtype_of
    from toolkit.train.report.footprint import parameter_counts

    params, trainable = parameter_counts(engine, topo, record)
    dtype = dtype_of(cfg)
    name = (args.hub_ids or {}).get("--model") or Path(args.model).name or args.model  # a hub id, not its commit
    return {"model": args.model, "model_name": name, "from_dir": Path(args.model).is_dir(),
            "seed": args.seed, "dtype": dtype, "params": params, "trainable": trainable,
            "layout": {"dp": topo.dp, "pp": topo.pp, "tp": topo.tp, "sp": topo.sp,
                       "schedule": args.schedule if topo.pp > 1 else None,  # pp 1 runs no pipeline schedule
                       "zero_stage": (cfg.get("zero_optimization") or {}).get("stage", 0),
                       **({"ep": record["expert_parallel"]} if record.get("expert_parallel") else {})},
            "mbs": batch.mbs, "gas": batch.gas, "gbs": batch.gbs, "seq_len": args.seq_len,
            "lora": record.get("lora_adapters") or record.get("lora"), "start_step": start, "steps": steps,
            "resume": resume, "tiled_loss": getattr(engine.module, "dstk_tiled_loss", None),
            "tiled_mlp": getattr(engine.module, "dstk_tiled_mlp", None),
            "offload_activations": getattr(engine.module, "dstk_offload_activations", None)}


def trust_notes(args) -> list:
    """The opening block's word on --trust-checkpoint: the checkpoint was loaded as pickles, unchecked."""
    if not args.trust_checkpoint:
        return []
    return ["--trust-checkpoint: the checkpoint's .pt files were loaded as pickles (torch.load weights_only=False), "
            "unchecked: any code in them ran"]


def start_lines(about: dict) -> list:
    """Rank 0's opening block: what runs, on what layout and batch, from where (prepare's `about`)."""
    lay, lines = about["layout"], []
    weights = f"weights from {about['model']}" if about["from_dir"] else f"random weights (seed {about['seed']})"
    lines.append(f"model: {about['model_name']}, {weights}, {about['dtype']}; {_count(about['params'])} parameters")
    ranks = lay["dp"] * lay["pp"] * lay["tp"] * lay.get("sp", 1)
    schedule = f", schedule {lay['schedule']}" if lay.get("schedule") else ""  # pp > 1 only
    lines.append(f"layout: dp {lay['dp']} x pp {lay['pp']} x tp {lay['tp']} x sp {lay.get('sp', 1)} = {ranks} rank{'s' if ranks != 1 else ''}"
                 f"{schedule}, ZeRO {lay['zero_stage']}; batch: micro-batch {about['mbs']} x gas {about['gas']} x dp "
                 f"{lay['dp']} = {about['gbs']} rows of {about['seq_len']} tokens per step")
    if lay.get("ep"):  # DeepSpeed's AutoEP (toolkit.config.rules.expert_parallel)
        lines.append(f"experts: ep {lay['ep']} (DeepSpeed AutoEP): each group of {lay['ep']} data-parallel ranks "
                     f"shares one copy of the experts, each rank holding 1/{lay['ep']} of every MoE block's experts")
    if about.get("tf32_note"):  # toolkit.train.tf32: an fp32 run on a GPU with TF32 left off, or what --tf32 did
        lines.append(about["tf32_note"])
    lora = about.get("lora")
    trains = f"{_count(about['trainable'])} ({100 * about['trainable'] / max(about['params'], 1):.2f}%)"
    if lora:
        targets = lora.get("adapted") or lora.get("targets")  # linears, fused expert parameters
        lines.append(f"LoRA: r {lora['r']}, alpha {lora.get('alpha') or 2 * lora['r']}, on "
                     f"{', '.join(targets or ['the default targets'])}; {trains} parameters train")
        if lora.get("experts_frozen"):  # an MoE model whose experts the flags leave out (models.lora.adapters)
            lines.append(f"LoRA: {lora['experts_frozen']}")
    else:
        lines.append(f"training: all {trains} trainable parameters")
    if about.get("objective"):  # --objective dpo (toolkit.train.preference.opening_line)
        lines.append(about["objective"])
    if about.get("tiled_loss"):  # (on, why): models.tiled.loss.choose
        on, why = about["tiled_loss"]
        lines.append(f"loss: {'tiled, the logits never whole' if on else 'whole logits'} ({why})")
    if about.get("tiled_mlp"):  # (on, why, shards): models.tiled.mlp.decide
        on, why, shards = about["tiled_mlp"]
        lines.append(f"mlp: {f'tiled in {shards} shards per micro-batch' if on else 'whole'} ({why})")
    if about.get("offload_activations"):  # (on, why): models.tiled.offload.choose
        from models.tiled.offload import NO_CHECKPOINTS

        on, why = about["offload_activations"]
        where = "none" if why == NO_CHECKPOINTS else "offloaded to host memory" if on else "kept on the device"
        lines.append(f"checkpoints: {where} ({why})")
    resume = about.get("resume")
    steps = f"steps {about['start_step'] + 1}..{about['steps']}"
    if resume:
        saved = resume["saved"]
        extra = (f" x sp {saved['sp']}" if saved.get("sp", 1) > 1 else "") + (
            f", ep {saved['expert_parallel']}" if saved.get("expert_parallel") else "")
        lines.append(f"resume: from {resume['tag']} (step {about['start_step']}), written on dp {saved.get('dp')} x pp "
                     f"{saved.get('pp')} x tp {saved.get('tp', 1)}{extra}, ZeRO {saved.get('zero_stage')}; {steps}")
        lines += [f"note: {note}" for note in resume.get("notes") or []]  # an input moved, or not checkable
    else:
        lines.append(f"fresh run: {steps}")
    took = dict(about.get("startup") or {})
    total = took.pop("total", None)
    if total is not None:
        lines.append(f"ready after {total:.1f} s: " + ", ".join(f"{name} {sec:.1f}" for name, sec in took.items()))
    return lines


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


SHOWN = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s")  # what the bar and the plain lines show


class ProgressLog:
    """Rank 0's output: one JSON line per step in metrics.jsonl, the experiment trackers (--report-to:
    trackers.Trackers), and progress for a person: a tqdm bar (loss, lr, tokens/s) on a terminal, else (a
    log file, a batch job) a plain line every N steps. MFU joins each step's record on CUDA."""

    def __init__(self, folder, job, args, trackers: tuple = ()):
        import sys

        from tqdm import tqdm

        from toolkit import data
        from toolkit.train.report.trackers import Trackers

        folder.metrics.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(folder.metrics, "a")
        self.job, self.args = job, args
        self.every = args.log_every or max(1, (job.steps - job.start_step) // 20)
        self.last = job.steps
        tty = args.progress and sys.stderr.isatty()
        self.bar = tqdm(total=job.steps, initial=job.start_step, disable=not tty, unit="step")
        self.plain = args.progress and not tty
        for line in start_lines(job.about) if job.about else []:
            self.bar.write(line)
        if job.data_info:  # what was read and inferred, truncated and dropped: never silently
            self.bar.write(data.Prepared(None, None, job.data_info).message())
        self.mfu_per_rate = run_throughput({"tokens_per_s": 1.0}, job, args)["mfu"]  # None off CUDA
        testing = ("crash_at_step", "crash_in_step", "stall_at_step")  # the test suite's hooks
        hparams = {"args": {k: v for k, v in vars(args).items() if k not in testing},
                   "layout": (job.about or {}).get("layout") or {}, "deepspeed": job.config or {}}
        self.trackers = Trackers(trackers, folder, hparams, resume=job.start_step > 0)
        if self.trackers.where():
            self.bar.write(self.trackers.where())

    def write(self, record: dict):
        if self.mfu_per_rate is not None:
            record["mfu"] = self.mfu_per_rate * record["tokens_per_s"]
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.trackers.log(record, record["step"])
        shown = {k: f"{record[k]:.4g}" for k in SHOWN if isinstance(record.get(k), (int, float))}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)
        if self.plain and (record["step"] % self.every == 0 or record["step"] == self.last):
            self.bar.write(f"step {record['step']}/{self.last} " + " ".join(f"{k} {v}" for k, v in shown.items()))

    def close(self, summary: dict):
        """Add the throughput fields (mfu_fields) to `summary`, the caller's dict too, and write it last; the
        final eval loss goes to the trackers at the last step."""
        summary.update(run_throughput(summary, self.job, self.args))
        self.file.write(json.dumps({"summary": summary}) + "\n")
        self.file.close()
        if summary.get("eval_loss") is not None:
            self.trackers.log({"eval_loss": summary["eval_loss"], "eval_ppl": summary.get("eval_ppl")}, summary["steps"])
        self.trackers.close()
        self.bar.close()
