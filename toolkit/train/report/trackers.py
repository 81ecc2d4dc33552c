"""Experiment trackers (--report-to), under the names HF Trainer uses: tensorboard (OUT/tensorboard),
wandb (Weights & Biases: WANDB_PROJECT, default "dstk"; WANDB_MODE=offline writes OUT/wandb only) and
mlflow (MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME, default "dstk"). Rank 0 logs alone, per step:
train/loss, train/learning_rate, train/grad_norm, train/tokens_per_second, train/samples_per_second,
train/peak_memory_mib, train/mfu (CUDA), pipeline/stage_<s>/forward_seconds and backward_seconds (pp > 1),
eval/loss; and the run's arguments, DeepSpeed config and layout as hyperparameters. A resumed run
continues the same wandb and mlflow runs (their ids are kept in OUT/trackers.json).

check_report_to runs before any model is built: a misspelt name is refused with the closest one, a
tracker whose package is missing with the pip command. check_deepspeed_monitors does the same for
DeepSpeed's own monitors in the config (its tensorboard, wandb, comet sections).
"""

import difflib
import importlib.util
import json

from toolkit.errors import ConfigError

# tracker -> (the module it needs, how to install it)
PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
            "wandb": ("wandb", "pip install wandb  (or: pip install -e '.[wandb]')"),
            "mlflow": ("mlflow", "pip install mlflow")}
WORDS = ("all", "none")
# DeepSpeed's monitor sections -> (the module its monitor imports, how to install it); csv_monitor needs none
MONITORS = {"tensorboard": PACKAGES["tensorboard"], "wandb": PACKAGES["wandb"],
            "comet": ("comet_ml", 'pip install "comet_ml>=3.41.0"')}
# metrics.jsonl's keys -> the trackers' names (HF Trainer's where it has one)
NAMES = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
         "tokens_per_s": "train/tokens_per_second", "samples_per_s": "train/samples_per_second",
         "peak_mem_mib": "train/peak_memory_mib", "mfu": "train/mfu", "eval_loss": "eval/loss",
         "eval_ppl": "eval/perplexity"}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_report_to(report_to) -> tuple:
    """The trackers `report_to` asks for (the flag's values; each may hold several, comma-separated), in
    order, without repeats: "none" (or nothing) is none, "all" every tracker whose package is installed.
    Refuses an unknown name, naming the closest, and a tracker whose package is missing, with the pip command."""
    names = [n.strip().lower() for value in report_to or () for n in str(value).split(",") if n.strip()]
    for name in names:
        if name not in PACKAGES and name not in WORDS:
            close = difflib.get_close_matches(name, [*PACKAGES, *WORDS], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"--report-to {name}: no such tracker{hint} (one or more of "
                              f"{', '.join([*PACKAGES, *WORDS])})")
    if "none" in names and len(set(names)) > 1:
        raise ConfigError(f"--report-to none with {', '.join(n for n in names if n != 'none')}: none turns tracking off; "
                          "pass one or the other")
    if "all" in names:
        return tuple(name for name, (module, _) in PACKAGES.items() if _installed(module))
    chosen = tuple(dict.fromkeys(n for n in names if n != "none"))
    for name in chosen:
        module, pip = PACKAGES[name]
        if not _installed(module):
            raise ConfigError(f"--report-to {name}: the {module} package is not installed here; {pip}, "
                              f"or drop {name} from --report-to")
    if "wandb" in chosen:
        _check_wandb_login()
    return chosen


def _check_wandb_login() -> None:
    """wandb online needs an API key (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc): without one its
    init fails on rank 0 after the model is built. Offline and disabled modes need none."""
    import netrc
    import os

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        hosts = {}
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].rstrip("/")
    if host not in hosts:
        raise ConfigError(f"--report-to wandb: no W&B API key here (WANDB_API_KEY unset, no {host} entry in ~/.netrc); "
                          "run `wandb login` on this node, set WANDB_API_KEY, or WANDB_MODE=offline to keep the run "
                          "in OUT/wandb and `wandb sync` it later")


def check_deepspeed_monitors(cfg: dict, path) -> None:
    """DeepSpeed's own monitors (the config's tensorboard, wandb, comet sections) import their package when
    the engine starts, on every rank, after the model is built: refuse a missing one now."""
    for key, (module, pip) in MONITORS.items():
        section = cfg.get(key)
        if isinstance(section, dict) and section.get("enabled") is True and not _installed(module):
            raise ConfigError(f'{path}: "{key}": {{"enabled": true}} needs the {module} package, which is not '
                              f"installed here; {pip}, or remove the section (or log through dstk: --report-to "
                              f"{key if key in PACKAGES else 'tensorboard'})")


def flat(tree: dict, prefix: str = "") -> dict:
    """{"a/b": value} from nested dicts, values as numbers, bools or strings (lists and None as text): what
    hyperparameter tables take."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, name + "/"))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


def scalars(record: dict) -> dict:
    """A metrics.jsonl record as the trackers' scalars (the per-stage lists spread out by stage)."""
    out = {NAMES[k]: v for k, v in record.items() if k in NAMES and isinstance(v, (int, float))}
    for key, name in (("stage_forward_s", "forward_seconds"), ("stage_backward_s", "backward_seconds")):
        for stage, seconds in enumerate(record.get(key) or []):
            out[f"pipeline/stage_{stage}/{name}"] = seconds
    return out


class Trackers:
    """The trackers of one run, on rank 0: log(record) per step, close() at the end."""

    def __init__(self, names: tuple, folder, hparams: dict, resume: bool):
        self.folder, self.resume = folder, resume
        self.ids = self._read_ids() if resume else {}
        self.open = []
        self.hparams = flat(hparams)
        run_name = folder.out.resolve().name
        for name in names:
            try:
                self.open.append((name, getattr(self, f"_open_{name}")(run_name)))
            except Exception as exc:  # noqa: BLE001  a tracker never stops training, from its first step on
                _dropped(name, exc)
        if self.open:
            self._write_ids()

    def _read_ids(self) -> dict:
        path = self.folder.trackers
        return json.loads(path.read_text()) if path.is_file() else {}

    def _write_ids(self) -> None:
        from toolkit.files import write_text

        write_text(json.dumps(self.ids, indent=1) + "\n", str(self.folder.trackers), force=True, flag="--out's")

    def _open_tensorboard(self, run_name: str):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        writer = SummaryWriter(log_dir=str(self.folder.tensorboard))
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(self.hparams.items()))  # a Markdown code block
        writer.add_text("run/config", text)
        if not self.resume:  # the hyperparameters once, in the run's own folder (not add_hparams' subfolder)
            for summary in hparams(self.hparams, {}):
                writer.file_writer.add_summary(summary)
        return writer

    def _open_wandb(self, run_name: str):
        import os

        import wandb

        self.folder.out.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dstk"), name=run_name,
                         id=self.ids.get("wandb") or os.environ.get("WANDB_RUN_ID"), resume="allow",
                         dir=str(self.folder.out), config=self.hparams, settings=wandb.Settings(quiet=True))
        self.ids["wandb"] = run.id
        return run

    def _open_mlflow(self, run_name: str):
        import os

        import mlflow

        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "dstk"))
        run = mlflow.start_run(run_id=self.ids.get("mlflow"), run_name=None if self.ids.get("mlflow") else run_name)
        self.ids["mlflow"] = run.info.run_id
        if not self.resume:
            params = {k: str(v)[:6000] for k, v in self.hparams.items()}  # MLflow's limit on a value
            mlflow.log_params(params)
        return mlflow

    def where(self) -> str:
        """One line for the opening block: where each tracker logs."""
        places = []
        for name, handle in self.open:
            if name == "tensorboard":
                places.append(f"tensorboard {self.folder.tensorboard} (tensorboard --logdir {self.folder.tensorboard})")
            elif name == "wandb":
                places.append(f"wandb offline run {handle.id} in {self.folder.out / 'wandb'} (wandb sync to upload)"
                              if handle.offline else f"wandb {handle.url}")
            else:
                places.append(f"mlflow run {self.ids['mlflow']} at {handle.get_tracking_uri()}")
        return "report-to: " + "; ".join(places) if places else ""

    def log(self, record: dict, step: int) -> None:
        """Every tracker's scalars of `record` at `step`. A tracker that fails (a server gone, a full disk) is
        named once and dropped: the run, its checkpoints and metrics.jsonl go on."""
        values = scalars(record)
        if values:
            self._each(lambda name, handle: self._log(name, handle, values, step))

    @staticmethod
    def _log(name: str, handle, values: dict, step: int) -> None:
        if name == "tensorboard":
            for key, value in values.items():
                handle.add_scalar(key, value, step)
            handle.flush()
        elif name == "wandb":
            handle.log(values, step=step)
        else:
            handle.log_metrics(values, step=step)

    def close(self) -> None:
        ends = {"tensorboard": "close", "wandb": "finish", "mlflow": "end_run"}
        self._each(lambda name, handle: getattr(handle, ends[name])())
        self.open = []

    def _each(self, call) -> None:
        for entry in list(self.open):
            try:
                call(*entry)
            except Exception as exc:  # noqa: BLE001  a tracker never stops training
                _dropped(entry[0], exc)
                self.open.remove(entry)


def _dropped(name: str, exc: Exception) -> None:
    import sys

    print(f"warning: --report-to {name} failed and is dropped for the rest of the run (metrics.jsonl goes on): "
          f"{type(exc).__name__}: {exc}", file=sys.stderr)


def check_tracker_folders(chosen: tuple, folder) -> None:
    """Where the chosen trackers write inside OUT (tensorboard: OUT/tensorboard; wandb: OUT/wandb) can be
    written: said by --check, before the launch, rather than as a tracker dropped at the first step."""
    from toolkit.files import check_writable

    for name, path in (("tensorboard", folder.tensorboard), ("wandb", folder.wandb)):
        if name not in chosen:
            continue
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--report-to {name} logs into {path}, which is a file; move it away, or use another "
                              "--out")
        check_writable(path, "--out")  # (a folder this process cannot write in: said as --out's)
