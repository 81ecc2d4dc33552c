"""Expert parallelism through DeepSpeed 0.19.8's own AutoEP ("expert_parallel": {"enabled": true, "autoep_size": 2}),
on CPU ranks forked from the warm rank server (gloo), fp32.

`dstk train` at pp 1: a tiny Mixtral saved by transformers (4 experts per block, top-2, the router aux loss on at
coef 0.5), 2 ranks at ep 2 (each holds 2 of every block's 4 experts; tokens reach their experts by all-to-all) give
one process's losses and gradient norms step by step (ZeRO-1); the eval loss is that of 2 ranks without ep (the
eval rows split over dp). DeepSpeed writes one file per expert. Inside pipeline stages: pp 2 x dp 2 x ep 2 on 4 ranks
gives the same losses and norms (dstk replaces the stages' blocks itself). Heavy: the same for qwen3_moe, dp 2 x ep 2
(4 ranks), pp 2 x dp 4 x ep 2 (8 ranks) and qwen3_moe at pp 2 x ep 2; runs resumed from their step 2 (pp 1 and
pp 2) continue their losses. Plain DeepSpeed (tests/distributed/scripts/ep_losses.py, no dstk in the engine's way): ZeRO 0-3 at ep 2
against one process without AutoEP.

Checkpoints by HF name (toolkit/checkpoint/experts.py): the export joins every expert (pp 1; inside pipeline stages
from every stage's files; at ZeRO-3 from its shares, heavy), and moves off AutoEP continue the losses from ZeRO-0
(each ep rank's torch state, named after initialize), ZeRO-1, ZeRO-3 (experts in shares of their expert-data group)
and pp 2 x ep 2; deepseek_v3's router bias goes through the export and a move unchanged.
"""

import json
import re
from pathlib import Path

import pytest

from toolkit.errors import ConfigError

from tests.configs import run_config
from tests.distributed.launch import LazyRuns, run_script
from tests.unit.test_moe_aux import AUX, SIX

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
STEPS, SEQ = 3, 64
RUNS = {  # processes, ep (0: no expert_parallel section), model; gas makes every run's global batch 8 rows
    "ref": (1, 0, "mixtral"), "ep2": (2, 2, "mixtral"), "dp2": (2, 0, "mixtral"),
    "qwen_ref": (1, 0, "qwen3_moe"), "qwen_ep2": (2, 2, "qwen3_moe"), "dp2_ep2": (4, 2, "mixtral"),
    "pp2_ep2": (4, 2, "mixtral"), "pp2_dp4_ep2": (8, 2, "mixtral"), "qwen_pp2_ep2": (4, 2, "qwen3_moe")}
PP = {"pp2_ep2": 2, "pp2_dp4_ep2": 2, "qwen_pp2_ep2": 2}  # pipeline stages (else 1); per stage: dp / ep ep groups, ep expert-data groups
RUNS.update({"ep2_z0": (2, 2, "mixtral"), "dp2_z0": (2, 0, "mixtral"), "pp2_ep2_z0": (4, 2, "mixtral"), "dp4_ep2_z3": (4, 2, "mixtral"),
             "dp2_z3": (2, 0, "mixtral"), "ds_ep2": (2, 2, "deepseek_v3"), "ds_dp2": (2, 0, "deepseek_v3")})
# (ZeRO stage, steps) where not (1, STEPS); ZeRO-0 unclipped
PP["pp2_ep2_z0"] = 2
ZERO = {"ep2_z0": (0, 4), "dp2_z0": (0, 4), "pp2_ep2_z0": (0, 4), "dp4_ep2_z3": (3, 4), "dp2_z3": (3, 4)}


class Runs(LazyRuns):
    def _launch(self, name: str) -> None:
        from tests.distributed.test_resume_layouts import resumed_from
        from tests.ranks import run_train

        resume, layout = [], name.removesuffix("_resumed")
        if name.endswith("_resumed"):  # NAME's run from its step 2 checkpoint (DeepSpeed's own load)
            resumed_from(self / layout, 2, self.tmp / name)
            resume = ["--resume"]
        elif "_to_" in name:  # SOURCE_to_LAYOUT: SOURCE's step 2 continued on LAYOUT (by HF name: portable)
            source, layout = name.split("_to_")
            resumed_from(self / source, 2, self.tmp / name)
            resume = ["--resume"]
        procs, ep, model = RUNS[layout]
        pp, (zero, steps) = PP.get(layout, 1), ZERO.get(layout, (1, STEPS))
        cfg = run_config(2, 4 * pp // procs, pp, clip=1.0 if zero else 0.0)
        cfg["zero_optimization"] = {"stage": zero}  # ZeRO-0 clips by a wrong norm under ep (rules/expert_parallel.py)
        if ep:
            cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": model}
        (self.tmp / f"{name}.json").write_text(json.dumps(cfg))
        rc, log = run_train(["--config", self.tmp / f"{name}.json", "--model", self.model(model), "--data",
                             self.tmp / "docs.txt", "--seq-len", SEQ, "--steps", steps, "--eval-fraction", "0.01",
                             "--no-progress", "--attention", "eager",
                             *([] if ep else ["--no-export"]), "--save-every", 2, "--out",
                             self.tmp / name, *resume], procs)
        assert rc == 0, f"{name}:\n{log[-4000:]}"
        (self.tmp / f"{name}.log").write_text(log)

    def model(self, model_type: str) -> Path:
        """The corpus's sentences as documents (docs.txt) and `model_type` saved by save_pretrained, once."""
        import torch

        from toolkit.train.hf import byte_tokenizer
        from toolkit.train.parity import small_model

        folder = self.tmp / model_type
        if not folder.exists():
            text = (REPO / "toolkit" / "corpus" / "corpus.txt").read_text()
            sentences = [s.strip() for s in re.split(r"(?<=\.)\s+", text) if s.strip()]
            (self.tmp / "docs.txt").write_text("\n\n".join(sentences[:400]) + "\n")
            model = small_model(model_type, attn_implementation="eager", vocab_size=320, **AUX, **SIX[model_type])
            for name, bias in model.named_buffers():  # DeepSeek's router bias, as a pretrained model's: not zero
                if name.endswith("e_score_correction_bias"):
                    bias.copy_(torch.linspace(-0.5, 0.5, bias.numel()))
            model.save_pretrained(folder)
            byte_tokenizer().save_pretrained(folder)
        return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("ep"))


def metrics(out: Path) -> tuple[dict, dict, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "loss" in r]
    return ({r["step"]: r["loss"] for r in steps}, {r["step"]: r["grad_norm"] for r in steps},
            next(r["summary"]["eval_loss"] for r in rows if "summary" in r))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def assert_close(got: dict, want: dict, tol: float = 1e-5):
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (got, want)
    assert all(abs(got[s] - want[s]) <= tol * abs(want[s]) for s in want), (got, want)


@pytest.mark.parametrize("ep_run,ref_run,dp_run", [
    ("ep2", "ref", "dp2"),
    pytest.param("qwen_ep2", "qwen_ref", None, marks=pytest.mark.heavy),
    pytest.param("dp2_ep2", "ref", None, marks=pytest.mark.heavy)])
def test_ep_trains_as_one_process_does(runs, ep_run, ref_run, dp_run):
    (loss, norm, evaluated), (want_loss, want_norm, _) = metrics(runs / ep_run), metrics(runs / ref_run)
    assert_close(loss, want_loss)
    assert_close(norm, want_norm)  # the experts' share of the norm reduced over the ep group (ZeRO-1)
    if dp_run:
        assert abs(evaluated - metrics(runs / dp_run)[2]) <= 1e-5 * evaluated
    assert summary(runs / ep_run)["run"]["params"] == summary(runs / ref_run)["run"]["params"]  # every expert counted
    assert "experts: ep 2 (DeepSpeed AutoEP)" in (runs.tmp / f"{ep_run}.log").read_text()
    manifest = json.loads((runs.tmp / ep_run / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert manifest["expert_parallel"] == 2
    tag = runs.tmp / ep_run / "checkpoints" / f"global_step{STEPS}"
    experts = sorted(p.name for p in tag.glob("layer_*_expert_*_model_states.pt"))  # DeepSpeed's MoE files
    assert experts == [f"layer_{b}_expert_{e}_mp_rank_00_model_states.pt" for b in range(2) for e in range(4)]


@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.heavy), pytest.param(2, marks=pytest.mark.heavy),
                                  pytest.param(3, marks=pytest.mark.heavy)])
def test_deepspeeds_autoep_alone_gives_one_process_losses(tmp_path, zero):
    """No dstk in the engine: ep_losses.py hands the HF model to deepspeed.initialize with the section."""
    script = REPO / "tests" / "distributed" / "scripts" / "ep_losses.py"
    run_script(script, "mixtral", 0, 0, tmp_path / "one.json", num_procs=1)
    run_script(script, "mixtral", 2, zero, tmp_path / "ep2.json", num_procs=2)
    one, ep2 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "ep2"))
    assert one["replaced"] == [] and ep2["replaced"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert ep2["experts"]["model.layers.0.mlp.experts.w1"][0] == 2  # 2 of the block's 4 experts on this rank
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ep2["losses"], one["losses"])), (ep2, one)


@pytest.mark.heavy
@pytest.mark.parametrize("run", ["ep2", "pp2_ep2"])
def test_an_ep_run_resumes_on_its_layout(runs, run):
    assert_close(metrics(runs / f"{run}_resumed")[0], metrics(runs / run)[0], tol=1e-6)


@pytest.mark.parametrize("run,ref_run", [("pp2_ep2", "ref"), pytest.param("pp2_dp4_ep2", "ref", marks=pytest.mark.heavy),
                                         pytest.param("qwen_pp2_ep2", "qwen_ref", marks=pytest.mark.heavy)])
def test_ep_inside_pipeline_stages_trains_as_one_process_does(runs, run, ref_run):
    """pp 2 x dp 2 x ep 2 on 4 ranks: dstk replaces each stage's MoE blocks by AutoEP's layers itself (toolkit.
    distributed.tensor_parallel.shard_stage_experts) over the stage's ep group; the router aux loss is carried
    between the stages from AutoEP's router gates. Heavy: pp 2 x dp 4 x ep 2 on 8 ranks, where each expert lives on
    2 ranks of a stage and its gradient is averaged over that expert-data group (1 rank each at dp 2)."""
    (loss, norm, evaluated), (want_loss, want_norm, _) = metrics(runs / run), metrics(runs / ref_run)
    assert_close(loss, want_loss, tol=1e-4)
    assert_close(norm, want_norm, tol=1e-4)  # experts' norms over their expert-data group, stages' over pp (ZeRO-1)
    if run == "pp2_ep2":  # the eval rows split over dp 2, as in the 2-rank run without ep
        assert abs(evaluated - metrics(runs / "dp2")[2]) <= 1e-5 * evaluated
    assert summary(runs / run)["run"]["params"] == summary(runs / ref_run)["run"]["params"]  # every expert counted
    assert "experts: ep 2 (DeepSpeed AutoEP)" in (runs.tmp / f"{run}.log").read_text()


@pytest.mark.parametrize("moved", ["ep2_to_dp2", "dp2_to_ep2", "dp2_to_pp2_ep2",
                                   pytest.param("ep2_to_ref", marks=pytest.mark.heavy),
                                   pytest.param("dp2_ep2_to_dp2", marks=pytest.mark.heavy),
                                   pytest.param("ep2_to_dp2_ep2", marks=pytest.mark.heavy)])
def test_an_ep_run_moves_by_hf_name_and_continues(runs, moved):
    """ep 2 -> ep 1 by HF name (toolkit.checkpoint.experts): every expert's fp32 master and Adam moments joined
    from its ep ranks into the HF model's fused tensors; onto AutoEP each rank's experts cut from them
    (models.autoep.from_hf), inside pipeline stages too (each stage's AutoEP layers under their block's HF name).
    The step-3 loss is the source run's own."""
    source, layout = moved.split("_to_")
    assert_close(metrics(runs / moved)[0], metrics(runs / source)[0], tol=1e-4)
    manifest = json.loads((runs / moved / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert manifest.get("expert_parallel") == (RUNS[layout][1] or None)


@pytest.mark.heavy  # ZeRO-0's ep move: ~10 s (the default tier's move: test_dstk_reshard_takes_an_ep_run_off_autoep)
def test_a_zero0_ep_run_moves_off_autoep_with_its_moments(runs):
    """ZeRO-0 ep 2 -> dp 2 (ep 1) from step 2: each ep rank's torch optimizer state (DeepSpeed's
    expp_rank_E_mp_rank_00_optim_states.pt) named by the parameters the engine's optimizer holds after AutoEP replaced
    them (the manifest's param_groups). Steps 3 and 4 are the source run's: step 4's loss comes after an Adam step
    taken with the moved moments. Inside pipeline stages too (pp 2 x dp 2 x ep 2: each stage's own files and
    parameter names)."""
    for source_name in ("ep2_z0", "pp2_ep2_z0"):
        moved, source = metrics(runs / f"{source_name}_to_dp2_z0")[0], metrics(runs / source_name)[0]
        assert sorted(moved) == sorted(source) == [1, 2, 3, 4], (source_name, moved, source)
        assert all(abs(moved[s] - source[s]) <= 1e-4 * abs(source[s]) for s in (3, 4)), (source_name, moved, source)
    manifest = json.loads((runs / "ep2_z0" / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert "model.layers.0.mlp.experts.w1" in {n for group in manifest["param_groups"] for n in group}


@pytest.mark.heavy  # ZeRO-3's ep moves: ~13 s (the default tier's move: test_dstk_reshard_takes_an_ep_run_off_autoep)
def test_a_zero3_ep_run_moves_off_and_onto_autoep_with_its_moments(runs):
    """ZeRO-3 dp 4 x ep 2 -> dp 2 (ep 1, ZeRO-3) from step 2: the dense weights and moments from their shares on every
    rank, each expert's from its shares on its expert-data-parallel group (2 ranks here), joined over the ep ranks;
    and back, dp 2 -> dp 4 x ep 2 at ZeRO-3 (each rank's experts cut, then its share of them within its
    expert-data-parallel group). Steps 3 and 4 are the source run's (step 4 after an Adam step on the moved moments)."""
    for moved_name, source_name in (("dp4_ep2_z3_to_dp2_z3", "dp4_ep2_z3"), ("dp2_z3_to_dp4_ep2_z3", "dp2_z3")):
        moved, source = metrics(runs / moved_name)[0], metrics(runs / source_name)[0]
        assert sorted(moved) == sorted(source) == [1, 2, 3, 4], (moved_name, moved, source)
        assert all(abs(moved[s] - source[s]) <= 1e-4 * abs(source[s]) for s in (3, 4)), (moved_name, moved, source)


@pytest.mark.heavy
def test_the_export_of_a_zero3_ep_run_is_the_same_training_without_ep(runs):
    """The end-of-run export of dp 4 x ep 2 at ZeRO-3 loads with from_pretrained and holds every tensor of dp 2 at
    ZeRO-3 without ep (the same batches; sums reduced in another order)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.checkpoint.state import load_state_dict

    got = dict(AutoModelForCausalLM.from_pretrained(runs / "dp4_ep2_z3" / "hf", dtype=torch.float32).named_parameters())
    want, _ = load_state_dict(runs / "dp2_z3" / "checkpoints")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=2e-5), name


def test_ep_inside_pipeline_stages_exports_and_moves_by_hf_name(runs):
    """pp 2 x dp 2 x ep 2: each stage writes its experts under its own stage number (layer_L_expert_E_mp_rank_<stage>,
    L counted from 0 in every stage) and its names ("1.layer.mlp.experts.w1"); the export joins them under HF names
    through the manifest's per-layer map, equal to the one-process run's tensors, and a move off ep (-> dp 2 at pp 1)
    continues the losses."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.checkpoint.state import load_state_dict

    tag = runs / "pp2_ep2" / "checkpoints" / f"global_step{STEPS}"
    assert {p.name for p in tag.glob("layer_0_expert_0_mp_rank_*")} == {
        "layer_0_expert_0_mp_rank_00_model_states.pt", "layer_0_expert_0_mp_rank_01_model_states.pt"}
    got = dict(AutoModelForCausalLM.from_pretrained(runs / "pp2_ep2" / "hf", dtype=torch.float32).named_parameters())
    want, _ = load_state_dict(runs / "ref" / "checkpoints")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():  # the same training in one process (the sums reduce in another order)
        assert torch.allclose(got[name], tensor, rtol=0, atol=2e-5), name
    assert_close(metrics(runs / "pp2_ep2_to_dp2")[0], metrics(runs / "pp2_ep2")[0], tol=1e-4)


def test_deepseeks_router_bias_goes_through_the_export_and_a_move(runs):
    """deepseek_v3 at ep 2: AutoEP copies the gate's e_score_correction_bias (a buffer that picks the experts, not
    trained) onto its router; the export writes it back under HF's name, equal to the model's own, and a move
    ep 2 -> dp 2 (by HF name) continues the losses."""
    import torch
    from safetensors import safe_open

    with safe_open(str(next((runs / "ds_ep2" / "hf").glob("*.safetensors"))), framework="pt") as f:
        exported = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert torch.equal(exported, torch.linspace(-0.5, 0.5, 4)), exported
    assert_close(metrics(runs / "ds_ep2_to_ds_dp2")[0], metrics(runs / "ds_ep2")[0], tol=1e-4)


def test_the_export_of_an_ep_run_joins_every_expert(runs):
    """The end-of-run export of ep 2 (ZeRO-1): the HF per-expert files save_pretrained writes, which
    from_pretrained loads; each expert exactly DeepSpeed's own file of it, every tensor the one-process run's."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from toolkit.checkpoint.state import load_state_dict

    hf = runs / "ep2" / "hf"
    with safe_open(str(next(hf.glob("*.safetensors"))), framework="pt") as f:
        on_disk = set(f.keys())
    assert {f"model.layers.{b}.block_sparse_moe.experts.{e}.w{n}.weight" for b in range(2) for e in range(4)
            for n in (1, 2, 3)} <= on_disk
    got = dict(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).named_parameters())
    tag = runs / "ep2" / "checkpoints" / f"global_step{STEPS}"
    for b in range(2):
        for e in range(4):
            own = torch.load(tag / f"layer_{b}_expert_{e}_mp_rank_00_model_states.pt", weights_only=True)
            w1, w2, w3 = (own[f"model.layers.{b}.mlp.experts.w{n}.{e}"] for n in (1, 2, 3))
            assert torch.equal(got[f"model.layers.{b}.mlp.experts.gate_up_proj"][e], torch.cat([w1, w3]))
            assert torch.equal(got[f"model.layers.{b}.mlp.experts.down_proj"][e], w2)
    one, _ = load_state_dict(runs / "ref" / "checkpoints")
    assert sorted(one) == sorted(got)
    for name, tensor in one.items():  # the same training in one process (the sums reduce in another order)
        assert torch.allclose(got[name], tensor, rtol=0, atol=2e-5), name


def test_dstk_reshard_takes_an_ep_run_off_autoep(runs, tmp_path):
    """`dstk reshard --ep 1`: the tag's state by HF name, the manifest without "expert_parallel"; onto AutoEP at
    ZeRO-3 (`--zero 3`, the same ep) the manifest says so."""
    import torch

    from toolkit.checkpoint import portable
    from toolkit.checkpoint.reshard import reshard_checkpoint
    from toolkit.checkpoint.state import load_state_dict

    done = reshard_checkpoint(runs / "ep2", tmp_path / "ep1", ep=1)
    assert done["from"]["expert_parallel"] == 2 and not done["to"]["expert_parallel"]
    ckpt = tmp_path / "ep1" / "checkpoints"
    assert "expert_parallel" not in json.loads((ckpt / "dstk" / "manifest.json").read_text())
    moved, (want, _) = portable.read(ckpt), load_state_dict(runs / "ep2" / "checkpoints")
    assert sorted(moved.weights) == sorted(want) and all(torch.equal(moved.weights[k], want[k]) for k in want)
    assert moved.moments["exp_avg"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 256, 64)
    reshard_checkpoint(runs / "ep2", tmp_path / "zero3", zero=3)
    manifest = json.loads((tmp_path / "zero3" / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert (manifest["expert_parallel"], manifest["zero_stage"]) == (2, 3)
    for dp, ep, words in ((None, 3, "does not divide the 2 data-parallel ranks"), (6, 3, "does not divide .*'s 4 experts")):
        with pytest.raises(ConfigError, match=words):  # refused before anything is written
            reshard_checkpoint(runs / "ep2", tmp_path / f"ep{ep}", dp=dp, ep=ep)
        assert not (tmp_path / f"ep{ep}").exists()
