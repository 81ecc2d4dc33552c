"""Hand-written schema for the parts of a DeepSpeed 0.19 config that are NOT pydantic models.

DeepSpeed reads these as plain dicts (runtime/config.py `get_*` helpers, activation_checkpointing,
pipeline, checkpoint, flops_profiler, aio, ...) and ignores keys it does not know; here each has a
fixed key set so dstk can flag typos. Defaults are DeepSpeed's own constants. Used by `build`.
"""

from toolkit.config.schema.parts import count, enabled, flag, prop, real, section, text

DTYPE_NAMES = ["fp32", "fp16", "bf16"]


def top_level_scalars() -> dict:
    """Top-level keys read with get_scalar_param (runtime/config.py, constants.py)."""
    return {
        "train_batch_size": count(
            "Global batch in samples per optimizer step: train_micro_batch_size_per_gpu x "
            "gradient_accumulation_steps x data-parallel size.", None, minimum=1, auto=True),
        "train_micro_batch_size_per_gpu": count(
            "Samples per GPU in one forward/backward (mbs).", None, minimum=1, auto=True),
        "gradient_accumulation_steps": count(
            "Micro-batches accumulated per optimizer step (gas); with pipeline parallelism, the "
            "micro-batches per train_batch().", None, minimum=1, auto=True),
        "managed_gradient_accumulation": flag(
            "True: DeepSpeed counts micro-steps and steps the optimizer at the boundary. False: "
            "every step() applies an update.", True),
        "steps_per_print": count("Print progress every N optimizer steps (null: never).", None, minimum=1),
        "gradient_clipping": real("Clip the global gradient norm to this value (0 disables).", 1.0,
                                  auto=True, minimum=0),
        "prescale_gradients": flag("Scale gradients before all-reduce instead of after."),
        "gradient_predivide_factor": real("Divide gradients by this before all-reduce.", 1.0,
                                          exclusiveMinimum=0),
        "gradient_allreduce_op": text("Gradient all-reduce: mean over ranks or plain sum "
                                      "(sum is refused with ZeRO-3).", "mean", enum=["mean", "sum"]),
        "communication_data_type": prop(["string", "null"], "Dtype of gradient communication; "
                                        "null picks it from the training precision.", None,
                                        enum=DTYPE_NAMES + [None]),
        "seq_parallel_communication_data_type": prop(["string", "null"], "Dtype of sequence-parallel "
                                                     "gradient communication (null: from the training "
                                                     "precision, as communication_data_type).", "fp32",
                                                     enum=DTYPE_NAMES + [None]),
        "disable_allgather": flag("Disable all-gather (legacy ZeRO option)."),
        "dump_state": flag("Print DeepSpeed's state after initialisation."),
        "disable_python_gc": flag("Disable Python's automatic cyclic garbage collector during training."),
        "wall_clock_breakdown": flag("Time forward, backward and step and print the breakdown."),
        "memory_breakdown": flag("Print memory use at each stage of a step."),
        "zero_allow_untested_optimizer": flag("Allow an optimizer DeepSpeed has not tested with ZeRO."),
        "zero_force_ds_cpu_optimizer": flag("Require DeepSpeedCPUAdam (or CPU Adagrad/Lion) when "
                                            "optimizer state is offloaded to CPU.", True),
        "dataloader_drop_last": flag("Drop the last incomplete batch of deepspeed_io() loaders."),
        "use_data_before_expert_parallelism": flag("Order process groups data-parallel first, then "
                                                   "expert-parallel (MoE)."),
        "vocabulary_size": count("Vocabulary size; DeepSpeed warns when it is not a multiple of 8.",
                                 None, minimum=1),
        "log_level": prop(["string", "null"], "Logging level for DeepSpeed's logger (e.g. \"info\").", None),
        "sequence_parallel_size": count("Sequence-parallel degree (Ulysses); the data-parallel size "
                                        "becomes world / sequence_parallel_size.", 1, minimum=1),
    }


def activation_checkpointing() -> dict:
    return section("Activation checkpointing of deepspeed.checkpointing (read as a plain dict).", {
        "partition_activations": flag("Partition checkpointed activations across model-parallel ranks."),
        "number_checkpoints": count("Number of activation checkpoints kept (null: as the model asks).",
                                    None, minimum=1),
        "contiguous_memory_optimization": flag("Copy checkpoints into one contiguous buffer."),
        "cpu_checkpointing": flag("Move partitioned activations to CPU (needs partition_activations)."),
        "profile": flag("Time the checkpointing functions."),
        "synchronize_checkpoint_boundary": flag("Synchronise the device at each checkpoint boundary."),
    })


def pipeline() -> dict:
    """DeepSpeed's own pipeline keys plus dstk's topology record (DeepSpeed ignores the latter)."""
    methods = "^(compute|memory|profile|parameters|uniform|type:.+)$"
    return section("Pipeline engine settings; dstk also records its topology here.", {
        "stages": prop(["integer", "string"], "Pipeline stages (pp). dstk writes an integer; "
                       "DeepSpeed's own default is \"auto\" (from the PipelineModule).", "auto",
                       minimum=1, pattern="^auto$"),
        "partition_method": text("dstk: how layers are split across stages: compute, memory, parameters, "
                                 "uniform, type:REGEX, or profile (measured once by `dstk partition MODEL --pp N "
                                 "--method profile --config FILE`, which records parts; refused without parts). "
                                 "compute balances estimated forward+backward time per stage (DeepSpeed's "
                                 "PipelineModule alone defaults to parameters).",
                                 "compute", pattern=methods),
        "parts": prop("array", "dstk: stage boundaries as layer indices, length stages+1 "
                      "(stage s holds layers parts[s] .. parts[s+1]-1).",
                      items={"type": "integer", "minimum": 0}, minItems=2),
        "partition": text("DeepSpeed's own partition hint (kept for compatibility).", "best"),
        "seed_layers": flag("Seed each layer's RNG with its index when building layers."),
        "activation_checkpoint_interval": count("Checkpoint activations every N layers (0: off).", 0),
        "pipe_partitioned": flag("Partition activations sent between stages across model-parallel "
                                 "ranks.", True),
        "grad_partitioned": flag("Partition gradients sent between stages across model-parallel "
                                 "ranks.", True),
        "use_reentrant": flag("Use torch's reentrant activation checkpointing.", True),
    })


def flops_profiler() -> dict:
    return section("FLOPS profiler (profiling/config.py, read as a plain dict).", {
        "enabled": enabled("the flops profiler"),
        "recompute_fwd_factor": real("Extra forward passes from activation recomputation (0 to 1).",
                                     0.0, minimum=0),
        "profile_step": count("Optimizer step at which to profile.", 1, minimum=1),
        "module_depth": prop("integer", "Depth of the module tree to print (-1: all).", -1, minimum=-1),
        "top_modules": count("Number of top modules to print.", 1, minimum=1),
        "detailed": flag("Print a per-module breakdown.", True),
        "output_file": prop(["string", "null"], "Write the profile here (null: stdout).", None),
    })


def checkpoint() -> dict:
    modes = ["WARN", "IGNORE", "FAIL", "Warn", "Ignore", "Fail", "warn", "ignore", "fail"]
    writer = section("Checkpoint writer (model_checkpointing/config.py; null: the default writer).", {
        "type": text("Writer implementation (case-insensitive).", "FAST",
                     enum=["FAST", "PYTHON", "MOCK", "fast", "python", "mock"]),
        "decoupled": flag("Write checkpoints from a separate process."),
        "io_buffer_size": count("I/O buffer size in bytes.", 64 * 1024**2, minimum=1),
        "io_buffer_double": flag("Double-buffer checkpoint I/O.", True),
        "show_statistics": flag("Print I/O statistics."),
        "data_parallel": prop(["string", "null"], "Unit of data-parallel writing.", None,
                              enum=["REPLICA", "SOCKET", "MACHINE", "replica", "socket", "machine", None]),
        "io_multiplier": count("I/O multiplier.", 1, minimum=1),
    }, default=None)
    return section("Checkpoint save/load options (read as a plain dict).", {
        "tag_validation": text("Check that all ranks save the same tag (case-insensitive).", "WARN", enum=modes),
        "load_universal": flag("Load a universal (reshapeable) checkpoint."),
        "use_node_local_storage": flag("Each node saves to its own local storage."),
        "parallel_write": section("Parallel checkpoint writing.", {
            "pipeline_stage": flag("Each pipeline stage writes its own layers in parallel."),
        }),
        "checkpoint_serialization": flag("Serialise with torch.save's zipfile format.", True),
        "writer": writer,
    })


def data_types() -> dict:
    dtypes = {"type": ["string", "null"], "enum": DTYPE_NAMES + [None]}
    return section("Data types of accumulation, parameters and buffers (read as a plain dict).", {
        "grad_accum_dtype": {**dtypes, "description": "Dtype for gradient accumulation (null: as "
                             "the training precision).", "default": None},
        "param_dtype": {**dtypes, "description": "Cast parameters to this dtype (null: the mixed "
                        "precision dtype).", "default": None},
        "buffer_dtype": {**dtypes, "description": "Cast buffers to this dtype (null: keep the "
                         "loaded dtype).", "default": None},
        "keep_in_fp32_modules": {"type": ["string", "array"], "items": {"type": "string"},
                                 "pattern": "^auto$", "default": "auto",
                                 "description": "Buffers kept in fp32 under bf16/fp16: \"auto\" "
                                 "(the model's own list) or name patterns."},
    })


def aio() -> dict:
    return section("Asynchronous I/O for NVMe offload (swap_tensor/aio_config.py).", {
        "block_size": count("Read/write block size in bytes.", 1048576, minimum=1),
        "queue_depth": count("I/O queue depth.", 8, minimum=1),
        "intra_op_parallelism": count("Parallel I/O threads per operation.", 1, minimum=1),
        "single_submit": flag("Submit requests one at a time instead of in batches."),
        "overlap_events": flag("Overlap submission and completion of requests.", True),
        "use_gds": flag("Use NVIDIA GPUDirect Storage (CUDA only)."),
    })


def torch_autocast() -> dict:
    return section("torch.autocast mixed precision instead of fp16/bf16 master weights.", {
        "enabled": enabled("torch.autocast"),
        "dtype": text("Autocast dtype.", enum=["bfloat16", "bf16", "torch.bfloat16", "float16", "fp16",
                                               "half", "torch.float16"]),
        "lower_precision_safe_modules": prop("array", "Module classes run in the lower precision "
                                             "(dotted names).", items={"type": "string"}),
    })


def autotuning() -> dict:
    return section("DeepSpeed autotuner (autotuning/config.py).", {
        "enabled": enabled("autotuning"),
        "fast": flag("Tune only the micro-batch size, not ZeRO stages.", True),
        "results_dir": text("Directory for results.", "autotuning_results"),
        "exps_dir": text("Directory for experiment configs.", "autotuning_exps"),
        "overwrite": flag("Overwrite earlier results.", True),
        "start_profile_step": count("First step profiled.", 3),
        "end_profile_step": count("Last step profiled.", 5),
        "metric": text("Metric to optimise.", "throughput", enum=["throughput", "latency", "flops"]),
        "metric_path": prop(["string", "null"], "File the training script writes the metric to.", None),
        "tuner_type": text("Search strategy.", "gridsearch", enum=["gridsearch", "random", "model_based"]),
        "tuner_early_stopping": count("Stop after N experiments without improvement.", 5),
        "tuner_num_trials": count("Maximum experiments.", 50, minimum=1),
        "arg_mappings": prop(["object", "null"], "Map config keys to the script's arguments.", None),
        "max_train_batch_size": prop(["integer", "null"], "Largest global batch tried.", None),
        "min_train_batch_size": count("Smallest global batch tried.", 1, minimum=1),
        "max_train_micro_batch_size_per_gpu": count("Largest micro-batch tried.", 1024, minimum=1),
        "min_train_micro_batch_size_per_gpu": count("Smallest micro-batch tried.", 1, minimum=1),
        "num_tuning_micro_batch_sizes": count("Micro-batch sizes tried.", 3, minimum=1),
        "mp_size": count("Model-parallel size.", 1, minimum=1),
        "model_info_path": prop(["string", "null"], "Model information file.", None),
        "model_info": prop(["object", "null"], "Model information (num_params, hidden_size, ...).", None),
    })


def data_efficiency() -> dict:
    open_part = {"type": "object", "additionalProperties": True}
    sampling = section("Curriculum data sampling.", {
        "enabled": enabled("data sampling"),
        "num_epochs": count("Epochs of the sampler.", 1000),
        "num_workers": count("Data loader workers.", 0),
        "pin_memory": flag("Pin loader memory."),
        "curriculum_learning": {**open_part, "description": "Curriculum learning metrics and schedule."},
        "dynamic_batching": {**open_part, "description": "Variable batch size by sequence length."},
    })
    routing = section("Data routing.", {
        "enabled": enabled("data routing"),
        "random_ltd": {**open_part, "description": "Random layer-wise token dropping."},
    })
    return section("Data efficiency library (data_pipeline/config.py).", {
        "enabled": enabled("the data efficiency library"),
        "seed": count("Random seed.", 1234),
        "data_sampling": sampling,
        "data_routing": routing,
    })


def open_sections() -> dict:
    """Sections DeepSpeed hands whole to another component: only their type is checked."""
    return {
        "datastates_ckpt": {"type": ["object", "boolean"], "additionalProperties": True, "default": False,
                            "description": "DataStates asynchronous checkpointing options."},
    }
