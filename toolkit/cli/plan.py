"""`dstk plan`: memory per GPU, bubble and step time of every layout; the best few, or the closest."""


import click

from toolkit.cli import echo_json

from toolkit.plan.arch import builtin_names
from toolkit.plan.gpus import GPUS


def _size(ctx, param, value):
    from toolkit.plan.gpus import parse_size

    return None if value is None else parse_size(value, f"--{param.name.replace('_', '-')}")


@click.command("plan")
@click.option("--model", required=True, metavar="NAME|DIR|ORG/NAME", help=f"Built-in architecture ({builtin_names()}), a local HF directory, or a hub id whose config.json is read from the Hugging Face cache (downloaded when online; offline, HF_HUB_OFFLINE=1, fill it with `hf download ORG/NAME config.json`).")
@click.option("--revision", default="main", show_default=True, metavar="REV", help="Branch, tag or commit of a hub id in --model.")
@click.option("--gpus-per-node", "--gpus", "gpus_per_node", type=int, default=8, show_default=True, metavar="N", help="GPUs in each node (--gpus: the same, for one node).")
@click.option("--nodes", type=int, default=1, show_default=True, metavar="N", help="Nodes.")
@click.option("--gpu", metavar="NAME", help=f"GPU preset: {', '.join(GPUS)} (h100 means h100-sxm). Default: h100-sxm, "
              "unless --gpu-mem describes another card.")
@click.option("--gpu-mem", callback=_size, metavar="SIZE", help="Memory per GPU, e.g. 80GiB or 24GB (overrides the preset's).")
@click.option("--seq-len", type=int, metavar="T", help="Tokens per sequence. Default: min(2048, the model's maximum).")
@click.option("--gbs", type=int, metavar="N", help="Global batch: sequences per optimizer step. Default: one per GPU "
              "(--gpus-per-node x --nodes).")
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True, help="Training precision (bf16/fp16 keep fp32 master weights).")
@click.option("--optimizer", type=click.Choice(["adam", "sgd"]), default="adam", show_default=True, help="Adam(W): 2 fp32 states per parameter; SGD: momentum.")
@click.option("--tflops", type=float, metavar="X", help="Dense peak TFLOPs per GPU, > 0 (overrides the preset's).")
@click.option("--intra-bw", type=float, metavar="GB/S", help="Bandwidth between GPUs of a node, GB/s per direction, > 0.")
@click.option("--inter-bw", type=float, metavar="GB/S", help="Bandwidth per GPU between nodes, GB/s per direction, > 0.")
@click.option("--mfu", type=float, default=0.5, show_default=True, help="Share of peak FLOPs a step reaches, in (0, 1].")
@click.option("--reserve", type=float, default=0.1, show_default=True, help="Share of GPU memory left for the allocator's fragmentation, in [0, 1); the CUDA context and NCCL buffers are counted apart.")
@click.option("--host-mem", callback=_size, default="1TiB", show_default=True, metavar="SIZE", help="Host memory per node, for offload.")
@click.option("--attention", type=click.Choice(["sdpa", "eager", "flash_attention_2"]), default="sdpa", show_default=True,
              help="sdpa and flash_attention_2 keep no (seq x seq) attention matrix, eager does; sdpa and eager keep "
              "a (mbs, seq, seq) mask per micro-batch for padded or packed rows, flash_attention_2 none.")
@click.option("--rows", type=click.Choice(["padded", "full"]), default="padded", show_default=True,
              help="The data's rows: padded (some padded or packed: sdpa and eager keep a mask) or full (each row one "
              "document that fills it: at pp 1 sdpa runs causal with no mask).")
@click.option("--tiled-loss", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="As dstk train's: the causal LM loss in tiles, counted with a tile's logits instead of the whole "
              "micro-batch's (auto: where they would take 512 MiB or more).")
@click.option("--tiled-mlp", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="As dstk train's: each dense block's MLP through TiledMLP, counted with one shard's (tokens x "
              "intermediate) activations at the block's peak and none held, and one more MLP forward per block (auto: "
              "where a block's MLP would hold 1 GiB or more in rows longer than the hidden size).")
@click.option("--offload-activations", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="As dstk train's: with activation checkpointing, the checkpointed block inputs in host memory but "
              "two, counted against --host-mem (auto: where a GPU's would take 1 GiB or more per micro-batch).")
@click.option("--ep/--no-ep", "expert_parallel", default=True, show_default=True,
              help="Consider expert parallelism (DeepSpeed's AutoEP) for an MoE model.")
@click.option("--offload/--no-offload", default=True, show_default=True, help="Consider ZeRO offload to CPU.")
@click.option("--checkpointing/--no-checkpointing", default=True, show_default=True, help="Consider activation checkpointing.")
@click.option("--lora", type=int, metavar="R", help="Plan LoRA fine-tuning: rank-R adapters on every block linear train, the base is frozen (weights only: no gradients or optimizer states).")
@click.option("--top", type=int, default=3, show_default=True, help="How many layouts to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--emit-config", type=click.Path(dir_okay=False), metavar="FILE", help="Write the best layout as a DeepSpeed config.")
@click.option("--force", is_flag=True, help="Overwrite an existing --emit-config file.")
def plan(as_json, emit_config, force, **kwargs):
    """Estimate memory per GPU and step time of every layout; recommend the best.

    Exit code 1 when no layout fits (the closest one is shown).

    \b
    dstk plan --model llama-3.2-1b --gpu a100-80gb --gpus-per-node 8 --gbs 256
    dstk plan --model llama-3-8b --seq-len 524288 --gpus 1 --rows full
    dstk plan --model gpt2 --gpu-mem 24GiB --gpus-per-node 2 --gbs 32 --seq-len 1024 --json
    dstk plan --model llama-2-7b --gpu l4 --gpus-per-node 2 --gbs 16 --seq-len 1024 --lora 16
    """
    from toolkit.plan.layouts.planner import PlanRequest, make_plan
    from toolkit.plan.layouts.report import layout_config, render_text, render_whole_documents

    defaults = []
    if kwargs["gpu"] is None and kwargs["gpu_mem"] is None:
        kwargs["gpu"] = "h100-sxm"
        defaults.append("--gpu h100-sxm")
    if kwargs["gbs"] is None:
        kwargs["gbs"] = kwargs["gpus_per_node"] * kwargs["nodes"] if kwargs["gpus_per_node"] > 0 < kwargs["nodes"] else 0
        defaults.append(f"--gbs {kwargs['gbs']} (one sequence per GPU)")
    if defaults and not as_json:
        click.echo(f"assumed: {', '.join(defaults)}; give them to plan for another card or batch", err=True)
    result = make_plan(PlanRequest(**kwargs))
    if emit_config and result.fitting:
        from toolkit.config.generate import write_config

        write_config(layout_config(result), emit_config, force=force, flag="--emit-config")
    echo_json(result.to_dict()) if as_json else click.echo(render_text(result))
    if not (result.fitting or as_json) and kwargs["rows"] == "padded" and kwargs["attention"] != "flash_attention_2":
        whole = make_plan(PlanRequest(**{**kwargs, "rows": "full"}))  # without the (seq x seq) mask, at pp 1
        if whole.fitting:
            click.echo(render_whole_documents(whole))
    if emit_config:
        click.echo(f"wrote {emit_config} ({result.best[0].layout.describe()})" if result.fitting
                   else f"not writing {emit_config}: no layout fits", err=True)
        if result.fitting and result.best[0].layout.schedule == "dualpipev":
            click.echo("train it with `dstk train --schedule dualpipev` (the config holds no schedule)", err=True)
    return 0 if result.fitting else 1
