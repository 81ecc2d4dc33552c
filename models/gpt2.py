"""GPT-2 (no pp plan; learned positions; head tied to wte) as [embed, L blocks, ln_f, head]."""

from torch import nn

from models.attention import layer_inputs, positions
from models.generic import FinalNorm, LMHead, LogitTransform, TiedLogits
from models.spec import PipelineSpec, causal_lm_loss, needs_grad


class GPT2Embed(nn.Module):
    """Layer 0: (input_ids, document ids) -> (wte(ids) + wpe(positions), document ids), then dropout;
    positions restart at each document of a packed row (models.attention.positions)."""

    def __init__(self, source, prefix):
        super().__init__()
        # parts[0] is wte so TiedLogits finds the tied weight where it looks for it
        self.parts = nn.ModuleList(source.module(f"{prefix}.{n}") for n in ("wte", "wpe", "drop"))

    def forward(self, inputs):
        input_ids, doc_ids = inputs[0], inputs[1]
        wte, wpe, drop = self.parts
        return needs_grad(drop(wte(input_ids) + wpe(positions(doc_ids)))), doc_ids  # positions (B, T)

class GPT2BlockStage(nn.Module):
    """One GPT2Block with a causal mask kept inside each document, built by HF's create_causal_mask once per
    micro-batch and stage (models.attention)."""

    def __init__(self, source, name, config):
        super().__init__()
        self.block = source.module(name)
        self.config = config

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask

        hidden, doc_ids = inputs
        # no cache: the block's default (its keyword is past_key_values before transformers 5.24, cache since)
        out = self.block(hidden, **layer_inputs(doc_ids, hidden, self.config, create_causal_mask))
        return (out[0] if isinstance(out, tuple) else out), doc_ids

def build_gpt2(source, config) -> PipelineSpec:
    """GPT2LMHeadModel as L + 3 layers; the head shares wte through TiedLayerSpec("embed")."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    model, prefix = source.skeleton, source.skeleton.base_model_prefix  # "transformer"
    blocks = [f"{prefix}.h.{i}" for i in range(config.n_layer)]
    pre = [f"{prefix}.{n}" for n in ("wte", "wpe", "drop")]
    tied = model.lm_head.weight is model.get_submodule(pre[0]).weight
    if tied:  # only wte is shared; the head stage's copy of wpe is unused (as in Megatron-DeepSpeed)
        attrs = ["parts.0.weight"]
        first = TiedLayerSpec("embed", GPT2Embed, source, prefix, tied_weight_attr=attrs)
        last = TiedLayerSpec("embed", GPT2Embed, source, prefix, forward_fn=TiedLogits(LogitTransform(config)),
                             tied_weight_attr=attrs)
    else:
        first, last = LayerSpec(GPT2Embed, source, prefix), LayerSpec(LMHead, source, "lm_head", LogitTransform(config))
    layers = [first] + [LayerSpec(GPT2BlockStage, source, b, config) for b in blocks]
    layers += [LayerSpec(FinalNorm, source, [f"{prefix}.ln_f"]), last]
    hf_names = [pre] + [[b] for b in blocks] + [[f"{prefix}.ln_f"], pre if tied else ["lm_head"]]
    counts = [sum(p.numel() for n in names for p in model.get_submodule(n).parameters()) for names in hf_names]
    kinds = ["embed"] + ["block"] * len(blocks) + ["norm", "head"]
    return PipelineSpec(layers=layers, loss_fn=causal_lm_loss, kinds=kinds, config=config, task="causal-lm",
                        tied={"embed": [0, len(layers) - 1]} if tied else {}, param_counts=counts, hf_names=hf_names)
