"""Every run-time change to DeepSpeed internals (and one to torch's, where DeepSpeed's object collectives meet XLA
tensors: ``comm``), in one table, each guarded by the version it was written for.

The startup hook calls ``on_module_loaded`` as each target module finishes importing, and only when
the XLA accelerator is DeepSpeed's. ``tests/patches/test_table.py`` fails when an upstream target changes.
The wrappers live in one module per subsystem they patch: DeepSpeed's ``engine`` (its checkpoints: ``checkpoints``;
what it and ZeRO-3 keep of an engine after ``destroy()``: ``lifetime``), ``zero`` (ZeRO-1/2's weights held once:
``zero_params``; ZeRO-3's flat gradient buffer: ``zero3_grads``; its gradient reduce-scatter: ``zero3_reduce``; what
``deepspeed.initialize`` does once per parameter: ``zero_startup``; its per-module hooks: ``zero3_hooks``),
``precision``, ``grad_checks``, ``config``, ``nvtx`` (its ranges, which XLA does not record), ``monitor`` (XLA's
counters in its monitors), ``compiler``,
``launcher``, ``comm``, ``tensor_parallel``, the two places where the Hugging Face stack runs DeepSpeed
(``accelerate``, ``trainer``) and transformers' ``hub_kernels``, which cannot serve XLA; ``registry`` defines
``Patch``, the supported releases and how a patch is checked and applied. Their figures: (docs/performance.md, 'Why
the patches exist'). One change is not in the table because it must come before its target's import: ``stablehlo``
(torch_xla's exporter, loaded at first use).
"""
import sys
import warnings
from importlib import metadata

from deepspeed_xla.devices import wants_xla
from deepspeed_xla.patches import (accelerate, checkpoints, comm, compiler, config, engine, flops_profiler, grad_checks,
                                  hub_kernels, launcher, lifetime, mixed_dtypes, monitor, nvtx, precision,
                                  tensor_parallel, trainer, zero, zero3_grads, zero3_hooks, zero3_reduce, zero_params,
                                  zero_startup)
# WRITTEN_FOR, VERSIONS, SUPPORTED, Patch, is_applied, source_digest and upstream_digest are this package's API too.
from deepspeed_xla.patches.registry import (SUPPORTED, VERSIONS, WRITTEN_FOR, Patch, _apply, in_range, is_applied,
                                            label, releases, requirement, source_digest, upstream_digest)


# DeepSpeed imports has_inf_or_nan by name, so every importing module's binding is patched.
_HAS_INF_OR_NAN_DIGEST = "f2891c8e640be50c"

_FP16_OPTIMIZER = "deepspeed.runtime.fp16.fused_optimizer"
_UNFUSED_OPTIMIZER = "deepspeed.runtime.fp16.unfused_optimizer"
_MULTINODE_RUNNER = "deepspeed.launcher.multinode_runner"
_FLOPS_PROFILER = "deepspeed.profiling.flops_profiler.profiler"
_STAGE_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2"

PATCHES = [
    *(Patch(module, "", "has_inf_or_nan", grad_checks.has_inf_or_nan, _HAS_INF_OR_NAN_DIGEST)
      for module in ("deepspeed.runtime.utils", "deepspeed.runtime.zero.stage_1_and_2",
                     "deepspeed.runtime.zero.stage3", "deepspeed.runtime.fp16.loss_scaler")),
    *(Patch(module, "", "clip_tensors_by_global_norm", grad_checks.clip_tensors_by_global_norm, "7acb1d9576311c93")
      for module in ("deepspeed.runtime.utils", "deepspeed.runtime.bf16_optimizer")),
    *(Patch(module, "", "is_invalid_grad_norm", grad_checks.is_invalid_grad_norm, "6afd483e2c88e25e")
      for module in ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                     "deepspeed.runtime.bf16_optimizer", _FP16_OPTIMIZER, _UNFUSED_OPTIMIZER)),
    *(Patch(module, "", "CheckOverflow", precision.fp16_optimizer_overflow_checker, "ad6225ec62eec6f0")
      for module in (_FP16_OPTIMIZER, _UNFUSED_OPTIMIZER)),
    Patch(_FP16_OPTIMIZER, "", "get_flattened_grad_norm", precision.get_flattened_grad_norm, "0ac9d7bf88d477dc"),
    Patch(_UNFUSED_OPTIMIZER, "", "get_weight_norm", precision.get_weight_norm, "c62f70351cebc9ad"),
    *(Patch(module, "", "get_global_norm", precision.get_global_norm, "2279a25f9445daa5")
      for module in (_FP16_OPTIMIZER, _UNFUSED_OPTIMIZER)),
    Patch("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "update_hp_grads",
          precision.bf16_optimizer_update_hp_grads, "2e3323daf69099fd",
          reads=("update_hp_grads", "_update_hp_grad", "_setup_for_real_optimizer")),
    Patch("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "get_grads_for_norm",
          precision.bf16_optimizer_grads_for_clipping, "f50a60eac0fc1b77",
          reads=("get_grads_for_norm", "step", "clear_hp_grads")),
    Patch(_FP16_OPTIMIZER, "FP16_Optimizer", "step", precision.fp16_optimizer_step, "d3311d0b03f4d4db",
          reads=("step", "__init__")),
    Patch(_FP16_OPTIMIZER, "FP16_Optimizer", "unscale_and_clip_grads", precision.fp16_optimizer_unscale_and_clip_grads,
          "87c72c13927c20de"),
    Patch(_UNFUSED_OPTIMIZER, "FP16_UnfusedOptimizer", "unscale_and_clip_grads",
          precision.unfused_optimizer_unscale_and_clip_grads, "40c007a365c26f97",
          reads=("unscale_and_clip_grads", "step")),
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "has_overflow",
          zero.stage_1_and_2_has_overflow, "cadc27a13cb7e977"),
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "get_grad_norm_direct",
          zero.stage_1_and_2_grad_norm, "72af0993ad8cde2c"),
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "scaled_global_norm",
          zero.stage_1_and_2_converts_grads_once, "aa64e825f86b3aa5", reads=("scaled_global_norm", "step")),
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "async_inplace_copy_grad_to_fp32_buffer_from_gpu",
          zero.stage_1_and_2_offload_copy, "ac8267c47888ac4b",
          reads=("async_inplace_copy_grad_to_fp32_buffer_from_gpu", "copy_grads_in_partition",
                 "_finalize_cpu_offload_gradient_accumulation")),
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "async_accumulate_grad_in_cpu_via_gpu",
          zero.stage_1_and_2_offload_accumulate, "98a7ac8aa9a3a876",
          reads=("async_accumulate_grad_in_cpu_via_gpu", "_restore_cpu_offload_grad_to_gpu")),
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "update_offload_overflow_tracker",
          zero.stage_1_and_2_offload_overflow, "0bdf760deb3084fb",
          reads=("update_offload_overflow_tracker", "has_overflow", "complete_grad_norm_calculation_for_cpu_offload")),
    *(Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", method, zero.stage_1_and_2_offload_flush, digest)
      for method, digest in (("independent_gradient_partition_epilogue", "26ceef6d75b34b97"),
                             ("_finalize_cpu_offload_gradient_accumulation", "6228bc321fee7607"))),
    # Every function of the class that reads its flat bit16 buffers or their partitions, which zero_params makes per
    # step: a change to any of them must be looked at.
    Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", "__init__", zero_params.params_own_their_buffers,
          "3cea7405a1c12cbe",
          reads=("__init__", "_update_model_bit16_weights", "flatten_dense_tensors_aligned",
                 "get_data_parallel_partitions", "_link_all_hp_params", "step", "update_lp_params",
                 "_restore_from_bit16_weights", "get_bit16_param_group", "_expand_unpadded_flat_group",
                 "offload_states", "reload_states")),
    *(Patch(_STAGE_1_AND_2, "DeepSpeedZeroOptimizer", method, wrapper, digest)
      for method, wrapper, digest in (
          ("_update_model_bit16_weights", zero_params.bit16_weights_in_place, "f6e3c0c53b4a7e06"),
          ("step", zero_params.in_one_flat_buffer, "9520884fd916d178"),
          ("update_lp_params", zero_params.lp_params_into_params, "3cdce069e3c66082"),
          ("_link_all_hp_params", zero_params.fragments_after_linking, "e91c2f7e8f29ef11"))),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "partition_grads",
          zero3_grads.stage3_partition_grads, "bb90de763f44e437",
          reads=("partition_grads", "__init__", "_offload_grad_partition_at_boundary")),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "independent_gradient_partition_epilogue",
          zero3_grads.stage3_writes_grads_at_epilogue, "f1575b87b3d6c083"),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_prepare_fp32_grad_for_sub_group",
          zero3_grads.stage3_fp32_grad_from_flat_buffer, "53f9b85163435a2b",
          reads=("_prepare_fp32_grad_for_sub_group", "independent_gradient_partition_epilogue", "__init__")),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "get_grad_norm_direct",
          zero.stage3_grad_norm, "5ba2252d5f16b541"),
    Patch("deepspeed.runtime.zero.linear", "LinearFunctionForZeroStage3", "apply", zero.zero3_linear_apply,
          "a2d46ec1bf4107fd", reads=("forward", "setup_context")),
    *(Patch("deepspeed.runtime.zero.partition_parameters", "Init", method, zero.zero_init_moves_host_params, digest)
      for method, digest in (("_post_init_method", "19fdf0caca628f79"),
                             ("_convert_to_zero_parameters", "df65a7124c1cdc9c"))),
    Patch("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "_register_deepspeed_module",
          zero.zero3_register_module, "05081f6e841fa219"),
    # stage3 imports defragment by name.
    Patch("deepspeed.runtime.zero.stage3", "", "defragment", zero_startup.defragment_at_once, "3882c6720522a8ca"),
    Patch("deepspeed.runtime.zero.partition_parameters", "Init", "_zero_init_param",
          zero_startup.zero_init_param_in_place, "2930fbd6b94e89a5"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_broadcast_model", zero_startup.broadcast_model_in_place,
          "56eea8df0dbf0c18"),
    Patch("deepspeed.runtime.zero.partition_parameters", "", "print_rank_0", zero3_hooks.print_rank_0_when_asked,
          "bdf0d39499da2560"),
    Patch("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
          "release_sub_module", zero3_hooks.persistent_parameters_stay_gathered, "a4cbc962fa1b2bf8",
          reads=("release_sub_module", "_PartitionedParameterCoordinator__release_param")),
    Patch("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
          "_PartitionedParameterCoordinator__params_to_release", lifetime.params_to_release_per_coordinator,
          "a8a708d6d0c4b820"),
    Patch("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "destroy",
          lifetime.destroy_forgets_the_model, "39f23d1836455dfa", reads=("destroy", "setup_zero_stage3_hooks")),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "destroy", lifetime.destroy_once, "4d0d7d3035e011e1",
          reads=("destroy", "__del__", "__init__", "_configure_tensor_parallel_states")),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_distributed_model",
          lifetime.one_training_engine_per_model, "2276a4947f144e77", reads=("_configure_distributed_model", "destroy")),
    Patch("deepspeed.utils.nvtx", "", "enable_nvtx", nvtx.ranges_off, "c538ccdda7c8ea15",
          reads=("instrument_w_nvtx", )),
    Patch("deepspeed.runtime.comm.coalesced_collectives", "", "_torch_reduce_scatter_fn",
          zero3_reduce.reduce_scatter_computes_pending, "3b7ff5c86484fbae"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "skipped_steps", engine.skipped_steps, "c4c6e01aa1fc4e7d",
          reads=("_take_model_step", )),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_optimizer", engine.configure_optimizer,
          "dd82a70f2f92fe12"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_distributed_model",
          engine.configure_distributed_model, "a9a57b807f5eed72"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_distributed_model",
          engine.refuse_partitioned_model_below_stage_3, "a9a57b807f5eed72"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_zero_optimizer",
          engine.configure_zero_optimizer, "f31cf07a5d4f4170"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", engine.sync_after,
          "c4c6e01aa1fc4e7d"),
    # After sync_after, which it wraps: the save reads the state of a step whose graph was cut.
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", engine.checkpoint_on_sigterm,
          "c4c6e01aa1fc4e7d"),
    # After both: the counters it writes include the step's graph, cut by sync_after.
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", monitor.xla_counters_every_print,
          "c4c6e01aa1fc4e7d"),
    *(Patch("deepspeed.runtime.engine", "DeepSpeedEngine", name, engine.outside_user_code, digest)
      for name, digest in (("forward", "d99afaac0cfa272e"), ("backward", "b8c4368bee04391d"),
                           ("step", "02d6a4373435dd8e"))),
    Patch("deepspeed.runtime.engine", "", "create_checkpoint_engine", checkpoints.create_checkpoint_engine,
          "1adbe5fc9cc0c1d1"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "save_checkpoint", checkpoints.save_checkpoint,
          "c92409217281487c"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_copy_recovery_script", checkpoints.copy_recovery_script,
          "4bfd767dbf04240b"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_get_shared_params", engine.get_shared_params,
          "7ca3cfe76bcd4439"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "load_checkpoint", engine.sync_after, "5728d3dfa42a3d6c"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "load_checkpoint", checkpoints.ranks_load_one_checkpoint,
          "5728d3dfa42a3d6c"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_load_zero_checkpoint",
          checkpoints.zero_checkpoint_world_size, "0084918407ff3784"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_with_arguments", engine.ranks_agree,
          "33679f399d8eb304"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_load_checkpoint", checkpoints.zero_stage_of_checkpoint,
          "e8ba4301fc3bad2c", reads=("_load_checkpoint", "_get_ckpt_name")),
    Patch("deepspeed.runtime.config", "DeepSpeedConfig", "_configure_train_batch_size",
          config.configure_train_batch_size, "5d0a45deff9d4487"),
    Patch("deepspeed.runtime.config", "", "get_timers_config", config.timers_without_device_wait,
          "f497cad4ad72df4f"),
    Patch("deepspeed.runtime.compiler", "", "compile", compiler.deferred_compile, "41ba17e70620eebc"),
    Patch("deepspeed.comm.torch", "TorchBackend", "init_device_mesh", comm.init_device_mesh, "6244115c6499f66b"),
    Patch("torch._utils", "", "_rebuild_device_tensor_from_cpu_tensor", comm.rebuilt_xla_tensor_is_a_leaf,
          "06da87e73e8e98c7", loaded_with="deepspeed.comm.torch"),
    Patch("deepspeed.comm.comm", "", "timers", comm.each_op_timed_alone, "0e83059b5081132a",
          reads=("timed_op", "timer.SynchronizedWallClockTimer.Timer")),
    Patch("deepspeed.module_inject.layers", "TensorParallel_Layer", "move", tensor_parallel.keeps_host_shards_on_host,
          "3335100d7facc177"),
    Patch("deepspeed.launcher.runner", "", "DEEPSPEED_ENVIRONMENT_PATHS", launcher.runner_env_paths, "d40ac82930b5b28f",
          reads=("main", )),
    Patch("deepspeed.launcher.runner", "", "DEEPSPEED_ENVIRONMENT_NAME", launcher.runner_env_name, "d40ac82930b5b28f",
          reads=("main", )),
    Patch("deepspeed.launcher.runner", "", "_parse_hostfile", launcher.hostfile_without_options, "626e2273661134df"),
    Patch("deepspeed.launcher.runner", "", "parse_args", launcher.runner_makes_a_secret, "845642aa86e39fa8",
          reads=("parse_args", "main")),
    Patch(_MULTINODE_RUNNER, "MultiNodeRunner", "add_export", launcher.exports_exact_values, "ed7829601147cf59"),
    Patch(_MULTINODE_RUNNER, "PDSHRunner", "get_cmd", launcher.pdsh_checks_every_host, "c9fadd8a8a4c1cff"),
    *(Patch(_MULTINODE_RUNNER, runner, "get_cmd", launcher.exports_rendezvous, digest)
      for runner, digest in (("OpenMPIRunner", "b8995592e8249045"), ("MVAPICHRunner", "c00bc28c496b31c2"),
                             ("SlurmRunner", "6869ce47d8edb10b"))),
    Patch("accelerate.state", "PartialState", "_prepare_backend", accelerate.prepare_backend, "93f4a40a1da18edc",
          reads=("_prepare_backend", "__init__", "set_device"), digests_at=(("1.15.0", "7a668a99017a1a1b"), )),
    Patch("accelerate.state", "AcceleratorState", "__init__", accelerate.refuses_dropped_deepspeed, "d0193e759a02ea4e",
          digests_at=(("1.15.0", "e5c18cb49fc98393"), )),
    Patch("accelerate.utils.deepspeed", "DeepSpeedEngineWrapper", "get_global_grad_norm",
          accelerate.grad_norm_on_device,
          "f7e1593992852e14"),
    *(Patch("transformers.trainer", "Trainer", method, trainer.saves_through_deepspeed, digest)
      for method, digest in (("save_model", "705727ee10c8f24f"), ("_save_optimizer_and_scheduler", "c5ef974db69ab993"),
                             ("_save_scaler", "fd1ce04cfea46123"))),
    Patch("transformers.trainer", "Trainer", "_get_grad_norm", trainer.grad_norm_read_when_logged, "913ba6f52f074d10"),
    Patch("transformers.trainer", "", "nested_gather", trainer.gathers_by_parallel_mode, "e380e9b71a14b9ab"),
    Patch("transformers.training_args", "TrainingArguments", "parallel_mode", trainer.distributed_under_deepspeed,
          "04fe5dc71b61e7e4"),
    Patch("transformers.training_args", "TrainingArguments", "main_process_first", trainer.barrier_by_parallel_mode,
          "81bfffffb9fa0d86"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_start_timers", flops_profiler.start_timers_on_the_device,
          "bf462281b2ff8c29", reads=("_start_timers", "_forward_prologue")),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_stop_timers", flops_profiler.stop_timers_on_the_device,
          "3aa5e96f6018f802", reads=("_stop_timers", "step")),
    *(Patch(_FLOPS_PROFILER, "FlopsProfiler", method, wrapper, digest, reads=reads)
      for method, wrapper, digest, reads in (
        ("start_profile", flops_profiler.no_module_timing, "f45cc8c6aa18a48f", ()),
        ("get_total_duration", flops_profiler.forward_latency_from_the_engine, "33feb1505f18f6e4", ()),
        ("print_model_profile", flops_profiler.module_latencies_not_measured, "619a854e2d70147c",
         ("print_model_profile", "print_model_aggregated_profile")))),
    Patch("torch.nn.modules.linear", "Linear", "forward", mixed_dtypes.linear_refuses_mixed_dtypes,
          "c0ab8f42cc3bf948", loaded_with="deepspeed.runtime.engine"),
    # modeling_utils imports it by name, after this module has loaded (and been patched).
    Patch("transformers.integrations.hub_kernels", "", "_kernels_enabled", hub_kernels.disabled_on_xla,
          "89c31a84efa10f23", since="5.25.0"),
]

PATCHED_MODULES = sorted({p.hooked for p in PATCHES})


def _xla_is_active(distribution: str) -> bool:
    """Whether XLA is DeepSpeed's accelerator; accelerate and transformers load before DeepSpeed chooses, so for
    theirs: whether it will be."""
    if distribution != "deepspeed":
        return wants_xla()
    from deepspeed.accelerator import real_accelerator
    return getattr(real_accelerator.ds_accelerator, "_name", None) == "xla"


#: Distributions whose release outside ``registry.SUPPORTED`` was reported.
_REPORTED = set()


def _outside_range(distribution: str, installed: str, changed: list) -> str:
    found = f"changed: {', '.join(changed)}" if changed else "none changed"
    return (f"deepspeed_xla: {distribution} {installed} is outside the releases its patches are tested with "
            f"({releases(distribution)}; pip install '{requirement(distribution)}'). Of the functions it patches "
            f"(checked as each module loads), {found}.")


def on_module_loaded(module) -> None:
    """Startup-hook entry: apply the patches ``module``'s load applies (``Patch.hooked``), each distribution's if the
    XLA accelerator is (or will be) DeepSpeed's accelerator. A release outside the supported ones gets one warning, at
    its first patched module, naming the range and the patched functions there that changed; a changed one in a module
    loaded later gets its own."""
    targets = [patch for patch in PATCHES if patch.hooked == module.__name__]
    for distribution in dict.fromkeys(patch.distribution for patch in targets):
        if _xla_is_active(distribution):
            _apply_release(distribution, [patch for patch in targets if patch.distribution == distribution])


def _apply_release(distribution: str, targets: list) -> None:
    installed = metadata.version(distribution)
    targets = [patch for patch in targets if patch.applies_to(installed)]
    if in_range(distribution, installed) or distribution in _REPORTED:
        for patch in targets:
            _apply(patch)
        return
    _REPORTED.add(distribution)
    changed = [label(patch) for patch in targets if _apply(patch, warn=False)]
    warnings.warn(_outside_range(distribution, installed, sorted(set(changed))))


def apply_all() -> None:
    """Patch every target module that is already imported (the explicit ``register()`` route)."""
    for name in PATCHED_MODULES:
        if name in sys.modules:
            on_module_loaded(sys.modules[name])
