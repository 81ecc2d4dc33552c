"""Pipeline training on the real path: gradient clipping across stages and activation checkpointing.

Two kinds of launch, CPU processes on gloo:
- `dstk train` (forked ranks, tests/ranks.py) with "gradient_clipping": 1.0 at pp 1, pp 2 and pp 2 x dp 2 (the
  session's `train_runs`, which test_train reads too) and at pp 2 with
  pipeline.activation_checkpoint_interval 1, next to a plain PyTorch loop
  (torch.nn.utils.clip_grad_norm_) that also says how large the unclipped norms were;
- `worker` on every rank (forked ranks; in the session's one launch
  of tests/distributed/scripts/engines.py, or alone:
      deepspeed --num_gpus 2 tests/distributed/test_pipeline_training.py OUT_DIR).
  It compares DeepSpeed's pipeline gradient norm with the HF model's (tied GPT-2 and BERT MLM), and
  trains tiny-gpt2 at pp 2 with checkpointing off/on (reentrant and not), with and without a frozen
  embedding, measuring the peak CPU tensor memory of a train_batch (torch profiler's allocation events).
"""

import functools
import json
import os
import sys
from pathlib import Path

import pytest

from tests.configs import run_config

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
STEPS, SEQ, LR, CLIP = 10, 32, 1e-3, 1.0
COMMON = ["--model", "tiny-gpt2", "--data", str(CORPUS), "--seq-len", str(SEQ), "--no-progress",
          "--no-export", "--steps", str(STEPS)]


# ---------------------------------------------------------------- dstk train, every layout


def train(tmp: Path, name: str, procs: int, cfg: dict) -> dict:
    """`dstk train` on `procs` forked ranks (tests/ranks.py) -> step -> loss from the run's metrics.jsonl."""
    from tests.ranks import run_train

    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    out = tmp / name
    rc, log = run_train(["--config", path, *COMMON, "--out", out], procs)
    assert rc == 0, log[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "step" in r}


@functools.cache  # test_trackers compares its step-1 norm too
def plain_pytorch(mbs: int = 2, gas: int = 4) -> tuple[dict, dict]:
    """What `dstk train` at pp = 1, dp = 1 does, in plain PyTorch: (step -> loss, step -> the gradient
    norm before clipping, as torch.nn.utils.clip_grad_norm_ returns it)."""
    import torch

    from models.spec import attention_inputs
    from toolkit import data
    from models.weights import loading
    from toolkit.train import hf

    tok = hf.byte_tokenizer()
    config = hf.load_config("tiny-gpt2", tok, "causal-lm")
    train_set = data.prepare(data.DataOptions(str(CORPUS), SEQ, max_positions=hf.max_positions(config)), tok).train
    it = data.ShardedBatches(train_set, mbs, gas, 1, 0, 1234).micro_batches(0)
    model = loading.build_model("tiny-gpt2", config, "causal-lm", 1234).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses, norms = {}, {}
    for step in range(1, STEPS + 1):
        losses[step] = 0.0
        for _ in range(gas):
            (ids, docs), labels = next(it)
            mask, positions = attention_inputs(docs)  # packed documents: HF's packed-sequence format
            loss = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels,
                         use_cache=False).loss
            (loss / gas).backward()
            losses[step] += float(loss.detach()) / gas
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
    return losses, norms


@pytest.fixture(scope="module")
def layouts(train_runs, tmp_path_factory):
    """name -> step -> loss. pp1, pp2 and pp2dp2 are train_runs' pp1dp1, pp2dp1 and pp2dp2: the same
    configs as run_config(2, 4, 1, clip=CLIP), (2, 4, 2) and (2, 2, 2) here, the same COMMON flags
    (pp2dp1 also shows progress and exports, which trains nothing differently)."""
    from tests.distributed import test_train

    assert test_train.CLIP == CLIP
    shared = {"pp1": "pp1dp1", "pp2": "pp2dp1", "pp2dp2": "pp2dp2"}
    got = {name: test_train.losses(train_runs.get(run)) for name, run in shared.items()}
    got["pp2_ckpt"] = train(tmp_path_factory.mktemp("clip_ckpt"), "pp2_ckpt", 2,
                            run_config(2, 4, 2, clip=CLIP, activation_checkpoint_interval=1))
    return got


def far(got: dict, ref: dict, rel: float) -> dict:
    """Steps where got and ref differ by more than rel (relative to ref): {step: (got, ref)}."""
    return {s: (got.get(s), ref[s]) for s in ref if got.get(s) is None or abs(got[s] - ref[s]) > rel * abs(ref[s])}


@pytest.mark.distributed
def test_clipping_gives_the_same_losses_at_every_layout(layouts):
    """With clipping on (and triggered), pp 2 and pp 2 x dp 2 train like pp 1 and like plain PyTorch.
    Before dstk marked the parameters, DeepSpeed's norm at pp 2 was stage 0's alone (4.00 instead of
    5.16 at step 1) and the losses drifted ~1e-3 apart within 10 steps."""
    ref_losses, norms = plain_pytorch()
    assert max(norms.values()) > CLIP, f"clipping never triggered: unclipped norms {norms}"
    assert sorted(layouts["pp1"]) == list(range(1, STEPS + 1))
    assert not far(layouts["pp1"], ref_losses, 1e-5), ("pp1 vs plain PyTorch", far(layouts["pp1"], ref_losses, 1e-5))
    for name in ("pp2", "pp2dp2"):
        assert not far(layouts[name], layouts["pp1"], 1e-4), (name, far(layouts[name], layouts["pp1"], 1e-4), norms)


@pytest.mark.distributed
def test_the_logged_gradient_norm_is_plain_pytorchs_before_clipping_at_every_layout(train_runs):
    """metrics.jsonl's grad_norm (what --report-to logs as train/grad_norm) at fp32 ZeRO 0, where DeepSpeed
    keeps no norm of its own: the norm before clipping, each gradient counted once across the stages (the
    tied embedding too) and the dp replicas, as torch.nn.utils.clip_grad_norm_ gives it."""
    _, norms = plain_pytorch()
    for run in ("pp1dp1", "pp2dp1", "pp2dp2"):
        lines = [json.loads(line) for line in (train_runs.get(run) / "metrics.jsonl").read_text().splitlines()]
        logged = {r["step"]: r["grad_norm"] for r in lines if "step" in r}
        assert not far(logged, norms, 1e-4), (run, far(logged, norms, 1e-4))


@pytest.mark.distributed
def test_activation_checkpointing_from_the_config_trains_the_same(layouts):
    assert not far(layouts["pp2_ckpt"], layouts["pp2"], 1e-5), far(layouts["pp2_ckpt"], layouts["pp2"], 1e-5)


# ---------------------------------------------------------------- engine-level checks (worker)


@pytest.fixture(scope="module")
def ranks(engine_runs):
    """rank -> the worker's report, from the session's 2-process deepspeed launch of scripts/engines.py."""
    return [json.loads((engine_runs / "pipeline_training" / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["gpt2", "bert-mlm"])
def test_pipeline_gradient_norm_is_the_hf_models(ranks, case):
    """DeepSpeed's clip norm over a 2-stage pipeline (what clip_fp32_gradients computes) equals the HF
    model's gradient norm: every stage's gradients counted, the tied embedding once, BERT's MLM
    transform (trained on the last stage only, inside the tied module's copy) counted."""
    for rank in ranks:
        got = rank["norms"][case]
        assert abs(got["deepspeed"] - got["hf"]) <= 1e-5 * got["hf"], (case, rank["stage"], got)


@pytest.mark.distributed
def test_checkpointing_reaches_the_module_and_changes_no_loss(ranks):
    for rank in ranks:
        cases = rank["checkpointing"]
        assert cases["off"]["interval"] == 0 and cases["off"]["checkpointed_segments"] == 0
        for name in ("on", "on_nonreentrant", "frozen_on"):
            assert cases[name]["interval"] == 1 and cases[name]["checkpointed_segments"] >= 1, (name, cases[name])
        for on, off in (("on", "off"), ("on_nonreentrant", "off"), ("frozen_on", "frozen_off")):
            a, b = cases[on]["losses"], cases[off]["losses"]
            assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (on, a, off, b)
        assert cases["frozen_off"]["losses"] != cases["off"]["losses"]  # freezing changed the training


@pytest.mark.distributed
def test_embedding_trains_under_checkpointing_and_stays_frozen_when_frozen(ranks):
    first = ranks[0]["checkpointing"]  # stage 0 holds the embedding (wpe trains on stage 0 only)
    assert ranks[0]["stage"] == 0
    for name in ("off", "on", "on_nonreentrant"):
        assert first[name]["embedding_moved"] > 0 and first[name]["blocks_moved"] > 0, (name, first[name])
    for name in ("frozen_off", "frozen_on"):
        assert first[name]["embedding_moved"] == 0 and first[name]["blocks_moved"] > 0, (name, first[name])


@pytest.mark.distributed
def test_checkpointing_holds_less_activation_memory(ranks):
    """Peak CPU tensor memory allocated during one train_batch (above its start), per stage."""
    for rank in ranks:
        cases = rank["checkpointing"]
        for on, off in (("on", "off"), ("on_nonreentrant", "off"), ("frozen_on", "frozen_off")):
            held_on, held_off = cases[on]["peak_bytes"], cases[off]["peak_bytes"]
            assert held_on < 0.75 * held_off, (f"stage {rank['stage']}: {on} peak {held_on / 2**20:.2f} MiB, "
                                               f"{off} peak {held_off / 2**20:.2f} MiB: not 25% less")


# ---------------------------------------------------------------- the worker (every rank)

CKPT_MBS, CKPT_GAS, CKPT_SEQ, CKPT_STEPS = 8, 4, 128, 3
CKPT_CASES = {  # name: (activation_checkpoint_interval, use_reentrant, frozen embedding)
    "off": (0, True, False), "on": (1, True, False), "on_nonreentrant": (1, False, False),
    "frozen_off": (0, True, True), "frozen_on": (1, True, True)}


def worker(out: Path) -> None:
    from toolkit.distributed import process_group

    tdist = process_group.init(cpu=True)
    stage = tdist.get_rank()  # pp 2, dp 1
    report = {"stage": stage, "norms": norm_cases(), "checkpointing": {}}
    for name, (interval, reentrant, frozen) in CKPT_CASES.items():
        report["checkpointing"][name] = checkpoint_case(interval, reentrant, frozen)
    (out / f"rank{tdist.get_rank()}.json").write_text(json.dumps(report, indent=1))


def norm_cases() -> dict:
    """DeepSpeed's clip_grad_norm_ (as clip_fp32_gradients calls it) right before the optimizer step
    of one train_batch, vs the HF model's gradient norm on the same micro-batch."""
    import copy

    import deepspeed
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from deepspeed.runtime.utils import clip_grad_norm_

    import models
    from toolkit.train.parity import small_model

    results = {}
    for case, model_type, task, parts in (("gpt2", "gpt2", None, [0, 1, 5]), ("bert-mlm", "bert", "masked-lm", [0, 2, 4])):
        model = small_model(model_type, task)
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        inputs = (ids, torch.ones_like(ids)) + ((torch.zeros_like(ids),) if model_type == "bert" else ())
        reference = copy.deepcopy(model).train()
        reference(input_ids=ids, attention_mask=inputs[1], labels=ids).loss.backward()
        hf_norm = float(torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None]).norm())
        with torch.no_grad():  # as toolkit.distributed.pipeline builds it: the tied-weight broadcast is not recorded
            module = models.build_pipeline_module(models.pipeline_layers(model, task=task), parts=parts,
                                                  topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
        seen = []

        class NormProbe(torch.optim.Optimizer):
            def step(self, closure=None):
                seen.append(float(clip_grad_norm_(module.parameters(), max_norm=1e9, mpu=module.mpu())))

        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "steps_per_print": 10**6}
        engine, *_ = deepspeed.initialize(model=module, optimizer=NormProbe(module.parameters(), {}), config=cfg)
        engine.train_batch(iter([(inputs, ids)]))
        engine.destroy()
        results[case] = {"hf": hf_norm, "deepspeed": seen[0]}
    return results


def checkpoint_case(interval: int, reentrant: bool, frozen: bool) -> dict:
    """tiny-gpt2 over 2 stages through toolkit.distributed.pipeline (dstk train's builder), CKPT_STEPS steps."""
    import deepspeed
    import torch

    from toolkit.distributed.pipeline import pipeline_module
    from toolkit.distributed.topology import Topology
    from models.weights import loading
    from toolkit.train import hf

    cfg = run_config(CKPT_MBS, CKPT_GAS, 2, clip=CLIP, activation_checkpoint_interval=interval,
                     use_reentrant=reentrant)
    config = hf.load_config("tiny-gpt2", hf.byte_tokenizer(), "causal-lm")
    model = loading.build_model("tiny-gpt2", config, "causal-lm", 1234)
    embedding = [model.transformer.wte.weight, model.transformer.wpe.weight]
    if frozen:
        for p in embedding:
            p.requires_grad_(False)
    module, _ = pipeline_module(model, "causal-lm", Topology(2, 2), cfg, seq_len=CKPT_SEQ)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                                      config=cfg)
    wpe = [p for n, p in module.named_parameters() if n.endswith("parts.1.weight")]  # wpe, on stage 0
    blocks = [p for n, p in module.named_parameters() if ".block." in n]
    before = [p.detach().clone() for p in wpe + blocks]
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(CKPT_STEPS * CKPT_GAS):
        ids = torch.randint(0, config.vocab_size, (CKPT_MBS, CKPT_SEQ), generator=gen)
        batches.append(((ids, torch.ones_like(ids)), ids))
    it = iter(batches)
    losses = [float(engine.train_batch(it)) for _ in range(CKPT_STEPS - 1)]
    loss, peak = peak_allocated(lambda: float(engine.train_batch(it)))  # a warm step: optimizer state exists
    moved = [float((p.detach() - b).abs().max()) for p, b in zip(wpe + blocks, before)]
    result = {"losses": losses + [loss], "peak_bytes": peak, "interval": module.activation_checkpoint_interval,
              "checkpointed_segments": sum(module.is_checkpointable_results) if interval else 0,
              "embedding_moved": max(moved[:len(wpe)], default=None), "blocks_moved": max(moved[len(wpe):], default=None)}
    engine.destroy()
    return result


def peak_allocated(fn):
    """(fn(), the most CPU tensor bytes live at once during fn beyond those live at its start), from the
    allocation and free events torch's profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(REPO))
    worker(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))  # the launcher adds --local_rank


@pytest.mark.parametrize("model, zero", [("tiny-llama", 0), ("tiny-gpt2", 1)])
def test_bf16_pipeline_exports_the_fp32_masters(bf16_runs, model, zero):
    """pp = 2 under bf16: the layer files hold bf16 weights, BF16_Optimizer's files the fp32 masters;
    the export carries the masters (most values off the bf16 grid), tied embedding included. (The
    tiny-gpt2 run is the one test_export_stream streams.)"""
    import torch
    from safetensors.torch import load_file

    weights = load_file(bf16_runs.get(model, pp=2, zero=zero) / "hf" / "model.safetensors")
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[0] > 16:
            off_grid = (w.bfloat16().float() != w).float().mean().item()
            moved_rows = any(k in name for k in ("wte", "wpe", "embed"))  # rows move only for bytes and positions seen
            assert w.dtype == torch.float32 and off_grid > (0.05 if moved_rows else 0.5), (name, off_grid)
