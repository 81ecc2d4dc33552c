"""GPU fine-tuning throughput of THE trainer: each case runs `toolkit.train` through launch.sh (the deepspeed
launcher) as its own subprocess, on a ~1B Llama-style model (llama-3.2-1b's published dimensions, random
weights, dstk's byte tokenizer), bf16, `--attention sdpa`, seq 2048, on the shipped corpus. Skips, exit 0,
without CUDA.

    bench/gpu.sh                                                # plan_gpu.py, this, report.py (CUDA only)
    .venv/bin/python bench/gpu_finetune.py [--quick] [--gpus N] [--gpu h100-sxm] [--fused-adam]
    .venv/bin/python bench/gpu_finetune.py --dry-run            # same code on CPU: tiny-llama, seq 64, 2 steps
                                                                # (a machine without CUDA: gloo ranks)

Cases (CASES), each 8 sequences per replica per step, a fresh --out, and the config
toolkit.config.generate.build_config writes (`dstk generate-config --precision bf16 --zero Z --pp P
--world-size W --mbs M --gas G`, torch's AdamW "torch_adam" unless --fused-adam):
    pp1-zero1  1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2
    pp1-zero3  1 GPU    pp 1, ZeRO 3, mbs 4 x gas 2
    pp2        2 GPUs   pp 2, ZeRO 1, mbs 2 x gas 4
    pp2-dp2    4 GPUs   pp 2 x dp 2, ZeRO 1, mbs 2 x gas 4
    pp1-lora   1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, --lora (r 16, every block linear)
    pp2-lora   2 GPUs   pp 2, ZeRO 1, mbs 2 x gas 4, --lora
    pp1-qlora  1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, --qlora (4-bit NF4 base: bitsandbytes; skipped without it)
A case needing more GPUs than torch.cuda.device_count() (or --gpus N: the first N) is reported as
skipped; one that fails is reported as failed, with the tail of its log.

Per case: tokens/s over the steps after the warm-up ones (metrics.jsonl's per-step rates); MFU =
6 N T / time / (GPUs x peak), N = parameters in matmuls (all but a learned position table; a tied
embedding counted once, as the LM head), peak = dense bf16 TFLOPs of the toolkit.plan.gpus preset
matched from the device name (--gpu, --peak-tflops to choose); the JSON also gives MFU with attention's
12 L s h_attn FLOPs per token. Peak GPU memory: the summary's peak_gpu_mib_per_rank (largest rank) next
to `dstk plan`'s estimate for the same layout (toolkit.plan.planner.estimate_layout). Loss: first and
last step. Writes bench/results/gpu.json and gpu.md (--dry-run: into --out-dir or a temp dir, never
over real figures). Checkpoints (the trainer saves one at the end, ~14 GB at 1B) are deleted per case.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]
import common  # noqa: E402

CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
LR = 1e-4
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torch.cuda.get_device_name() (lower case) -> toolkit.plan.gpus preset; the first match wins. None: a card
# with no preset (H100 NVL: 835 dense bf16 TFLOPs, not the SXM's 989); give --gpu or --peak-tflops.
DEVICE_NAMES = [(r"h200", "h200"), (r"h100.*nvl", None), (r"h100.*pcie", "h100-pcie"), (r"h100", "h100-sxm"),
                (r"a100.*pcie.*80|a100.*80.*pcie", "a100-pcie-80gb"), (r"a100.*40", "a100-40gb"),
                (r"a100", "a100-80gb"), (r"\bl4\b", "l4"), (r"a10g", "a10g"), (r"v100.*16", "v100-16gb"),
                (r"v100", "v100-32gb"), (r"4090", "rtx-4090")]


@dataclass(frozen=True)
class Case:
    name: str
    pp: int
    dp: int
    zero: int
    mbs: int
    gas: int
    adapters: str = ""  # "", "lora" or "qlora": the dstk train flag

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def gbs(self) -> int:
        return self.mbs * self.gas * self.dp


CASES = [Case("pp1-zero1", 1, 1, 1, 4, 2), Case("pp1-zero3", 1, 1, 3, 4, 2), Case("pp2", 2, 1, 1, 2, 4),
         Case("pp2-dp2", 2, 2, 1, 2, 4), Case("pp1-lora", 1, 1, 1, 4, 2, "lora"), Case("pp2-lora", 2, 1, 1, 2, 4, "lora"),
         Case("pp1-qlora", 1, 1, 1, 4, 2, "qlora")]
LORA_R = 16


def match_gpu(device_name: str) -> str | None:
    """The toolkit.plan.gpus preset for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm"), or None."""
    for pattern, preset in DEVICE_NAMES:
        if re.search(pattern, device_name.lower()):
            return preset
    return None


def trained_model_dir(model: str, work: Path) -> Path:
    """config.json of the model exactly as `dstk train --model NAME` builds it (byte tokenizer's vocabulary),
    so the FLOP count and the planner see the trained model, not the published vocabulary."""
    from toolkit.train import hf

    path = work / f"{model}-as-trained"
    hf.builtin_config(model, hf.byte_tokenizer()).save_pretrained(path)
    return path


def flops_per_token(arch, seq_len: int) -> dict:
    """Training FLOPs per token: 6N (forward 2N, backward 4N), and with attention's 12 L s h_attn added
    (scores and weighted sum, forward and backward, without the causal saving: PaLM's convention).
    N counts the parameters a token uses: an MoE block's top-k experts, not all of them."""
    matmul_params = arch.active_params() - (arch.max_positions * arch.hidden if arch.learned_positions else 0)
    six_n = 6 * matmul_params
    return {"matmul_params": matmul_params, "6N": six_n,
            "6N+attention": six_n + 12 * arch.layers * seq_len * arch.heads * arch.head_dim}


def ds_config(case: Case, fused: bool) -> dict:
    """What `dstk generate-config --world-size W --pp P --mbs M --gas G --zero Z --precision bf16 [--cpu]` writes."""
    from toolkit.config.generate import build_config
    from toolkit.config.options import GenerateOptions

    return build_config(GenerateOptions(world_size=case.world, pp=case.pp, mbs=case.mbs, gas=case.gas,
                                        zero=case.zero, precision="bf16", lr=LR, cpu=not fused,
                                        steps_per_print=10**6))


def plan_cases(names: list[str], gpus: int, dry_run: bool) -> list[tuple[Case, str | None]]:
    """(case, why it is skipped or None) for each case asked for."""
    out = []
    for case in (c for c in CASES if c.name in names):
        why = None
        if case.adapters == "qlora" and (dry_run or importlib.util.find_spec("bitsandbytes") is None):
            why = "--qlora needs CUDA and bitsandbytes (pip install bitsandbytes)"
        elif case.world > gpus:
            why = (f"needs {case.world} CPU processes; the dry run starts at most {gpus} (--gpus {case.world} "
                   f"includes it, about a minute on 2 cores)" if dry_run else
                   f"needs {case.world} GPUs, {gpus} available")
        out.append((case, why))
    return out


def predicted_bytes(case: Case, seq: int, model_dir: Path, preset: str) -> int:
    """`dstk plan`'s peak memory per GPU for this layout (the stage holding the most)."""
    from toolkit.plan.estimate import Layout
    from toolkit.plan.planner import PlanRequest, estimate_layout

    req = PlanRequest(model=str(model_dir), gbs=case.gbs, gpus_per_node=case.world, gpu=preset, seq_len=seq,
                      precision="bf16", attention="sdpa", lora=LORA_R if case.adapters else None)
    return estimate_layout(req, Layout(pp=case.pp, dp=case.dp, zero=case.zero, mbs=case.mbs, gas=case.gas)).memory


def corpus_file(tokens: int, work: Path) -> Path:
    """The shipped corpus, repeated into a temporary .txt when it holds fewer than `tokens` bytes
    (the byte tokenizer: one token per byte) plus 10% for the packing's end-of-text tokens and remainders."""
    text = CORPUS.read_text()
    repeats = math.ceil(tokens * 1.1 / len(text.encode()))
    if repeats <= 1:
        return CORPUS
    path = work / "corpus.txt"
    path.write_text("\n\n".join([text.strip()] * repeats) + "\n")
    return path


def launch_command(case: Case, config: Path, data: Path, out: Path, opts) -> list[str]:
    return ["bash", str(REPO / "launch.sh"), "--num-gpus", str(case.world), "--config", str(config), "--",
            "--model", opts.model, "--data", str(data), "--seq-len", str(opts.seq_len),
            "--steps", str(opts.warmup + opts.steps), "--attention", "sdpa", "--no-export", "--eval-fraction", "0",
            "--out", str(out), *([f"--{case.adapters}", "--lora-r", str(LORA_R)] if case.adapters else [])]


def child_env(dry_run: bool) -> dict:
    """This environment for launch.sh, less any rank variables; the dry run hides CUDA from launch.sh."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(PYTHON=sys.executable, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu") if dry_run else env.update(DS_ACCELERATOR="cuda")
    return env


def launch(cmd: list[str], log: Path, env: dict, timeout: float) -> tuple[int | None, float]:
    """Run `cmd` (launcher and ranks in one new process group) with its output in `log`; (exit code or None
    when killed at `timeout`, wall seconds)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to the ranks
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    return rc, time.perf_counter() - start


def read_metrics(out: Path) -> tuple[list[dict], dict | None]:
    """(per-step records, the run's summary or None) from OUT/metrics.jsonl."""
    path = out / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    summaries = [r["summary"] for r in lines if "summary" in r]
    return [r for r in lines if "step" in r], summaries[-1] if summaries else None


def timed_rate(records: list[dict], warmup: int, tokens_per_step: int) -> float | None:
    """Tokens/s over the steps after `warmup`: their tokens over their summed step times."""
    timed = [r["tokens_per_s"] for r in records if r["step"] > warmup]
    return len(timed) * tokens_per_step / sum(tokens_per_step / r for r in timed) if timed else None


def run_case(case: Case, ctx: dict, opts) -> dict:
    """Launch one case, read what the trainer wrote, delete its checkpoints; the case's JSON entry."""
    config = ctx["work"] / f"{case.name}.json"
    config.write_text(json.dumps(ds_config(case, opts.fused_adam), indent=2))
    out, log = ctx["work"] / case.name, ctx["work"] / f"{case.name}.log"
    cmd = launch_command(case, config, ctx["data"], out, opts)
    rc, wall = launch(cmd, log, child_env(opts.dry_run), opts.timeout)
    records, summary = read_metrics(out)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    entry = {**asdict(case), "world": case.world, "gbs": case.gbs, "seq_len": opts.seq_len, "command": cmd,
             "config": json.loads(config.read_text()), "wall_s": round(wall, 1), "log": str(log)}
    if rc != 0 or summary is None:
        why = f"timed out after {opts.timeout:.0f} s" if rc is None else f"exit code {rc}" if rc else "no summary"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        return {**entry, "status": "failed", "reason": why, "log_tail": tail}
    return {**entry, "status": "ok", **figures(case, records, summary, ctx, opts)}


def figures(case: Case, records: list[dict], summary: dict, ctx: dict, opts) -> dict:
    """Tokens/s, MFU, peak memory against the planner, and the loss, from one finished run."""
    rate = timed_rate(records, opts.warmup, case.gbs * opts.seq_len)
    peak = ctx["peak_tflops"] * 1e12 * case.world if ctx["peak_tflops"] else None
    gpu_mib = [m for m in summary["peak_gpu_mib_per_rank"] if m is not None]
    measured = max(gpu_mib) * 2**20 if gpu_mib else None
    predicted = predicted_bytes(case, opts.seq_len, ctx["model_dir"], ctx["preset"] or "h100-sxm")
    return {"tokens_per_s": rate, "mfu": rate * ctx["flops"]["6N"] / peak if rate and peak else None,
            "mfu_with_attention": rate * ctx["flops"]["6N+attention"] / peak if rate and peak else None,
            "peak_gpu_bytes": measured, "predicted_bytes": predicted,
            "predicted_error": predicted / measured - 1 if measured else None,
            "first_loss": summary["first_loss"], "last_loss": summary["last_loss"],
            "loss_fell": summary["last_loss"] < summary["first_loss"], "losses": [r["loss"] for r in records],
            "summary": summary}


def markdown(meta: dict, cases: list) -> list[str]:
    lines = [f"GPU: **{meta['gpu']}** (peak {meta['peak_tflops'] or '?'} dense bf16 TFLOPs, preset {meta['preset']}); "
             f"`dstk train --model {meta['model']}` ({meta['matmul_params'] / 1e6:,.1f} M parameters in matmuls, "
             f"byte tokenizer), seq {meta['seq_len']}, bf16, sdpa, {meta['optimizer']}; {meta['warmup']} warm-up + "
             f"{meta['steps']} timed steps per case, each through `launch.sh`.", "",
             "| case | GPUs | pp x dp | ZeRO | mbs x gas | tokens/s | MFU | peak (GiB) | dstk plan (GiB) | "
             "plan error | loss first -> last |", "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        head = f"| {c['name']} | {c['pp'] * c['dp']} | {c['pp']} x {c['dp']} | {c['zero']} | {c['mbs']} x {c['gas']} |"
        if c["status"] != "ok":
            lines.append(f"{head} {c['status']}: {c['reason']} |" + " - |" * 5)
            continue
        lines.append(f"{head} {_fmt(c['tokens_per_s'], ',.0f')} | {_fmt(c['mfu'], '.1%')} | "
                     f"{_gib(c['peak_gpu_bytes'])} | {_gib(c['predicted_bytes'])} | {_fmt(c['predicted_error'], '+.1%')} "
                     f"| {c['first_loss']:.3f} -> {c['last_loss']:.3f} |")
    lines += ["", "MFU counts 6N FLOPs per token over all the case's GPUs (gpu.json also gives it with attention's "
              "12 L s h_attn). Peak: the largest rank's `torch.cuda.max_memory_allocated` (the run's summary); "
              "dstk plan: `toolkit.plan.planner.estimate_layout` for the same layout. A failed case's log tail "
              "is in gpu.json."]
    return lines + plan_gpu_lines(meta["gpu"])


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)  # "-": no CUDA (dry run) or no GPU preset


def _gib(n) -> str:
    return _fmt(None if n is None else n / 2**30, ".2f")


def plan_gpu_lines(gpu_name: str) -> list[str]:
    """bench/plan_gpu.py's table (ZeRO 0/1 peak vs planner), when gpu.sh ran it on this GPU just before."""
    path = common.RESULTS / "plan_gpu.json"
    if not path.exists() or json.loads(path.read_text()).get("gpu") != gpu_name:
        return []
    lines = ["", "Planner peak memory, `bench/plan_gpu.py` on the same GPU (target: within 15%):", "",
             "| model | seq x mbs | ZeRO | measured (GiB) | predicted (GiB) | error |", "|---|---|---:|---:|---:|---:|"]
    for c in json.loads(path.read_text())["cases"]:
        lines.append(f"| {c['model']} | {c['seq_len']} x {c['mbs']} | {c['zero']} | {_gib(c['measured_bytes'])} | "
                     f"{_gib(c['predicted_bytes'])} | {c['error']:+.1%} |")
    return lines


def hardware(opts) -> tuple[str, str | None, float | None, int] | str | None:
    """(device name, toolkit.plan.gpus preset, peak bf16 TFLOPs, GPUs to use); None without CUDA (the dry
    run: CPU processes, the preset only for the planner); "cuda" for a dry run where CUDA is."""
    import torch

    from toolkit.plan.gpus import get_gpu

    if not torch.cuda.is_available():  # counts devices without making a CUDA context
        return ("CPU (dry run)", opts.gpu or "h100-sxm", opts.peak_tflops, opts.gpus or 2) if opts.dry_run else None
    if opts.dry_run:
        return "cuda"
    # The name from a child process: a CUDA context here would hold GPU 0 memory through every case (and
    # keep the ranks off a GPU in exclusive-process mode).
    name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    preset = opts.gpu or match_gpu(name)
    peak = opts.peak_tflops or (get_gpu(preset).tflops("bf16") if preset else None)
    return name, preset, peak, min(opts.gpus or torch.cuda.device_count(), torch.cuda.device_count())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU processes, tiny-llama, seq 64, 2 steps")
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 10 timed steps (default: 3 + 30)")
    parser.add_argument("--cases", nargs="+", metavar="NAME", choices=[c.name for c in CASES],
                        default=[c.name for c in CASES])
    parser.add_argument("--gpus", type=int, metavar="N", help="use at most the first N GPUs (dry run: processes, 2)")
    parser.add_argument("--model", help="a built-in name (default: llama-3.2-1b; dry run: tiny-llama)")
    parser.add_argument("--seq-len", type=int, help="default: 2048 (dry run: 64)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per case")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--gpu", metavar="PRESET",
                        help="toolkit.plan.gpus preset for the peak (default: matched from the device name)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak, overriding the preset")
    parser.add_argument("--fused-adam", action="store_true", help="DeepSpeed's FusedAdam (JIT build; not with --dry-run)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case before it is killed")
    parser.add_argument("--out-dir", help="where results go (default: bench/results; dry run: a temp dir)")
    parser.add_argument("--work-dir", help="configs, corpus, logs and runs (default: a new temp dir)")
    opts = parser.parse_args(argv)
    if opts.dry_run and opts.fused_adam:
        parser.error("--fused-adam needs CUDA (FusedAdam is a JIT-built CUDA op); drop it with --dry-run")
    warmup, steps = (1, 1) if opts.dry_run else (2, 10) if opts.quick else (3, 30)
    opts.warmup = warmup if opts.warmup is None else opts.warmup
    opts.steps = steps if opts.steps is None else opts.steps
    opts.model = opts.model or ("tiny-llama" if opts.dry_run else "llama-3.2-1b")
    opts.seq_len = opts.seq_len or (64 if opts.dry_run else 2048)
    return opts


def save(meta: dict, cases: list) -> list[str]:
    """JSON and the BENCHMARKS.md fragment, rewritten after every case so a cut-short run keeps its figures."""
    common.write_result("gpu", {**meta, "cases": cases})
    lines = markdown(meta, cases)
    common.write_markdown("gpu", f"GPU fine-tuning through `dstk train` ({meta['gpu']})", lines)
    return lines


def main(argv=None) -> int:
    opts = parse_args(argv)
    found = hardware(opts)
    if found is None:
        print("gpu_finetune: skipped: no CUDA (use --dry-run to check the script on CPU)")
        return 0
    if found == "cuda":
        print("gpu_finetune: --dry-run needs a machine without CUDA: DeepSpeed's launcher gives each rank its own "
              "CUDA_VISIBLE_DEVICES, so CPU ranks cannot be had where GPUs are (run the real benchmark instead)")
        return 2
    gpu_name, preset, peak, gpus = found
    if opts.out_dir or opts.dry_run:  # common writes under RESULTS: point it away from the real figures
        common.RESULTS = Path(opts.out_dir or tempfile.mkdtemp(prefix="dstk-gpu-dry-run-"))
    work = Path(opts.work_dir or tempfile.mkdtemp(prefix="dstk-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = trained_model_dir(opts.model, work)
    from toolkit.plan.arch import load_arch

    flops = flops_per_token(load_arch(str(model_dir)), opts.seq_len)
    planned = plan_cases(opts.cases, gpus, opts.dry_run)
    most_tokens = max(c.gbs for c, _ in planned) * opts.seq_len * (opts.warmup + opts.steps)
    ctx = {"work": work, "model_dir": model_dir, "flops": flops, "preset": preset, "peak_tflops": peak,
           "data": corpus_file(most_tokens, work)}
    meta = {"gpu": gpu_name, "preset": preset, "peak_tflops": peak, "gpus": gpus, "dry_run": opts.dry_run,
            "model": opts.model, "seq_len": opts.seq_len, "matmul_params": flops["matmul_params"],
            "flops_per_token": flops, "optimizer": "DeepSpeed FusedAdam" if opts.fused_adam else
            "torch AdamW (torch_adam)", "warmup": opts.warmup, "steps": opts.steps, "work_dir": str(work)}
    print(f"gpu_finetune: {meta}", flush=True)
    cases, start = [], time.perf_counter()
    for case, why in planned:
        if why:
            cases.append({**asdict(case), "world": case.world, "status": "skipped", "reason": why})
            print(f"  {case.name}: skipped: {why}", flush=True)
        else:
            cases.append(run_case(case, ctx, opts))
            report_case(cases[-1])
        lines = save(meta, cases)
    print("\n".join(lines))
    print(f"gpu_finetune: {time.perf_counter() - start:.0f} s; wrote {common.RESULTS / 'gpu.json'}; logs in {work}")
    return 1 if any(c["status"] == "failed" for c in cases) else 0


def report_case(c: dict) -> None:
    if c["status"] == "failed":
        print(f"  {c['name']}: FAILED ({c['reason']}, {c['wall_s']} s); last lines of {c['log']}:\n{c['log_tail']}",
              flush=True)
        return
    mem = f", peak {_gib(c['peak_gpu_bytes'])} GiB (plan {_gib(c['predicted_bytes'])})" if c["peak_gpu_bytes"] else ""
    print(f"  {c['name']}: {_fmt(c['tokens_per_s'], ',.0f')} tokens/s, MFU {_fmt(c['mfu'], '.1%')}{mem}, "
          f"loss {c['first_loss']:.3f} -> {c['last_loss']:.3f}, {c['wall_s']} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
