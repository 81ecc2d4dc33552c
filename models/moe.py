"""HF's MoE load-balancing (auxiliary) loss through pipeline stages, exactly.

With `output_router_logits`, a Mixtral-style CausalLM adds `router_aux_loss_coef * aux` to its loss,
where aux = E * sum_e (tokens routed to e / N) * (router probability of e summed / N) over the
router logits of EVERY layer (N = non-padding tokens x layers; HF's load_balancing_loss_func). Those
are sums: each DecoderBlock adds its layers' [counts (E), probability sums (E), N] to a (2E + 1)
float tensor that travels with the hidden state (fixed shape, what DeepSpeed's pipeline sends), and
the loss on the last stage finishes the formula. Gradients reach every stage's routers through the
probability sums, as in HF. Padding (document id 0) is left out, as HF does with an attention mask.

Which module emits router logits comes from the model class's own `_can_record_outputs` (what HF
records them with); that the model's load_balancing_loss_func is this sum is checked numerically
when the layers are built, and a model whose aux loss is something else is refused.
"""

import sys

import torch
import torch.nn.functional as F

from models.spec import causal_lm_loss
from toolkit.errors import ConfigError


class RouterAux:
    """The aux-loss settings of one model: router module class, E, top-k, coefficient."""

    def __init__(self, model, config):
        kind = config.model_type
        record = getattr(type(model), "_can_record_outputs", None) or {}
        target = record.get("router_logits")
        self.router_class = getattr(target, "target_class", target)
        self.index = getattr(target, "index", 0)
        hf_loss = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        coef = getattr(model, "router_aux_loss_coef", getattr(model, "aux_loss_coef", None))  # jetmoe: aux_loss_coef
        settings = [getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None), coef]
        if self.router_class is None or hf_loss is None or None in settings:
            raise ConfigError(f"model_type {kind!r}: output_router_logits is true but dstk does not find how "
                              f"{type(model).__name__} computes its router aux loss; set output_router_logits to "
                              "false in config.json (the LM loss alone), or train at pp 1 where HF computes it")
        self.num_experts, self.top_k, self.coef = int(settings[0]), int(settings[1]), float(settings[2])
        _check_same_as_hf(hf_loss, self, kind)

    @classmethod
    def of(cls, model, config):
        """RouterAux when the model adds the aux loss (output_router_logits and a CausalLM forward that adds
        one: deepseek_v3's and hy_v3's configs have the flag, their forwards no aux loss), else None."""
        if not getattr(config.get_text_config(), "output_router_logits", False):
            return None
        import inspect

        try:
            adds = "aux_loss_coef" in inspect.getsource(type(model).forward)  # (router_)aux_loss_coef * aux
        except (OSError, TypeError):
            adds = True  # cannot tell: look for it, and refuse if it is not found
        return cls(model, config) if adds else None

    def zeros(self, like: torch.Tensor) -> torch.Tensor:
        """The sums before the first layer; requires grad so DeepSpeed's backward can pass through it."""
        stats = torch.zeros(2 * self.num_experts + 1, dtype=torch.float32, device=like.device)
        return stats.requires_grad_() if torch.is_grad_enabled() else stats

    def accumulate(self, stats: torch.Tensor, router_logits, keep: torch.Tensor) -> torch.Tensor:
        """stats + this layer's [routed counts, probability sums, tokens]; keep: (B*T,) 1.0 for real tokens."""
        probs = F.softmax(router_logits.float(), dim=-1)  # (B*T, E)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
        counts = torch.zeros(self.num_experts, device=probs.device).scatter_add_(
            0, chosen, keep.repeat_interleave(self.top_k))
        return stats + torch.cat([counts, (probs * keep.unsqueeze(-1)).sum(0), keep.sum().reshape(1)])

    def aux_loss(self, stats: torch.Tensor) -> torch.Tensor:
        e, total = self.num_experts, stats[-1]
        return (stats[:e] / total * stats[e:2 * e] / total).sum() * e

    def loss_fn(self, outputs, labels) -> torch.Tensor:
        """The CausalLM loss: cross entropy + router_aux_loss_coef * aux, from (logits, stats)."""
        logits, stats = outputs
        return causal_lm_loss(logits, labels) + self.coef * self.aux_loss(stats)


def _check_same_as_hf(hf_loss, aux: RouterAux, kind: str) -> None:
    """The model's own load_balancing_loss_func equals the sums above on random router logits."""
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(12, aux.num_experts, generator=g) for _ in range(3)]
    mask = torch.ones(2, 6)
    mask[0, -2:] = 0
    stats = torch.zeros(2 * aux.num_experts + 1)
    for logits in layers:
        stats = aux.accumulate(stats, logits, mask.reshape(-1))
    try:  # another signature or router-output format (doge, flint) fails here: another form too
        want = torch.as_tensor(hf_loss(tuple(layers), aux.num_experts, aux.top_k, mask), dtype=torch.float32)
        same = torch.allclose(aux.aux_loss(stats), want, atol=1e-6)
    except Exception:  # noqa: BLE001  (any failure: not the form dstk carries)
        same = False
    if not same:
        raise ConfigError(f"model_type {kind!r}: its router aux loss (output_router_logits) is not the Mixtral-style "
                          "load-balancing sum dstk carries between stages; set output_router_logits to false in "
                          "config.json, or train at pp 1 where HF computes it")


class RouterCapture:
    """Router logits emitted inside one decoder layer during a forward (forward hooks on its routers)."""

    def __init__(self, layer, aux: RouterAux):
        self.aux, self.seen = aux, []
        for module in layer.modules():
            if isinstance(module, aux.router_class):
                module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.seen.append(output[self.aux.index] if isinstance(output, (tuple, list)) else output)

    def add(self, stats, doc_ids, run):
        """run() under capture; returns (run's result, stats + the routers' sums)."""
        self.seen = []
        out = run()
        keep = (doc_ids > 0).reshape(-1).float()
        for logits in self.seen:
            stats = self.aux.accumulate(stats, logits.reshape(-1, logits.shape[-1]), keep)
        self.seen = []
        return out, stats
