"""Runs that several test files read, each made once per session. Ranks are forked from the warm rank
server (tests/ranks.py); what a run costs is its training, not the ~20 s a launcher's start-up took."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory) -> Path:
    """One 2-rank launch of scripts/engines.py, pp 1 engines first: the CPU dp 2 preset,
    test_memory_accuracy's engines (pp 1, then pp 2), the pp 2 preset (both: test_presets_engine), the
    pipeline parity cases (test_pipeline_models) and test_pipeline_training's worker. Returns the folder
    holding preset_<preset name> and memory_accuracy/, parity/, pipeline_training/ with rank<R>.json."""
    from tests.distributed.launch import run_script
    from toolkit.config.presets import PRESET_DIR
    from toolkit.train.parity import small_model

    out = tmp_path_factory.mktemp("engines")
    for part in ("memory_accuracy", "parity", "pipeline_training"):
        (out / part).mkdir()
    small_model("llama").save_pretrained(out / "llama_dir", max_shard_size="100KB")  # a sharded saved model
    jobs = ["preset", PRESET_DIR / "cpu_dp2.json", out / "preset_cpu_dp2.json", "+",
            "memory-accuracy", out / "memory_accuracy", "+",
            "preset", PRESET_DIR / "cpu_pp2.json", out / "preset_cpu_pp2.json", "+",
            "parity", out / "parity", out / "llama_dir", "+", "pipeline-training", out / "pipeline_training"]
    run_script(REPO / "tests" / "distributed" / "scripts" / "engines.py", *jobs, num_procs=2)
    return out


class TrainRuns:
    """`dstk train` of tiny-gpt2 on the corpus through launch.sh, by layout: gbs 8 rows of 32 tokens,
    fp32, dropout off, gradient_clipping test_train.CLIP (1.0, which these runs trigger:
    test_pipeline_training checks the unclipped norms), each launched the first time a test asks for it."""

    LAYOUTS = {  # name: (processes, mbs, gas, pp, steps)
        "pp1dp1": (1, 2, 4, 1, 10),
        "pp2dp1": (2, 2, 4, 2, 10),  # shows its progress lines and exports
        "pp1dp2": (2, 2, 2, 1, 20),  # 20 steps: the resume reference
        "pp2dp2": (4, 2, 2, 2, 10),
    }

    def __init__(self, folder: Path):
        self.folder = folder
        self.done = set()

    def get(self, name: str) -> Path:
        """The run folder of layout `name` (its config: FOLDER/NAME.json, its output: FOLDER/NAME.log)."""
        from tests.configs import run_config, write_config
        from tests.distributed.launch import COMMON, launch
        from tests.distributed.test_train import CLIP

        out = self.folder / name
        if name not in self.done:
            procs, mbs, gas, pp, steps = self.LAYOUTS[name]
            shown = [a for a in COMMON if a != "--no-progress"] if name == "pp2dp1" else COMMON
            cfg = run_config(mbs, gas, pp, clip=CLIP)
            if name == "pp2dp1":  # DeepSpeed's default steps_per_print (10, as generated configs write): still quiet
                cfg.pop("steps_per_print")
            cfg = write_config(self.folder / f"{name}.json", cfg)
            rc, log = launch(cfg, out, procs, "--steps", steps, *([] if name == "pp2dp1" else ["--no-export"]),
                             model_args=shown)
            assert rc == 0, log[-3000:]
            (self.folder / f"{name}.log").write_text(log)
            self.done.add(name)
        return out

    def all(self) -> Path:
        for name in self.LAYOUTS:
            self.get(name)
        return self.folder


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory) -> TrainRuns:
    """The layouts test_train, test_pipeline_training (clipping) and test_launchers compare against."""
    return TrainRuns(tmp_path_factory.mktemp("layouts"))


class Bf16Runs:
    """`dstk train` of a built-in model on 2 ranks, bf16 (BF16_Optimizer's fp32
    masters), 2 steps, a short eval split (SHORT_EVAL); by (model, pp, zero, export), each launched on
    first request."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.done = set()

    def get(self, model: str, pp: int, zero: int, export: bool = True) -> Path:
        from tests.configs import QUIET, SHORT_EVAL, write_config
        from tests.ranks import run_train

        tmp = self.folder / f"{model}_pp{pp}_zero{zero}{'' if export else '_no_export'}"
        if tmp not in self.done:
            tmp.mkdir(exist_ok=True)
            cfg = tmp / "ds.json"
            write_config(cfg, mbs=2, gas=2, zero=zero, pp=pp, bf16=True, gradient_clipping=0.0, **QUIET)
            args = ["--config", cfg, "--model", model, "--data", REPO / "toolkit" / "corpus" / "corpus.txt",
                    "--seq-len", "32", "--steps", "2", "--no-progress", "--eval-fraction", SHORT_EVAL,
                    *([] if export else ["--no-export"]), "--out", tmp / "run"]
            rc, log = run_train(args, 2, timeout=600)
            assert rc == 0, log[-3000:]
            self.done.add(tmp)
        return tmp / "run"


@pytest.fixture(scope="session")
def bf16_runs(tmp_path_factory) -> Bf16Runs:
    """bf16 runs test_export_stream and test_pipeline_training share (tiny-gpt2 at pp 2, ZeRO-1: both)."""
    return Bf16Runs(tmp_path_factory.mktemp("bf16"))


class SavedModels:
    """Built-in models as `dstk train` builds them (random weights at `seed`), saved with their tokenizer
    as a HF directory (what a user fine-tunes), once per session for each (name, seed)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def get(self, name: str, seed: int = 1234) -> Path:
        from toolkit.train import hf

        out = self.folder / f"{name}_seed{seed}"
        if not out.exists():
            hf.builtin_model(name, seed).save_pretrained(out.with_suffix(".tmp"))
            hf.byte_tokenizer().save_pretrained(out.with_suffix(".tmp"))
            out.with_suffix(".tmp").rename(out)
        return out


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> SavedModels:
    """Saved tiny model directories that test_tensor_parallel, test_resume_layouts and test_lora_pipeline use."""
    return SavedModels(tmp_path_factory.mktemp("saved_models"))


class SavedMoe:
    """Tiny MoE checkpoints saved by save_pretrained (tests.moe_models), once per session for each model type."""

    def __init__(self, folder: Path):
        self.folder = folder

    def get(self, model_type: str) -> Path:
        from tests.moe_models import save_tiny_moe

        out = self.folder / model_type
        if not out.exists():
            save_tiny_moe(model_type, out.with_suffix(".tmp")).rename(out)
        return out


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> SavedMoe:
    """Tiny MoE directories (mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, gpt_oss) that test_moe_checkpoints
    and test_weights_complete read."""
    return SavedMoe(tmp_path_factory.mktemp("moe_dirs"))
