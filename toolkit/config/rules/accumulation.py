"""The dtype gradients accumulate in (`data_types.grad_accum_dtype`) against the weights' dtype and the
ZeRO stage, as DeepSpeed 0.19 decides it (runtime/engine.py `_do_optimizer_sanity_check`):

  stage 0      accumulates in the weights' dtype only: any other "grad_accum_dtype" raises NotImplementedError
               at deepspeed.initialize (an ERROR here); bf16 then sums the micro-batches' gradients in bf16
  stages 1-3   any dtype; bf16 weights with "fp32" is BF16_Optimizer at stage 1 (no offload), which refuses
               "compute_grad_norm": false (ValueError)

bf16 without fp32 accumulation is a WARNING: each micro-batch's gradient is rounded to 8 significant bits
as it is added. `dstk generate-config --bf16` writes ZeRO-1 with "grad_accum_dtype": "fp32".

    >>> [p.severity for p in accumulation_problems({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})]
    ['error']
"""

from toolkit.config.problems import WARNING, Problem
from toolkit.config.rules.zero_stages import zero_stage

KEY = "$.data_types.grad_accum_dtype"
FIX = '"zero_optimization": {"stage": 1} with "data_types": {"grad_accum_dtype": "fp32"}'


def weights_dtype(cfg: dict) -> str | None:
    """bf16, fp16 or fp32 as DeepSpeed trains the weights; None when a switch is "auto" or not a bool."""
    bf16 = cfg.get("bf16") if "bf16" in cfg else cfg.get("bfloat16")  # "bfloat16": the legacy name, read without "bf16"
    switches = [(name, (section or {}).get("enabled", False) if isinstance(section, dict) else False)
                for name, section in (("bf16", bf16), ("fp16", cfg.get("fp16")))]
    if any(not isinstance(on, bool) for _, on in switches):
        return None
    return next((name for name, on in switches if on), "fp32")


def accumulation_problems(cfg: dict, ctx=None) -> list[Problem]:
    """ERROR where DeepSpeed refuses the accumulation dtype at this stage; WARNING where bf16 accumulates in bf16."""
    stage, said = zero_stage(cfg)
    weights = weights_dtype(cfg)
    types = cfg.get("data_types") if isinstance(cfg.get("data_types"), dict) else {}
    accum = types.get("grad_accum_dtype")
    if stage is None or weights is None or accum not in (None, "fp32", "fp16", "bf16"):
        return []  # unknown, or a wrong value the schema reports
    if stage == 0 and accum not in (None, weights):
        return [Problem(KEY, f'"grad_accum_dtype" "{accum}" with {weights} weights, but {said}: DeepSpeed accumulates '
                        f"in the weights' dtype only at stage 0 (NotImplementedError at deepspeed.initialize); set "
                        f'"zero_optimization": {{"stage": 1}} (or 2, 3), or remove "grad_accum_dtype"')]
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    offload = (zero.get("offload_optimizer") or {}) if isinstance(zero.get("offload_optimizer"), dict) else {}
    if (stage == 1 and weights == "bf16" and accum == "fp32" and zero.get("compute_grad_norm") is False
            and offload.get("device") in (None, "none")):
        return [Problem("$.zero_optimization.compute_grad_norm", '"compute_grad_norm": false with bf16 weights, '
                        '"grad_accum_dtype" "fp32" and "stage" 1: DeepSpeed\'s BF16_Optimizer refuses it (ValueError); '
                        'remove "compute_grad_norm"')]
    if weights == "bf16" and accum in (None, "bf16") and stage == 0:
        return [Problem(KEY, f"bf16 weights and {said}: the micro-batches' gradients are summed in bf16 (8 significant "
                        'bits), and DeepSpeed takes "grad_accum_dtype" "fp32" only at stages 1-3; use ' + FIX, WARNING)]
    if weights == "bf16" and accum in (None, "bf16"):
        setting = '"grad_accum_dtype" "bf16"' if accum else 'no "grad_accum_dtype"'
        return [Problem(KEY, f"bf16 weights with {setting}: the micro-batches' gradients are summed in bf16 (8 "
                        'significant bits); add "data_types": {"grad_accum_dtype": "fp32"}', WARNING)]
    return []


__all__ = ["accumulation_problems", "weights_dtype"]
