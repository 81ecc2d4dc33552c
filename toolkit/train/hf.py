"""Models and tokenizers for `dstk train`: a local HF directory, or a built-in architecture. A hub id
(org/name) reaches here as its snapshot folder in huggingface_hub's cache (toolkit.train.runner.local_inputs).

Built-in names are the one registry every command knows (toolkit.plan.arch: tiny-gpt2, gpt2,
llama-3.2-1b, ...). They give random weights from a fixed seed, so every rank (and every layout) starts from
the same model. Their tokenizer is a 256-byte tokenizer (+ one end-of-text token) built in code:
it needs no download and saves/loads like any HF tokenizer.
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


def build_model(model: str, config, task: str, seed: int, ds_config: dict | None = None):
    """Pretrained weights from a directory, or random ones from `seed` (the same on every rank).

    A directory's weights load in the dtype DeepSpeed gives the parameters under `ds_config` (param_dtype):
    bf16 under bf16, never a whole fp32 copy first (DeepSpeed's bf16/fp16 modes cast the module and keep
    fp32 masters themselves, made from those values); fp32 under an fp32 config, each tensor cast as it is
    read (transformers 5 would keep a bf16 checkpoint bf16, dtype="auto", and an optimizer stepping bf16
    weights loses every update below bf16's resolution). Buffers keep the dtype an fp32 build gives them.
    Random weights are drawn in fp32, the same at every ZeRO stage. ZeRO-3 (`ds_config` stage 3): a directory's
    model is built already partitioned (deepspeed.zero.Init; from_pretrained through HF's HfDeepSpeedConfig), so
    no rank ever holds it whole; a built-in is built whole, then partitioned (`partition`)."""
    import torch

    import models

    cls = models.auto_class(task)
    torch.manual_seed(seed)  # heads that a pretrained directory lacks get the same init everywhere
    attn = {"attn_implementation": config._attn_implementation}
    zero3 = ((ds_config or {}).get("zero_optimization") or {}).get("stage") == 3
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # an earlier ZeRO-3 model in this process must not make this one ZeRO-3
    dtype = param_dtype(ds_config) if Path(model).is_dir() else torch.float32
    with torch.device("meta"):  # the fp32 build's buffers (shapes and dtypes only); never under zero.Init
        reference = cls.from_config(config, dtype=torch.float32, **attn) if dtype != torch.float32 else None

    # ZeRO-3: transformers builds (and initialises, and loads) inside deepspeed.zero.Init while an
    # HfDeepSpeedConfig is alive (it holds it by weak reference; HF's docs ask to keep it for the
    # model's lifetime, so the model carries it). Without "tensor_parallel": transformers 5 refuses to load
    # any checkpoint whose keys it renames (integrations/deepspeed.py _apply_weight_conversions_to_state_dict:
    # "Weight conversions ... with DeepSpeed Tensor Parallelism are not yet implemented", llama included)
    # when the config names an autotp_size; AutoTP shards the loaded model later, in deepspeed.initialize.
    loading = {k: v for k, v in (ds_config or {}).items() if k != "tensor_parallel"}
    if Path(model).is_dir():  # transformers 5 initialises only what the checkpoint lacks
        zero3_config = HfDeepSpeedConfig(loading) if zero3 else None
        built = cls.from_pretrained(model, config=config, dtype=dtype, **attn)
        if reference is not None:
            fp32_buffers(built, reference)
    else:  # random: built whole, as at ZeRO 0-2 (under zero.Init HF draws other weights: another first loss)
        built = random_model(config, task, seed, dtype=torch.float32, **attn)
        zero3_config = HfDeepSpeedConfig(loading) if zero3 else None
        if zero3:
            partition(built, zero3_config.config)
    built.dstk_hf_deepspeed_config = zero3_config
    return built


def random_model(config, task: str = "causal-lm", seed: int = 0, cls=None, **kwargs):
    """The HF model of `config` with random weights drawn from `seed`: the one place dstk, its benchmarks
    and its tests build a model from a config. task: a models/ task (causal-lm, sequence-classification,
    ...) naming the class, unless `cls` is given; kwargs go to transformers' _from_config (dtype,
    attn_implementation). Weights as the class's constructor draws them, in train mode."""
    import torch

    import models

    cls = cls or models.auto_class(task, config)
    torch.manual_seed(seed)
    return cls._from_config(config, **kwargs)


def builtin_model(name: str, seed: int = 0, task: str = "causal-lm", **sizes):
    """Built-in `name` as `dstk train --model NAME` builds it (the byte tokenizer's vocabulary, random weights
    from `seed`); `sizes` override config fields (hidden_size, num_hidden_layers, ...; head_dim derived again)."""
    config = load_config(name, byte_tokenizer(), task)
    if sizes:
        fields = {k: v for k, v in config.to_dict().items() if k != "head_dim"}
        config = type(config)(**{**fields, **sizes}, attn_implementation=config._attn_implementation)
    return build_model(name, config, task, seed)


def partition(model, ds_config: dict) -> None:
    """Partition a built model's parameters as deepspeed.zero.Init would have built them: in the dtype
    DeepSpeed trains them in (param_dtype: the engine casts only models that were not built partitioned),
    each rank keeping its share. For the built-in models, whose random weights must not depend on the
    ZeRO stage; each rank holds the whole fp32 model for a moment (as at ZeRO 0-2)."""
    import deepspeed

    dtype = param_dtype(ds_config)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)


def param_dtype(ds_config: dict | None):
    """The dtype DeepSpeed casts a module's parameters to under `ds_config` (engine._mixed_precision_dtypes):
    fp16 or bf16 when that mode is enabled, read as DeepSpeed reads it (the old "bfloat16" key included),
    else fp32."""
    import torch

    if not ds_config:
        return torch.float32
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    if get_float16_config(ds_config).enabled:
        return torch.float16
    return torch.bfloat16 if get_bfloat16_config(ds_config).enabled else torch.float32


def fp32_buffers(model, reference) -> None:
    """Give `model`, loaded in 16 bits, the buffers of `reference` (the same model built in fp32 on the meta
    device). transformers builds under the load dtype as torch's default, so a buffer made from a Python
    float (gemma's embed_scale) comes out in 16 bits where the fp32 build keeps it fp32, and DeepSpeed
    casts parameters only. Such a buffer is recomputed by the model's own init on a copy of its module
    whose parameters stay on meta; a persistent one (read from the checkpoint) is cast back."""
    import copy

    import torch
    from transformers import initialization

    wanted = dict(reference.named_buffers())
    for name, buf in list(model.named_buffers()):
        if name not in wanted or buf.dtype == wanted[name].dtype:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr not in owner._non_persistent_buffers_set:
            owner._buffers[attr] = buf.to(wanted[name].dtype)
            continue
        fresh = copy.deepcopy(reference.get_submodule(owner_name))
        fresh._buffers[attr] = torch.empty_like(wanted[name], device=buf.device)
        with torch.no_grad(), initialization.guard_torch_init_functions():
            model._init_weights(fresh)  # its meta parameters take no memory and no values
        owner._buffers[attr] = fresh._buffers[attr]


def max_positions(config):
    """How many positions the model can embed, or None when it does not say."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None
