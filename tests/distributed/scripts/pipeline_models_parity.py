"""Two pipeline stages (one per process) under DeepSpeed's engine vs the HF model in each process.

    deepspeed --num_gpus 2 tests/distributed/scripts/pipeline_models_parity.py OUT_DIR [HF_DIR]

For each case every rank builds the same small HF model (same seed), wraps it, splits it with
explicit `parts` (the tied head on the other stage than the embedding), runs engine.train_batch
(loss, gradients captured by a no-op optimizer after DeepSpeed's tied-gradient all-reduce) and
eval_batch (logits), once without and once with padding (and the causal LMs once on a packed batch
of several documents per row, against each document alone), and writes the max abs differences to
OUT_DIR/rank<R>.json. HF_DIR, if given, is a saved model loaded per stage from safetensors.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import models  # noqa: E402
from toolkit.distributed import process_group  # noqa: E402
from toolkit.train import parity  # noqa: E402

CASES = [  # (model_type, task, config overrides, parts over L + 3 (or L + 2) layers with L = 2)
    ("llama", None, {}, [0, 2, 5]),
    ("qwen2", None, {"tie_word_embeddings": True}, [0, 3, 5]),
    ("gemma2", None, {"sliding_window": 4, "final_logit_softcapping": 5.0}, [0, 2, 5]),
    ("gpt2", None, {}, [0, 1, 5]),
    ("bert", "masked-lm", {}, [0, 2, 4]),
    ("bert", "sequence-classification", {}, [0, 2, 4]),
    # MoE with the router aux loss in the loss: its sums travel from stage 0's router to the loss on stage 1
    ("mixtral", None, {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                       "router_aux_loss_coef": 0.5}, [0, 2, 5]),
    # another router (softmax top-k of its own, no normalisation): stage 0 holds both MoE blocks, stage 1 the head
    ("qwen3_moe", None, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "output_router_logits": True, "router_aux_loss_coef": 0.5}, [0, 3, 5]),
]
DS_CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "steps_per_print": 10**6, "gradient_clipping": 0.0, "pipeline": {"activation_checkpoint_interval": 0}}


class GradCapture(torch.optim.Optimizer):
    """An optimizer whose step records each gradient (after DeepSpeed's reductions) and changes nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.captured = {}

    def step(self, closure=None):
        self.captured = {p: p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None}


def run_case(hf, spec, parts, pad):
    """Max abs differences of loss, logits (last stage) and gradients (params this stage holds)."""
    module = models.build_pipeline_module(spec, num_stages=2, parts=parts)
    optimizer = GradCapture([p for p in module.parameters() if p.requires_grad])
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=DS_CONFIG)
    inputs, labels = parity.batch(hf.config, spec.task, pad=pad)
    hf.zero_grad(set_to_none=True)
    loss_hf, logits_hf = parity.hf_loss_logits(hf, inputs, labels)
    loss_hf.backward()
    names = {p: n for n, p in hf.named_parameters()}
    reference = {p: p.grad.clone() for p in names if p.grad is not None}
    hf.zero_grad(set_to_none=True)  # the pipeline shares these parameters: start it from no grads
    loss = engine.train_batch(iter([(inputs, labels)]))
    extras = _tied_extras(module, names)
    diffs = {names.get(p, "?"): (g - reference[p]).abs().max().item() if p in reference else float("inf")
             for p, g in optimizer.captured.items()}
    out = {"loss": abs(loss.item() - loss_hf.item()), "stage": engine.stage_id, "parts": module.parts,
           "grads": len(diffs), "grad": max(d for n, d in diffs.items() if n not in extras),
           "extras": {n: d for n, d in diffs.items() if n in extras}}
    _, logits = engine.eval_batch(iter([(inputs, labels)]), return_logits=True)
    if engine.is_last_stage():
        logits = logits[0] if isinstance(logits, tuple) else logits  # (logits, MoE router sums)
        out["logits"] = (logits - logits_hf).abs().max().item()
    return out


def _tied_extras(module, names):
    """HF names of tied-module parameters other than the tied weight: a stage holding only one end
    of the model leaves its copy of the other end's extras (wpe, or BERT's MLM transform) unused."""
    extras = set()
    for key, tied in module.tied_modules.items():
        shared = {id(module._recursive_getattr(tied, a)) for a in module.tied_weight_attrs[key]}
        extras |= {names[p] for p in tied.parameters() if id(p) not in shared}
    return extras


def run_dir_case(path, parts):
    """A saved model loaded per stage from `path`: loss and logits vs HF's from_pretrained."""
    spec = models.pipeline_layers(path)
    module = models.build_pipeline_module(spec, num_stages=2, parts=parts)
    engine, *_ = deepspeed.initialize(model=module, optimizer=GradCapture(module.parameters()), config=DS_CONFIG)
    hf = parity.load_model(path)
    inputs, labels = parity.batch(hf.config, spec.task, pad=True)
    with torch.no_grad():
        loss_hf, logits_hf = parity.hf_loss_logits(hf, inputs, labels)
    loss, logits = engine.eval_batch(iter([(inputs, labels)]), return_logits=True)
    out = {"loss": abs(loss.item() - loss_hf.item()), "stage": engine.stage_id,
           "params_held": sum(p.numel() for p in module.parameters()),
           "params_total": sum(p.numel() for p in hf.parameters())}
    if engine.is_last_stage():
        out["logits"] = (logits - logits_hf).abs().max().item()
    return out


def run_packed_case(hf, spec, parts):
    """A packed batch (documents in a row, attention blocked per document) through 2 stages: the last
    stage's logits and loss vs each document run alone through the HF model."""
    module = models.build_pipeline_module(spec, num_stages=2, parts=parts)
    engine, *_ = deepspeed.initialize(model=module, optimizer=GradCapture(module.parameters()), config=DS_CONFIG)
    inputs, labels, docs = parity.packed_batch(hf.config)
    loss, logits = engine.eval_batch(iter([(inputs, labels)]), return_logits=True)
    out = {"stage": engine.stage_id}
    if engine.is_last_stage():
        out["logits"], out["loss"] = parity.packed_vs_alone(logits, loss, hf, docs)
    return out


def main(out_dir, hf_dir=None):
    process_group.init()
    results = {}
    for model_type, task, overrides, parts in CASES:
        hf = parity.small_model(model_type, task, **overrides)
        spec = models.pipeline_layers(hf)
        for pad in (False, True):
            results[f"{model_type}:{spec.task}:pad={pad}"] = run_case(hf, spec, parts, pad)
    for model_type, _, overrides, parts in CASES[:4]:  # causal LMs: llama, qwen2 (tied), gemma2 (windows), gpt2
        hf = parity.small_model(model_type, **overrides)
        results[f"packed:{model_type}"] = run_packed_case(hf, models.pipeline_layers(hf), parts)
    if hf_dir:
        results["dir"] = run_dir_case(hf_dir, [0, 2, 5])
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])  # the launcher adds --local_rank
