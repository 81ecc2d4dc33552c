"""bench/long_context.py's tables: each row's longest sequence within the budget at every sp beside the planner's,
the worst measured / planner's activations of the row, tokens/s at its common length, every length tried, and the
ALST comparison."""

OFFLOAD = ("+ offload activations: on a CPU the host is the device, so --offload-activations on copies the "
           "checkpointed block inputs within the same memory (models.tiled.offload): it cannot save anything here, and "
           "the row shows what the copies cost; on a GPU it moves them off the device. The planner does not count it "
           "(its figures are + tiled MLP's).")


def cell(c: dict) -> str:
    """'4096 (planner 8192)'; '>= 16384, the cap (planner ...)'; 'none (...)'; 'failed: why'."""
    if c["status"] != "ok":
        return f"failed: {c['status']}"
    got = "none" if not c["longest"] else f">= {c['longest']}, the cap" if c["capped"] else str(c["longest"])
    return f"{got} (planner {c['predicted_longest'] or 'none'})"


def worst(cells: list) -> str:
    """The measured / planner's activation ratio farthest from 1 over the row's completed runs, and where."""
    import math

    found = [(t["ratio"], c["sp"], t["length"]) for c in cells if c["status"] == "ok" for t in c["tried"]
             if t.get("ratio") and t["status"] in ("fits", "over")]
    if not found:
        return "-"
    ratio, sp, length = max(found, key=lambda f: abs(math.log(f[0])))
    return f"{ratio:.2f} (sp {sp}, {length})"


def speed_text(speed: dict, sps: list) -> str:
    if not speed["length"]:
        return "-"
    rates = speed["median_tokens_per_s"]
    return f"{speed['length']}: " + " / ".join(f"{rates[sp]:.0f}" if rates.get(sp) else "-" for sp in sps)


def tried_text(t: dict) -> str:
    """'2048: 180 / 210 MiB fits'; a run stopped past the limit: '4096: > 330 / 410 MiB, stopped'."""
    pred = f"{t['predicted_mib']:.0f} MiB"
    if t["status"] == "failed":
        return f"{t['length']}: failed / {pred}"
    if t["status"] == "killed":
        return f"{t['length']}: > {t['activation_mib']:.0f} / {pred}, stopped"
    return f"{t['length']}: {t['activation_mib']:.0f} / {pred} {'fits' if t['status'] == 'fits' else 'over'}"


def markdown(meta: dict, rows: list, speed: list, alst: list) -> list:
    sps = meta["sps"]
    lines = [meta["model"] + f" Activation budget per rank: {meta['budget_mib']:g} MiB (peak RSS above a "
             f"baseline run of {meta['base_tokens']} tokens per rank at the same sp, ZeRO-{meta['zero']}); lengths double from one known to fit, up to "
             f"{meta['cap']}{', then one step halfway to the first failing one' if meta['bisect'] else ''}. "
             f"{meta['cpus']} CPUs, cpus / sp threads per rank; load average {meta['load'][0]:.1f} before, "
             f"{meta['load'][1]:.1f} after.", "",
             "| features (each row adds one; the last is dstk's defaults) | "
             + " | ".join(f"sp {sp}: longest" for sp in sps) + " | measured / planner's activations, worst (sp, "
             f"length) | tokens/s at the row's common length (sp {' / '.join(map(str, sps))}) |",
             "|---" * (len(sps) + 3) + "|"]
    for cells, rate in zip(rows, speed):
        lines.append(f"| {cells[0]['row']}: {cells[0]['flags']} | " + " | ".join(cell(c) for c in cells)
                     + f" | {worst(cells)} | {speed_text(rate, sps)} |")
    lines += ["", OFFLOAD, "", "Each length tried: measured / planner's activations (MiB above the baseline run of "
              f"{meta['base_tokens']} tokens per rank; the planner's with the head's gradient where the loss is tiled; a run past {meta['kill_at']:g}x the budget is stopped there, its figure a "
              "lower bound):", "", "| features | sp | lengths |", "|---|---|---|"]
    for cells in rows:
        for c in cells:
            if c["status"] == "ok":
                lines.append(f"| {c['row']} | {c['sp']} | " + "; ".join(map(tried_text, c["tried"])) + " |")
    return lines + alst_lines(alst)


def alst_lines(alst: list) -> list:
    lines = ["", "ALST (arXiv 2506.13996) against dstk's GPU path as `dstk plan` sizes it (Llama-3.1-8B with 4M "
             "positions, H100 80GB, bf16, gbs 1, rows of one whole document (`--rows full`), any layout it plans (sp "
             "included), activation checkpointing and offload allowed; lengths: powers of two from 16K, then the gap to the first that does not fit halved 4 times):", "",
             "| GPUs | ALST measured | dstk, planner's longest | its layout | long-sequence features (checkpoints on the "
             "host) | the next length needs (least-memory layout) | of which the loss's peak |",
             "|---|---|---|---|---|---|---|"]
    for r in alst:
        best, short = r["dstk_planned"], r["next_length"]
        lines.append(f"| {r['gpus']} | {r['alst_tokens'] / 1e6:.1f}M | "
                     + (f"{best['length'] / 2**10:.0f}K ({best['memory_gib']:.0f} GiB) | {best['layout']} | "
                        f"{', '.join(best['features'])} ({best['host_activations_gib']:.0f} GiB) | " if best
                        else "none fits at 16K | | | ")
                     + (f"{short['length'] / 2**10:.0f}K: {short['memory_gib']:.0f} GiB | {short['loss_peak_gib']:.0f} "
                        "GiB |" if short else "- | - |"))
    return lines + ["", "The planner counts dstk train's defaults: the tiled loss (--tiled-loss auto, "
                    "models.tiled.loss: four fp32 tiles at the loss's peak instead of (seq / sp) x vocab logits in fp32 "
                    "and their softmax; bench/tiled_loss.py measures it), DeepSpeed's TiledMLP (--tiled-mlp auto, "
                    "models.tiled.mlp: one shard's MLP intermediates) and the checkpointed block inputs in host memory "
                    "but two (--offload-activations auto: on a GPU from 1 GiB per micro-batch; not measurable on this "
                    "CPU machine, where host memory is the device's)."]
