"""GPU fine-tuning throughput of THE trainer: each case runs `toolkit.train` through launch.sh (the deepspeed
launcher) as its own subprocess on a ~1B Llama-shaped model (llama-3.2-1b's published dimensions, dstk's
byte tokenizer), built from its config with random weights and saved in bf16 with save_pretrained first
(bench/gpu_inputs.py): every case loads that directory. bf16, seq 2048, the shipped corpus (packed text) or
the same stories as chat rows. Skips, exit 0, without CUDA (bench/gpu.sh refuses instead).

    bench/gpu.sh                                                # plan_gpu.py, this, report.py (CUDA only)
    .venv/bin/python bench/gpu_finetune.py [--quick] [--gpus N] [--gpu h100-sxm] [--fused-adam] [--budget S]
    .venv/bin/python bench/gpu_finetune.py --dry-run            # same code on CPU: tiny-llama, seq 128, 2 steps
                                                                # (a machine without CUDA: gloo ranks)

Cases (CASES), each 8 sequences per replica per step, a fresh --out, and the config
toolkit.config.generate.build_config writes (`dstk generate-config --precision bf16 --zero Z --pp P
--world-size W --mbs M --gas G`: torch's AdamW, "torch_adam" with torch's fused kernel, unless --fused-adam;
no op is JIT-built):
    pp1-zero1  1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, sdpa
    pp1-zero1-hf 1 GPU  the same under HF Trainer (bench/hf_trainer.py: transformers' Trainer, the same config file,
                        model directory, rows in the same order, seq and batch), started by DeepSpeed's launcher;
                        skipped without accelerate
    pp1-fa2    1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, --attention flash_attention_2 (skipped without flash_attn)
    pp1-lora   1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, --lora (r 16, every block linear)
    pp1-qlora  1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, --qlora (4-bit NF4 base: bitsandbytes; skipped without it)
    pp1-chat   1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, chat rows, --packing (loss on the assistant's tokens)
    pp1-zero3  1 GPU    pp 1, ZeRO 3, mbs 4 x gas 2
    pp1-ep1    1 GPU    pp 1, ZeRO 1, mbs 4 x gas 2, DeepSpeed's AutoEP at ep 1 ("expert_parallel": autoep_size 1,
                        preset qwen3_moe) on Qwen3-30B-A3B's widths with 2 blocks (MOE_MODEL, ~1.25B parameters with
                        the byte vocabulary, its own saved directory; dry run: tiny-mixtral): AutoEP's router and
                        grouped-GEMM experts timed on one GPU, no all-to-all
    pp2        2 GPUs   pp 2, ZeRO 1, mbs 2 x gas 4
    pp2-lora   2 GPUs   pp 2, ZeRO 1, mbs 2 x gas 4, --lora
    pp2-dp2    4 GPUs   pp 2 x dp 2, ZeRO 1, mbs 2 x gas 4
A case needing more GPUs than torch.cuda.device_count() (or --gpus N: the first N) is reported as skipped
(NCCL refuses two ranks on one GPU: pp 2 is not run, nor simulated, on one); one that fails is reported as
failed, with the tail of its log; with --budget S, a case that cannot start S seconds after this script did
is reported as skipped, and the one running then is stopped.

Per case: tokens/s over the steps after the warm-up ones (metrics.jsonl's per-step rates: every position of
every row, padding included) and rows/s; MFU = tokens/s x FLOPs per token / (GPUs x peak): FLOPs per token
from the planner's cost model (toolkit.plan.cost.mfu: 6N + attention's 12 L s h_attn, LoRA's frozen weights
without weight gradients), peak = the dense bf16 TFLOPs of the toolkit.plan.gpus preset matched from the
device name (--gpu, --peak-tflops to choose). Peak GPU memory: the summary's peak_gpu_mib_per_rank (largest
rank), counted from just before the first step (the load's peak beside it), next to `dstk plan`'s estimate
for the same layout (toolkit.plan.layouts.planner.estimate_layout; none for QLoRA: the planner has no 4-bit
base). Loss: first and last step. dstk against HF Trainer (gpu_report.anchor_lines): tokens/s, trained
tokens/s (positions with a loss target, counted on the rows both trained), rows/s and both peaks, side by
side with their ratios. Writes bench/results/gpu.json and gpu.md (--dry-run: into --out-dir or a temp dir, never
over real figures), with gpu.sh's steps (--step) and their failures. Checkpoints (the trainer saves one at
the end, ~14 GB at 1B) are deleted per case.
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]
import common  # noqa: E402
import gpu_inputs  # noqa: E402
from gpu_report import record_steps, report_case, save  # noqa: E402

LR = 1e-4
LORA_R = 16
MIN_CASE_S = 60  # under --budget, a case is not started with less time than this left
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Case:
    name: str
    pp: int
    dp: int
    zero: int
    mbs: int
    gas: int
    adapters: str = ""  # "", "lora" or "qlora": the dstk train flag
    attention: str = "sdpa"  # dstk train --attention
    data: str = "text"  # "text" (the corpus, packed) or "chat" (chat rows, --packing)
    trainer: str = "dstk"  # or "hf": transformers' Trainer on the same config, model and rows (bench/hf_trainer.py)
    ep: int = 0  # > 0: the MoE model (MOE_MODEL) under DeepSpeed's AutoEP at this autoep_size

    @property
    def model_key(self) -> str:
        """Which saved model the case trains: "moe" (MOE_MODEL's directory) or "dense" (--model's)."""
        return "moe" if self.ep else "dense"

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def gbs(self) -> int:
        return self.mbs * self.gas * self.dp


MOE_MODEL = ("qwen3-30b-a3b", 2, "qwen3_moe")  # (built-in widths, blocks kept, AutoEP preset); dry run: DRY_MOE
DRY_MOE = ("tiny-mixtral", None, "mixtral")
CASES = [Case("pp1-zero1", 1, 1, 1, 4, 2), Case("pp1-ep1", 1, 1, 1, 4, 2, ep=1),
         Case("pp1-zero1-hf", 1, 1, 1, 4, 2, trainer="hf"),
         Case("pp1-fa2", 1, 1, 1, 4, 2, attention="flash_attention_2"),
         Case("pp1-lora", 1, 1, 1, 4, 2, "lora"), Case("pp1-qlora", 1, 1, 1, 4, 2, "qlora"),
         Case("pp1-chat", 1, 1, 1, 4, 2, data="chat"), Case("pp1-zero3", 1, 1, 3, 4, 2),
         Case("pp2", 2, 1, 1, 2, 4), Case("pp2-lora", 2, 1, 1, 2, 4, "lora"), Case("pp2-dp2", 2, 2, 1, 2, 4)]


def matmul_params(arch) -> int:
    """N of 6N: the parameters a token multiplies (all but a learned position table; a tied embedding once)."""
    return arch.active_params() - (arch.max_positions * arch.hidden if arch.learned_positions else 0)


def ds_config(case: Case, fused_adam: bool, cpu: bool) -> dict:
    """What `dstk generate-config --world-size W --pp P --mbs M --gas G --zero Z --precision bf16 [--fused-adam]
    [--cpu] [--ep N --ep-preset P]` writes: torch's AdamW (fused kernel on GPUs), or DeepSpeed's JIT-built FusedAdam
    with --fused-adam."""
    from toolkit.config.generate import build_config
    from toolkit.config.options import GenerateOptions

    preset = (DRY_MOE if cpu else MOE_MODEL)[2] if case.ep else None
    return build_config(GenerateOptions(world_size=case.world, pp=case.pp, mbs=case.mbs, gas=case.gas,
                                        zero=case.zero, precision="bf16", lr=LR, cpu=cpu, fused_adam=fused_adam,
                                        steps_per_print=10**6, ep=max(case.ep, 1), ep_preset=preset))


def plan_cases(names: list[str], gpus: int, dry_run: bool) -> list[tuple[Case, str | None]]:
    """(case, why it is skipped or None) for each case asked for."""
    out = []
    for case in (c for c in CASES if c.name in names):
        why = None
        if case.adapters == "qlora" and (dry_run or importlib.util.find_spec("bitsandbytes") is None):
            why = "--qlora needs CUDA and bitsandbytes (pip install bitsandbytes)"
        elif case.attention == "flash_attention_2" and (dry_run or importlib.util.find_spec("flash_attn") is None):
            why = ("flash_attention_2 needs CUDA and the flash-attn package, which is not installed "
                   "(pip install flash-attn --no-build-isolation)")
        elif case.trainer == "hf" and importlib.util.find_spec("accelerate") is None:
            why = "HF Trainer needs the accelerate package, which is not installed (pip install accelerate)"
        elif case.world > gpus:
            why = (f"needs {case.world} CPU processes; the dry run starts at most {gpus} (--gpus {case.world} "
                   f"includes it, about a minute on 2 cores)" if dry_run else
                   f"needs {case.world} GPUs, {gpus} available: one rank per GPU (NCCL refuses two ranks on one "
                   f"GPU), so pp {case.pp} x dp {case.dp} is not run here, nor simulated")
        out.append((case, why))
    return out


def predicted_bytes(case: Case, seq: int, model_dir: Path, preset: str) -> int | None:
    """`dstk plan`'s peak bytes from torch's allocator per GPU for this layout (the stage holding the most;
    Estimate.allocated: without the CUDA context and NCCL buffers, which max_memory_allocated does not see);
    None for QLoRA (the planner holds the frozen base in bf16, not in 4 bits)."""
    if case.adapters == "qlora":
        return None
    from toolkit.plan.layouts.estimate import Layout
    from toolkit.plan.layouts.planner import PlanRequest, estimate_layout

    req = PlanRequest(model=str(model_dir), gbs=case.gbs, gpus_per_node=case.world, gpu=preset, seq_len=seq,
                      precision="bf16", attention=case.attention, lora=LORA_R if case.adapters else None)
    return estimate_layout(req, Layout(pp=case.pp, dp=case.dp, zero=case.zero, mbs=case.mbs, gas=case.gas,
                                       ep=max(case.ep, 1))).allocated


def launch_command(case: Case, config: Path, data: Path, model: Path, out: Path, opts) -> list[str]:
    """dstk's case: `launch.sh ... -- dstk train's flags`; HF Trainer's (hf_command): DeepSpeed's launcher on
    bench/hf_trainer.py with the same config, model, data, sequence length and steps."""
    if case.trainer == "hf":
        return hf_command(case, config, data, model, out, opts)
    return ["bash", str(REPO / "launch.sh"), "--num-gpus", str(case.world), "--config", str(config), "--",
            "--model", str(model), "--data", str(data), "--seq-len", str(opts.seq_len),
            "--steps", str(opts.warmup + opts.steps), "--attention", case.attention, "--no-export",
            "--eval-fraction", "0", "--out", str(out), *(["--packing"] if case.data == "chat" else []),
            *([f"--{case.adapters}", "--lora-r", str(LORA_R)] if case.adapters else [])]


def hf_command(case: Case, config: Path, data: Path, model: Path, out: Path, opts) -> list[str]:
    """What launch.sh runs for dstk, with HF Trainer's program in place of toolkit.train: DeepSpeed's launcher
    on a free port, its INFO lines off."""
    from toolkit.distributed.process_group import free_port

    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(case.world), "--master_port",
            str(free_port()), "--log_level", "critical", str(BENCH / "hf_trainer.py"), "--config", str(config),
            "--model", str(model), "--data", str(data), "--seq-len", str(opts.seq_len),
            "--steps", str(opts.warmup + opts.steps), "--attention", case.attention, "--out", str(out)]


def child_env(dry_run: bool) -> dict:
    """This environment for launch.sh, less any rank variables; the dry run hides CUDA from launch.sh."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(PYTHON=sys.executable, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu") if dry_run else env.update(DS_ACCELERATOR="cuda")
    return env


def read_metrics(out: Path) -> tuple[list[dict], dict | None]:
    """(per-step records, the run's summary or None) from OUT/metrics.jsonl."""
    path = out / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    summaries = [r["summary"] for r in lines if "summary" in r]
    return [r for r in lines if "step" in r], summaries[-1] if summaries else None


def timed_seconds(records: list[dict], warmup: int, tokens_per_step: int) -> tuple[int, float]:
    """(steps, their summed seconds) after `warmup`, from each record's tokens/s."""
    timed = [r["tokens_per_s"] for r in records if r["step"] > warmup]
    return len(timed), sum(tokens_per_step / r for r in timed)


def timed_rate(records: list[dict], warmup: int, tokens_per_step: int) -> float | None:
    """Tokens/s over the steps after `warmup`: their tokens over their summed step times."""
    steps, seconds = timed_seconds(records, warmup, tokens_per_step)
    return steps * tokens_per_step / seconds if steps else None


def _most(values) -> float | None:
    """The largest rank's figure in MiB as bytes (None where no rank has one: off CUDA)."""
    known = [m for m in values or [] if m is not None]
    return max(known) * 2**20 if known else None


def run_case(case: Case, ctx: dict, opts, timeout: float) -> dict:
    """Launch one case, read what the trainer wrote, delete its checkpoints; the case's JSON entry."""
    config = ctx["work"] / f"{case.name}.json"
    config.write_text(json.dumps(ds_config(case, opts.fused_adam, cpu=opts.dry_run), indent=2))
    out, log = ctx["work"] / case.name, ctx["work"] / f"{case.name}.log"
    cmd = launch_command(case, config, ctx["data"][case.data], ctx["model_dir"][case.model_key], out, opts)
    env = child_env(opts.dry_run)
    if opts.dry_run and case.trainer == "hf":  # the CPU threads launch.sh gives a dstk rank (cores / processes)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // case.world)))
    rc, wall = common.launch(cmd, log, env, timeout)
    records, summary = read_metrics(out)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    entry = {**asdict(case), "world": case.world, "gbs": case.gbs, "seq_len": opts.seq_len, "command": cmd,
             "config": json.loads(config.read_text()), "wall_s": round(wall, 1), "log": str(log)}
    if rc != 0 or summary is None:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit code {rc}" if rc else "no summary"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        return {**entry, "status": "failed", "reason": why, "log_tail": tail}
    return {**entry, "status": "ok", **figures(case, records, summary, ctx, opts)}


def figures(case: Case, records: list[dict], summary: dict, ctx: dict, opts) -> dict:
    """Tokens/s, MFU, peak memory against the planner, and the loss, from one finished run."""
    from toolkit.plan.cost.mfu import flops_per_token, utilisation

    rate = timed_rate(records, opts.warmup, case.gbs * opts.seq_len)
    steps, seconds = timed_seconds(records, opts.warmup, case.gbs * opts.seq_len)
    flops = flops_per_token(ctx["arch"][case.model_key], opts.seq_len, LORA_R if case.adapters else None)
    measured = _most(summary["peak_gpu_mib_per_rank"])
    predicted = predicted_bytes(case, opts.seq_len, ctx["model_dir"][case.model_key], ctx["preset"] or "h100-sxm")
    counted = {key: [r[key] for r in records if r["step"] > opts.warmup and key in r] for key in ("targets", "padding")}
    return {"tokens_per_s": rate, "rows_per_s": rate / opts.seq_len if rate else None, "timed_steps": steps,
            "timed_seconds": seconds, **{f"timed_{key}": sum(v) if steps and len(v) == steps else None
                                         for key, v in counted.items()},
            "flops_per_token": flops,
            "mfu": utilisation(rate, flops, case.world, ctx["peak_tflops"]) if rate and ctx["peak_tflops"] else None,
            "trainer_mfu": summary.get("mfu"),  # the trainer's own, over its steps after the first
            "peak_gpu_bytes": measured, "load_peak_gpu_bytes": _most(summary.get("load_peak_gpu_mib_per_rank")),
            "predicted_bytes": predicted,
            "predicted_error": predicted / measured - 1 if measured and predicted else None,
            "first_loss": summary["first_loss"], "last_loss": summary["last_loss"],
            "loss_fell": summary["last_loss"] < summary["first_loss"], "losses": [r["loss"] for r in records],
            "summary": summary}


def hardware(opts) -> tuple[str, str | None, float | None, int] | str | None:
    """(device name, toolkit.plan.gpus preset, peak bf16 TFLOPs, GPUs to use); None without CUDA (the dry
    run: CPU processes, the preset only for the planner); "cuda" for a dry run where CUDA is."""
    import torch

    from toolkit.errors import ConfigError
    from toolkit.plan.gpus import get_gpu
    from toolkit.plan.cost.mfu import peak_tflops

    if not torch.cuda.is_available():  # counts devices without making a CUDA context
        return ("CPU (dry run)", opts.gpu or "h100-sxm", opts.peak_tflops, opts.gpus or 2) if opts.dry_run else None
    if opts.dry_run:
        return "cuda"
    # The name from a child process: a CUDA context here would hold GPU 0 memory through every case (and
    # keep the ranks off a GPU in exclusive-process mode).
    name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    preset, peak = (opts.gpu, get_gpu(opts.gpu).tflops("bf16")) if opts.gpu else (None, None)
    if not opts.gpu:
        try:
            preset, peak = peak_tflops(name, "bf16")
        except ConfigError as exc:
            print(f"gpu_finetune: {exc}: MFU is left out (give --gpu PRESET or --peak-tflops N)", flush=True)
    return name, preset, opts.peak_tflops or peak, min(opts.gpus or torch.cuda.device_count(), torch.cuda.device_count())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU processes, tiny-llama, seq 128, 2 steps")
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 10 timed steps (default: 3 + 30)")
    parser.add_argument("--cases", nargs="+", metavar="NAME", choices=[c.name for c in CASES],
                        default=[c.name for c in CASES])
    parser.add_argument("--gpus", type=int, metavar="N", help="use at most the first N GPUs (dry run: processes, 2)")
    parser.add_argument("--model", help="the built-in architecture saved and trained (default: llama-3.2-1b; "
                        "dry run: tiny-llama)")
    parser.add_argument("--seq-len", type=int, help="default: 2048 (dry run: 128, room for a chat row's prompt)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per case")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--gpu", metavar="PRESET",
                        help="toolkit.plan.gpus preset for the peak (default: matched from the device name)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak, overriding the preset")
    parser.add_argument("--fused-adam", action="store_true", help="DeepSpeed's FusedAdam (JIT build; not with --dry-run)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case before it is killed")
    parser.add_argument("--budget", type=float, metavar="S", help="seconds for the whole script: cases that "
                        f"cannot start by then (or with under {MIN_CASE_S} s left) are skipped, the running one stopped")
    parser.add_argument("--step", dest="script_steps", action="append", default=[], metavar="NAME=STATUS",
                        help="an earlier step of gpu.sh and how it went ('ok[: detail]' or 'failed: why'), kept in gpu.json")
    parser.add_argument("--record-only", action="store_true",
                        help="only add the --step entries to this run's gpu.json (gpu.sh: a later step's failure)")
    parser.add_argument("--out-dir", help="where results go (default: bench/results; dry run: a temp dir)")
    parser.add_argument("--work-dir", help="model, data, configs, logs and runs (default: a new temp dir)")
    opts = parser.parse_args(argv)
    if opts.dry_run and opts.fused_adam:
        parser.error("--fused-adam needs CUDA (FusedAdam is a JIT-built CUDA op); drop it with --dry-run")
    warmup, steps = (1, 1) if opts.dry_run else (2, 10) if opts.quick else (3, 30)
    opts.warmup = warmup if opts.warmup is None else opts.warmup
    opts.steps = steps if opts.steps is None else opts.steps
    opts.model = opts.model or ("tiny-llama" if opts.dry_run else "llama-3.2-1b")
    opts.seq_len = opts.seq_len or (128 if opts.dry_run else 2048)
    opts.script_steps = [_step(s) for s in opts.script_steps]
    return opts


def _step(text: str) -> dict:
    """'plan_gpu.py=failed: exit code 1' -> {"name": "plan_gpu.py", "status": "failed", "detail": "exit code 1"}."""
    name, _, how = text.partition("=")
    status, _, detail = how.partition(":")
    return {"name": name.strip(), "status": status.strip() or "ok", "detail": detail.strip() or None}


def prepare(meta: dict, work: Path, opts, planned: list) -> dict:
    """The saved model directory, its architecture and the data files every case reads."""
    from toolkit.plan.arch import load_arch

    print(f"gpu_finetune: saving {opts.model} (random weights, bf16) with save_pretrained", flush=True)
    model_dir = {"dense": gpu_inputs.save_model(opts.model, work)}
    if any(c.ep and why is None for c, why in planned):  # the MoE model, only where an AutoEP case runs
        name, blocks, _ = DRY_MOE if opts.dry_run else MOE_MODEL
        print(f"gpu_finetune: saving {name} widths, {blocks or 'all'} blocks (random weights, bf16)", flush=True)
        model_dir["moe"] = gpu_inputs.save_model(name, work, blocks=blocks)
    arch = {key: load_arch(str(path)) for key, path in model_dir.items()}
    most_tokens = max(c.gbs for c, _ in planned) * opts.seq_len * (opts.warmup + opts.steps)
    meta.update(model_dir=str(model_dir["dense"]), matmul_params=matmul_params(arch["dense"]),
                moe_model_dir=str(model_dir.get("moe")), moe_matmul_params=matmul_params(arch["moe"]) if "moe" in arch
                else None)
    return {"work": work, "model_dir": model_dir, "arch": arch, "preset": meta["preset"],
            "peak_tflops": meta["peak_tflops"], "data": {"text": gpu_inputs.text_file(most_tokens, work),
                                                         "chat": gpu_inputs.chat_file(most_tokens, work)}}


def run_cases(cases: list, meta: dict, ctx: dict, planned: list, opts, deadline: float | None) -> None:
    """Each planned case in turn (or its reason to skip), appended to `cases` and saved after each."""
    for case, why in planned:
        left = None if deadline is None else deadline - time.perf_counter()
        if why is None and left is not None and left < MIN_CASE_S:
            why = f"the --budget of {opts.budget:.0f} s was spent ({max(left, 0):.0f} s left)"
        if why:
            cases.append({**asdict(case), "world": case.world, "status": "skipped", "reason": why})
            print(f"  {case.name}: skipped: {why}", flush=True)
        else:
            cases.append(run_case(case, ctx, opts, opts.timeout if left is None else min(opts.timeout, left)))
            report_case(cases[-1])
        save(meta, cases)


def main(argv=None) -> int:
    opts = parse_args(argv)
    start = time.perf_counter()
    if opts.out_dir or opts.dry_run:  # common writes under RESULTS: point it away from the real figures
        common.RESULTS = Path(opts.out_dir or tempfile.mkdtemp(prefix="dstk-gpu-dry-run-"))
    if opts.record_only:
        return record_steps(opts.script_steps)
    found = hardware(opts)
    if found is None:
        print("gpu_finetune: skipped: no CUDA (use --dry-run to check the script on CPU)")
        return 0
    if found == "cuda":
        print("gpu_finetune: --dry-run needs a machine without CUDA: DeepSpeed's launcher gives each rank its own "
              "CUDA_VISIBLE_DEVICES, so CPU ranks cannot be had where GPUs are (run the real benchmark instead)")
        return 2
    gpu_name, preset, peak, gpus = found
    work = Path(opts.work_dir or tempfile.mkdtemp(prefix="dstk-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    planned = plan_cases(opts.cases, gpus, opts.dry_run)
    meta = {"gpu": gpu_name, "preset": preset, "peak_tflops": peak, "gpus": gpus, "dry_run": opts.dry_run,
            "model": opts.model, "seq_len": opts.seq_len, "matmul_params": 0, "optimizer": "DeepSpeed FusedAdam"
            if opts.fused_adam else "torch AdamW (torch_adam; fused on GPUs)", "warmup": opts.warmup, "steps": opts.steps,
            "work_dir": str(work), "script_steps": opts.script_steps}
    print(f"gpu_finetune: {meta}", flush=True)
    cases = []
    try:
        ctx = prepare(meta, work, opts, planned)
        run_cases(cases, meta, ctx, planned, opts, None if opts.budget is None else start + opts.budget)
    except Exception as exc:  # recorded in gpu.json too, then the traceback as usual
        meta["script_steps"].append({"name": "gpu_finetune.py", "status": "failed", "detail": f"{type(exc).__name__}: "
                                     f"{exc}", "traceback": traceback.format_exc()[-4000:]})
        save(meta, cases)
        raise
    failed = [c["name"] for c in cases if c["status"] == "failed"]
    meta["script_steps"].append({"name": "gpu_finetune.py", "status": "failed" if failed else "ok",
                                 "detail": f"case(s) failed: {', '.join(failed)}" if failed else None})
    print("\n".join(save(meta, cases)))
    print(f"gpu_finetune: {time.perf_counter() - start:.0f} s; wrote {common.RESULTS / 'gpu.json'}; logs in {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
