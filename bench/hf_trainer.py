"""The anchor of bench/gpu_finetune.py: transformers' Trainer training what dstk's case pp1-zero1 trains, so the
two rates and peaks can be read side by side (case pp1-zero1-hf). Started by DeepSpeed's launcher, as dstk's
ranks are (launch.sh), one process per GPU:

    python -m deepspeed.launcher.runner --num_gpus 1 bench/hf_trainer.py --config ds.json --model DIR \\
        --data corpus.txt --seq-len 2048 --steps 33 --out OUT

The same for both trainers: the DeepSpeed config file (TrainingArguments(deepspeed=...), every value HF
checks against its own arguments set to the config's: mbs, gas, lr, Adam's betas and eps, weight decay,
clipping, bf16; a constant learning rate, as the config names no scheduler and dstk adds none); the model
directory (from_pretrained, the attention kernel named); and the token rows, in the same order: read by
dstk's own data preparation and sampler (toolkit.data: the same file, --seq-len, packing and seed), fed
sequentially (train_sampling_strategy "sequential"), each micro-batch in HF's packed-sequence format
(position_ids restarting at each document, no attention mask: what dstk's pp 1 forward passes,
models.attention.model_inputs), so both compute the same attention over the same tokens.

Per step, timed from one on_step_end to the next after a CUDA sync (HF's batch fetch and its logging of the
previous step included; logging_steps 1 reads the loss back every step, as dstk does): OUT/metrics.jsonl
holds dstk's record shape (step, loss, tokens_per_s, samples_per_s) plus targets (tokens the loss is taken on)
and padding (positions of no document), and a summary with dstk's field names: tokens/s over the steps after
the first, and peak memory counted from on_train_begin (the engine built: toolkit.train.report.memory, as
dstk's loop counts it), the load's peak beside it.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--config", "--model", "--data", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps, the warm-up ones included")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--seed", type=int, default=1234, help="dstk train's default: the same rows in the same order")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def training_arguments(cfg: dict, out: str, steps: int, seed: int, cpu: bool = False) -> dict:
    """TrainingArguments' keywords for DeepSpeed config `cfg`: every value HF checks against the config
    (integrations/deepspeed.py trainer_config_process) equal to the config's, a constant learning rate, no
    checkpoint, the loss logged (read back) every step, the rows in order; `cpu`: on CPU processes (HF
    refuses bf16 without a GPU unless told use_cpu)."""
    params = (cfg.get("optimizer") or {}).get("params") or {}
    betas = params.get("betas", [0.9, 0.999])
    return dict(output_dir=out, deepspeed=cfg, max_steps=steps, seed=seed,
                per_device_train_batch_size=cfg["train_micro_batch_size_per_gpu"],
                gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
                learning_rate=params.get("lr", 1e-3), adam_beta1=betas[0], adam_beta2=betas[1],
                adam_epsilon=params.get("eps", 1e-8), weight_decay=params.get("weight_decay", 0.0),
                max_grad_norm=cfg.get("gradient_clipping", 0.0), lr_scheduler_type="constant", warmup_steps=0,
                bf16=bool((cfg.get("bf16") or {}).get("enabled")), fp16=bool((cfg.get("fp16") or {}).get("enabled")),
                logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
                disable_tqdm=True, remove_unused_columns=False, train_sampling_strategy="sequential",
                dataloader_num_workers=0, use_cpu=cpu)


def training_rows(opts, cfg: dict) -> list:
    """The rows dstk's run of these flags trains on, in its order (dp 1): its data options (job.data_options),
    preparation (toolkit.data.prepare) and sampler (ShardedBatches, --seed), opts.steps x gas micro-batches of
    mbs rows, each row {"input_ids", "doc_ids", "labels"}."""
    from toolkit import data
    from toolkit.train import hf, job
    from toolkit.train.runner import TrainArgs

    args = TrainArgs(model=opts.model, data=opts.data, config=opts.config, seq_len=opts.seq_len, eval_fraction=0.0,
                     seed=opts.seed, attention=opts.attention)
    tokenizer = hf.load_tokenizer(args.model)
    config = hf.load_config(args.model, tokenizer, args.task, attention=args.attention)
    prepared = data.prepare(job.data_options(args, hf.max_positions(config)), tokenizer)
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    batches = data.ShardedBatches(prepared.train, mbs, gas, 1, 0, args.seed).micro_batches(0)
    rows = []
    for _ in range(opts.steps * gas):
        (input_ids, doc_ids), labels = next(batches)
        rows += [{"input_ids": i, "doc_ids": d, "labels": y} for i, d, y in zip(input_ids, doc_ids, labels)]
    return rows


def collator(model_config):
    """Rows -> one micro-batch as dstk's pp 1 forward passes it (models.attention.model_inputs): packed rows
    get position_ids restarting per document and no attention mask (HF's packed-sequence format)."""
    import torch

    from models.attention import model_inputs

    def collate(rows: list) -> dict:
        doc_ids = torch.stack([r["doc_ids"] for r in rows])
        batch = {"input_ids": torch.stack([r["input_ids"] for r in rows]),
                 "labels": torch.stack([r["labels"] for r in rows]), **model_inputs(doc_ids, model_config)}
        return {k: v for k, v in batch.items() if v is not None}

    return collate


def step_counts(rows: list, per_step: int) -> tuple:
    """(targets, padding) per optimizer step of `per_step` rows: the positions the loss is taken on (labels
    after the causal shift, toolkit.data.loss_weight) and the positions of no document (doc_ids 0)."""
    import torch

    from toolkit.data import loss_weight

    steps = [rows[i:i + per_step] for i in range(0, len(rows), per_step)]
    return ([loss_weight(torch.stack([r["labels"] for r in s])) for s in steps],
            [int(sum(int((r["doc_ids"] == 0).sum()) for r in s)) for s in steps])


def step_clock():
    """A TrainerCallback timing each optimizer step (after a CUDA sync), taking each step's logged loss, and the
    peaks: reset at on_train_begin (the DeepSpeed engine is built by then), read at on_train_end."""
    from transformers import TrainerCallback

    from toolkit.train.report import memory

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds, self.losses, self.load, self.peaks, self.last = [], {}, None, None, None

        def _now(self, device) -> float:
            if device.type == "cuda":
                import torch

                torch.cuda.synchronize(device)
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.load = memory.reset_peaks(args.device)
            self.last = self._now(args.device)

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now(args.device)
            self.seconds.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

        def on_train_end(self, args, state, control, **kwargs):
            gpu = memory.gpu_peak_mib(args.device)
            self.peaks = {"host_mib": round(memory.host_peak_mib(), 1),
                          "gpu_mib": None if gpu is None else round(gpu, 1)}

    return StepClock()


def write_metrics(out: Path, clock, rows: list, per_step: int, seq_len: int, model) -> dict:
    """OUT/metrics.jsonl in dstk's shape (one record per step, the summary last); returns the summary."""
    import accelerate
    import deepspeed
    import transformers

    from toolkit.train.report.summary import throughput

    targets, padding = step_counts(rows, per_step)
    records = [{"step": s, "loss": clock.losses.get(s), "tokens_per_s": per_step * seq_len / sec,
                "samples_per_s": per_step / sec, "targets": targets[s - 1], "padding": padding[s - 1]}
               for s, sec in enumerate(clock.seconds, start=1)]
    losses = [r["loss"] for r in records if r["loss"] is not None]
    params = sum(p.numel() for p in model.parameters())
    summary = {"trainer": "transformers.Trainer", "versions": {"transformers": transformers.__version__,
               "accelerate": accelerate.__version__, "deepspeed": deepspeed.__version__},
               "steps": len(records), "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, **throughput(clock.seconds, per_step * seq_len, per_step),
               "mfu": None, "params_per_rank": [params], "trainable_params_per_rank": [params],
               "peak_rss_mib_per_rank": [clock.peaks["host_mib"]], "peak_gpu_mib_per_rank": [clock.peaks["gpu_mib"]],
               "load_peak_rss_mib_per_rank": [clock.load["host_mib"]],
               "load_peak_gpu_mib_per_rank": [clock.load["gpu_mib"]]}
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + [json.dumps({"summary": summary})]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return summary


def main(argv=None) -> int:
    opts = parse_args(argv)
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    cfg = json.loads(Path(opts.config).read_text())
    rows = training_rows(opts, cfg)
    model = AutoModelForCausalLM.from_pretrained(opts.model, attn_implementation=opts.attention)
    model.config.use_cache = False  # with a cache HF ignores the packed format (models.spec.attention_inputs)
    out = Path(opts.out)
    cpu = os.environ.get("DS_ACCELERATOR") == "cpu"  # the dry run's CPU processes (bench/gpu_finetune.py child_env)
    if cpu:  # DeepSpeed's CPU accelerator would JIT-build its shared-memory all-reduce (minutes); dstk's ranks do not
        from toolkit.distributed.process_group import prepare

        prepare(cpu=True)
    args = TrainingArguments(**training_arguments(cfg, str(out / "trainer"), opts.steps, opts.seed, cpu))
    if args.world_size != 1:  # the rows are dstk's dp rank 0's; HF's sampler would shard them another way
        sys.exit(f"hf_trainer: runs on one process (dstk's rows at dp 1), not {args.world_size}")
    clock = step_clock()
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator(model.config),
                      callbacks=[clock])
    trainer.train()
    if args.process_index == 0:
        per_step = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * args.world_size
        summary = write_metrics(out, clock, rows, per_step, opts.seq_len, model)
        print(f"hf_trainer: {summary['tokens_per_s']:,.0f} tokens/s over steps 2-{summary['steps']}, loss "
              f"{summary['first_loss']} -> {summary['last_loss']}, peak GPU MiB {summary['peak_gpu_mib_per_rank']}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
