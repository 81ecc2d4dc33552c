"""The sweep's tables: bench/results/arch_sweep.json and .md (written by bench/arch_sweep.py) and the supported-
architecture section of docs/models.md, made from the committed arch_sweep.json.

    .venv/bin/python bench/arch_table.py      # rewrite the section between the markers in docs/models.md

tests/bench/test_arch_sweep.py checks that docs/models.md holds exactly what this makes from the committed
table, so the page says what the last sweep measured.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "results" / "arch_sweep.json"
BEGIN, END = "<!-- arch-sweep:begin -->", "<!-- arch-sweep:end -->"
OUTCOMES = ("crash", "mismatch", "config", "refused", "exact")  # table order: worst first

# refusal reason -> the kind shown in docs/models.md (first match wins)
KINDS = [
    (r"is '[^']*(indexed|compressed)[^']*'", "indexed or compressed attention (inputs of their own)"),
    (r"is '[^']*(linear|conv|mamba|recurrent|ssm|delta)[^']*'|causal convolution",
     "recurrent, state-space or convolution layers"),
    (r"outside its text decoder", "multimodal: parameters outside the text decoder"),
    (r"should hold one list|also holds|applies \w+ (before|after)|no \.layers list|separate loops",
     "not the standard structure (positions tables, embedding containers, encoder-decoder, ...)"),
    (r"forward takes|takes shared_kv_states",
     "decoder layers taking inputs built outside them (ALiBi, cross attention, shared KV, state, ...)"),
    (r"changes the model's forward|hidden_size_per_layer_input|no rotary parameters",
     "a base forward that computes more than its modules (embedding scale, per-layer inputs, NoPE positions)"),
    (r"task '", "encoder models (use their masked-lm / classification wrappers)"),
]


def kind(reason: str) -> str:
    return next((label for pattern, label in KINDS if re.search(pattern, reason)), "other")


def section(table: dict) -> str:
    rows = table["rows"]
    by = {}
    for row in rows:
        by.setdefault(row["outcome"], []).append(row)
    counts = ", ".join(f"{len(by.get(o, []))} {o}" for o in ("exact", "refused", "config", "mismatch", "crash"))
    lines = [BEGIN, f"Every causal LM type with an AutoModelForCausalLM class ({len(rows)}: {counts}; "
             f"{table['versions']}), from `{table['command']}`; bench/results/arch_sweep.md gives each reason.", "",
             "**Exact** (the layer list equals the HF model: logits, loss, every gradient, 1e-5 in fp32):",
             ", ".join(sorted(r["type"] for r in by.get("exact", []))) + ".", "",
             "MoE types whose router aux loss (output_router_logits) is carried between stages exactly: "
             + ", ".join(sorted(r["type"] for r in rows if r.get("aux") == "exact")) + ".", "",
             "From a checkpoint saved by save_pretrained (MoE experts stored one tensor per expert), each stage "
             "loading its own layers, pp 1 and pp 2 against from_pretrained (" + ", ".join(
                 f"{n} {o}" for o, n in dir_counts(rows).items()) + "); the MoE types exact so: "
             + ", ".join(sorted(r["type"] for r in rows if r.get("moe") and r.get("dir") == "exact")) + ".", "",
             "| refused: why | model types |", "|---|---|"]
    refused = {}
    for row in by.get("refused", []):
        refused.setdefault(kind(row["reason"]), []).append(row["type"])
    for label, types in sorted(refused.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"| {label} | {', '.join(sorted(types))} |")
    others = sorted(by.get("config", []) + by.get("mismatch", []) + by.get("crash", []), key=lambda r: r["type"])
    if others:
        lines += ["", "Not classified here (the tiny test config cannot be built on this machine, or a failing "
                  "case): " + ", ".join(f"{r['type']} ({r['outcome']})" for r in others) + "."]
    return "\n".join(lines + [END])


def render_markdown(rows: list, command: str, versions: str, when: str) -> list:
    """Lines of the table: counts per outcome, then one row per type (worst outcome first)."""
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    order = sorted(rows, key=lambda r: (OUTCOMES.index(r["outcome"]), r["type"]))
    lines = ["## Architecture coverage sweep (issue 16)", "",
             f"Command: `{command}`  ", f"Versions: {versions}  ", f"Measured: {when}", "",
             f"{len(rows)} causal LM types: " + ", ".join(f"{counts[o]} {o}" for o in reversed(OUTCOMES)) + "  ",
             "from dir: " + ", ".join(f"{n} {o}" for o, n in dir_counts(rows).items()), "",
             "aux: for MoE types, the outcome again with output_router_logits (HF adds coef x the router's "
             "load-balancing loss)  ", "from dir: the model saved by save_pretrained, each stage's layers built "
             "from that directory (per-stage loading through transformers' conversion mapping), against "
             "from_pretrained of it: weights bit-identical, then logits, loss and gradients (1e-5) at pp 1 and "
             "at pp 2 (the layer list in two halves, run in this process as two stages)", "",
             *_moe_lines(rows), "",
             "| model type | outcome | aux | from dir | reason | seconds |", "|---|---|---|---|---|---|"]
    for r in order:
        reason = full_reason(r).replace("|", "\\|")
        lines.append(f"| {r['type']} | {r['outcome']} | {r.get('aux', '')} | {r.get('dir', '')} | {reason} | "
                     f"{r.get('seconds', '')} |")
    return lines


def full_reason(row: dict) -> str:
    """The row's reason, and the from-dir one where that says something else."""
    reason, extra = row.get("reason", ""), row.get("dir_reason", "")
    return f"{reason}; from dir: {extra}" if extra and extra != reason else reason


def _moe_lines(rows: list) -> list:
    """Per MoE type (experts in the model): trained from its saved checkpoint exactly, or refused and why."""
    moe = sorted((r for r in rows if r.get("moe")), key=lambda r: r["type"])
    lines = [f"{len(moe)} MoE types from their saved checkpoints: "
             + ", ".join(f"{n} {o}" for o, n in dir_counts(moe).items()), "",
             "| MoE type | from dir | why |", "|---|---|---|"]
    for r in moe:
        why = r.get("dir_reason") or ("" if r.get("dir") == "exact" else r.get("reason", ""))
        why = why.replace("|", "\\|")
        lines.append(f"| {r['type']} | {r.get('dir', '')} | {why} |")
    return lines


def dir_counts(rows: list) -> dict:
    """{from-dir outcome: types}, best first; types not run from a directory (config) are left out."""
    return {o: n for o in reversed(OUTCOMES) if (n := sum(r.get("dir") == o for r in rows))}


def write_results(rows: list, out: Path, command: str, merge: bool) -> tuple:
    """arch_sweep.json and .md under `out`; with merge, rows update those of an earlier run."""
    import datetime
    from importlib import metadata

    path = out / "arch_sweep.json"
    old = json.loads(path.read_text())["rows"] if merge and path.exists() else []
    by_type = {r["type"]: r for r in old} | {r["type"]: r for r in rows}
    merged = [by_type[t] for t in sorted(by_type)]
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("transformers", "torch", "deepspeed"))
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    counts = {o: sum(r["outcome"] == o for r in merged) for o in OUTCOMES}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command, "versions": versions, "when": when, "counts": counts,
                                "dir_counts": dir_counts(merged), "rows": merged}, indent=1) + "\n")
    md = out / "arch_sweep.md"
    md.write_text("\n".join(render_markdown(merged, command, versions, when)) + "\n")
    return path, md


def update(page: Path = ROOT / "docs" / "models.md", table_path: Path = TABLE) -> bool:
    """Rewrite the page's section; True when it changed."""
    text = page.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + section(json.loads(table_path.read_text())) + text[end:]
    page.write_text(new)
    return new != text


if __name__ == "__main__":
    print("docs/models.md updated" if update() else "docs/models.md already current", file=sys.stderr)
