"""Mixture-of-experts checkpoints through the real `dstk train` ranks (issue 40): a tiny checkpoint saved by
transformers' save_pretrained (one tensor per expert on disk, fused experts in memory: tests.moe_models) trains at
pp 2 with pp 1's losses (fp32, 1e-4 relative); every export (OUT/hf, `dstk export` streamed and whole, from pp 1 and
pp 2, a LoRA run's merge) holds the input's on-disk names, the same key set as its safetensors, and loads with
from_pretrained with no missing or unexpected key; a resume (pp 2) and a move (pp 2 -> pp 1) continue the run's
losses and weights; a checkpoint really incomplete is refused naming the files' missing tensors.

mixtral and deepseek_v3 (MLA, a shared expert, a dense first layer) run in the default tier (deepseek_v3's LoRA run,
mixtral's resume and move); qwen3_moe, qwen2_moe (shared expert), olmoe and gpt_oss (natively fused, sinks, a
sliding layer; --attention eager), and the rest of the two, in the heavy one.
"""

import shutil
from pathlib import Path

import pytest
import torch

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, launch
from tests.distributed.test_resume_layouts import resumed_from
from tests.distributed.test_train import losses, summary
from tests.moe_models import ATTENTION, MOE_TYPES, disk_keys, read_disk
from tests.ranks import run_ranks, run_train

pytestmark = pytest.mark.distributed


def types(*default) -> list:
    """MOE_TYPES as parameters, heavy but for `default`."""
    return [pytest.param(t, marks=() if t in default else pytest.mark.heavy) for t in MOE_TYPES]


TYPES = types("mixtral", "deepseek_v3")
STEPS, SAVE = 6, 3  # the reference runs: 6 steps, a checkpoint every 3; the resumed ones start at step 4
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                                                "total_num_steps": STEPS}}


def config(path: Path, pp: int) -> Path:
    """fp32, gbs 8 (mbs 2 x gas 4), clipping off, warmup then decay: every layout computes the same steps."""
    return write_config(path, mbs=2, gas=4, optimizer=OPTIMIZER, zero=0, pp=pp, gradient_clipping=0.0,
                        scheduler=SCHEDULER, **QUIET)


class MoeRuns:
    """The runs of one model type's directory, by name, each launched on first use: pp2 (the reference, exported),
    pp1 (exported), same (pp2 resumed from pp2's step 3), move (pp 1 resumed from it), lora (pp 2, --lora, 3 steps)."""

    LAYOUTS = {"pp2": (2, None, []), "pp1": (1, None, []), "same": (2, "pp2", ["--no-export"]),
               "move": (1, "pp2", ["--no-export"]), "lora": (2, None, ["--lora", "--lora-r", "4"])}

    def __init__(self, folder: Path, moe_dirs):
        self.folder, self.moe_dirs, self.done = folder, moe_dirs, {}

    def get(self, model_type: str, name: str) -> Path:
        key = (model_type, name)
        if key not in self.done:
            pp, source, extra = self.LAYOUTS[name]
            out = self.folder / f"{model_type}_{name}"
            if source is not None:
                resumed_from(self.get(model_type, source), SAVE, out)
            steps = 3 if name == "lora" else STEPS  # (the warmup makes steps 1 and 2 at lr 0)
            args = ["--model", str(self.moe_dirs.get(model_type)), "--data", str(CORPUS), "--seq-len", "32",
                    "--no-progress", *ATTENTION.get(model_type, [])]
            rc, log = launch(config(self.folder / f"{name}.json", pp), out, pp, "--steps", steps, "--save-every", SAVE,
                             "--eval-fraction", 0, *extra, *(["--resume"] if source else []), model_args=args)
            assert rc == 0, log[-3000:]
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, moe_dirs) -> MoeRuns:
    return MoeRuns(tmp_path_factory.mktemp("moe_runs"), moe_dirs)


def rel_diff(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)


def loads_cleanly(folder: Path) -> dict:
    """The state dict from_pretrained loads from an export, which must report no missing, unexpected or
    mismatched key."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    return model.state_dict()


@pytest.mark.parametrize("model_type", TYPES)
def test_pp2_trains_a_saved_checkpoint_with_pp1s_losses(runs, model_type):
    pp1, pp2 = losses(runs.get(model_type, "pp1")), losses(runs.get(model_type, "pp2"))
    assert sorted(pp1) == sorted(pp2) == list(range(1, STEPS + 1))
    assert rel_diff(pp2, pp1, pp1) <= 1e-4, (pp1, pp2)
    assert pp1[STEPS] < pp1[1]  # it trains


@pytest.mark.parametrize("model_type", TYPES)
def test_the_export_holds_the_inputs_on_disk_names_and_loads(runs, moe_dirs, model_type):
    """OUT/hf of pp 1 and pp 2: the input's key set (per-expert names where the model fuses them), from_pretrained
    loads it cleanly, and both layouts exported the same weights."""
    want = disk_keys(moe_dirs.get(model_type))
    assert any(".experts." in k for k in want)
    states = []
    for name in ("pp1", "pp2"):
        hf = runs.get(model_type, name) / "hf"
        assert disk_keys(hf) == want, sorted(disk_keys(hf) ^ want)[:6]
        states.append(loads_cleanly(hf))
    assert max((states[0][k] - states[1][k]).abs().max().item() for k in states[0]) <= 1e-5


@pytest.mark.parametrize("model_type", TYPES)
def test_dstk_export_streamed_and_whole_write_the_inputs_key_set(runs, moe_dirs, model_type, tmp_path):
    """`dstk export` of the pp 1 and the pp 2 checkpoint, streamed and whole (save_pretrained of the model loaded in
    memory): the input's names, and the same tensors as OUT/hf."""
    from toolkit.export.directory import export

    want = disk_keys(moe_dirs.get(model_type))
    for name in ("pp1", "pp2"):
        run = runs.get(model_type, name)
        reference = read_disk(run / "hf")
        for stream in (True, False):
            out = export(run / "checkpoints", tmp_path / f"{name}_{stream}", stream=stream)
            got = read_disk(out)
            assert got.keys() == want, (name, stream, sorted(got.keys() ^ want)[:6])
            assert all(torch.equal(got[k], reference[k]) for k in want), (name, stream)


@pytest.mark.parametrize("model_type", types("deepseek_v3"))
def test_a_lora_runs_merged_export_holds_the_inputs_key_set(runs, moe_dirs, model_type, tmp_path):
    """--lora with the default targets at pp 2: the streamed merge (OUT/hf, and `dstk export`) equals the whole
    model's (peft's merge_and_unload, then save_pretrained) tensor for tensor, under the input's names; the merge
    changed the base. (deepseek_v3: peft adapts the fused experts too, through target_parameters.)"""
    from toolkit.export.directory import export

    base_dir = moe_dirs.get(model_type)
    run, want, base = runs.get(model_type, "lora"), disk_keys(base_dir), read_disk(base_dir)
    streamed = read_disk(run / "hf")
    whole = read_disk(export(run / "checkpoints", tmp_path / "whole", stream=False))
    assert streamed.keys() == whole.keys() == want, sorted(streamed.keys() ^ want)[:6]
    assert [k for k in want if not torch.equal(streamed[k], whole[k])] == []
    assert any(not torch.equal(streamed[k], base[k]) for k in want)  # the adapters were merged
    loads_cleanly(run / "hf")


@pytest.mark.parametrize("model_type", types("mixtral"))
@pytest.mark.parametrize("name", ["same", "move"])
def test_a_resumed_or_moved_moe_run_continues_its_losses(runs, model_type, name):
    """pp 2's run resumed at its step 3 on pp 2 (same) or pp 1 (move): steps 4-6 give the uninterrupted run's
    losses (1e-4) and its final weights (1e-5), Adam's moments and the schedule carried over by HF name."""
    from toolkit.checkpoint.state import load_state_dict

    reference, resumed = runs.get(model_type, "pp2"), runs.get(model_type, name)
    assert summary(resumed)["start_step"] == SAVE  # resumed, not trained again from the start
    got, want = losses(resumed), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert rel_diff(got, want, range(SAVE + 1, STEPS + 1)) <= 1e-4, (got, want)
    final = f"global_step{STEPS}"
    a, b = load_state_dict(reference / "checkpoints", final)[0], load_state_dict(resumed / "checkpoints", final)[0]
    assert any("experts" in k for k in a) and set(a) ^ set(b) <= {"lm_head.weight"}
    assert max((a[k] - b[k]).abs().max().item() for k in set(a) & set(b)) <= 1e-5


def test_a_run_from_a_builtin_moe_exports_save_pretrained_names(tmp_path):
    """tiny-mixtral (random weights, no directory) at pp 2: OUT/hf has the names save_pretrained writes for that
    model, one tensor per expert."""
    from toolkit.train import hf

    hf.builtin_model("tiny-mixtral").save_pretrained(tmp_path / "saved")
    args = ["--model", "tiny-mixtral", "--data", str(CORPUS), "--seq-len", "32", "--no-progress"]
    rc, log = launch(config(tmp_path / "pp2.json", 2), tmp_path / "run", 2, "--steps", 2, "--eval-fraction", 0,
                     model_args=args)
    assert rc == 0, log[-3000:]
    want = disk_keys(tmp_path / "saved")
    assert disk_keys(tmp_path / "run" / "hf") == want and "model.layers.3.block_sparse_moe.experts.3.w2.weight" in want
    loads_cleanly(tmp_path / "run" / "hf")


# ------------------------------------------------------------------------------------------------- refusals

def without(source: Path, folder: Path, drop: str, sharded: bool) -> Path:
    """A copy of `source` lacking tensor `drop`: model.safetensors rewritten without it, or (sharded) saved in
    shards whose index no longer lists it (the tensor still in its shard file)."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(source / "model.safetensors")
    if not sharded:
        kept = {k: v for k, v in tensors.items() if k != drop}
        save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {k: f"model-0000{1 + i * 2 // len(names)}-of-00002.safetensors" for i, k in enumerate(names)}
    for file in set(shards.values()):
        save_file({k: tensors[k] for k in names if shards[k] == file}, folder / file, metadata={"format": "pt"})
    shards.pop(drop)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return folder


def one_error_line(rc: int, log: str, *fragments) -> str:
    assert rc == 2, log[-3000:]
    assert "Traceback" not in log and "does not match" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), log[-3000:]
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


EXPERT_W1 = "model.layers.1.block_sparse_moe.experts.3.w1.weight"


@pytest.mark.parametrize("sharded", [False, True], ids=["deleted", "not_in_index"])
def test_a_checkpoint_lacking_an_experts_tensor_is_refused_naming_it(moe_dirs, tmp_path, sharded):
    """One expert's tensor deleted from model.safetensors, or left out of the index: `train --check` refuses it
    from the names alone, and so do the ranks (started without the check, as torchrun would) at pp 1 and pp 2,
    before training: one line naming the tensor as the files name it, exit 2."""
    model = without(moe_dirs.get("mixtral"), tmp_path / "model", EXPERT_W1, sharded)
    listing = "model.safetensors.index.json" if sharded else "model.safetensors"
    args = ["--model", str(model), "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--steps", 2]
    rc, log = run_ranks(["-m", "toolkit.train", "--check", "--world-size", 2, "--config",
                         config(tmp_path / "pp2.json", 2), *args, "--out", tmp_path / "check"], 1)
    one_error_line(rc, log, f"{listing} lacks 1 tensor(s)", EXPERT_W1, "copy the model's files again")
    for pp in (1, 2):
        rc, log = run_ranks(["-m", "toolkit.train", "--config", config(tmp_path / f"pp{pp}.json", pp), *args,
                             "--out", tmp_path / f"run{pp}"], pp)
        one_error_line(rc, log, f"{listing} lacks 1 tensor(s)", EXPERT_W1)
        assert not (tmp_path / f"run{pp}" / "metrics.jsonl").exists()


def test_a_checkpoint_lacking_a_whole_expert_is_refused_by_the_ranks(moe_dirs, tmp_path):
    """The last expert of a layer gone whole (w1, w2, w3): its names alone cannot tell (`train --check` passes);
    the ranks, which know the model, refuse it before training, naming the three."""
    from safetensors.torch import load_file, save_file

    source = moe_dirs.get("mixtral")
    shutil.copytree(source, tmp_path / "model")
    tensors = load_file(source / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".1.block_sparse_moe.experts.3." not in k},
              tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    args = ["--model", str(tmp_path / "model"), "--data", str(CORPUS), "--seq-len", "32", "--no-progress",
            "--steps", 2, "--out", tmp_path / "run"]
    rc, log = run_train(["--config", config(tmp_path / "pp2.json", 2), *args], 2)
    one_error_line(rc, log, "model.safetensors lacks 3 tensor(s) that its config.json's model needs",
                   *(f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")))


def test_gpt_oss_under_sdpa_is_refused_with_the_flag_that_runs_it(moe_dirs, tmp_path):
    """transformers has no sdpa attention for gpt_oss (its sinks): the ranks say so, and which flag to pass,
    before training (the class is known only once transformers is imported, which `--check` does not do)."""
    args = ["--model", str(moe_dirs.get("gpt_oss")), "--data", str(CORPUS), "--seq-len", "32", "--no-progress",
            "--steps", 2, "--out", tmp_path / "run"]
    rc, log = run_train(["--config", config(tmp_path / "pp2.json", 2), *args], 2)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines == ["error: --attention sdpa: transformers' GptOssForCausalLM has no sdpa attention (_supports_sdpa "
                     "is False); pass --attention eager"], log[-3000:]
