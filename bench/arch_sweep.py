"""Architecture coverage sweep (issue 16): every causal LM type in the installed transformers either
runs as a pipeline exactly or is refused clearly.

    .venv/bin/python bench/arch_sweep.py                        # all types (~2 minutes on 2 busy cores)
    .venv/bin/python bench/arch_sweep.py --types llama,mamba    # re-run a few; their rows are updated

For each model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: a tiny random config (tiny_config in
arch_sweep_config.py: the default config with every known size shrunk, sub-configs and per-layer
overrides too, plus PER_TYPE's fixes), the HF CausalLM built from it (fp32, eager attention, seed 0,
dropout off), then toolkit.train.parity.check_model: a real one-stage PipelineModule on a
right-padded batch against the HF model (logits, loss, grads; 1e-5). Outcomes:
  exact     within tolerance
  mismatch  ran, some difference > 1e-5 (the largest is given)
  refused   dstk raised ConfigError/UnusableInput (the first sentence of its message)
  config    the tiny config or model could not be built, or the HF model itself fails on the batch:
            the sweep's fault, not dstk's (CANNOT_RUN says why where it is known)
  crash     any other exception from wrapping or running (type, first line, innermost frame),
            a dead worker, or no result within --timeout seconds
Then, as a run with `--model DIR` starts (issue 40; every type but the config ones), "from dir": the model
saved by save_pretrained (so MoE experts stored one tensor per expert, modules under their checkpoint
names) and bench/arch_sweep_dir.py's check_dir: every stage's layers built from that directory hold
from_pretrained's weights bit for bit, and match from_pretrained's model at pp 1 and pp 2 (two halves run
in this process as DeepSpeed runs two stages). exact / mismatch / refused (ConfigError) / crash (any other
exception, an UnusableInput included: a directory save_pretrained wrote is not the user's mistake).
Types run one after another in a worker process (imports paid once); a worker that hangs or dies
is replaced. Writes bench/results/arch_sweep.json and arch_sweep.md (with a table of the MoE types:
exact from their saved checkpoints, or refused and why); tests/bench/test_arch_sweep.py (slow tier)
re-runs every type and fails when that table no longer matches.
"""

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arch_sweep_config import CANNOT_RUN, PER_TYPE, build_tiny, tiny_config  # noqa: E402,F401  (public names)
from arch_table import OUTCOMES, full_reason, render_markdown, write_results  # noqa: E402,F401  (public names)

RESULTS = Path(__file__).resolve().parent / "results"


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
        why = CANNOT_RUN.get(model_type)
        return {"type": model_type, "outcome": "config", "reason": f"{why} ({describe(exc)})" if why else describe(exc)}
    try:
        report = parity.check_model(model, name=model_type, task="causal-lm", data=data)
    except ConfigError as exc:  # UnusableInput is a ConfigError
        return {"type": model_type, "outcome": "refused", "reason": first_sentence(exc), **_from_dir(model, data)}
    except Exception as exc:  # noqa: BLE001
        return {"type": model_type, "outcome": "crash", "reason": describe(exc), **_from_dir(model, data)}
    row = _compared(model_type, report)
    row.update(_from_dir(model, data))  # before the aux run, which changes the config
    if row["outcome"] == "exact" and hasattr(model.config.get_text_config(), "output_router_logits"):
        row.update(_with_router_aux(model_type, model, data))
    return row


def _from_dir(model, data) -> dict:
    """The "dir" outcome: `model` saved by save_pretrained, its stages built from that directory
    (arch_sweep_dir.check_dir: weights bit-identical to from_pretrained's, then pp 1 and pp 2)."""
    import tempfile

    import arch_sweep_dir

    from toolkit.errors import ConfigError, UnusableInput

    moe = {"moe": True} if is_moe(model) else {}
    with tempfile.TemporaryDirectory() as path:
        try:
            model.save_pretrained(path)
        except Exception as exc:  # noqa: BLE001  (transformers' own save)
            return {**moe, "dir": "config", "dir_reason": "save_pretrained fails: " + describe(exc)}
        try:
            report = arch_sweep_dir.check_dir(path, task="causal-lm", attention="eager", data=data)
        except UnusableInput as exc:  # a directory save_pretrained wrote is never the user's fault
            return {**moe, "dir": "crash", "dir_reason": "the saved checkpoint called unusable: " + first_sentence(exc)}
        except ConfigError as exc:
            return {**moe, "dir": "refused", "dir_reason": first_sentence(exc)}
        except Exception as exc:  # noqa: BLE001
            return {**moe, "dir": "crash", "dir_reason": describe(exc)}
    if report.ok:
        return {**moe, "dir": "exact", "dir_reason": ""}
    if report.weights:
        why = f"{len(report.weights)} tensor(s) differ from from_pretrained's: {', '.join(report.weights[:3])}"
    else:
        pp, worst = next((pp, s) for pp, s in sorted(report.stages.items()) if not s.ok)
        diffs = {"loss": worst.loss, "logits": worst.logits, "grad": worst.grad}
        kind = max(diffs, key=diffs.get)
        why = f"pp {pp}: {kind} diff {diffs[kind]:.3g}" + (f" ({worst.grad_name})" if kind == "grad" else "")
    return {**moe, "dir": "mismatch", "dir_reason": why}


def is_moe(model) -> bool:
    """A mixture of experts: some module of the model holds experts ("experts", a class named *Experts) or
    is a MoE block (a class named *MoE* / *Moe*: Doge's CDMoE has no experts module)."""
    import re

    return any(name.rsplit(".", 1)[-1] == "experts" or re.search("Experts|MoE|Moe", type(m).__name__)
               for name, m in model.named_modules())


def _compared(model_type: str, report, prefix: str = "") -> dict:
    diffs = {"loss": report.loss_diff, "logits": report.logits_diff, "grad": report.grad_diff}
    if report.ok:
        return {"type": model_type, "outcome": "exact", "reason": "", "diffs": diffs}
    worst = max(diffs, key=diffs.get)
    reason = f"{worst} diff {diffs[worst]:.3g}" + (f" ({report.grad_name})" if worst == "grad" else "")
    return {"type": model_type, "outcome": "mismatch", "reason": prefix + reason, "diffs": diffs}


def _with_router_aux(model_type: str, model, data) -> dict:
    """An MoE type again with output_router_logits (HF adds coef x its load-balancing loss): "aux" is
    exact / refused (with the reason) / mismatch; a mismatch or crash there fails the whole row."""
    from toolkit.errors import ConfigError
    from toolkit.train import parity

    model.config.get_text_config().output_router_logits = True
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = 0.5  # large enough that a missing term shows (the default is ~0.001)
    prefix = "with output_router_logits: "
    try:
        import torch

        with torch.no_grad():  # the HF model must run it itself (flint's tiny config has no MoE layer)
            parity.hf_loss_logits(model, *data)
    except Exception as exc:  # noqa: BLE001
        return {"aux": "config", "reason": prefix + "the HF model itself fails: " + describe(exc)}
    try:
        report = parity.check_model(model, name=model_type, task="causal-lm", data=data)
    except ConfigError as exc:
        return {"aux": "refused", "reason": prefix + first_sentence(exc)}
    except Exception as exc:  # noqa: BLE001
        return {"aux": "crash", "outcome": "crash", "reason": prefix + describe(exc)}
    row = _compared(model_type, report, prefix)
    return {"aux": row["outcome"], **({"outcome": "mismatch", "reason": row["reason"]} if not report.ok else {})}


def _worker(conn):
    """Child process: receive a model_type, send back its row, until told None."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()  # save_pretrained's and from_pretrained's, once per type
    import torch

    torch.set_num_threads(1)  # tiny models: a second OpenMP thread only spins at each op's barrier on a busy host
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
    progress = lambda r: print(f"{r['type']:28s} {r['outcome']:8s} dir {r.get('dir', '-'):8s} "  # noqa: E731
                               f"{r['seconds']:6.1f}s {full_reason(r)[:100]}", flush=True)
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
