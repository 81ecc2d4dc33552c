"""Models and tokenizers for `dstk train`: a local HF directory, or a built-in tiny architecture.

Built-in names give random weights from a fixed seed, so every rank (and every layout) starts from
the same model. Their tokenizer is a 256-byte tokenizer (+ one end-of-text token) built in code:
it needs no download and saves/loads like any HF tokenizer.
"""

from pathlib import Path

from toolkit.errors import ConfigError

EOT = "<|endoftext|>"
# `dstk train --task` -> the models/ task whose head (and Auto class) it trains.
MODEL_TASKS = {"causal-lm": "causal-lm", "classification": "sequence-classification"}
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, attention_dropout=0.0)

# name -> (model_type, config kwargs). vocab_size is set from the tokenizer. Dropout is off so
# runs are deterministic and every layout computes the same loss.
BUILTIN = {
    "tiny-gpt2": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, n_positions=256)),
    "small-gpt2": ("gpt2", dict(n_embd=128, n_layer=6, n_head=4, n_positions=512)),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "tiny-bert": ("bert", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, max_position_embeddings=256)),
}


def byte_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes, 256 is end-of-text (also used as padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_chars().items()}  # id == byte value
    vocab[EOT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT)


def _byte_chars() -> dict:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer emits."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


def load_tokenizer(model: str, tokenizer: str | None = None):
    """The tokenizer given, else the model directory's, else the byte tokenizer for built-ins."""
    from transformers import AutoTokenizer

    source = tokenizer or (model if Path(model).is_dir() else None)
    if source is None:
        return byte_tokenizer()
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {source!r} ({exc}); pass --tokenizer DIR") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token  # GPT-2 style tokenizers ship without a pad token
    return tok


def load_config(model: str, tokenizer, task: str, num_labels: int = 2):
    """The HF config of a model directory or a built-in name, set up for the task."""
    from transformers import AutoConfig

    if Path(model).is_dir():
        config = AutoConfig.from_pretrained(model)
    elif model in BUILTIN:
        model_type, kwargs = BUILTIN[model]
        config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **kwargs, **_dropout_keys(model_type))
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    else:
        raise ConfigError(f"--model {model!r} is neither a directory nor a built-in architecture "
                          f"({', '.join(BUILTIN)})")
    if task == "classification":
        config.num_labels = num_labels
    config._attn_implementation = "eager"  # explicit: a config built in code has none set
    return config


def _dropout_keys(model_type: str) -> dict:
    from transformers import AutoConfig

    known = AutoConfig.for_model(model_type).to_dict()
    return {k: v for k, v in NO_DROPOUT.items() if k in known}


def build_model(model: str, config, task: str, seed: int):
    """Pretrained weights from a directory, or random ones from `seed` (the same on every rank)."""
    import torch

    import models

    cls = models.auto_class(MODEL_TASKS[task])
    torch.manual_seed(seed)  # heads that a pretrained directory lacks get the same init everywhere
    if Path(model).is_dir():
        return cls.from_pretrained(model, config=config)
    return cls.from_config(config)


def max_positions(config):
    """How many positions the model can embed, or None when it does not say."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None
