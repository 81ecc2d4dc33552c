"""`build_pipeline_module`: a PipelineSpec -> deepspeed.pipe.PipelineModule, on exactly the
stage boundaries dstk chose (`parts`) so every rank agrees, without building layers to count them.

Three things DeepSpeed 0.19 gets wrong for these layer lists, put right on the module it builds:
- Gradient clipping without ZeRO/bf16/fp16 (`clip_fp32_gradients` -> runtime/utils.clip_grad_norm_
  with mpu = the pipeline grid) counts a parameter only where `mpu.get_model_parallel_rank() == 0`
  or the parameter says `model_parallel`. On a PipeDataParallelTopology that rank is the STAGE
  index, so the "global" norm is stage 0's norm alone: every later stage's gradients are left out,
  and pp > 1 clips by a smaller norm than pp = 1. Each parameter is marked `model_parallel` here
  (the norm then sums every stage's own gradients over the pipeline group), except the copies of a
  tied weight on its later stages (`ds_pipe_replicated`, as DeepSpeed marks them): their gradient,
  all-reduced before the step, is counted once, on the first stage holding it.
- Activation checkpointing (`activation_checkpoint_interval`): DeepSpeed's default checkpoints
  every segment holding parameters, the embedding included, whose inputs are token ids; the
  reentrant checkpoint then returns a hidden state without a graph and the embedding gets no
  gradient. Only block and final-norm layers are checkpointed by default (`checkpointable_layers`).
- A frozen tied weight (LoRA trains adapters on a frozen embedding): the pipeline engine reduces
  every tied weight's gradient between its stages, and under bf16 reads `weight._hp_grad`, which
  exists only for what BF16_Optimizer optimizes (AttributeError at the first step). Frozen tied
  weights are left out of `get_tied_weights_and_groups`: they have no gradient to reduce.

And one thing it does too early: `PipelineModule.__init__` moves the stage to its device right after
building it (runtime/pipe/module.py: `self._build(); self.to(device)`), before the engine casts the
parameters to bf16/fp16 and before dstk shards the blocks over a tp group, so a GPU would briefly hold the
whole stage in the dtype it was built in (4 bytes x every parameter for a model built in fp32).
`build_pipeline_module(..., on_host=True)` holds that move (and the tied-weight broadcast that follows
it, which NCCL needs on the device) until the caller has made the stage final and calls `place(module)`.
"""

from toolkit.errors import ConfigError


def check_parts(parts, num_stages, num_layers) -> list:
    """Validate stage boundaries: len num_stages + 1, 0 first, num_layers last, each stage >= 1 layer."""
    parts = [int(p) for p in parts]
    if len(parts) != num_stages + 1:
        raise ConfigError(f"parts {parts} has {len(parts)} boundaries; {num_stages} stages need "
                          f"num_stages + 1 = {num_stages + 1}")
    if parts[0] != 0 or parts[-1] != num_layers:
        raise ConfigError(f"parts {parts} must start at 0 and end at num_layers = {num_layers}")
    empty = [s for s in range(num_stages) if parts[s + 1] <= parts[s]]
    if empty:
        raise ConfigError(f"parts {parts}: stage(s) {empty} get no layers; boundaries must increase strictly")
    return parts


def _module_class(dual: bool = False):
    """Defined lazily so importing models does not import deepspeed. dual: on DeepSpeed's DualPipeVModule
    (runtime/pipe/dualpipev.py), whose rank r builds stage r (phase 0) and stage 2p-1-r (phase 1)."""
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    class DstkPipelineModule(DualPipeVModule if dual else PipelineModule):
        """PipelineModule that takes given boundaries and precomputed parameter counts."""

        def __init__(self, layers, *, dstk_parts=None, dstk_param_counts=None, dstk_on_host=False, **kwargs):
            self._dstk_parts = dstk_parts  # plain attributes: allowed before nn.Module.__init__
            self._dstk_param_counts = dstk_param_counts
            self._dstk_held = None  # while held on the host: the device DeepSpeed asked for (place() moves it)
            self._dstk_holding = dstk_on_host
            super().__init__(layers, **kwargs)
            mark_grad_norm_owners(self)

        def to(self, *args, **kwargs):
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            if self._dstk_holding and dtype is None:  # __init__'s move after _build: recorded, done by place()
                self._dstk_held = device
                return self
            return super().to(*args, **kwargs)

        def _synchronize_tied_weights(self):
            if not self._dstk_holding:  # held with the move: a broadcast on NCCL needs the device
                super()._synchronize_tied_weights()

        def _partition_layers(self, method="uniform"):
            if self._dstk_parts is None:
                return super()._partition_layers(method=method)
            self.parts = list(self._dstk_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
            if dual:  # what DualPipeVModule._partition_layers sets: 2p stages, this rank's two
                self.num_stages *= 2
                mirror = self.num_stages - 1 - stage
                self.phase_bounds = [(self.parts[stage], self.parts[stage + 1]), (self.parts[mirror], self.parts[mirror + 1])]

        def get_tied_weights_and_groups(self):
            # A frozen tied weight (LoRA's embedding) has no gradient to reduce between its stages; under
            # bf16 the engine reads its `_hp_grad`, which BF16_Optimizer gives only to what it optimizes.
            return [(w, group) for w, group in super().get_tied_weights_and_groups() if w.requires_grad]

        def _count_layer_params(self):
            # DeepSpeed's version builds every LayerSpec (loading its weights) just to count them
            if self._dstk_param_counts:
                return list(self._dstk_param_counts)
            return super()._count_layer_params()

    return DstkPipelineModule


def mark_grad_norm_owners(module) -> None:
    """Make DeepSpeed's pipeline gradient norm count each gradient exactly once (see the module doc).

    A tied module's later copies are `ds_pipe_replicated` as a whole in DeepSpeed; only the tied
    weights themselves are replicated (all-reduced): the rest of a copy is either unused on that stage
    (no gradient) or trained there alone (BERT's MLM transform and bias on the last stage), so it counts.
    With a tp axis (PipeModelDataParallelTopology, toolkit.distributed.tensor_parallel) the norm is summed over the
    pipe x tp group: a tensor-parallel shard counts on every tp rank, a tensor the tp ranks hold whole on
    tp rank 0 only. Run again once the stage is sharded (the shards keep their Parameter objects)."""
    replicated = set()
    for comm in module.tied_comms.values():
        if module.global_rank != comm["ranks"][0]:
            replicated.update(id(module._recursive_getattr(comm["module"], attr)) for attr in comm["weight_attr"])
    tp_rank = module._grid.get_slice_parallel_rank()
    for p in module.parameters():
        p.ds_pipe_replicated = id(p) in replicated  # skipped by the ZeRO-1 / bf16 / fp16 norms
        # counted on its own stage by runtime/utils.clip_grad_norm_ (and by ZeRO-1 / bf16 on tp ranks > 0)
        p.model_parallel = id(p) not in replicated and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))


def checkpointable_layers(spec) -> list:
    """Class names of the layers activation checkpointing may wrap: blocks and the final norm, whose
    input is a hidden state; never the embedding (token ids in) nor a class the embedding shares."""
    def name(layer):
        return getattr(layer, "typename", type(layer)).__name__

    inner = {name(layer) for layer, kind in zip(spec.layers, spec.kinds) if kind in ("block", "norm")}
    return sorted(inner - {name(layer) for layer, kind in zip(spec.layers, spec.kinds) if kind == "embed"})


def build_pipeline_module(spec, *, num_stages=None, topology=None, parts=None,
                          partition_method="parameters", on_host=False, dual=False, **kwargs):
    """deepspeed.pipe.PipelineModule for `spec` (needs torch.distributed initialised, LOCAL_RANK set).

    parts: stage boundaries (len num_stages + 1, parts[0] = 0, parts[-1] = spec.num_layers);
        when given they are used as is and partition_method is ignored.
    on_host: leave the stage where its layers were built (the CPU) and its tied weights unsynchronised
        until `place(module)`, instead of DeepSpeed moving it to the device as it is built (module doc).
    dual: a DualPipeVModule (DeepSpeed picks its DualPipeVEngine): `parts` then cuts 2 x num_stages stages,
        rank r holding stages r and 2 x num_stages - 1 - r (the embedding and the head both on rank 0).
    Other keyword arguments go to PipelineModule (activation_checkpoint_interval, seed_layers, ...);
    checkpointable_layers defaults to the spec's blocks and final norm.
    """
    if num_stages is None and topology is None:
        if parts is None:
            raise ConfigError("build_pipeline_module needs num_stages, topology or parts")
        num_stages = len(parts) - 1
    stages = (topology.get_dim("pipe") if topology is not None else num_stages) * (2 if dual else 1)
    if parts is not None:
        parts = check_parts(parts, stages, spec.num_layers)
    elif stages > spec.num_layers:
        raise ConfigError(f"num_stages {stages} > {spec.num_layers} layers: every stage needs a layer")
    kwargs.setdefault("checkpointable_layers", checkpointable_layers(spec))
    cls = _module_class(dual)
    return cls(spec.layers, num_stages=None if topology is not None else num_stages, topology=topology,
               loss_fn=spec.loss_fn, partition_method=partition_method, dstk_parts=parts,
               dstk_param_counts=spec.param_counts, dstk_on_host=on_host, **kwargs)


def cast_parameters(module, dtype) -> None:
    """Parameters to `dtype` in place, as DeepSpeed's engine casts them under bf16/fp16
    (engine._cast_module_mixed_precision: every floating parameter, no buffer), where they are now."""
    import torch

    for p in module.parameters():
        if p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and p.dtype != dtype:
            p.data = p.data.to(dtype)


def place(module) -> None:
    """The move `build_pipeline_module(on_host=True)` held back: the stage, now final, to the device
    DeepSpeed chose for it, then the tied weights' broadcast from their first stage. Call under no_grad."""
    module._dstk_holding = False
    if module._dstk_held is not None:
        module.to(module._dstk_held)
    module._synchronize_tied_weights()
