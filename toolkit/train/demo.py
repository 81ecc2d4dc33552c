"""The embedded default: train a small GPT-2 from scratch on the shipped corpus, pp = 2.

    python -m toolkit.train.demo                 # or: make demo
    python -m toolkit.train.demo --steps 60 --out runs/demo
    python -m toolkit.train.demo --out mine --overwrite   # a folder with other files: deleted first

What it does, each step a real dstk piece: generate a DeepSpeed config for pp = 2 over 2
processes (CPU processes on gloo without CUDA, GPUs with it), launch `toolkit.train` on both
ranks through launch.sh (the `deepspeed` launcher), checkpoint, export the pipeline checkpoint to
a HF directory, then reload that directory with transformers and let it write a line.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import click

from toolkit.errors import ConfigError
from toolkit.files import check_writable

from toolkit.corpus import PATH as CORPUS

REPO = Path(__file__).resolve().parents[2]  # launch.sh lives at the repository root


def demo_config(out: Path, lr: float) -> Path:
    """pp = 2, dp = 1, mbs 4 x gas 4 = 16 rows per step; torch's Adam (no JIT build on CPU)."""
    from toolkit.config.generate import build_config
    from toolkit.config.options import GenerateOptions

    cfg = build_config(GenerateOptions(world_size=2, pp=2, mbs=4, gas=4, lr=lr, weight_decay=0.0, cpu=True,
                                       steps_per_print=10**6))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def train(out: Path, steps: int, lr: float, model: str) -> int:
    """launch.sh on 2 ranks; the config lives in a temporary folder (never inside the --out it clears)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dstk-demo-") as folder:
        return launch_run(demo_config(Path(folder), lr), out, steps, model)


def launch_run(config: Path, out: Path, steps: int, model: str) -> int:
    cmd = ["bash", str(REPO / "launch.sh"), "--num-gpus", "2", "--config", str(config), "--",
           "--model", model, "--data", str(CORPUS), "--seq-len", "128", "--steps", str(steps),
           "--eval-every", str(max(steps // 4, 1)), "--save-every", str(max(steps // 2, 1)), "--out", str(out),
           "--overwrite"]
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
               os.environ.get("PYTHONPATH")])))
    why = on_cpu_because(_gpu_count())
    if why:
        env["DS_ACCELERATOR"] = "cpu"
        click.echo(f"demo: {why}: its 2 pipeline stages run as CPU processes")
    click.echo("$ " + " ".join(cmd))
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_cpu_because(gpus: int) -> str | None:
    """Why the demo's two ranks run on CPU: a machine with one GPU cannot hold both (NCCL refuses two ranks
    on one GPU). None with two GPUs or more, and without any (CPU already)."""
    return "1 GPU here, and NCCL refuses two ranks on one GPU" if gpus == 1 else None


def report(out: Path) -> None:
    """A sample from the exported model (the run itself printed its loss table, curve and export)."""
    from toolkit.checkpoint.run_folder import RunFolder

    click.echo(f"sample: {sample(RunFolder(out).hf)!r}")


def sample(hf_dir: Path, prompt: str = "Once a ") -> str:
    """Greedy continuation from the exported directory, loaded by plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


MARK = ".dstk-demo"  # left in --out by a finished demo: the next demo may replace that folder without --overwrite


def check_out(out: Path, overwrite: bool) -> None:
    """The demo deletes what --out holds: only a previous demo's run, or anything with --overwrite."""
    if out.exists() and not out.is_dir():
        raise click.ClickException(f"--out {out} is a file; --out names the demo's run folder")
    try:
        check_writable(out, "--out")
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and MARK not in held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise click.ClickException(f"--out {out} already holds files ({shown}) that the demo would delete; pass "
                                   "--overwrite to delete them, or another --out")


@click.command()
@click.option("--steps", default=300, show_default=True, help="Optimizer steps (16 rows x 128 tokens each).")
@click.option("--lr", default=2e-3, show_default=True)
@click.option("--model", default="tiny-gpt2", show_default=True, help="A built-in name or a HF directory.")
@click.option("--out", default="runs/demo", show_default=True, type=click.Path(path_type=Path),
              help="The run folder. A previous demo's is replaced; any other folder with files needs --overwrite.")
@click.option("--overwrite", is_flag=True, help="Delete what --out holds, whatever it is, and run the demo there.")
def main(steps, lr, model, out, overwrite):
    """Train a small causal LM with pp = 2 on the shipped corpus; export and sample it."""
    out = out.absolute()  # launch.sh runs in the repository, not where the demo was started
    check_out(out, overwrite)
    rc = train(out, steps, lr, model)
    if rc:
        sys.exit(rc)
    (out / MARK).write_text("a finished `python -m toolkit.train.demo` run: the next demo may replace this folder\n")
    report(out)


if __name__ == "__main__":
    main()
