"""Hand-written schema for `optimizer` and `scheduler`: their types and the params of each type.

DeepSpeed passes `params` as keyword arguments to the optimizer / scheduler class, so a typo only
fails at `deepspeed.initialize` (or never, for keys DeepSpeed pops itself). The key sets below are
the union of the classes DeepSpeed may pick for a type (runtime/engine.py
`_configure_basic_optimizer`: FusedAdam, DeepSpeedCPUAdam or torch.optim.Adam(W) for Adam/AdamW;
FusedLamb; FusedLion / DeepSpeedCPULion; torch.optim.Adagrad / DeepSpeedCPUAdagrad) and
runtime/lr_schedules.py. Used by `build`.
"""

from toolkit.config.schema.parts import betas, count, flag, prop, real, section

LR = real("Learning rate.", 1e-3, auto=True, minimum=0)
EPS = real("Term added to the denominator for numerical stability.", 1e-8, auto=True, exclusiveMinimum=0)
WEIGHT_DECAY = real("Weight decay (L2 penalty, decoupled in AdamW mode).", 0.0, auto=True, minimum=0)
TORCH_FLAGS = {  # torch.optim implementation switches
    "foreach": prop(["boolean", "null"], "torch: use the foreach implementation (null: auto).", None),
    "maximize": flag("torch: maximise the objective instead of minimising."),
    "capturable": flag("torch: allow CUDA graph capture."),
    "differentiable": flag("torch: let autograd go through the optimizer step."),
    "fused": prop(["boolean", "null"], "torch: use the fused implementation.", None),
}


def _torch_flags(without: str) -> dict:
    return {k: v for k, v in TORCH_FLAGS.items() if k != without}


def adam_params() -> dict:
    return {
        "lr": LR, "betas": betas("Adam (beta1, beta2).", auto=True), "eps": EPS, "weight_decay": WEIGHT_DECAY,
        "bias_correction": flag("Apply Adam bias correction.", True),
        "amsgrad": flag("AMSGrad variant (not supported by FusedAdam)."),
        "adam_w_mode": flag("Decoupled weight decay (AdamW). Type Adam uses it too unless set false.", True),
        "torch_adam": flag("Use torch.optim.Adam/AdamW instead of FusedAdam (no JIT build: use on CPU)."),
        "fp32_optimizer_states": flag("DeepSpeedCPUAdam: keep moments in fp32.", True),
        "set_grad_none": flag("FusedAdam: set gradients to None on zero_grad.", True),
        "decoupled_weight_decay": flag("torch.optim.Adam: decoupled weight decay."),
        **TORCH_FLAGS,
    }


def lamb_params() -> dict:
    return {
        "lr": LR, "betas": betas("Lamb (beta1, beta2).", auto=True), "eps": EPS, "weight_decay": WEIGHT_DECAY,
        "bias_correction": flag("Apply bias correction.", True),
        "eps_inside_sqrt": flag("Add eps inside the square root."),
        "max_coeff": real("Upper bound of the trust ratio.", 10.0, minimum=0),
        "min_coeff": real("Lower bound of the trust ratio.", 0.01, minimum=0),
        "amsgrad": flag("Not supported by FusedLamb; must stay false."),
    }


def lion_params() -> dict:
    return {
        "lr": LR, "betas": betas("Lion (beta1, beta2).", (0.9, 0.99), auto=True), "weight_decay": WEIGHT_DECAY,
        "set_grad_none": flag("Set gradients to None on zero_grad.", True),
        "fp32_optimizer_states": flag("DeepSpeedCPULion: keep moments in fp32.", True),
    }


def adagrad_params() -> dict:
    return {
        "lr": LR, "eps": real("Stability term.", 1e-10, auto=True, exclusiveMinimum=0), "weight_decay": WEIGHT_DECAY,
        "lr_decay": real("torch: learning-rate decay.", 0.0, minimum=0),
        "initial_accumulator_value": real("torch: starting value of the accumulators.", 0.0, minimum=0),
        "amsgrad": flag("DeepSpeedCPUAdagrad: AMSGrad variant."),
        "fp32_optimizer_states": flag("DeepSpeedCPUAdagrad: keep state in fp32.", True),
        **_torch_flags(without="capturable"),
    }


def sgd_params() -> dict:
    return {
        "lr": LR, "weight_decay": WEIGHT_DECAY,
        "momentum": real("Momentum factor.", 0.0, minimum=0),
        "dampening": real("Dampening for momentum.", 0.0, minimum=0),
        "nesterov": flag("Nesterov momentum."),
        **_torch_flags(without="capturable"),
    }


# type names -> params. DeepSpeed lower-cases the names of its own optimizers (any case works);
# any other name goes to getattr(torch.optim, type) and is case-sensitive.
OPTIMIZERS = {
    "adam_params": (["Adam", "AdamW"], adam_params),
    "lamb_params": (["Lamb"], lamb_params),
    "lion_params": (["Lion"], lion_params),
    "adagrad_params": (["Adagrad"], adagrad_params),
    "sgd_params": (["SGD"], sgd_params),
}
# runtime/config.py DEEPSPEED_OPTIMIZERS, spelt as the docs spell them (checked at build time).
DEEPSPEED_NAMES = ["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "Muon", "MuAdam", "MuAdamW", "MuSGD"]
# Classes DeepSpeed resolves by name but that cannot work from a JSON config: refused, with the reason.
TORCH_OPTIMIZERS_REFUSED = {
    "Optimizer": "the abstract base class of torch.optim, not an optimizer",
    "LBFGS": "DeepSpeed builds it but calls step() without the closure LBFGS needs, so the first step fails",
}
TORCH_SCHEDULERS_REFUSED = {
    "LRScheduler": "the abstract base class of torch.optim.lr_scheduler, not a schedule",
    "LambdaLR": "it needs lr_lambda, a Python function that a JSON config cannot hold",
    "MultiplicativeLR": "it needs lr_lambda, a Python function that a JSON config cannot hold",
    "SequentialLR": "it needs scheduler objects, which a JSON config cannot hold",
    "ChainedScheduler": "it needs scheduler objects, which a JSON config cannot hold",
}
TYPE_NAME = {"type": ["string", "null"]}  # null: DeepSpeed builds nothing from the section (its default)


def torch_optimizer_names() -> list:
    """torch.optim classes that `getattr(torch.optim, type)` in runtime/engine.py
    _configure_basic_optimizer reaches: not DeepSpeed's own names (those match in any case first)."""
    import inspect

    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    if sorted(n.lower() for n in DEEPSPEED_NAMES) != sorted(DEEPSPEED_OPTIMIZERS):
        raise RuntimeError(f"DeepSpeed's optimizer names changed: {DEEPSPEED_OPTIMIZERS}; update DEEPSPEED_NAMES")
    return sorted(n for n, c in vars(torch.optim).items() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                  and not n.startswith("_") and n.lower() not in DEEPSPEED_OPTIMIZERS)


def scheduler_names() -> tuple[list, list]:
    """(DeepSpeed's schedulers, torch's) as runtime/engine.py _scheduler_from_config resolves a type:
    an attribute of runtime/lr_schedules.py first, else of torch.optim.lr_scheduler; case-sensitive."""
    import inspect

    from deepspeed.runtime import lr_schedules
    from torch.optim import lr_scheduler

    bases = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)
    torch_names = sorted(n for n, c in vars(lr_scheduler).items() if inspect.isclass(c) and issubclass(c, bases)
                         and not n.startswith("_") and not hasattr(lr_schedules, n))
    return list(lr_schedules.VALID_LR_SCHEDULES), torch_names


def _name_pattern(names: list) -> str:
    """Regex matching `names`, DeepSpeed's own in any case: "Adam" -> "[Aa][Dd][Aa][Mm]".
    Character classes rather than a (?i) flag, so editors' ECMA-262 regexes understand it too."""
    def one(name):
        if name not in DEEPSPEED_NAMES:
            return name
        return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in name)

    return "^(" + "|".join(one(n) for n in names) + ")$"


def _type_key(names: list, refused: dict, description: str, case_note: str) -> dict:
    """The "type" key: one of `names` (explain.py turns a miss into did-you-mean), or null."""
    return {**TYPE_NAME, "pattern": _name_pattern(names), "examples": names, "description": description,
            "default": None, "x-refused": refused, "x-case-note": case_note}


def optimizer() -> tuple[dict, dict]:
    """The `optimizer` section and the `$defs` it refers to (one closed params object per type).
    `params` may be null: DeepSpeed reads `optimizer_params() or {}`."""
    defs, rules = {}, []
    for def_name, (types, params) in OPTIMIZERS.items():
        defs[def_name] = section(f"params of optimizer type {'/'.join(types)}.", params(), default=None)
        rules.append(_if_type(_name_pattern(types), def_name))
    torch_names = torch_optimizer_names()
    names = DEEPSPEED_NAMES + [n for n in torch_names if n not in TORCH_OPTIMIZERS_REFUSED]
    refused = {n: why for n, why in TORCH_OPTIMIZERS_REFUSED.items() if n in torch_names}
    body = section("Optimizer DeepSpeed builds (omit it when the script passes its own optimizer).", {
        "type": _type_key(names, refused, "Optimizer class: one of DeepSpeed's (Adam, AdamW, Lamb, Lion, Adagrad, "
                          "Muon, ...; any case) or a torch.optim class name (case-sensitive). null: no optimizer "
                          "from the config.", "torch.optim names are case-sensitive"),
        "params": {"type": ["object", "null"], "description": "Keyword arguments of the optimizer class (null: "
                   "none).", "default": None},
        "legacy_fusion": flag("Legacy fused fp16 optimizer path."),
    }, required=["type"], allOf=rules)
    return body, defs


def _if_type(pattern: str, def_name: str) -> dict:
    """params must fit `def_name` when "type" is a string matching `pattern` (not when it is null)."""
    return {"if": {"properties": {"type": {"type": "string", "pattern": pattern}}, "required": ["type"]},
            "then": {"properties": {"params": {"$ref": f"#/$defs/{def_name}"}}}}


def _warmup(total: bool) -> dict:
    out = {
        "warmup_min_lr": real("Learning rate at the start of warm-up.", 0.0, auto=True, minimum=0),
        "warmup_max_lr": real("Learning rate at the end of warm-up.", 0.001, auto=True, minimum=0),
        "warmup_num_steps": count("Warm-up steps (> 0).", 1000, minimum=1, auto=True),
        "warmup_type": prop("string", "Warm-up curve.", "log", enum=["log", "linear"]),
        "last_batch_iteration": prop("integer", "Index of the last batch (-1: start fresh).", -1, minimum=-1),
    }
    if total:
        out["total_num_steps"] = count("Total training steps (decay ends here).", minimum=1, auto=True)
    return out


def _cosine() -> dict:
    return {
        "total_num_steps": count("Total training steps.", minimum=1, auto=True),
        "warmup_min_ratio": real("Warm-up start as a fraction of the optimizer lr.", 0.0, minimum=0, maximum=1),
        "warmup_num_steps": count("Warm-up steps (> 0).", 1000, minimum=1, auto=True),
        "cos_min_ratio": real("Final lr as a fraction of the optimizer lr.", 0.0001, minimum=0, maximum=1),
        "warmup_type": prop("string", "Warm-up curve.", "log", enum=["log", "linear"]),
        "last_batch_iteration": prop("integer", "Index of the last batch (-1: start fresh).", -1, minimum=-1),
    }


def _one_cycle() -> dict:
    steps = {k: prop(["integer", "null"], d, None, minimum=0) for k, d in [
        ("cycle_second_step_size", "Steps of the decreasing half (null: same as the first)."),
        ("cycle_second_stair_count", "Stairs in the decreasing half (null: same as the first).")]}
    return {
        "cycle_min_lr": real("Lowest lr of the cycle.", minimum=0),
        "cycle_max_lr": real("Highest lr of the cycle.", minimum=0),
        "decay_lr_rate": real("lr decay rate after the cycle.", 0.0, minimum=0),
        "cycle_first_step_size": count("Steps of the increasing half.", 2000, minimum=1),
        "cycle_first_stair_count": count("Stairs in the increasing half.", 0), **steps,
        "decay_step_size": count("Decay interval after the cycle.", 0),
        "cycle_momentum": flag("Cycle momentum inversely to lr.", True),
        "cycle_min_mom": real("Lowest momentum.", 0.8, minimum=0),
        "cycle_max_mom": real("Highest momentum.", 0.9, minimum=0),
        "decay_mom_rate": real("Momentum decay after the cycle.", 0.0, minimum=0),
        "last_batch_iteration": prop("integer", "Index of the last batch (-1: start fresh).", -1, minimum=-1),
    }


def _range_test() -> dict:
    return {
        "lr_range_test_min_lr": real("Starting lr.", 1e-3, minimum=0),
        "lr_range_test_step_size": count("Steps between lr increases.", 2000, minimum=1),
        "lr_range_test_step_rate": real("lr increase rate.", 1.0, minimum=0),
        "lr_range_test_staircase": flag("Increase in stairs instead of continuously."),
        "last_batch_iteration": prop("integer", "Index of the last batch (-1: start fresh).", -1, minimum=-1),
    }


SCHEDULERS = {
    "WarmupLR": lambda: _warmup(total=False), "WarmupDecayLR": lambda: _warmup(total=True),
    "WarmupCosineLR": _cosine, "OneCycle": _one_cycle, "LRRangeTest": _range_test,
}
REQUIRED_SCHEDULER_PARAMS = {"WarmupDecayLR": ["total_num_steps"], "WarmupCosineLR": ["total_num_steps"],
                             "OneCycle": ["cycle_min_lr", "cycle_max_lr"]}


def scheduler() -> tuple[dict, dict]:
    """The `scheduler` section and its `$defs`; torch.optim.lr_scheduler names keep open params."""
    defs, rules = {}, []
    for name, params in SCHEDULERS.items():
        def_name = f"{name}_params"
        defs[def_name] = section(f"params of scheduler {name} (runtime/lr_schedules.py).", params(),
                                 required=REQUIRED_SCHEDULER_PARAMS.get(name, []))
        rules.append(_if_type(f"^{name}$", def_name))
    ours, torch_names = scheduler_names()
    names = ours + [n for n in torch_names if n not in TORCH_SCHEDULERS_REFUSED]
    refused = {n: why for n, why in TORCH_SCHEDULERS_REFUSED.items() if n in torch_names}
    body = section("Learning-rate scheduler DeepSpeed builds from runtime/lr_schedules.py or "
                   "torch.optim.lr_scheduler.", {
                       "type": _type_key(names, refused, "Scheduler class name (case-sensitive): " + ", ".join(ours)
                                         + ", or a torch.optim.lr_scheduler class. null: no scheduler from the "
                                         "config.", "scheduler names are case-sensitive"),
                       "params": {"type": "object", "description": "Keyword arguments of the scheduler.",
                                  "default": {}},
                   }, required=["type"], allOf=rules)
    return body, defs
