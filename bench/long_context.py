"""Long sequences on CPU: the longest sequence that trains within one activation budget per rank at sp = 1, 2 and 4,
before and after each long-sequence feature of `dstk train` (rows, each adding one: activation checkpointing, the
tiled loss, the tiled MLP, the checkpointed activations offloaded; then dstk's defaults), with tokens/s and the
planner's prediction beside each; then where the planner puts dstk's GPU path against ALST (arXiv 2506.13996:
Llama-3.1-8B, 500K tokens on one H100, 3.7M on 8).

    python bench/long_context.py                                   # ~30 minutes on 2 idle cores (~40 launches)
    python bench/long_context.py --sps 1 2 --cap 4096 --reps 1     # ~12 minutes idle; 21 under a load average of 8

Model: a small Llama built here (hidden 256, 2 blocks, 8 heads, 4 key/value heads, max positions 2^20) with a 32000-
token vocabulary, so that the loss weighs as in Llama (bench/tiled_loss.py's), random weights, the byte tokenizer, fp32,
ZeRO-0, mbs 1, gas 1, dp 1 (world = sp), cpus / sp threads per rank, one document per row: every run is `launch.sh` like
a user's. Activations: the peak resident set the run logs (peak_mem_mib, the largest over ranks; glibc's blocks of 64
KiB and more mmap'd, MMAP_THRESHOLD) less that of a baseline run (no feature) of BASE_TOKENS tokens per rank at the same sp
(the process, the model states and that run's activations, the loss's peak mostly). A row whose flags settle as an earlier row's at a length (the defaults where auto turns nothing on)
takes that row's run there. Search: from a length known to fit
(the previous row's longest at this sp, or this row's at the sp before; --start at first; never
below twice the baseline's length) the length doubles while the
activations stay within --budget-mib, up to --cap (--bisect: then one step halfway to the first failing length); a
start that does not fit halves, down to twice the baseline's length. A run whose ranks pass --kill-at x the budget is stopped there (its activations are
then a lower bound). The planner's figures: its activations for the same layout, flags and length less its own for
the baseline run (toolkit.plan.layouts: pp 1, ZeRO-0, fp32), and its longest on the same lengths (not capped); where
the run's loss is tiled, plus the head's weight gradient (hidden x vocab fp32): the tiled loss sums it from its first
tile, so it is alive at the run's peak, while the baseline (whole logits) peaks in its loss before it exists; the
planner counts every gradient among the model states, alive the whole step. Tokens/s: the
median per-step tokens/s (the first step left out) at the row's common length, the longest every sp of the row
trained; --reps > 1 adds runs there, sps alternated.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import build_llama, launch, tree_peak_mib, write_markdown, write_result  # noqa: E402
from bench.long_context_tables import markdown  # noqa: E402

ARCH = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "intermediate_size": 688, "max_position_embeddings": 2**20}
VOCAB = 32000
# tokens per rank of the baseline run every activation figure is above (its length: BASE_TOKENS x sp): enough that
# its peak is in its loss, as the longer runs' are, not in the model states' moments (the end of backward: every
# gradient and DeepSpeed's flat copy for its all-reduce, 136 MiB here; traced by counting torch's allocations)
BASE_TOKENS = 512
ZERO = 0  # ZeRO-1 adds its step's moment (the fp32 gradient partition and AdamW's temporaries), above 128 tokens' loss
PLANNER_CAP = 2**20
# glibc serves blocks of 64 KiB and more (every tensor here but the smallest) from mmap and unmaps them when freed,
# so the resident set follows the live tensors, as a GPU allocator's count does: with its moving threshold it keeps
# freed blocks instead and one run's peak varies by 60 MiB and more from another's at the same length (1 MiB here)
MMAP_THRESHOLD = 2**16
GiB, MiB = 2**30, 2**20
MODEL_WORDS = (f"Model: small Llama (hidden {ARCH['hidden_size']}, {ARCH['num_hidden_layers']} blocks, "
               f"{ARCH['num_attention_heads']} heads, {ARCH['num_key_value_heads']} kv heads) with a {VOCAB}-token "
               "vocabulary, fp32, ZeRO-0, mbs 1, one document per row.")
CKPT = {"activation_checkpointing": {"partition_activations": False}}  # dstk: HF gradient checkpointing at pp 1


class Row:
    """One line of the table: dstk train's flags for it, whether checkpointing is on, and the row whose longest
    (at the same sp) is known to fit here too (this row holds at most its activations at every length)."""

    def __init__(self, name: str, checkpointing: bool, tiled_loss: str, tiled_mlp: str, after: str | None,
                 offload: str = "off"):
        self.name, self.checkpointing, self.tiled_loss, self.tiled_mlp, self.after, self.offload = (
            name, checkpointing, tiled_loss, tiled_mlp, after, offload)

    @property
    def flags(self) -> tuple:
        return ("--tiled-loss", self.tiled_loss, "--tiled-mlp", self.tiled_mlp, "--offload-activations", self.offload)

    def resolved(self, sp: int, length: int) -> tuple:
        """(checkpointing, tiled loss on, tiled MLP on, offload on) as dstk train settles this row's flags at `length`
        under sp on a CPU (models.tiled's choose on a rank's length / sp tokens, fp32): rows that agree run the same
        computation."""
        from models.tiled import loss, mlp, offload

        tokens = length // sp
        mlp_on = mlp.choose(self.tiled_mlp, tokens, ARCH["hidden_size"], ARCH["intermediate_size"], 4)[0]
        offload_on = offload.choose(self.offload, 0, self.checkpointing, "cpu")[0]
        return self.checkpointing, loss.choose(self.tiled_loss, tokens, VOCAB)[0], mlp_on, offload_on

    @property
    def words(self) -> str:
        ckpt = "activation checkpointing" if self.checkpointing else "no checkpointing"
        return (f"{ckpt}, --tiled-loss {self.tiled_loss}, --tiled-mlp {self.tiled_mlp}, "
                f"--offload-activations {self.offload}")


ROWS = [Row("baseline", False, "off", "off", None), Row("+ checkpointing", True, "off", "off", "baseline"),
        Row("+ tiled loss", True, "on", "off", "+ checkpointing"), Row("+ tiled MLP", True, "on", "on", "+ tiled loss"),
        Row("+ offload activations", True, "on", "on", "+ tiled MLP", offload="on"),  # on a CPU: copies, no saving
        Row("all (defaults)", True, "auto", "auto", "+ checkpointing", offload="auto")]


def build_model(folder: Path) -> Path:
    return build_llama(folder, ARCH, VOCAB)


def corpus(path: Path, length: int, rows: int) -> Path:
    """`rows` documents of `length` + 64 bytes of words, blank-line separated: one truncated row each."""
    import random

    rng = random.Random(length)
    words = ["the", "pipeline", "stage", "sends", "tokens", "attention", "heads", "gradient", "sequence", "rank"]
    docs = []
    for _ in range(rows):
        text = []
        while sum(map(len, text)) + len(text) < length + 64:
            text.append(rng.choice(words))
        docs.append(" ".join(text))
    path.write_text("\n\n".join(docs) + "\n")
    return path


def run(model: Path, sp: int, length: int, steps: int, tmp: Path, flags: tuple = (), config: dict | None = None,
        threads: int = 1, limit_mib: float | None = None) -> dict | None:
    """One `launch.sh` run of sp ranks at `length` tokens per row (`flags` more for dstk train, `config` more for its
    DeepSpeed config, `threads` per rank): its peak and median tokens/s, None when it failed. Stopped once a rank's
    peak resident set passes `limit_mib`: then {"peak_mib": what it had reached, "killed": True}."""
    name = f"sp{sp}_{length}_{len(list(tmp.iterdir()))}"
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": ZERO}, "steps_per_print": 10**6, **(config or {})}
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    data = corpus(tmp / f"{name}.txt", length, steps + 1)
    cmd = ["bash", str(REPO / "launch.sh"), "--num-gpus", str(sp), "--config", str(tmp / f"{name}.json"), "--",
           "--model", str(model), "--data", str(data), "--seq-len", str(length), "--steps", str(steps),
           "--eval-fraction", "0", "--no-export", "--no-progress", "--out", str(tmp / name), *flags]
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO),
               MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    seen = [0.0]

    def over(pid: int) -> bool:
        seen[0] = max(seen[0], tree_peak_mib(pid))
        return seen[0] > limit_mib

    rc, wall = launch(cmd, tmp / f"{name}.log", env, timeout=1800, watch=None if limit_mib is None else over)
    if rc is None and limit_mib is not None and seen[0] > limit_mib:
        return {"peak_mib": seen[0], "killed": True, "wall_s": wall}
    metrics = tmp / name / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        print(f"  sp {sp} at {length} tokens failed (exit {rc}); log: {tmp / f'{name}.log'}", flush=True)
        return None
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    return {"peak_mib": max(r["peak_mem_mib"] for r in records),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:] or records),
            "step_tokens_per_s": [r["tokens_per_s"] for r in records], "wall_s": wall}


def predicted_activations(model: Path, sp: int, length: int, row: Row = ROWS[0]) -> int:
    """The planner's activation bytes for this layout (pp 1, dp 1, sp, ZeRO-0, mbs 1, fp32) with `row`'s features."""
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    result = make_plan(PlanRequest(model=str(model), gpus_per_node=sp, gbs=1, seq_len=length, precision="fp32",
                                   gpu_mem=2**50, tflops=1.0, checkpointing=row.checkpointing, offload=False,
                                   tiled_loss=row.tiled_loss, tiled_mlp=row.tiled_mlp,
                                   offload_activations="off"))  # on a CPU host memory is the device's: no saving
    return next(e.activations for e in result.fitting if (e.layout.pp, e.layout.sp, e.layout.zero, e.layout.tp,
                                                            e.layout.checkpointing) == (1, sp, ZERO, 1, row.checkpointing))


def base_len(sp: int) -> int:
    return BASE_TOKENS * sp


def predicted_share(model: Path, sp: int, length: int, row: Row) -> float:
    """MiB the planner counts above the baseline run at `sp`: its activations at `length` less the baseline's, and the
    head's weight gradient where the run's loss is tiled (module docstring)."""
    head_grad = 4 * ARCH["hidden_size"] * VOCAB if row.resolved(sp, length)[1] else 0
    return (predicted_activations(model, sp, length, row) + head_grad
            - predicted_activations(model, sp, base_len(sp))) / MiB


def predicted_longest(model: Path, sp: int, row: Row, budget_mib: float, bisect: bool) -> int | None:
    """The planner's longest on the benchmark's lengths: powers of two from MIN_LEN until the first that does not fit
    (--bisect: then halfway to it), up to PLANNER_CAP."""
    best, length = None, 2 * base_len(sp)
    while length <= PLANNER_CAP and predicted_share(model, sp, length, row) <= budget_mib:
        best, length = length, 2 * length
    if bisect and best and length <= PLANNER_CAP and predicted_share(model, sp, best * 3 // 2, row) <= budget_mib:
        best = best * 3 // 2
    return best


class Bench:
    """The runs of one benchmark: the model, the options and the base run's peak per sp."""

    def __init__(self, model: Path, args, tmp: Path):
        self.model, self.args, self.tmp, self.base = model, args, tmp, {}
        self.done = {}  # (sp, length, Row.resolved) -> a run's measures: a row whose flags settle alike reuses them

    def launch(self, row: Row, sp: int, length: int, limit_mib: float | None = None) -> dict | None:
        return run(self.model, sp, length, self.args.steps, self.tmp, flags=row.flags, limit_mib=limit_mib,
                   config=CKPT if row.checkpointing else None, threads=max(1, (os.cpu_count() or 1) // sp))

    def attempt(self, row: Row, sp: int, length: int) -> dict:
        """One run at `length`: its activations against the budget and the planner's."""
        budget, base, key = self.args.budget_mib, self.base[sp], (sp, length, row.resolved(sp, length))
        if key not in self.done:  # the defaults at lengths where auto turns nothing on: + checkpointing's run
            limit = base + self.args.kill_at * budget if self.args.kill_at else None
            self.done[key] = self.launch(row, sp, length, limit)
        got = self.done[key]
        out = {"length": length, "predicted_mib": predicted_share(self.model, sp, length, row)}
        if got is None:
            out["status"] = "failed"
        else:
            share = got["peak_mib"] - base
            out.update(activation_mib=share, ratio=share / out["predicted_mib"] if out["predicted_mib"] > 0 else None,
                       tokens_per_s=got.get("tokens_per_s"), step_tokens_per_s=got.get("step_tokens_per_s"),
                       wall_s=got["wall_s"],
                       status="killed" if got.get("killed") else "fits" if share <= budget else "over")
        print(f"  {row.name}, sp {sp}, {length} tokens: {out['status']}, "
              f"{out.get('activation_mib', float('nan')):.0f} MiB (planner {out['predicted_mib']:.0f}), "
              f"{out.get('wall_s', float('nan')):.0f} s", flush=True)
        return out

    def longest(self, row: Row, sp: int, start: int) -> dict:
        """Double from `start` (halve while it does not fit) to the longest length within the budget."""
        tried, length = [], max(min(start, self.args.cap), 2 * base_len(sp))

        def fits(n: int) -> bool:
            tried.append(self.attempt(row, sp, n))
            return tried[-1]["status"] == "fits"

        best = length if fits(length) else None
        while best and 2 * best <= self.args.cap and fits(2 * best):
            best *= 2
        while best is None and length // 2 >= 2 * base_len(sp):
            length //= 2
            best = length if fits(length) else None
        failing = min((t["length"] for t in tried if t["status"] != "fits" and t["length"] > (best or 0)), default=None)
        if self.args.bisect and best and failing and best * 3 // 2 < failing and fits(best * 3 // 2):
            best = best * 3 // 2
        return {"row": row.name, "flags": row.words, "sp": sp, "status": "ok", "longest": best,
                "capped": bool(best) and failing is None,
                "predicted_longest": predicted_longest(self.model, sp, row, self.args.budget_mib, self.args.bisect),
                "tried": sorted(tried, key=lambda t: t["length"])}

    def rows(self) -> list:
        """Every row at every sp: sp by sp, each row's search started where a row known to use no more fitted."""
        found = {}
        for sp in self.args.sps:
            base = self.launch(ROWS[0], sp, base_len(sp))
            for row in ROWS:
                if base is None:
                    found[row.name, sp] = {"row": row.name, "flags": row.words, "sp": sp,
                                            "status": "failed at the base length"}
                    continue
                self.base[sp] = base["peak_mib"]
                before = [found.get((row.name, s), {}).get("longest") for s in self.args.sps if s < sp]
                start = before[-1] if before and before[-1] else found.get((row.after, sp), {}).get("longest")
                found[row.name, sp] = {**self.longest(row, sp, start or self.args.start),
                                       "base_peak_mib": base["peak_mib"]}
        return [[found[row.name, sp] for sp in self.args.sps] for row in ROWS]

    def speed(self, cells: list) -> dict:
        """Per-step tokens/s at the row's common length (the longest all its sps trained): the search's run there and
        more, sps alternated, up to --reps runs of each (one at least where the search did not run that length)."""
        lengths = [c.get("longest") for c in cells]
        if not all(lengths):
            return {"length": None}
        common, row = min(lengths), next(r for r in ROWS if r.name == cells[0]["row"])
        steps = {c["sp"]: [t["step_tokens_per_s"] for t in c["tried"] if t["length"] == common][:1] for c in cells}
        for round_ in range(max(self.args.reps, 1)):
            for sp, runs in steps.items():
                if len(runs) <= round_:
                    got = self.launch(row, sp, common)
                    runs.append(got["step_tokens_per_s"] if got else [])
        median = {sp: statistics.median(v for run in runs for v in run[1:]) if any(run[1:] for run in runs) else None
                  for sp, runs in steps.items()}
        return {"length": common, "median_tokens_per_s": median, "step_tokens_per_s": steps}


def alst_comparison(tmp: Path) -> list:
    """The longest sequence (a power-of-two multiple of 16K tokens) `dstk plan` fits for Llama-3.1-8B (rope
    scaled to 4M positions, as ALST runs it) on 1 and on 8 H100 80GB, any layout, bf16, checkpointing and offload
    allowed, gbs = dp: what dstk's GPU path would train per the planner, next to ALST's measured 500K and 3.7M."""
    from dataclasses import replace

    from toolkit.plan.arch import load_arch
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    arch = replace(load_arch("llama-3-8b"), name="llama-3.1-8b-4M", max_positions=4 * 2**20)
    folder = tmp / "llama-3.1-8b"
    folder.mkdir(exist_ok=True)
    config = {"model_type": "llama", "hidden_size": arch.hidden, "num_hidden_layers": arch.layers,
              "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
              "intermediate_size": arch.intermediate, "vocab_size": arch.vocab, "max_position_embeddings": arch.max_positions,
              "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    def plan(gpus: int, length: int):  # ALST's rows: whole documents (no mask at pp 1)
        return make_plan(PlanRequest(model=str(folder), gpus_per_node=gpus, gpu="h100", gbs=1, seq_len=length,
                                     rows="full"))

    rows = []
    for gpus, alst in ((1, 500_000), (8, 3_700_000)):
        fits, length = 0, 16384
        while length <= 4 * 2**20 and plan(gpus, length).fitting:  # powers of two, then halves of the gap
            fits, length = length, 2 * length
        for _ in range(4 if fits and length <= 4 * 2**20 else 0):
            middle = (fits + length) // 2 // 16384 * 16384
            fits, length = (middle, length) if plan(gpus, middle).fitting else (fits, middle)
        best = None
        if fits:
            chosen = plan(gpus, fits).fitting[0]  # fastest first
            best = {"length": fits, "layout": chosen.layout.describe(), "memory_gib": chosen.memory / GiB,
                    "features": list(chosen.features), "host_activations_gib": chosen.host_activations / GiB}
        short = None
        if length <= 4 * 2**20:  # the least memory at the first length that does not fit, and the loss's peak there
            closest = plan(gpus, length).closest
            short = {"length": length, "memory_gib": closest.memory / GiB, "activations_gib": closest.activations / GiB,
                     "loss_peak_gib": closest.loss_peak / GiB, "layout": closest.layout.describe()}
        rows.append({"gpus": gpus, "alst_tokens": alst, "dstk_planned": best, "next_length": short})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=256, help="activations per rank, MiB")
    parser.add_argument("--cap", type=int, default=8192, help="longest length tried")
    parser.add_argument("--start", type=int, default=1024, help="the first length tried (baseline, first sp)")
    parser.add_argument("--bisect", action="store_true", help="one more run halfway to the first failing length")
    parser.add_argument("--kill-at", type=float, default=3, help="stop a run past this x the budget (0: never)")
    parser.add_argument("--reps", type=int, default=1, help="runs pooled for tokens/s at the common length")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    args.sps = sorted(args.sps)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="dstk-long-") as name:
        tmp = Path(name)
        (tmp / "runs").mkdir()
        bench = Bench(build_model(tmp / "model"), args, tmp / "runs")
        rows = bench.rows()
        speed = [bench.speed(cells) for cells in rows]
        alst = alst_comparison(tmp)
    load.append(os.getloadavg()[0])
    meta = {"model": MODEL_WORDS, "base_tokens": BASE_TOKENS, "zero": ZERO, "budget_mib": args.budget_mib, "cap": args.cap, "sps": args.sps,
            "reps": args.reps, "steps": args.steps, "bisect": args.bisect, "kill_at": args.kill_at, "load": load,
            "cpus": os.cpu_count()}
    write_result("long_context", {"meta": meta, "rows": rows, "throughput": speed, "alst": alst})
    lines = markdown(meta, rows, speed, alst)
    write_markdown("long_context", "Long sequences on CPU: each feature's longest sequence, and the planner against "
                   "ALST", lines)
    print("\n".join(lines))
    return 1 if any(c["status"] != "ok" or not c["longest"] for cells in rows for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
