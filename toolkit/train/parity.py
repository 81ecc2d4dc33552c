"""Does the wrapped model compute what the HF model computes? (library side of `dstk parity`)

    dstk parity llama            # a model type: small random weights
    dstk parity path/to/hf_dir   # a local HF directory (full model in this process)

The layer list runs as a real single-stage deepspeed PipelineModule in a gloo world of one; the
HF model shares its parameters with it, so gradients are compared parameter by parameter.
Batches are (B, T) with right padding in one row (pad=True) so the padding mask is exercised.

The one wrapper-against-HF check: `check_model` (one stage, in this process) and `hf_loss_logits`
(the HF side, also read by the multi-stage checks in tests/distributed and bench/arch_sweep.py).
"""

import contextlib
import io
import os
from dataclasses import dataclass

from toolkit.errors import ConfigError, UnusableInput
from toolkit.checkpoint.state import first_line
from models.weights.loading import random_model
from toolkit.train.hf import no_dropout

TOLERANCE = 1e-5  # max abs difference allowed in fp32
PAD = 3  # tokens of right padding in row 0 of the batch (pad=True)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, pad_token_id=0)


@dataclass
class ParityReport:
    """Max abs differences between the HF model and its pipeline layer list."""

    model: str
    task: str
    num_layers: int
    loss_hf: float
    loss_diff: float
    logits_diff: float
    grad_diff: float
    grad_name: str  # the parameter with the largest gradient difference
    params_checked: int
    attn_implementation: str

    @property
    def ok(self) -> bool:
        return max(self.loss_diff, self.logits_diff, self.grad_diff) <= TOLERANCE


def small_model(model_type: str, task=None, seed: int = 0, attn_implementation=None, registry: bool = False,
                **overrides):
    """A HF model of transformers `model_type` with SMALL dimensions and random weights (fp32, no
    dropout); a name from the model registry (toolkit.plan.arch: tiny-gpt2, gpt2, llama-3.2-1b, ...)
    with the registry's dimensions instead when `registry` is set (what `dstk parity NAME` does)."""
    from transformers import AutoConfig

    from models import default_task
    from toolkit.plan.arch import builtin_names, is_builtin, load_arch, to_hf_config

    try:
        config = to_hf_config(load_arch(model_type)) if registry and is_builtin(model_type) else \
            AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    except ValueError:
        raise ConfigError(f"unknown model {model_type!r}: not a local directory, a built-in architecture "
                          f"({builtin_names()}) nor a transformers model_type (llama, gpt2, bert, qwen2, mistral, "
                          "gemma, phi3, ...)") from None
    no_dropout(config)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return random_model(config, task or default_task(config), seed, **kwargs).float().eval()


def load_model(path: str, task=None, attn_implementation=None, seq_len=None):
    """The full HF model saved at `path`, fp32, dropout off; seq_len is checked against the config
    before any weight is read."""
    from safetensors import SafetensorError
    from transformers import AutoConfig

    from models import auto_class, default_task
    from models.weights.source import check_directory, check_model_folder

    check_model_folder(path, flag="MODEL")
    try:
        config = no_dropout(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as exc:
        raise UnusableInput(f"{path}/config.json cannot be read as a HF config: {first_line(exc)}") from None
    if seq_len is not None:
        check_seq_len(config, seq_len, path)
    check_directory(path)  # damaged or cut-short weights: named by file before transformers reads them
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    cls = auto_class(task or default_task(config), config)
    try:
        return cls.from_pretrained(path, config=config, **kwargs).float().eval()
    except (OSError, ValueError, SafetensorError) as exc:  # no weights file, a truncated one
        raise UnusableInput(f"{path}: cannot load the model's weights: {first_line(exc)}") from None


def check_min_seq_len(seq_len: int, pad: bool) -> None:
    """Row 0 keeps at least one real token after its padding; a causal LM needs two tokens to predict one."""
    least = PAD + 1 if pad else 2
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < least:
        raise ConfigError(f"--seq-len must be >= {least}, got {seq_len!r}: " + (
            f"the first sequence is right-padded by {PAD} tokens (>= 2 with --no-pad)" if pad
            else "a causal LM predicts token t+1 from token t"))


def check_seq_len(config, seq_len: int, name: str, small: bool = False) -> None:
    """Refuse a sequence longer than the model's position table / rotary range."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        where = f"the {name} model (random weights)" if small else name
        raise ConfigError(f"--seq-len {seq_len} exceeds the max_position_embeddings of {where} ({limit}); "
                          f"use --seq-len <= {limit}")


def batch(config, task, batch_size=2, seq_len=8, pad=True, seed=0):
    """(inputs, labels) as the pipeline's data iterator yields them; row 0 right-padded by 3 if pad."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if pad:
        mask[0, -PAD:] = 0
    if task == "sequence-classification":
        labels = torch.randint(0, config.num_labels, (batch_size,), generator=g)
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return (ids, mask), labels


def ensure_world_of_one():
    """A gloo process group of one in this process, as PipelineModule needs (no-op if one exists)."""
    from toolkit.distributed import process_group

    process_group.init(cpu=True, alone=True)


def hf_loss_logits(model, inputs, labels):
    """The HF model's own loss and logits for a pipeline batch."""
    kwargs = dict(input_ids=inputs[0], attention_mask=inputs[1], labels=labels)
    if len(inputs) > 2:
        kwargs["token_type_ids"] = inputs[2]
    out = model(**kwargs)
    return out.loss, out.logits


def grads_of(model) -> dict:
    """name -> gradient clone, then clear them (tied parameters appear once)."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def max_grad_diff(reference: dict, model):
    """(max abs difference, parameter name, parameters compared) against `reference` grads."""
    worst, worst_name, count = 0.0, "", 0
    for name, p in model.named_parameters():
        if name not in reference:
            continue
        got = p.grad if p.grad is not None else reference[name].new_zeros(())
        diff = (got - reference[name]).abs().max().item()
        count += 1
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name, count


def check_model(model, name="model", task=None, seq_len=8, pad=True, seed=0, data=None,
                reference=None) -> ParityReport:
    """Run `model` and its single-stage PipelineModule on one batch; report the differences.

    data: (inputs, labels) to use instead of a random batch (e.g. tokenized real text).
    reference: the model whose forward is the truth, when it is not `model` itself (a PeftModel
    around it: `model` is then the HF model inside, which the layers wrap).
    """
    import models

    ensure_world_of_one()
    spec = models.pipeline_layers(model, task=task)
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its partition table
        module = models.build_pipeline_module(spec, num_stages=1)
    inputs, labels = data or batch(model.config, spec.task, seq_len=seq_len, pad=pad, seed=seed)
    model.zero_grad(set_to_none=True)
    loss_hf, logits_hf = hf_loss_logits(reference or model, inputs, labels)
    loss_hf.backward()
    reference = grads_of(model)
    outputs = module(inputs)
    loss = spec.loss_fn(outputs, labels)
    logits = outputs[0] if isinstance(outputs, tuple) else outputs  # (logits, MoE router sums)
    loss.backward()
    grad_diff, grad_name, count = max_grad_diff(reference, model)
    model.zero_grad(set_to_none=True)
    return ParityReport(model=name, task=spec.task, num_layers=spec.num_layers, loss_hf=loss_hf.item(),
                        loss_diff=(loss - loss_hf).abs().item(), logits_diff=(logits - logits_hf).abs().max().item(),
                        grad_diff=grad_diff, grad_name=grad_name, params_checked=count,
                        attn_implementation=str(model.config._attn_implementation))


def run_parity(model: str, task=None, seq_len=8, pad=True, attn_implementation=None, revision="main") -> ParityReport:
    """`dstk parity MODEL`: MODEL is a local HF directory, a hub id at `revision` (its folder in
    huggingface_hub's cache, models.weights.hub), a built-in name (the registry's dimensions, random weights)
    or a transformers model_type (SMALL dimensions)."""
    from models.weights import hub

    check_min_seq_len(seq_len, pad)
    looks_like_path = os.sep in model or model.startswith(".") or os.path.exists(model)
    if hub.is_hub_id(model):
        hf = load_model(hub.snapshot(model, revision, flag="model"), task, attn_implementation, seq_len=seq_len)
    elif looks_like_path:
        hf = load_model(model, task, attn_implementation, seq_len=seq_len)
    else:
        hf = small_model(model, task, attn_implementation=attn_implementation, registry=True)
        check_seq_len(hf.config, seq_len, model, small=True)
    return check_model(hf, name=model, task=task, seq_len=seq_len, pad=pad)


def packed_batch(config, rows=((5, 3, 4), (10,)), seq_len=16, seed=0):
    """A packed batch: `rows` lists each row's document lengths; ((ids, doc_ids), labels) as dstk's data
    yields it (doc ids 1..k, 0 on padding; labels -100 on padding and on each document's first token, which
    no token of the previous document may predict), and the documents as (row, start, ids)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (len(rows), seq_len), generator=g)
    doc_ids, labels, docs = torch.zeros_like(ids), torch.full_like(ids, -100), []
    for r, lengths in enumerate(rows):
        start = 0
        for k, n in enumerate(lengths, 1):
            doc_ids[r, start:start + n] = k
            labels[r, start + 1:start + n] = ids[r, start + 1:start + n]
            docs.append((r, start, ids[r, start:start + n]))
            start += n
    return (ids, doc_ids), labels, docs


def packed_vs_alone(logits, loss, hf, docs) -> tuple:
    """(max |logits - each document's logits run alone|, |loss - the token-weighted loss of the documents
    run alone|) for a packed batch's logits (B, T, V) and mean loss."""
    import torch
    import torch.nn.functional as F

    worst, total, count = 0.0, 0.0, 0
    with torch.no_grad():
        for row, start, ids in docs:
            alone = hf(input_ids=ids[None]).logits[0].float()
            worst = max(worst, (logits[row, start:start + len(ids)].float() - alone).abs().max().item())
            total += F.cross_entropy(alone[:-1], ids[1:], reduction="sum").item()
            count += len(ids) - 1
    return worst, abs(float(loss) - total / count)
