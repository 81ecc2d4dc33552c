"""--objective dpo against TRL's DPOTrainer (trl 1.16, the `test` extra), issue 47: the same tiny GPT-2 directory,
the same pairs in the same order, beta 0.1, 2 pairs a micro-batch x gas 2, torch's AdamW at a constant lr, clipping at
1.0, dropout off and fp32 in both (TRL's DPOConfig defaults to bf16 autocast, on CPUs too: bf16=False): dstk's losses,
rewards and log-probs over 3 steps at pp 1 are TRL's to 1e-4 (measured: 1e-7). TRL runs in this process (its Trainer
on the CPU, a SequentialSampler over the pairs in dstk's epoch-0 order), dstk on one forked rank."""

import json

import pytest
import torch

from tests.configs import adamw, ds_config, write_config
from tests.distributed.launch import launch
from tests.unit.test_dpo_data import PAIRS

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]
trl = pytest.importorskip("trl")

SEED, STEPS, PAIRS_PER_MICRO, GAS, LR, CLIP = 1234, 3, 2, 2, 1e-3, 1.0
ADAM = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # torch's AdamW defaults, written out
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def dstk_run(tmp_path, model) -> dict:
    cfg = write_config(tmp_path / "ds.json", ds_config(2 * PAIRS_PER_MICRO, GAS, optimizer=adamw(LR, **ADAM),
                                                       gradient_clipping=CLIP, steps_per_print=10**6))
    args = ["--model", str(model), "--data", str(PAIRS), "--seq-len", "128", "--no-progress", "--objective", "dpo",
            "--eval-fraction", "0", "--data-cache", str(tmp_path / "cache"), "--no-export"]
    rc, log = launch(cfg, tmp_path / "run", 1, "--steps", STEPS, model_args=args)
    assert rc == 0, log[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "step" in r}


def trl_run(tmp_path, model) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED))  # dstk's epoch 0 (batches.py)
    used = [rows[int(i)] for i in order[: STEPS * GAS * PAIRS_PER_MICRO]]

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    config = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PAIRS_PER_MICRO,
                           gradient_accumulation_steps=GAS, max_steps=STEPS, learning_rate=LR, beta=0.1,
                           lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_epsilon=ADAM["eps"],
                           max_grad_norm=CLIP,
                           optim="adamw_torch", logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                           max_length=128, seed=SEED, dataloader_num_workers=0,
                           bf16=False)  # TRL's DPOConfig defaults to bf16 autocast (on CPUs too); dstk's run is fp32
    trainer = InOrder(model=AutoModelForCausalLM.from_pretrained(model), args=config,
                      train_dataset=Dataset.from_list(used), processing_class=AutoTokenizer.from_pretrained(model))
    trainer.train()
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def test_dstk_dpo_matches_trl_dpo_trainer(tmp_path, saved_models):
    model = saved_models.get("tiny-gpt2", SEED)
    ours, theirs = dstk_run(tmp_path, model), trl_run(tmp_path, model)
    assert abs(ours[1]["loss"] - 0.693147) < 1e-5
    assert theirs[STEPS]["rewards/margins"] != 0  # the policy moved
    for step in range(1, STEPS + 1):
        for key in KEYS:
            assert ours[step][key] == pytest.approx(theirs[step][key], rel=1e-4, abs=1e-5), (step, key, ours[step],
                                                                                              theirs[step])
