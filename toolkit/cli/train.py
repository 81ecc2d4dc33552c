"""`dstk train`: run on every rank by the launcher (see launch.sh); parse, call toolkit.train.runner.run, print.
Every visible option is also a key of a --recipe file (toolkit.config.recipe), but COMMAND_LINE_ONLY."""

import os

import click

from models import spellings
from toolkit import __version__
from toolkit.config.recipe import config_named, recipe_option, recorded, write_inline_config
from toolkit.plan.arch import builtin_names

# What one invocation does rather than what the run is: never in a recipe, nor in the OUT/recipe.yaml a run
# saves (so `--recipe OUT/recipe.yaml --resume` reads back as it was written, whatever the first run was given).
COMMAND_LINE_ONLY = ("check_only", "world_size", "resume", "resume_with_new_data", "overwrite", "trust_checkpoint")


@click.command()
@recipe_option(COMMAND_LINE_ONLY)
@click.option("--model", required=True, metavar="DIR|NAME|ORG/NAME", help="Local HF model directory, a built-in "
              f"architecture (random weights, a byte tokenizer: {builtin_names()}), or a hub id read from the "
              "Hugging Face cache (HF_HUB_CACHE): downloaded there once per node when online; offline "
              "(HF_HUB_OFFLINE=1) it must be there already (fill it with `hf download ORG/NAME`).")
@click.option("--data", required=True, metavar="FILE|DIR", help="Local .txt (blank-line separated documents), "
              ".jsonl/.json, .parquet, .csv, .arrow, or a datasets.save_to_disk folder; see --format.")
@click.option("--format", "format", type=click.Choice(["auto", "text", "prompt-completion", "chat", "alpaca",
              "sharegpt", "preference"]), default="auto", show_default=True, help="Row format; auto: from the columns "
              "(text; prompt + completion|response; messages; instruction + output; conversations; prompt + chosen + "
              "rejected), said in the log.")
@click.option("--objective", type=click.Choice(["lm", "dpo"]), default="lm", show_default=True, help="lm: the task's "
              "own loss; dpo: preference training (DPO) on TRL's rows (prompt, chosen, rejected: strings, or message "
              "lists continuing the prompt), the loss on the completions; a micro-batch of mbs rows holds mbs/2 pairs "
              "(mbs even). The reference: the base with adapters off (--lora at pp 1), else the initial weights' "
              "log-probs, computed once and cached with the data.")
@click.option("--dpo-beta", type=click.FloatRange(min=0, min_open=True), default=0.1, show_default=True,
              help="DPO's beta: how far the policy may move from the reference.")
@click.option("--dpo-loss", type=click.Choice(["sigmoid"]), default="sigmoid", show_default=True,
              help="DPO's loss of a pair (TRL's loss_type): sigmoid, -log sigmoid(beta x the log-ratio margin).")
@click.option("--train-on", type=click.Choice(["assistant", "all"]), default="assistant", show_default=True,
              help="Loss on the assistant turns / completions only, or on every token.")
@click.option("--chat-template", metavar="FILE", help="Jinja chat template for chat, alpaca and sharegpt rows "
              "(default: the tokenizer's).")
@click.option("--packing/--no-packing", default=None, help="Several documents per row, attention kept inside "
              "each (default: on for text, off for prompt-completion and chat).")
@click.option("--drop-long", is_flag=True, help="Drop rows longer than --seq-len (default: truncate them; "
              "packed text: cut into pieces). Counted in the log either way.")
@click.option("--eval-data", metavar="FILE|DIR", help="Evaluate on this data instead of --eval-fraction of --data.")
@click.option("--streaming", is_flag=True, help="Read --data (.jsonl/.json, .txt, .parquet) as a stream, sharded by dp "
              "rank, in file order, tokenized and packed as it is needed (for corpora that fit neither in memory nor on "
              "local disk); needs --steps, and --eval-data or --eval-fraction 0. --resume continues at the next unseen row.")
@click.option("--data-cache", metavar="DIR", help="Cache of tokenized rows (default: HF_DATASETS_CACHE).")
@click.option("--data-workers", type=click.IntRange(min=1), metavar="N",
              help="Tokenizing threads per node; default: the cores, at most 8.")
@click.option("--config", "--deepspeed-config", "--deepspeed_config", "config", required=True, metavar="JSON",
              help="DeepSpeed config (from `dstk generate-config`).")
@click.option("--out", default="runs/dstk", show_default=True, metavar="DIR",
              help="Run folder: checkpoints/, hf/ (the export), metrics.jsonl, recipe.yaml (the flags it used).")
@click.option("--tokenizer", metavar="DIR|ORG/NAME", help="Tokenizer directory or hub id (default: the model's; "
              "bytes for built-ins).")
@click.option("--revision", default="main", show_default=True, metavar="REV", help="Branch, tag or commit of a hub "
              "id in --model / --tokenizer.")
@click.option("--task", type=click.Choice(spellings(("causal-lm", "sequence-classification"))), default="causal-lm",
              show_default=True, help="The head to train (classification: sequence-classification).")
@click.option("--pp", type=click.IntRange(min=1), help="Pipeline stages (default: the config's pipeline.stages, else 1).")
@click.option("--sp", type=click.IntRange(min=1), help="Ulysses sequence-parallel size: each group of SP ranks shares "
              "its rows, each rank holding 1/SP of the sequence (default: the config's sequence_parallel_size, "
              "else 1); dp = world / (pp x sp x tp).", metavar="SP")
@click.option("--schedule", type=click.Choice(["1f1b", "dualpipev"]), default="1f1b", show_default=True,
              help="Pipeline schedule at pp > 1: DeepSpeed's 1F1B, or DualPipeV (two stages per rank, the loss "
                   "back on rank 0; needs gradient_accumulation_steps >= 2 x pp).")
@click.option("--seq-len", type=click.IntRange(min=1), default=128, show_default=True, help="Tokens per row.")
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps (default: one epoch).")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Steps between eval losses (0: at the end).")
@click.option("--eval-batches", type=click.IntRange(min=1), hidden=True,
              help="Deprecated and ignored: evaluation covers the whole eval split.")
@click.option("--save-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Steps between checkpoints (0: at the end).")
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoints/latest with the same data order.")
@click.option("--resume-with-new-data", is_flag=True,
              help="With --resume: continue although the token stream changed (data, format, chat template, "
                   "--train-on, --seq-len, packing or tokenizer files): the weights, optimizer and step carry on, "
                   "on the new rows from the same step.")
@click.option("--trust-checkpoint", is_flag=True, help="With --resume: load the checkpoint's .pt files as pickles, "
              "unchecked (torch.load weights_only=False), for a checkpoint from a source you trust that holds classes "
              "other than DeepSpeed's; by default any other class is refused before loading (a pickle can run code).")
@click.option("--overwrite", is_flag=True, help="Delete the run OUT holds, then start a fresh run there (a folder holding files no run writes is refused).")
@click.option("--seed", type=int, default=1234, show_default=True, help="Model init and data order.")
@click.option("--eval-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="Share of documents held out for evaluation (split before packing), in [0, 1); 0: none.")
@click.option("--text-field", default="text", show_default=True, help="Column holding the text (text and "
              "classification rows).")
@click.option("--attention", type=click.Choice(["sdpa", "eager", "flash_attention_2"]), default="sdpa",
              show_default=True, help="Attention kernel, the same at every pp (flash_attention_2: CUDA and the "
              "flash-attn package).")
@click.option("--tf32", is_flag=True, help="fp32 matmuls and convolutions on TF32 tensor cores (NVIDIA Ampere and "
              "later: several times the fp32 peak, a 10-bit mantissa), as HF Trainer's --tf32; torch leaves TF32 off. "
              "On a CPU or an older GPU it does nothing, and the run's opening lines say so.")
@click.option("--lora", is_flag=True, help="Train LoRA adapters (peft) on a frozen base, at any pp x dp; exports "
              "OUT/adapter (PEFT format) and OUT/hf with them merged.")
@click.option("--qlora", is_flag=True, help="LoRA on a 4-bit NF4 base (bitsandbytes): CUDA GPUs, pp 1, ZeRO 0-2, "
              "--model a local directory or hub id; OUT/hf merges the adapters into the full-precision base.")
@click.option("--lora-r", type=click.IntRange(min=1), default=16, show_default=True, help="LoRA rank.")
@click.option("--lora-alpha", type=click.IntRange(min=1), help="LoRA alpha (default: 2 x --lora-r).")
@click.option("--lora-dropout", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Dropout on the adapters' input.")
@click.option("--lora-targets", metavar="NAMES", help="Comma-separated module names to adapt (default: every "
              "linear layer in the attention and MLP blocks, e.g. q_proj,k_proj,v_proj,o_proj,gate_proj,...).")
@click.option("--encoding", default="utf-8", show_default=True, help="Text encoding of --data (e.g. latin-1).")
@click.option("--export/--no-export", default=True, show_default=True, help="Write OUT/hf at the end.")
@click.option("--max-eval-rows", type=click.IntRange(min=1), metavar="N", help="Evaluate on the first N rows of the "
              "eval split only (HF's max_eval_samples; default: all of it); a long evaluation prints a progress line.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress on rank 0: a bar on a terminal, else a line every --log-every steps.")
@click.option("--log-every", type=click.IntRange(min=0), default=0, metavar="N",
              help="Steps between progress lines when not on a terminal (0: about 20 per run).")
@click.option("--report-to", multiple=True, metavar="NAME", help="Experiment trackers, as in HF Trainer: tensorboard "
              "(OUT/tensorboard), wandb, mlflow, all (every one installed) or none (the default); repeat the flag or "
              "separate with commas. Rank 0 logs loss, eval loss, lr, grad norm, tokens/s, samples/s, peak memory, MFU "
              "(CUDA) and each pipeline stage's forward/backward seconds, with the run's arguments, DeepSpeed config "
              "and layout as hyperparameters. metrics.jsonl holds the same either way.")
@click.option("--verbose", is_flag=True, help="DeepSpeed's INFO logs on every rank, transformers' progress bars, "
              "and (through launch.sh) the launcher's INFO lines.")
@click.option("--check", "check_only", is_flag=True, help="Only check, then exit 0 or refuse; starts no process "
              "group (launch.sh runs this first): the config (for --world-size) and any recorded pipeline.parts "
              "against --model; the model folder (config.json, safetensors headers, tokenizer files; a hub id's from "
              "the cache alone: one not cached yet is refused offline, downloaded by the ranks online); the data file "
              "(--streaming with --world-size: a document for every dp rank); "
              "--chat-template; --out (writable; used or not; not in use by a run training there); with --resume, that "
              "the latest checkpoint is whole and was written by this run on this token stream (its files by content).")
@click.option("--world-size", type=click.IntRange(min=1), metavar="N", help="Processes the run will have (with --check).")
@click.option("--tiled-loss", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Compute the causal LM loss with the head inside it, in tiles of tokens, so a micro-batch's logits "
              "(tokens x vocabulary, fp32) never exist whole: the same loss and gradients for one more head matmul. "
              "auto: on where a micro-batch's logits would take 512 MiB or more (Llama 3: 1024 tokens); the run's "
              "opening lines say which and why.")
@click.option("--tiled-mlp", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Run each decoder block's dense MLP through DeepSpeed's TiledMLP, in shards of hidden-size tokens "
              "recomputed in the backward, so only one shard's (tokens x intermediate) activations exist at a time: "
              "the same loss and gradients for one more MLP forward. auto: on where a block's MLP would hold 1 GiB "
              "or more (Llama-3-8B in bf16: about 9400 tokens per micro-batch) in rows longer than the hidden size; "
              "the opening lines say which and why.")
@click.option("--offload-activations", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="With activation checkpointing, move each checkpointed block's input (tokens x hidden per block) to "
              "pinned host memory in the forward and back for its recompute in the backward (DeepSpeed's activation "
              "offload), so the GPU holds about one block's at a time: the same loss and gradients for host copies "
              "that overlap compute. auto: on a GPU where they would take 1 GiB or more per micro-batch (Llama-3-8B "
              "in bf16: 4096 tokens); the opening lines say which and why.")
@click.option("--step-timeout", type=click.FloatRange(min=1), metavar="SECONDS", help="End the run when a step, an "
              "evaluation or a checkpoint save lasts longer than this on any rank (a stuck collective, a hung GPU): "
              "each rank names where it was; under launch.sh --max-restarts the run restarts from its last checkpoint. "
              "Allow for the slowest save. Default: no limit.")
@click.option("--save-on-signal", is_flag=True, help="On SIGUSR1 or SIGTERM (a scheduler's warning before its time "
              "limit, e.g. slurm --signal=USR1@300), finish the current step, save a checkpoint, then stop (exit 0; "
              "`--resume` continues). A second SIGTERM stops at once.")
@click.option("--crash-at-step", type=int, hidden=True)
@click.option("--crash-in-step", type=int, hidden=True)
@click.option("--stall-at-step", type=int, hidden=True)
@click.option("--local_rank", "--local-rank", "local_rank", type=int, hidden=True, help="Set by the deepspeed launcher.")
def train(local_rank, check_only, world_size, **options):
    """Train a HF model (run on every rank by the launcher).

    \b
    ./launch.sh --num-gpus 2 -- --recipe ds_configs/recipes/full_finetune.yaml
    ./launch.sh --num-gpus 2 --config ds.json -- --model tiny-gpt2 --data toolkit/corpus/corpus.txt
    """
    from toolkit.distributed.process_group import shutdown
    from toolkit.train.runner import TrainArgs, check, run

    ctx = click.get_current_context()
    write_inline_config(ctx)  # a recipe's inline DeepSpeed config, as the file --config reads
    if options["eval_batches"] is not None and os.environ.get("RANK", "0") == "0":
        click.echo("note: --eval-batches is ignored: evaluation now covers the whole eval split "
                   "(token-weighted mean loss); drop the flag", err=True)
    if check_only:
        check(TrainArgs(**options), world_size)
        click.echo(f"ok: {config_named(ctx)}, {options['data']} and --out {options['out']} are fit to train"
                   + (f" on {world_size} process(es)" if world_size else ""))
        return
    header = (f"# The flags of this run (the command line's over any --recipe's), saved by dstk {__version__}.\n"
              f"# Continue it: --recipe {os.path.join(options['out'], 'recipe.yaml')} --resume (--steps N for more)\n")
    summary = run(TrainArgs(**options), teardown=True, recipe=recorded(ctx, COMMAND_LINE_ONLY, header))
    if summary.get("rank0"):
        from toolkit.checkpoint.run_folder import RunFolder
        from toolkit.train.report import read_metrics, table

        click.echo(table(*read_metrics(RunFolder(options["out"]).metrics)))
        curve = summary["loss_png"] or f"skipped: {summary['loss_png_skipped']}"
        click.echo(f"loss curve: {curve}" + (f"; HF model: {summary['export']}" if "export" in summary else "")
                   + f"; summary: {summary['summary_json']}")
        if summary.get("stopped_by"):
            tag = RunFolder(options["out"]).checkpoints / f"global_step{summary['stopped_at']}"
            click.echo(f"stopped by {summary['stopped_by']} (--save-on-signal) after step {summary['stopped_at']} of "
                       f"{summary['steps']}: {tag} is saved; --resume continues the run")
    shutdown()


def launch_view(argv: list) -> str:
    """What launch.sh needs before any rank starts, from the training arguments it passes on (--recipe
    included, the command line over it): the DeepSpeed config file (a recipe's inline one written where
    every rank writes it), --out, and whether --save-on-signal is on (1 or 0), one a line."""
    ctx = train.make_context("train", list(argv))
    return f"{write_inline_config(ctx) or ctx.params['config']}\n{ctx.params['out']}\n{int(ctx.params['save_on_signal'])}"
