"""HF's MoE load-balancing (auxiliary) loss through pipeline stages, exactly as HF computes it at pp 1.

With `output_router_logits`, a Mixtral-style CausalLM adds `router_aux_loss_coef * aux` to its loss,
where aux = E * sum_e (tokens routed to e / N) * (router probability of e summed / N) over the
router logits of EVERY layer (N = counted tokens x layers; HF's load_balancing_loss_func). Those
are sums: each DecoderBlock adds its layers' [counts (E), probability sums (E), N] to a (2E + 1)
float tensor that travels with the hidden state (fixed shape, what DeepSpeed's pipeline sends), and
the loss on the last stage finishes the formula. Gradients reach every stage's routers through the
probability sums, as in HF.

What HF counts, and so what the stages count:
- the logits HF records: the output (index) of the router class the model's `_can_record_outputs` names;
- "routed" is HF's own top-k of softmax(those logits) in their dtype, not the router's selection: a
  sigmoid router with a correction bias (minimax_m2, laguna, ernie4_5_moe) picks other experts than HF's
  aux loss counts, and the stages count what HF counts;
- tokens: a micro-batch of one document per row reaches HF with its padding mask (padding not counted);
  one with packed rows reaches it with none (positions carry the documents, models.spec.attention_inputs),
  and HF then counts every token, padding too: so do the stages (`counted_tokens`).
That the model's load_balancing_loss_func is this sum is checked numerically when the layers are built
(and at `dstk train --check`, models.api.check_router_aux); a model whose aux loss is something else is refused.
"""

import inspect
import sys

import torch
import torch.nn.functional as F

from models.spec import causal_lm_loss
from toolkit.errors import ConfigError

FIX = "set output_router_logits to false in config.json (the LM loss alone), or train at pp 1 where HF computes it"


class RouterAux:
    """The aux-loss settings of one model: router module class and output index, E, top-k, coefficient."""

    def __init__(self, model, config):
        kind = config.model_type
        self.router_class, self.index = _recorded_router(model, kind)
        hf_loss = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        coef = getattr(model, "router_aux_loss_coef", getattr(model, "aux_loss_coef", None))  # jetmoe: aux_loss_coef
        settings = [getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None), coef]
        if hf_loss is None or None in settings:
            raise ConfigError(f"model_type {kind!r}: output_router_logits is true but dstk does not find how "
                              f"{type(model).__name__} computes its router aux loss (load_balancing_loss_func, "
                              f"num_experts, num_experts_per_tok, router_aux_loss_coef); {FIX}")
        self.num_experts, self.top_k, self.coef = int(settings[0]), int(settings[1]), float(settings[2])
        _check_same_as_hf(hf_loss, self, kind)

    @classmethod
    def of(cls, model, config):
        """RouterAux when the model adds the aux loss (output_router_logits and a CausalLM forward that adds
        one: deepseek_v3's and hy_v3's configs have the flag, their forwards no aux loss), else None."""
        if not getattr(config.get_text_config(), "output_router_logits", False):
            return None
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
        """stats + this layer's [routed counts, probability sums, tokens]; router_logits (N, E), keep (N,) 1.0 for
        a counted token. As HF's load_balancing_loss_func: softmax in the logits' dtype, its top-k, fp32 sums."""
        probs = F.softmax(router_logits, dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=probs.device).scatter_add_(
            0, chosen, keep.repeat_interleave(self.top_k))
        return stats + torch.cat([counts, (probs.float() * keep.unsqueeze(-1)).sum(0), keep.sum().reshape(1)])

    def aux_loss(self, stats: torch.Tensor) -> torch.Tensor:
        e, total = self.num_experts, stats[-1]
        return torch.sum(stats[:e] / total * (stats[e:2 * e] / total)) * e  # HF's order of operations

    def loss_fn(self, outputs, labels) -> torch.Tensor:
        """The CausalLM loss: cross entropy + router_aux_loss_coef * aux, from (logits, stats)."""
        logits, stats = outputs
        return causal_lm_loss(logits, labels) + self.coef * self.aux_loss(stats)


def _recorded_router(model, kind: str) -> tuple:
    """(router class, index of the router-logits output) as HF's output recorder finds them
    (transformers.utils.output_capturing: an OutputRecorder names both; a bare class records index 1 of a tuple)."""
    record = getattr(type(model), "_can_record_outputs", None) or {}
    target = record.get("router_logits")
    if isinstance(target, type):
        return target, 1
    router = getattr(target, "target_class", None)
    if router is None or getattr(target, "layer_name", None) or getattr(target, "class_name", None):
        raise ConfigError(f"model_type {kind!r}: output_router_logits is true but {type(model).__name__} records its "
                          f"router logits as {target!r}, not one router class dstk can capture in each stage; {FIX}")
    return router, getattr(target, "index", 0)


def _check_same_as_hf(hf_loss, aux: RouterAux, kind: str) -> None:
    """The model's own load_balancing_loss_func equals the sums above on random router logits, with a padding
    mask and without one (packed rows)."""
    g = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(12, aux.num_experts, generator=g) for _ in range(3))
    mask = torch.ones(2, 6)
    mask[0, -2:] = 0
    for hf_mask in (mask, None):
        keep = (mask if hf_mask is not None else torch.ones_like(mask)).reshape(-1)
        stats = torch.zeros(2 * aux.num_experts + 1)
        for logits in layers:
            stats = aux.accumulate(stats, logits, keep)
        try:  # another signature or router-output format (doge, flint) fails here: another form too
            want = torch.as_tensor(hf_loss(layers, aux.num_experts, aux.top_k, hf_mask), dtype=torch.float32)
            same = torch.allclose(aux.aux_loss(stats), want, atol=1e-6)
        except Exception:  # noqa: BLE001  (any failure: not the form dstk carries)
            same = False
        if not same:
            raise ConfigError(f"model_type {kind!r}: its router aux loss (output_router_logits) is not the "
                              f"Mixtral-style load-balancing sum dstk carries between pipeline stages; {FIX}")


def counted_tokens(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B*T,) 1.0 for each token HF's aux loss counts at pp 1 for this micro-batch of document ids (B, T): rows of
    one document each reach HF with their padding mask (padding not counted); a micro-batch with a packed row
    (an id > 1) reaches it with no mask (models.spec.attention_inputs' rule), so every token counts. No host sync."""
    return ((doc_ids > 0) | (doc_ids.amax() > 1)).reshape(-1).float()


class RouterCapture:
    """Router logits emitted inside one decoder layer during a forward (forward hooks on its routers)."""

    def __init__(self, layer, aux: RouterAux):
        self.aux, self.seen = aux, []
        for module in layer.modules():
            if isinstance(module, aux.router_class):
                self.watch(module)

    def watch(self, module) -> None:
        """Record `module`'s output (the router logits (N, E), or a tuple holding them at aux.index) in each forward:
        AutoEP's router gate when it replaces the block's router (models.autoep)."""
        module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if not isinstance(output, tuple):
            self.seen.append(output)
        elif output[self.aux.index] is not None:  # as HF's recorder: a None output is not recorded
            self.seen.append(output[self.aux.index])

    def add(self, stats, doc_ids, run):
        """run() under capture; returns (run's result, stats + the routers' sums)."""
        self.seen = []
        out = run()
        keep = counted_tokens(doc_ids)
        for logits in self.seen:
            stats = self.aux.accumulate(stats, logits.reshape(-1, logits.shape[-1]), keep)
        self.seen = []
        return out, stats
