"""The sweep's "from dir" check (bench/arch_sweep.py): the layers pipeline stages build from a HF directory
against from_pretrained of it.

    report = check_dir("path/to/hf_dir", attention="eager")   # report.ok, report.weights, report.stages[1|2]

What a run does with `--model DIR`: each stage builds its layers from the directory's safetensors
(models.weights.source.DirSource, through transformers' conversion mapping), never the full model. Checked
against the model transformers' own from_pretrained makes of the same directory:
- weights: every module a stage loads holds from_pretrained's parameters and persistent buffers, bit for bit;
- pp 1: the whole layer list as one PipelineModule (a gloo world of one), on one padded batch;
- pp 2: the list cut in two halves, each built from the directory as its own PipelineModule (a tied head
  loads its own copy of the embedding, as the last stage does), run in this process as DeepSpeed's engine
  runs two stages: the first stage's output sent as tensors only, detached, floating ones set requires_grad
  and each given its gradient back; a tied weight's gradient is the sum over its copies (DeepSpeed's
  all-reduce). Gradients are compared by HF name, since the layers do not share the HF model's parameters.
"""

import contextlib
import io
from dataclasses import dataclass, field

from toolkit.train.parity import TOLERANCE, batch, ensure_world_of_one, hf_loss_logits, load_model


@dataclass
class StageDiffs:
    """Max abs differences of one layout (pp 1 or pp 2) against from_pretrained's model."""

    loss: float
    logits: float
    grad: float
    grad_name: str  # the HF parameter with the largest gradient difference
    params_checked: int

    @property
    def ok(self) -> bool:
        return max(self.loss, self.logits, self.grad) <= TOLERANCE


@dataclass
class DirParity:
    """weights: HF tensor names a stage loads otherwise than from_pretrained (empty: bit-identical)."""

    path: str
    weights: list
    stages: dict = field(default_factory=dict)  # pp -> StageDiffs

    @property
    def ok(self) -> bool:
        return not self.weights and all(s.ok for s in self.stages.values())


class Recorder:
    """The `adapt` hook of models.pipeline_layers: keeps (HF name, module) of each module a stage builds."""

    def __init__(self):
        self.built = []

    def __call__(self, module, name):
        self.built.append((name, module))
        return module


def check_dir(path: str, task=None, attention=None, data=None) -> DirParity:
    """Load `path` per stage and with from_pretrained; compare weights, then pp 1 and pp 2 on one batch
    (`data`: (inputs, labels), else a random padded one). ConfigError where dstk refuses the model."""
    import models

    ensure_world_of_one()
    hf = load_model(path, task, attention)
    recorder = Recorder()
    spec = models.pipeline_layers(path, task=task, attention=attention, adapt=recorder)
    inputs, labels = data or batch(hf.config, spec.task, pad=True)
    loss_hf, logits_hf = hf_loss_logits(hf, inputs, labels)
    loss_hf.backward()
    reference = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    report = DirParity(path, weights=[])
    for pp, cut in ((1, spec.num_layers), (2, spec.num_layers // 2)):
        recorder.built.clear()
        loss, logits = _run_stages([_part(spec, 0, cut), _part(spec, cut, spec.num_layers)], inputs, labels)
        if pp == 1:
            report.weights = _weights_differing(recorder.built, hf)
        grads = _grads_by_hf_name(recorder.built)
        grad, grad_name = _worst(reference, grads)
        diffs = dict(loss=(loss - loss_hf).abs().item(), logits=(logits - logits_hf).abs().max().item())
        report.stages[pp] = StageDiffs(**diffs, grad=grad, grad_name=grad_name, params_checked=len(reference | grads))
    return report


def _part(spec, start: int, stop: int):
    """Layers start..stop-1 of `spec` as a spec of their own (None when empty: pp 1 has one part)."""
    from models.spec import PipelineSpec

    if start >= stop:
        return None
    tied = {key: [i - start for i in at if start <= i < stop] for key, at in spec.tied.items()}
    return PipelineSpec(layers=spec.layers[start:stop], loss_fn=spec.loss_fn, kinds=spec.kinds[start:stop],
                        config=spec.config, task=spec.task, tied={k: v for k, v in tied.items() if v},
                        param_counts=spec.param_counts[start:stop], hf_names=spec.hf_names[start:stop])


def _run_stages(parts: list, inputs, labels) -> tuple:
    """(loss, logits) of the stages `parts` run one after another, forward then backward as the pipeline
    engine runs them: between stages only detached tensors travel, and every floating one needs a gradient."""
    import torch

    import models

    parts = [p for p in parts if p is not None]
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its partition table
        modules = [models.build_pipeline_module(p, num_stages=1).eval() for p in parts]  # as from_pretrained's
    sent, x = [], inputs
    for module in modules:
        if sent:
            x = _received(x)
        out = module(x)
        sent.append((x, out))
        x = out
    loss = parts[-1].loss_fn(x, labels)
    loss.backward()
    for (received, _), (_, out) in zip(reversed(sent[1:]), reversed(sent[:-1])):
        pairs = [(o, r.grad) for o, r in zip(_tensors(out), _tensors(received)) if r.is_floating_point()]
        if any(g is None for _, g in pairs):
            raise RuntimeError("a floating tensor sent between stages gets no gradient back (DeepSpeed's "
                               "send_grads asserts one)")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return loss.detach(), (x[0] if isinstance(x, tuple) else x).detach()  # (logits, MoE router sums)


def _tensors(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _received(x):
    """What the next stage gets: a tensor or a flat tuple of tensors, detached; floating ones need a grad."""
    import torch

    if not all(torch.is_tensor(t) for t in _tensors(x)):
        raise TypeError(f"a stage returns {[type(t).__name__ for t in _tensors(x)]}: only a tensor or a tuple of "
                        "tensors travels between pipeline stages")
    out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _tensors(x))
    return out if isinstance(x, tuple) else out[0]


def _weights_differing(built: list, hf) -> list:
    """HF names of the tensors the built modules hold otherwise than `hf` (value, dtype or presence)."""
    import torch

    bad = []
    for name, module in built:
        got, want = module.state_dict(), hf.get_submodule(name).state_dict()
        bad += [f"{name}.{k}" for k in got.keys() ^ want.keys()]
        bad += [f"{name}.{k}" for k in got.keys() & want.keys()
                if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    return sorted(set(bad))


def _grads_by_hf_name(built: list) -> dict:
    """{HF name: gradient} of the built modules; a module built twice (a tied embedding's copies) sums."""
    grads = {}
    for name, module in {id(m): (n, m) for n, m in built}.values():
        for key, p in module.named_parameters():
            if p.grad is not None:
                full = f"{name}.{key}"
                grads[full] = grads[full] + p.grad if full in grads else p.grad.clone()
    return grads


def _worst(reference: dict, grads: dict) -> tuple:
    """(max abs gradient difference, its HF name); a gradient only one side has counts against zero."""
    worst, worst_name = 0.0, ""
    for name in reference.keys() | grads.keys():
        a, b = reference.get(name), grads.get(name)
        diff = (a if b is None else b if a is None else a - b).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name
