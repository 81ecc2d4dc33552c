"""Models and tokenizers for `dstk train`: a local HF directory, or a built-in architecture. A hub id
(org/name) reaches here as its snapshot folder in huggingface_hub's cache (toolkit.train.runner.local_inputs).

Built-in names are the one registry every command knows (toolkit.plan.arch: tiny-gpt2, gpt2,
llama-3.2-1b, ...). They give random weights from a fixed seed, so every rank (and every layout) starts from
the same model. Their tokenizer is a 256-byte tokenizer (+ one end-of-text token) built in code:
it needs no download and saves/loads like any HF tokenizer. The weights load in the run's dtype through
models.weights.loading.
"""

import json
from pathlib import Path

from toolkit.data.chat import check_template_syntax
from toolkit.errors import ConfigError

EOT = "<|endoftext|>"


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


def load_tokenizer(model: str, tokenizer: str | None = None, chat_template: str | None = None):
    """The tokenizer given, else the model directory's, else the byte tokenizer for built-ins; with the
    Jinja chat template read from the file `chat_template` when given (it is saved with the tokenizer)."""
    tok = _tokenizer(model, tokenizer)
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str) -> str:
    """The text of --chat-template FILE, refused clearly when it is not a readable file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read it ({type(exc).__name__}); pass a Jinja template "
                          "file") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path} is empty; pass a Jinja template file")
    check_template_syntax(text, path)
    return text


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")  # what transformers loads a tokenizer from (any one may be enough)


def check_tokenizer(model: str, tokenizer: str | None) -> None:
    """The tokenizer comes from a local folder that has one: --tokenizer DIR, else --model's directory.
    Said at once, with where dstk looked (transformers would go on to the hub, retrying for a minute)."""
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ConfigError(f"--tokenizer {tokenizer}: no such local directory; pass a folder with the tokenizer's "
                          "files, or a hub id (org/name) in the Hugging Face cache")
    source = tokenizer or (model if Path(model).is_dir() else None)
    if source is None:
        return
    flag = "--tokenizer" if tokenizer else "--model"
    if not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"no tokenizer found: {flag} {source} holds none of {', '.join(TOKENIZER_FILES)}; pass "
                          "--tokenizer DIR, a folder with the model's tokenizer (as save_pretrained writes it)")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the JSON ones, read as transformers would
        path = Path(source) / name
        try:
            content = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{flag} {source}: {name} is not JSON ({exc}); restore the tokenizer's files, or pass "
                              "--tokenizer DIR") from None
        if not isinstance(content, dict):
            raise ConfigError(f"{flag} {source}: {name} is a JSON {type(content).__name__}, not a tokenizer's "
                              "(an object); restore the tokenizer's files, or pass --tokenizer DIR")


def _tokenizer(model: str, tokenizer: str | None):
    from transformers import AutoTokenizer

    check_tokenizer(model, tokenizer)
    source = tokenizer or (model if Path(model).is_dir() else None)
    if source is None:
        return byte_tokenizer()
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {source!r} ({exc}); pass --tokenizer DIR") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token  # GPT-2 style tokenizers ship without a pad token
    return tok


def load_config(model: str, tokenizer, task: str, attention: str = "sdpa"):
    """The HF config of a model directory or a built-in name, checked against the task, with the
    attention kernel (the same at every pp: the wrappers are exact under eager and sdpa). A
    classifier's num_labels is the caller's to set: it comes from the data."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model) if Path(model).is_dir() else builtin_config(model, tokenizer)
    if task == "causal-lm" and getattr(config, "model_type", "") == "bert":
        raise ConfigError(f"--model {model}: {config.model_type} is an encoder (every token attends to the whole "
                          "row), so --task causal-lm would train it to copy the next token it can already see; "
                          "use --task classification, or a decoder model (gpt2, llama, ...)")
    config._attn_implementation = attention
    return config


def check_model_name(model: str) -> None:
    """--model is a local directory with a config.json (a hub id's snapshot folder included), or a built-in
    name; else a clear refusal. A directory's config.json and safetensors headers are read
    (models.weights.source.check_directory)."""
    from toolkit.plan.arch import builtin_names, is_builtin

    path = Path(model)
    if path.is_dir():
        from models.weights.source import check_directory, check_model_folder

        check_model_folder(path)
        check_directory(path)
    if not path.is_dir() and not is_builtin(model):
        raise ConfigError(f"--model {model!r} is neither a local HF directory nor a built-in architecture "
                          f"({builtin_names()}), nor a hub id (org/name)")


def check_attention(attention: str) -> None:
    """flash_attention_2 needs CUDA and the flash-attn package; say so before anything is built."""
    if attention != "flash_attention_2":
        return
    import importlib.util

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("--attention flash_attention_2 needs a CUDA GPU and the flash-attn package "
                          f"(CUDA {'available' if torch.cuda.is_available() else 'not available'}, flash-attn "
                          f"{'installed' if importlib.util.find_spec('flash_attn') else 'not installed'}); "
                          "use --attention sdpa (PyTorch's fused kernels)")


ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}  # transformers' own


def check_model_class(model: str, config, task: str) -> None:
    """What the model's class needs, before the data or a weight is read (the class is known only once
    transformers is imported: on the ranks): the attention kernel of `config` (--attention) among those it
    implements (gpt_oss: no sdpa, its attention sinks), and a directory's safetensors holding every tensor of
    its body (models.weights.source.check_complete: an expert's tensor missing is named as the files name it)."""
    import torch

    import models
    from models.weights.source import check_complete

    cls = models.auto_class(task, config)
    attention = config._attn_implementation
    if not getattr(cls, ATTENTION_FLAGS.get(attention, ""), True):
        raise ConfigError(f"--attention {attention}: transformers' {cls.__name__} has no {attention} attention "
                          f"({ATTENTION_FLAGS[attention]} is False); pass --attention eager")
    if Path(model).is_dir():
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # a plain skeleton: an earlier ZeRO-3 model in this process would make it one
        with torch.device("meta"):  # names and shapes only
            check_complete(model, cls._from_config(config, dtype=torch.float32))


def builtin_config(name: str, tokenizer):
    """A name from the one model registry (toolkit.plan.arch: what `dstk partition`, `plan` and `parity`
    mean by it) with the tokenizer's vocabulary and dropout off (runs are deterministic and every
    layout computes the same loss); weights are random."""
    from dataclasses import replace

    from toolkit.plan.arch import load_arch, to_hf_config

    check_model_name(name)
    config = no_dropout(to_hf_config(replace(load_arch(name), vocab=len(tokenizer))))
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    return config


def no_dropout(config):
    """Set every dropout probability in `config` to 0 (in place): dropout makes runs differ."""
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    return config


def check_tensor_parallel(config, tp: int, custom_plan: bool = False) -> None:
    """What DeepSpeed's AutoTP needs to shard this model over `tp` ranks (toolkit.plan.tp.shard_problems,
    the rule `dstk validate --model` applies too): a sharding plan (the HF config's base_model_tp_plan, or
    the config's "preset_model" / "partition_config"), and heads, key/value heads and the MLP's width that
    divide by tp. Every problem in one message."""
    from toolkit.plan.tp import shard_problems

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {k: getattr(text, k, None) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    problems = shard_problems(config.model_type, config.model_type, bool(getattr(text, "base_model_tp_plan", None)),
                              tp, custom_plan, sizes)
    if problems:
        raise ConfigError(f"tensor_parallel.autotp_size {tp}: " + "; ".join(problems))


def builtin_model(name: str, seed: int = 0, task: str = "causal-lm", **sizes):
    """Built-in `name` as `dstk train --model NAME` builds it (the byte tokenizer's vocabulary, random weights
    from `seed`); `sizes` override config fields (hidden_size, num_hidden_layers, ...; head_dim derived again)."""
    from models.weights.loading import build_model

    config = load_config(name, byte_tokenizer(), task)
    if sizes:
        fields = {k: v for k, v in config.to_dict().items() if k != "head_dim"}
        config = type(config)(**{**fields, **sizes}, attn_implementation=config._attn_implementation)
    return build_model(name, config, task, seed)


def max_positions(config):
    """How many positions the model can embed, or None when it does not say."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None
