"""Rules for expert parallelism ("expert_parallel": {"enabled": true, "autoep_size": N}, DeepSpeed 0.19.8's AutoEP),
for a config alone (`expert_parallel_problems`, run by rules.check_rules) and for a config with its model
(`model_problems`, run by `dstk validate --model`).

AutoEP replaces each MoE block of a HF model with an AutoEPMoELayer holding E / ep of its experts; the tokens
travel to their experts by all-to-all inside groups of ep consecutive ranks of a pipeline stage. What DeepSpeed
refuses, and where (paths in site-packages/deepspeed/, all at deepspeed.initialize, on every rank):
- ep * expert_tensor_parallel_size must divide the ranks of a stage, world / pp (module_inject/
  auto_ep_folding.py:110-115); expert_tensor_parallel_size other than 1 is refused (:214-217).
- With AutoTP (tensor_parallel.autotp_size > 1, "folding"): ep must be > 1 (:240-242), pp 1 (:206-208), no
  Ulysses sp (:210-212), no ZeRO offload (:248-250), no async_split_plan (auto_ep_config.py:133).
- With ZeRO-3: no sequence parallelism, no zero_quantized_gradients, no zero_hpz_partition_size > 1
  (runtime/engine.py:2219-2227).
- load_balance_coeff must be null or absent (auto_ep_presets/base.py:19-23); preset_model one of the presets
  (auto_ep_config.py:176).
- Once the model is known: every MoE block's expert count must divide by ep (auto_ep_config.py:369-383).
ZeRO 0-2, ZeRO-3 and ZeRO offload without tp are allowed. A section without "enabled": true is ignored.
"""

from toolkit.config.problems import Problem, WARNING

EP = "$.expert_parallel.autoep_size"
# DeepSpeed's AutoEP presets -> the HF model_type values each matches (auto_ep_presets/*.py hf_model_types);
# tests/unit/test_ep_rules.py holds this table to DeepSpeed's registry
PRESETS = {"mixtral": ("mixtral",), "qwen3_moe": ("qwen3_moe", "qwen2_moe"), "qwen3_5_moe": ("qwen3_5_moe_text",),
           "deepseek_v2": ("deepseek_v2",), "deepseek_v3": ("deepseek_v3",), "minimax_m3": ("minimax_m3_vl_text",)}


def _section(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    return value if isinstance(value, dict) else {}


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def expert_parallel_section(ep: int, preset: str | None = None) -> dict:
    """The section `dstk generate-config --ep N [--ep-preset NAME]` writes: at deepspeed.initialize each MoE block
    becomes an AutoEPMoELayer holding experts / ep of its experts (auto_ep_config.py parse_autoep_config)."""
    return {"enabled": True, "autoep_size": ep, **({"preset_model": preset} if preset else {})}


def expert_parallel_problems(cfg: dict, ctx) -> list[Problem]:
    """Problems of a config's "expert_parallel" section (rules.Context: world_size, pp, tp, sp)."""
    section = _section(cfg, "expert_parallel")
    if section.get("enabled") is not True:
        size = section.get("autoep_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            return [Problem("$.expert_parallel.enabled", f'"autoep_size" {size} without "enabled": true: DeepSpeed '
                            'ignores the section and every rank holds every expert; add "enabled": true', WARNING)]
        return []
    ep, etp = section.get("autoep_size", 1), section.get("expert_tensor_parallel_size", 1)
    for key, value in (("autoep_size", ep), ("expert_tensor_parallel_size", etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return [Problem(f"$.expert_parallel.{key}", f'"{key}" must be an integer >= 1, got {value!r}')]
    problems = []
    if etp != 1:
        problems.append(Problem("$.expert_parallel.expert_tensor_parallel_size", f'"expert_tensor_parallel_size" '
                                f"{etp}: DeepSpeed 0.19.8 reserves it and refuses anything but 1 "
                                "(auto_ep_folding.py:214); set it to 1 or remove it"))
    if etp == 1:  # else refused above
        problems += _stage_fit(ep, ctx)
    problems += _clipping_at_zero0(cfg, ep)
    problems += _with_tensor_parallel(cfg, section, ep, ctx)
    problems += _with_zero3(cfg, ctx)
    if section.get("load_balance_coeff") is not None:
        problems.append(Problem("$.expert_parallel.load_balance_coeff", '"load_balance_coeff" '
                                f"{section['load_balance_coeff']!r}: DeepSpeed 0.19.8's AutoEP has no auxiliary-loss-"
                                "free balancing (auto_ep_presets/base.py:19); set it to null or remove it"))
    return problems


def _stage_fit(width: int, ctx) -> list[Problem]:
    """ep must tile the ranks of one pipeline stage."""
    if ctx.world_size is None or ctx.world_size % ctx.pp:
        return []  # no world to fit, or _topology reports it
    stage = ctx.world_size // ctx.pp
    if stage % width == 0:
        return []
    return [Problem(EP, f'"autoep_size" {width} does not divide the ranks of a stage: world({ctx.world_size}) / '
                    f"pp({ctx.pp}) = {stage}; AutoEP groups {width} consecutive ranks of a stage "
                    f'(auto_ep_folding.py:111); use "autoep_size" one of {divisors(stage)}')]


def _clipping_at_zero0(cfg: dict, ep: int) -> list[Problem]:
    """At ZeRO 0 DeepSpeed clips with runtime/utils.py clip_grad_norm_ (engine.py:3503), which averages the ranks'
    local norms over dp (utils.py:413-418): with ep > 1 each rank's norm counts only its own experts, so the clip
    uses a norm below the true one (tiny Mixtral, ep 2: 3.1897 for 3.1943). The ZeRO 1-3 optimizers reduce the
    expert norms over the expert-parallel group and match one process."""
    stage = _section(cfg, "zero_optimization").get("stage", 0)
    clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default (runtime/constants.py:203)
    if ep == 1 or stage != 0 or not isinstance(clip, (int, float)) or clip <= 0:
        return []
    return [Problem("$.zero_optimization.stage", f'"stage" 0 with "autoep_size" {ep} and "gradient_clipping" {clip}: '
                    "DeepSpeed's ZeRO-0 clipping averages each rank's norm, which holds only its own experts "
                    "(runtime/utils.py:413-418), so it clips by a wrong global norm; use \"stage\": 1 (or 2, 3), or "
                    '"gradient_clipping": 0')]


def _with_tensor_parallel(cfg: dict, section: dict, ep: int, ctx) -> list[Problem]:
    if ctx.tp <= 1:
        return []
    why = f'with "autotp_size" {ctx.tp} (AutoEP+AutoTP folding)'
    problems = []
    if ep == 1:
        problems.append(Problem(EP, f'"autoep_size" 1 {why}: DeepSpeed refuses it, each tp lane would count the '
                                f"routed tokens' gradients again (auto_ep_folding.py:240); use \"autoep_size\" > 1, "
                                'or "autotp_size": 1'))
    if ctx.pp > 1:
        problems.append(Problem(EP, f"pp {ctx.pp} {why}: DeepSpeed 0.19.8 folds ep into tp only at pp 1 "
                                '(auto_ep_folding.py:206); use pp 1, or "autotp_size": 1'))
    if ctx.sp > 1:
        problems.append(Problem(EP, f'"sequence_parallel_size" {ctx.sp} {why}: DeepSpeed refuses the three together '
                                '(auto_ep_folding.py:210); drop sp or set "autotp_size": 1'))
    zero = _section(cfg, "zero_optimization")
    for key in ("offload_optimizer", "offload_param"):
        if _section(zero, key).get("device") not in (None, "none"):
            problems.append(Problem(f"$.zero_optimization.{key}", f'"{key}" {why}: DeepSpeed 0.19.8 refuses ZeRO '
                                    f'offload with folding (auto_ep_folding.py:248); remove "{key}", or set '
                                    '"autotp_size": 1'))
    if section.get("async_split_plan") is True and ep > 1:
        problems.append(Problem("$.expert_parallel.async_split_plan", f'"async_split_plan" {why}: DeepSpeed refuses '
                                '(auto_ep_config.py:133); remove it, or set "autotp_size": 1'))
    return problems


def _with_zero3(cfg: dict, ctx) -> list[Problem]:
    zero = _section(cfg, "zero_optimization")
    if zero.get("stage") != 3:
        return []
    problems = []
    if ctx.sp > 1:
        problems.append(Problem("$.sequence_parallel_size", f'"sequence_parallel_size" {ctx.sp} with AutoEP and '
                                "ZeRO-3: DeepSpeed refuses it at start-up (runtime/engine.py:2219); use ZeRO 1-2 with "
                                'sp, or drop "expert_parallel"'))
    if zero.get("zero_quantized_gradients") is True:
        problems.append(Problem("$.zero_optimization.zero_quantized_gradients", '"zero_quantized_gradients" with '
                                "AutoEP and ZeRO-3: DeepSpeed refuses it (runtime/engine.py:2222); remove it"))
    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, int) and hpz > 1:
        problems.append(Problem("$.zero_optimization.zero_hpz_partition_size", f'"zero_hpz_partition_size" {hpz} '
                                "with AutoEP and ZeRO-3: DeepSpeed refuses hpZeRO's secondary groups "
                                '(runtime/engine.py:2225); set it to 1'))
    return problems


def model_problems(cfg: dict, arch) -> list[Problem]:
    """Whether AutoEP at the file's ep fits `arch` (toolkit.plan.arch.Arch, read from config.json): a preset
    that matches its model_type, and an expert count that ep divides."""
    from toolkit.distributed.topology import ep_of

    section = _section(cfg, "expert_parallel")
    if section.get("enabled") is not True:
        return []
    ep, preset = ep_of(cfg), section.get("preset_model")
    problems = []
    if not arch.is_moe:
        return [Problem("$.expert_parallel.enabled", f"{arch.name} ({arch.model_type}) has no experts: AutoEP finds "
                        'no MoE block to replace and DeepSpeed raises (auto_ep.py:760); remove "expert_parallel"')]
    fits = [name for name, types in PRESETS.items() if arch.model_type in types]
    if preset in PRESETS and arch.model_type not in PRESETS[preset]:
        fix = f'use "preset_model": "{fits[0]}"' if fits else 'remove "preset_model" (AutoEP then tries every preset)'
        problems.append(Problem("$.expert_parallel.preset_model", f'"preset_model" "{preset}" is made for model_type '
                                f"{', '.join(PRESETS[preset])}, but {arch.name} is {arch.model_type}: AutoEP matches "
                                f"MoE blocks by module names, which may still fit; {fix}", WARNING))
    elif preset is None and not fits and not section.get("moe_layer_pattern"):
        problems.append(Problem("$.expert_parallel.preset_model", f"no AutoEP preset matches model_type "
                                f"{arch.model_type} (presets: {', '.join(PRESETS)}); AutoEP will try each and may find "
                                'no MoE block; give "moe_layer_pattern" and the expert names', WARNING))
    if arch.experts % ep:
        problems.append(Problem(EP, f'"autoep_size" {ep} does not divide {arch.name}\'s {arch.experts} experts per '
                                f"MoE block: each rank holds experts / ep whole experts (auto_ep_config.py:369-383); "
                                f'use "autoep_size" one of {divisors(arch.experts)}'))
    return problems


def train_refusals(cfg: dict, pp: int, schedule: str, lora: bool) -> list[str]:
    """What `dstk train` cannot combine with "expert_parallel" yet (checked by `dstk train --check`, before any
    rank starts), each with its reason. At pp 1 the whole HF model goes to deepspeed.initialize, which replaces its
    MoE blocks; at pp > 1 dstk replaces each stage's blocks itself (toolkit.distributed.tensor_parallel.
    shard_stage_experts) under the 1F1B schedule (tests/distributed/test_expert_parallel.py). A resume on
    the same layout is DeepSpeed's own load; onto another layout it goes by HF name (toolkit.checkpoint.experts),
    and toolkit.checkpoint.manifest.check_resumable refuses the moves dstk does not make yet. The end-of-run export
    joins every expert at any pp and ZeRO stage."""
    from toolkit.distributed.topology import sp_of, tp_of

    if _section(cfg, "expert_parallel").get("enabled") is not True:
        return []
    ep, tp, sp, out = (_section(cfg, "expert_parallel").get("autoep_size", 1), tp_of(cfg), sp_of(cfg), [])
    named = f'"expert_parallel" (ep {ep})'
    if schedule == "dualpipev":
        out.append(f"--schedule dualpipev with {named}: each DualPipeV rank holds two stages, whose expert groups "
                   "dstk has not built; use --schedule 1f1b")
    if tp > 1:
        out.append(f'"autotp_size" {tp} with {named}: DeepSpeed folds ep into tp (module_inject/auto_ep_folding.py), '
                   'which dstk train has not run yet; use "autotp_size": 1')
    if sp > 1:
        out.append(f'"sequence_parallel_size" {sp} with {named}: at pp 1 Ulysses hands DeepSpeed its groups as the mpu '
                   "and AutoEP then groups ranks in sp mode (runtime/engine.py:866-875), which dstk train has not run, "
                   "and the router aux loss would be counted per sequence slice; use sp 1")
    if lora:
        out.append(f"--lora with {named}: peft wraps the model, so its MoE blocks are named "
                   "base_model.model.model.layers.N.mlp, which no AutoEP preset matches (auto_ep.py:429: DeepSpeed "
                   "then raises 'no MoE layers detected' where a preset is named, auto_ep.py:624, else only warns and "
                   "splits nothing), and LoRA on the fused experts (peft's "
                   "target_parameters on gate_up_proj/down_proj) would be dropped when AutoEP replaces them; "
                   "train without --lora")
    return out
