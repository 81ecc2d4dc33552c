"""--objective dpo: the DpoLoss (models.objectives) a run trains with, what it refuses, pp 1's forward and the
metrics TRL logs (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected).

A micro-batch counts rows, as DeepSpeed's train_micro_batch_size_per_gpu does: mbs rows = mbs / 2 pairs, each pair's
chosen and rejected rows adjacent in the same micro-batch (toolkit.data.pairs), so mbs must be even.
"""

from toolkit.errors import ConfigError, UnusableInput


def uses_preference(args) -> bool:
    return getattr(args, "objective", "lm") == "dpo"


PAIR_COLUMNS = ("prompt", "chosen", "rejected")  # toolkit.data.pairs.PAIR_FIELDS (that package imports torch)


def check(args, cfg: dict, pp: int, sp: int, tp: int) -> None:
    """What --objective dpo refuses before any rank starts, every reason at once."""
    if not uses_preference(args):
        if args.format == "preference" or (args.format == "auto" and _preference_file(args.data, args.encoding)):
            raise ConfigError("the data holds preference rows ('prompt', 'chosen', 'rejected'): they train with "
                              "--objective dpo (pairs of chosen and rejected completions); add --objective dpo")
        return
    mbs = cfg.get("train_micro_batch_size_per_gpu")
    problems = []
    if isinstance(mbs, int) and mbs % 2:
        problems.append(f'"train_micro_batch_size_per_gpu" is {mbs} rows: --objective dpo keeps each pair\'s chosen '
                        f"and rejected rows in the same micro-batch, so it must be even; use {mbs + 1} "
                        f"({(mbs + 1) // 2} pairs)")
    if args.task != "causal-lm":
        problems.append(f"--task {args.task}: DPO scores a causal LM's completions; use --task causal-lm")
    if args.format not in ("auto", "preference"):
        problems.append(f"--format {args.format}: --objective dpo reads preference rows (prompt, chosen, rejected); "
                        "use --format preference or auto")
    for flag, on in (("--packing", args.packing), ("--streaming", args.streaming), ("--qlora", args.qlora)):
        if on:
            problems.append(f"{flag} with --objective dpo is not built yet; drop {flag}")
    if sp > 1:
        problems.append(f'"sequence_parallel_size" {sp}: a row\'s log-prob would be split over the sp ranks, which '
                        "--objective dpo does not gather yet; use sp 1")
    if tp > 1:
        problems.append(f"tensor parallel (tp {tp}) with --objective dpo is not built yet; use tp 1")
    if args.train_on != "assistant":
        problems.append(f"--train-on {args.train_on}: DPO scores the completions only (the prompt is the same in both "
                        "rows of a pair); drop --train-on")
    if args.drop_long:
        problems.append("--drop-long: a pair whose prompt leaves no completion token within --seq-len is refused by "
                        "its row number instead (a dropped pair would change which pairs train); drop --drop-long")
    if args.tiled_loss == "on":
        problems.append("--tiled-loss on: --objective dpo scores each row from the whole logits (per-row sums, not "
                        "the tiled token mean); use --tiled-loss off or auto")
    if problems:
        raise ConfigError("--objective dpo: " + "; ".join(problems))


def _preference_file(path, encoding: str) -> bool:
    """Whether a .jsonl file's first row holds the preference columns (read before any rank starts, without torch)."""
    from pathlib import Path

    from toolkit.data.source import first_row

    path = Path(path)
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    try:
        row = first_row(path, "--data", encoding)
    except UnusableInput:  # not JSON lines: the data's own check (source.check_path) says what it is
        return False
    return all(key in row for key in PAIR_COLUMNS)


def build(args, pp: int, lora: bool):
    """The run's DpoLoss (None for --objective lm); at pp 1 with LoRA its reference is live (adapters off)."""
    if not uses_preference(args):
        return None
    from models.objectives import DpoLoss

    objective = DpoLoss(args.dpo_beta, args.dpo_loss)
    objective.live_reference = lora and pp == 1
    return objective


def check_prepared(objective, info: dict | None) -> None:
    """The prepared rows fit the objective: preference rows train with dpo only, and dpo trains on them only."""
    fmt = (info or {}).get("format")
    if objective is not None and fmt != "preference":
        raise ConfigError(f"--objective dpo needs preference rows ('prompt', 'chosen', 'rejected'); the data is format "
                          f"{fmt}")
    if objective is None and fmt == "preference":
        raise ConfigError("the data holds preference rows (prompt, chosen, rejected): train them with --objective dpo")


def opening_line(objective, mbs: int, reference_note: str = "") -> str | None:
    if objective is None:
        return None
    reference = ("the base with the adapters off (PEFT disable_adapter), each micro-batch" if objective.live_reference
                 else reference_note)
    return (f"objective: DPO, {objective.name} loss, beta {objective.beta}; micro-batch {mbs} rows = {mbs // 2} pairs "
            f"(chosen, rejected adjacent); reference: {reference}")


def forward_loss(engine, batch, objective):
    """pp 1: the micro-batch's DPO loss (a 0-d tensor). batch ((input_ids, doc_ids), (labels, ref_logps)) on the host;
    the model's logits whole (no tiled loss), each row's completion log-prob summed (models.objectives.sequence_logps).
    torch is imported here, not with the module: `dstk train --check` reads this package's refusals without it."""
    import torch

    from models.attention import model_inputs
    from models.objectives import sequence_logps
    from toolkit.data.transfer import to_device

    (input_ids, doc_ids), (labels, ref) = batch
    inputs = to_device({"input_ids": input_ids, **model_inputs(doc_ids, engine.module.config)}, engine.device)
    labels, ref = to_device((labels, ref), engine.device)
    if objective.live_reference:  # LoRA: the base is the reference
        with torch.no_grad(), engine.module.disable_adapter():
            ref = sequence_logps(engine.module(**inputs).logits, labels)
    logps = sequence_logps(engine(**inputs).logits, labels)
    return objective.loss(logps, ref, labels)


def stage_metrics(objective, device, prefix: str = "") -> dict:
    """TRL's metrics of the pairs the objective scored since the last call, over every rank (each pair is scored
    on one rank: a pp 1 rank, or its replica's loss stage); {} when none was."""
    from models.objectives import METRICS
    from toolkit.distributed.process_group import all_reduce_sum

    if objective is None:
        return {}
    *sums, count = all_reduce_sum(objective.stats.take(device), device)
    return {prefix + name: value / count for name, value in zip(METRICS, sums)} if count else {}
