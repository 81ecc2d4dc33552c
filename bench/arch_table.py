"""The README's supported-architecture section, made from the sweep's table (bench/results/arch_sweep.json).

    .venv/bin/python bench/arch_table.py      # rewrite the section between the markers in README.md

tests/unit/test_arch_sweep.py checks that README.md holds exactly what this makes from the committed
table, so the README says what the last sweep measured.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "results" / "arch_sweep.json"
BEGIN, END = "<!-- arch-sweep:begin -->", "<!-- arch-sweep:end -->"

# refusal reason -> the kind shown in the README (first match wins)
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


def update(readme: Path = ROOT / "README.md", table_path: Path = TABLE) -> bool:
    """Rewrite the README's section; True when it changed."""
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + section(json.loads(table_path.read_text())) + text[end:]
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    print("README.md updated" if update() else "README.md already current", file=sys.stderr)
