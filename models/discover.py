"""The decoder structure of a causal LM whose config has no `base_model_pp_plan` naming 'layers', read from its module
tree when it is unambiguous, else a ConfigError saying what is not standard.

Standard: a base model (the module holding the token embedding) whose children are exactly the token
embedding, dropout, ONE nn.ModuleList of the config's num_hidden_layers decoder layers, final norm(s)
after it and a rotary-embedding module; decoder layers that take `hidden_states` first and nothing
else but what dstk's DecoderBlock builds per stage (attention mask, positions, rotary cos/sin, cache
flags). Anything else the base model holds (learned/sinusoidal position tables, ALiBi, vision towers,
embedding containers) or passes to its layers (alibi, block states, router states, cross attention) is
computed outside the layers: the generic wrapper would compute something else, so it is refused. So are
layers holding a causal convolution (state-space / short-conv mixers: their state runs along the whole
sequence, so packed documents would see each other, and they take a 2-D padding mask, not an attention
mask). What passes these checks is proven per model type by bench/arch_sweep.py.
"""

import inspect
import re

from torch import nn

from toolkit.errors import ConfigError

# what DecoderBlock passes (or a layer may take and leave at its default in training); cache_params: the cache's
# name in state-space layers before transformers 5.24 (which calls it cache)
LAYER_INPUTS = {"hidden_states", "attention_mask", "position_ids", "position_embeddings", "cache", "past_key_values",
                "past_key_value", "layer_past", "cache_params", "use_cache", "cache_position", "output_attentions",
                "output_router_logits", "kwargs"}


def decoder_structure(model, config) -> tuple:
    """(pre-layer names, block names, post-layer names, head name, rotary name), as generic._module_names."""
    def refuse(why):
        return ConfigError(f"model_type {config.model_type!r} has no base_model_pp_plan with 'layers' and dstk cannot "
                           f"read its decoder structure: {why}")

    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()
    base_name = names.get(id(embed), "").rpartition(".")[0]
    if not base_name:
        raise refuse("its token embedding is not inside a base model")
    base = model.get_submodule(base_name)
    children = list(base.named_children())
    layers = [i for i, (_, c) in enumerate(children) if isinstance(c, nn.ModuleList)]
    wanted = getattr(config.get_text_config(), "num_hidden_layers", None)
    if len(layers) != 1 or len(children[layers[0]][1]) != wanted:
        found = ", ".join(f"{children[i][0]} ({len(children[i][1])})" for i in layers) or "none"
        raise refuse(f"{type(base).__name__} should hold one list of its {wanted} decoder layers; its lists: {found}")
    cut = layers[0]
    pre, post, rotary, other = [], [], None, []
    for i, (name, child) in enumerate(children):
        full = f"{base_name}.{name}"
        if i == cut:
            continue
        if child is embed and i < cut:
            pre.append(full)
        elif "Rotary" in type(child).__name__ and rotary is None:
            rotary = full
        elif isinstance(child, nn.Dropout):
            (pre if i < cut else post).append(full)
        elif i > cut and "norm" in type(child).__name__.lower():
            post.append(full)
        else:
            other.append(f"{name} ({type(child).__name__})")
    if other or not pre or pre[0] != names[id(embed)]:
        raise refuse(f"{type(base).__name__} also holds {', '.join(other) or 'modules before its embedding'}, "
                     "which its forward applies outside the decoder layers")
    _check_call_order(base, [n.rpartition(".")[2] for n in pre], children[cut][0],
                      [n.rpartition(".")[2] for n in post], refuse)
    block_list = children[cut][1]
    for layer in block_list:
        _check_layer(layer, rotary is not None, refuse)
    blocks = [f"{base_name}.{children[cut][0]}.{i}" for i in range(len(block_list))]
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    _check_covered(model, pre + blocks + post + [head] + ([rotary] if rotary else []), refuse)
    return pre, blocks, post, head, rotary


def _check_call_order(base, pre, layers, post, refuse) -> None:
    """The base forward's source calls the modules before the layers before its layer loop and the final
    norm(s) after it, each once (nanochat also norms before the layers, with the same module)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):  # no source (compiled, dynamic): the structure alone decides
        return
    calls = [(m.start(), m.group(1)) for m in re.finditer(r"self\.(\w+)\s*[(\[]", source)]
    loops = [at for at, name in calls if name == layers]
    if not loops:
        return
    if len(loops) > 1:  # dory: input layers, recurrent layers looped with norms between, output layers
        raise refuse(f"{type(base).__name__}.forward runs its decoder layers in {len(loops)} separate loops (with "
                     "work between them), not once in order, which dstk's wrapper does not reproduce")
    for at, name in calls:
        if (name in pre and at > loops[0]) or (name in post and at < loops[0]):
            raise refuse(f"{type(base).__name__}.forward applies {name} {'after' if name in pre else 'before'} "
                         f"its decoder layers too, which dstk's wrapper does not repeat")


def _check_covered(model, names, refuse) -> None:
    """Every parameter of the model belongs to a module the pipeline holds: nothing (a vision or audio
    tower, a projector) would be left out of training and export."""
    def held(prefix):
        return any(m == prefix or m.startswith(prefix + ".") or prefix.startswith(m + ".") for m in names)

    left = set()
    for name, _ in model.named_parameters():
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if not any(p in names for p in prefixes):
            left.add(next(p for p in prefixes if not held(p)))
    if left:
        raise refuse(f"{type(model).__name__} has parameters outside its text decoder ({', '.join(sorted(left)[:4])}): "
                     "dstk trains and exports the decoder alone, which would leave them out")


def _check_layer(layer, has_rotary: bool, refuse) -> None:
    params = inspect.signature(layer.forward).parameters
    cls = type(layer).__name__
    extra = [p for p in params if p not in LAYER_INPUTS]
    if next(iter(params), None) != "hidden_states" or extra:
        raise refuse(f"{cls}.forward takes {extra or list(params)[:1]}: inputs its base model builds outside the "
                     "layers, which dstk's wrapper does not build or send between stages")
    if has_rotary and "position_embeddings" not in params:
        raise refuse(f"{cls}.forward takes no position_embeddings although the base model has a rotary module")
    conv = next((type(m).__name__ for m in layer.modules() if any(isinstance(c, nn.Conv1d) for c in m.children())),
                None)
    if conv:
        raise refuse(f"{cls} holds a causal convolution ({conv}: a state-space or short-conv mixer): its state runs "
                     "along the whole sequence, so packed documents would see each other, and it takes a 2-D "
                     "padding mask, not the attention masks dstk builds")
