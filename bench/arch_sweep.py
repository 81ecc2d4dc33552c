"""Architecture coverage sweep (issue 16): every causal LM type in the installed transformers either
runs as a pipeline exactly or is refused clearly.

    .venv/bin/python bench/arch_sweep.py                        # all types (~N minutes on 2 cores)
    .venv/bin/python bench/arch_sweep.py --types llama,mamba    # re-run a few; their rows are updated

For each model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: a tiny random config (tiny_config: the
default config with every known size shrunk, sub-configs too), the HF model built from it (fp32,
eager attention, seed 0, dropout off), then toolkit.train.parity.check_model: a real one-stage
PipelineModule on a right-padded batch against the HF model (logits, loss, grads; 1e-5). Outcomes:
  exact     within tolerance
  mismatch  ran, some difference > 1e-5 (the largest is given)
  refused   dstk raised ConfigError/UnusableInput (the first sentence of its message)
  config    the tiny config or model could not be built, or the HF model itself fails on the batch:
            the sweep's fault, not dstk's
  crash     any other exception from wrapping or running (type, first line, innermost frame),
            a dead worker, or no result within --timeout seconds
Types run one after another in a worker process (imports paid once); a worker that hangs or dies
is replaced. Writes bench/results/arch_sweep.json and arch_sweep.md.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
OUTCOMES = ("crash", "mismatch", "config", "refused", "exact")  # table order: worst first
MAX_PARAMS = 20_000_000  # a "tiny" model above this was not shrunk enough: refuse to build it

# key -> the tiny value (or a function of the default value), applied wherever the key appears.
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "hidden_dim", "embed_dim", "model_dim", "dim",
                     "word_embed_proj_dim", "emb_dim", "lru_width"), HIDDEN),
    **dict.fromkeys(("n_inner", "d_ff", "ffn_hidden_size", "expert_ffn_hidden_size"), FFN),
    # state-space / recurrent parts: n_heads * d_head == expand * hidden (mamba2, bamba)
    **dict.fromkeys(("mamba_n_heads",), HEADS), **dict.fromkeys(("mamba_d_head",), HEAD_DIM),
    **dict.fromkeys(("expand", "mamba_expand", "n_groups"), lambda v: min(v, 1)),
    **dict.fromkeys(("state_size", "mamba_d_state"), lambda v: min(v, 16)),
    "hidden_size_per_layer_input": lambda v: min(v, 16), "zero_expert_num": lambda v: min(v, 2),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "linear_num_value_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                     "linear_num_key_heads"), KV_HEADS),
    **dict.fromkeys(("kv_channels", "attention_head_dim", "head_size", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts"), lambda v: min(v, 4)),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k"),
                    lambda v: min(v, 2)),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "topk_group"), lambda v: min(v, 1)),
    "n_group": lambda v: min(v, 2),
    "rotary_dim": HEAD_DIM // 2,  # partial rotary (gptj, codegen): half of each head
    "kv_lora_rank": 32, "q_lora_rank": 32,
    "vocab_size": 128,
    "sliding_window": 4, "attention_chunk_size": 4, "attention_window_size": 4,  # seq_len 8: the window really cuts
    "first_k_dense_replace": lambda v: min(v, 1),  # layer 0 dense, layer 1 MoE
    "num_kv_shared_layers": lambda v: min(v, 1),
}


# Defaults that no generic rule reaches: sizes that must add up, hybrid periods (keep an attention
# layer in 2-4 layers), flags without which the CausalLM class refuses to build.
PER_TYPE = {
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[4, 16]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
}
# None in a default config that the model needs as a number (dots1, ...): experts, top-k, shared.
NONE_DEFAULTS = {"n_routed_experts": 4, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
                 "n_shared_experts": 1, "head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}


def _tiny_value(key, value):
    """The tiny value for `key`, or None to leave it."""
    if value is None:
        return NONE_DEFAULTS.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    rule = SIZES.get(key)
    if rule is None and ("intermediate_size" in key or "ffn_dim" in key):
        rule = FFN
    elif rule is None and "vocab" in key:  # vocab_size_per_layer_input (gemma3n/4), hash vocabularies (blt)
        rule = SIZES["vocab_size"]
    elif rule is None and key.endswith("head_dim"):
        rule = HEAD_DIM
    if rule is None:
        return None
    return rule(value) if callable(rule) else rule


def _layer_indices(config, n_layers: int, values: dict) -> list:
    """Which of the default config's layers the tiny one keeps: the first layer of each distinct
    combination of per-layer settings (so every layer kind is exercised), padded to >= LAYERS."""
    lists = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == n_layers and n_layers > 1}
    lists |= {k: v for k, v in values.items() if isinstance(v, dict) and v and _by_layer(v, n_layers)}
    keep, seen = [], set()
    for i in range(n_layers):
        kind = tuple(json.dumps(_at(v, i), sort_keys=True, default=str) for v in lists.values())
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    for i in range(n_layers):
        if len(keep) >= LAYERS:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)[:max(LAYERS, 4)], lists


def _by_layer(mapping: dict, n_layers: int) -> bool:
    """A dict keyed by layer index (per_layer_config: {5: {...}, 11: {...}})."""
    return all(str(k).isdigit() and int(k) < n_layers and isinstance(v, dict) for k, v in mapping.items())


def _at(per_layer, i):
    """Layer i's entry of a per-layer list or index-keyed dict (None where a dict has none)."""
    if isinstance(per_layer, list):
        return per_layer[i]
    return per_layer.get(i, per_layer.get(str(i)))


def _select(per_layer, keep: list):
    """The entries of the kept layers, renumbered 0..len(keep)-1."""
    if isinstance(per_layer, list):
        return [per_layer[i] for i in keep]
    key_type = type(next(iter(per_layer)))
    return {key_type(new): _at(per_layer, old) for new, old in enumerate(keep) if _at(per_layer, old) is not None}


def _overrides(config) -> dict:
    """Keyword arguments that rebuild `config` tiny (derived fields are recomputed by the config)."""
    values = config.to_dict()  # raw values: per-layer (heterogeneous) configs refuse getattr
    out = {k: v for k, v in ((k, _tiny_value(k, v)) for k, v in values.items()) if v is not None}
    heads = next((k for k in SIZES if SIZES[k] == HEADS and isinstance(values.get(k), int)), None)
    for key in (k for k in SIZES if SIZES[k] == KV_HEADS and k in out):
        if heads and values[key] == values[heads]:  # MHA (and MLA, which has no grouped kv) stays so
            out[key] = out[heads]
    layer_key = next((k for k in SIZES if SIZES[k] == LAYERS and isinstance(values.get(k), int)), None)
    if layer_key:
        keep, lists = _layer_indices(config, values[layer_key], values)
        out[layer_key] = len(keep)
        out.update({k: _select(v, keep) for k, v in lists.items()})
    vocab = out.get("vocab_size", values.get("vocab_size"))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values.get(key), int) and vocab and values[key] >= vocab:
            out[key] = min(vocab - 1, 2)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if hasattr(sub, "to_dict"):
            out[name] = {**sub.to_dict(), **_overrides(sub)}  # all of it: parents copy fields from it
    return out


def tiny_config(model_type: str):
    """The default config of `model_type` rebuilt with every known size shrunk, dropout off, eager."""
    from transformers import AutoConfig

    from toolkit.train.hf import no_dropout

    overrides = _overrides(AutoConfig.for_model(model_type)) | PER_TYPE.get(model_type, {})
    config = AutoConfig.for_model(model_type, **overrides)
    for name in getattr(config, "sub_configs", {}) or {}:
        if hasattr(getattr(config, name, None), "to_dict"):
            no_dropout(getattr(config, name))
    return no_dropout(config)


def causal_lm_types() -> dict:
    """model_type -> CausalLM class name, as the installed transformers registers them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def first_sentence(message: str, limit: int = 240) -> str:
    """Up to the first '. ' of the first line (and the next line when the first ends with ':')."""
    lines = [x.strip() for x in str(message).strip().splitlines() if x.strip()] or [""]
    line = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    cut = line.find(". ")
    return (line[:cut + 1] if cut > 0 else line)[:limit]


def describe(exc: BaseException) -> str:
    """'Type: first line (at file.py:123 in func)' from the innermost traceback frame."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {first_sentence(exc) or '(no message)'}{where}"


def build_tiny(model_type: str, seed: int = 0):
    """The tiny HF causal LM of `model_type`: fp32, eager attention, dropout off, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"tiny config still has {params / 1e6:.1f}M parameters (> {MAX_PARAMS / 1e6:.0f}M): "
                         "some size is not shrunk")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.float().eval()


def sweep_one(model_type: str) -> dict:
    """One type's row: {"type", "outcome", "reason", "diffs"?}; runs in this process."""
    import torch

    from toolkit.errors import ConfigError
    from toolkit.train import parity

    try:
        model = build_tiny(model_type)
        data = parity.batch(model.config.get_text_config(), "causal-lm", seq_len=8, pad=True)  # vocab of text part
        with torch.no_grad():  # the HF model must run the batch itself, or the comparison means nothing
            parity.hf_loss_logits(model, *data)
    except Exception as exc:  # noqa: BLE001  (any failure here is the sweep's, reported as such)
        return {"type": model_type, "outcome": "config", "reason": describe(exc)}
    try:
        report = parity.check_model(model, name=model_type, task="causal-lm", data=data)
    except ConfigError as exc:  # UnusableInput is a ConfigError
        return {"type": model_type, "outcome": "refused", "reason": first_sentence(exc)}
    except Exception as exc:  # noqa: BLE001
        return {"type": model_type, "outcome": "crash", "reason": describe(exc)}
    diffs = {"loss": report.loss_diff, "logits": report.logits_diff, "grad": report.grad_diff}
    if report.ok:
        return {"type": model_type, "outcome": "exact", "reason": "", "diffs": diffs}
    worst = max(diffs, key=diffs.get)
    reason = f"{worst} diff {diffs[worst]:.3g}" + (f" ({report.grad_name})" if worst == "grad" else "")
    return {"type": model_type, "outcome": "mismatch", "reason": reason, "diffs": diffs}


def _worker(conn):
    """Child process: receive a model_type, send back its row, until told None."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    while (model_type := conn.recv()) is not None:
        conn.send(sweep_one(model_type))


class Worker:
    """A child process running sweep_one; replaced when it hangs or dies."""

    def __init__(self):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()

    def run(self, model_type: str, timeout: float) -> dict:
        self.conn.send(model_type)
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        alive = self.proc.is_alive()
        self.stop()
        why = f"no result within {timeout:.0f} s" if alive else f"worker died (exit code {self.proc.exitcode})"
        return {"type": model_type, "outcome": "crash", "reason": f"Timeout: {why}" if alive else why}

    def stop(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


def run_sweep(types, timeout: float = 60.0, progress=None) -> list:
    """Rows for `types`, each in a worker (a fresh one after a hang or death), with seconds taken.
    The first type's time includes the worker's imports (~5 s)."""
    rows, worker = [], None
    for model_type in types:
        worker = worker if worker is not None and worker.proc.is_alive() else Worker()
        start = time.perf_counter()
        row = worker.run(model_type, timeout)
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        if progress:
            progress(row)
    if worker is not None and worker.proc.is_alive():
        worker.conn.send(None)
        worker.proc.join(10)
        worker.stop()
    return rows


def render_markdown(rows: list, command: str, versions: str, when: str) -> list:
    """Lines of the table: counts per outcome, then one row per type (worst outcome first)."""
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    order = sorted(rows, key=lambda r: (OUTCOMES.index(r["outcome"]), r["type"]))
    lines = ["## Architecture coverage sweep (issue 16)", "",
             f"Command: `{command}`  ", f"Versions: {versions}  ", f"Measured: {when}", "",
             f"{len(rows)} causal LM types: " + ", ".join(f"{counts[o]} {o}" for o in reversed(OUTCOMES)), "",
             "| model type | outcome | reason | seconds |", "|---|---|---|---|"]
    for r in order:
        reason = r.get("reason", "").replace("|", "\\|")
        lines.append(f"| {r['type']} | {r['outcome']} | {reason} | {r.get('seconds', '')} |")
    return lines


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
                                "rows": merged}, indent=1) + "\n")
    md = out / "arch_sweep.md"
    md.write_text("\n".join(render_markdown(merged, command, versions, when)) + "\n")
    return path, md


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", metavar="A,B", help="only these model types (their rows are updated)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per type before it counts as a crash")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (types are split among them)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for arch_sweep.json/.md")
    args = parser.parse_args(argv)
    known = causal_lm_types()
    types = args.types.split(",") if args.types else sorted(known)
    unknown = [t for t in types if t not in known]
    if unknown:
        parser.error(f"not causal LM types in this transformers: {', '.join(unknown)}")
    start = time.perf_counter()
    progress = lambda r: print(f"{r['type']:28s} {r['outcome']:8s} {r['seconds']:6.1f}s {r['reason'][:110]}",  # noqa: E731
                               flush=True)
    if args.jobs <= 1:
        rows = run_sweep(types, args.timeout, progress)
    else:
        from concurrent.futures import ThreadPoolExecutor

        chunks = [types[i::args.jobs] for i in range(args.jobs)]
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = [r for part in pool.map(lambda c: run_sweep(c, args.timeout, progress), chunks) for r in part]
    command = " ".join([".venv/bin/python", "bench/arch_sweep.py", *(argv if argv is not None else sys.argv[1:])])
    paths = write_results(rows, args.out, command, merge=bool(args.types))
    print(f"{len(rows)} types in {time.perf_counter() - start:.0f} s; wrote {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
