"""Patches of DeepSpeed's engine (``deepspeed.runtime.engine``): placement, step ends, ZeRO setup, tied weights.

``DeepSpeedEngine`` assumes an eager device: it moves the model with ``module.to`` (which on XLA replaces
the Parameters the optimizer holds), never marks a step's end (the lazy graph would grow across steps),
sizes ZeRO's buckets for CUDA's unbacked allocations, finds tied weights by storage pointer (0 on XLA)
and counts skipped steps on the host. These wrappers fit each of those to XLA; its checkpoint save and load:
``checkpoints.py``.
"""
import contextlib
import functools


@contextlib.contextmanager
def keep_parameter_objects():
    """Make ``module.to(xla)`` swap tensor contents into the existing Parameter objects.

    A CPU Parameter cannot take an XLA tensor as ``.data``, so torch replaces the Parameter, and the
    optimizer (built from the user's ``model.parameters()``) keeps training the stale CPU tensors.
    """
    import torch
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def configure_distributed_model(original):
    """The engine's move to the device keeps each Parameter object (``keep_parameter_objects``) and its Python
    attributes: swapping a tensor's contents swaps its ``__dict__`` too, and DeepSpeed reads marks set before the
    move (MoE's ``allreduce``/``group_name``, AutoTP's checkpoint layout, Megatron's model-parallel attributes)."""

    @functools.wraps(original)
    def configure(self, model):
        from deepspeed.utils import debug
        # DeepSpeed's debug name maps hold weakrefs to every parameter, and swapping refuses weakref'd
        # tensors: drop the maps for the move and rebuild them (ids do not change) afterwards.
        debug.debug_clear_module_and_param_names()
        attributes = [(param, dict(param.__dict__)) for param in model.parameters()]
        # A model that already served an engine is on the device: swapping its parameters again would be refused
        # while that engine's optimizer still holds them (a second engine on the same model).
        from deepspeed.accelerator import get_accelerator
        device_type = get_accelerator().device_name()
        moves = any(param.device.type != device_type for param, _ in attributes)
        try:
            with keep_parameter_objects() if moves else contextlib.nullcontext():
                return original(self, model)
        finally:
            for param, saved in attributes:
                param.__dict__.update(saved)
            debug.debug_extract_module_and_param_names(model)

    return configure


def refuse_partitioned_model_below_stage_3(original):
    """A model built inside ``deepspeed.zero.Init`` holds empty parameters that only ZeRO-3 gathers; any other stage
    runs its forward on them and fails deep in it (on XLA, an operand-shape check in the graph's lowering)."""

    @functools.wraps(original)
    def configure(self, model):
        partitioned = [name for name, param in model.named_parameters() if hasattr(param, "ds_id")]
        if partitioned and not self.zero_optimization_partition_weights():
            raise ValueError(
                f"the model was built inside deepspeed.zero.Init ({len(partitioned)} partitioned parameter(s), e.g. "
                f"{partitioned[0]}), but zero_optimization.stage is {self.zero_optimization_stage()}: only ZeRO-3 "
                "gathers such parameters. Set \"stage\": 3, or build the model outside deepspeed.zero.Init.")
        return original(self, model)

    return configure


# What the graph cut after each method holds, for an error that names it (``compile_errors``).
_GRAPH_ENDED_BY = {
    "_take_model_step": ("optimizer step {step}'s graph (its forward, backward and optimizer update, traced since the "
                         "step before)"),
    "load_checkpoint": "the graph that load_checkpoint left to run (at optimizer step {step})",
}


def sync_after(original):
    """End the lazy graph when ``original`` returns.

    ``_take_model_step``: one XLA execution per step, bounded graph size. DeepSpeed never marks steps
    (eager devices need no marker); without one the traced graph grows across steps until the
    compiler runs out of memory. The pipeline engine steps here too.

    ``load_checkpoint``: the load leaves lazy computations over the freshly loaded buffers (ZeRO-3
    rebuilds its partitions and gathered parameters from them). Left to the first step, one of them
    reads a partition-sized buffer that step donates to an in-place update, and the second step
    fails with "buffer ... is deleted" (docs/performance.md, 'Why the patches exist'). Materialized
    here, the first step starts from device data, as after initialize.
    """

    @functools.wraps(original)
    def sync_after(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from deepspeed_xla import compile_errors, compile_watch, xla_runtime
        step = self.global_steps if original.__name__ == "_take_model_step" else None
        graph = compile_watch.step_graph(step) if step else "the graph load_checkpoint left to run"
        with compile_errors.naming_refusals(_GRAPH_ENDED_BY[original.__name__].format(step=self.global_steps)):
            compile_watch.graph_end(self.global_rank, graph, step, lambda: xla_runtime.sync(wait=False))
        return result

    return sync_after


def outside_user_code(original):
    """Mark the engine's ``forward``, ``backward`` and ``step`` as DeepSpeed's code for ``host_reads``, which names
    the device reads of the user's code between them (after the warm-up steps); reads inside them are DeepSpeed's."""

    @functools.wraps(original)
    def engine_call(self, *args, **kwargs):
        from deepspeed_xla.host_reads import EngineCall
        with EngineCall(self):
            return original(self, *args, **kwargs)

    return engine_call


def checkpoint_on_sigterm(original):
    """Save the checkpoint that SIGTERM asked for (``DS_XLA_CHECKPOINT_ON_SIGTERM``), at the end of the step every
    rank agreed on (``comm/preemption.py``), then stop. Every rank passes here once per optimizer step, the
    pipeline engine too; the check reads the rendezvous store, not the device. Wraps ``sync_after``: the step's
    graph is cut before the save reads the state."""

    @functools.wraps(original)
    def take_model_step(self, *args, **kwargs):
        from deepspeed_xla.comm import watchdog
        agreement = watchdog.checkpoint_on_sigterm()
        if agreement is None:
            return original(self, *args, **kwargs)
        agreement.step_started(self.global_steps)
        result = original(self, *args, **kwargs)
        if agreement.step_ended(self.global_steps):
            tag = f"global_step{self.global_steps}"
            watchdog.stop_after_checkpoint(lambda: self.save_checkpoint(agreement.save_dir, tag=tag),
                                           agreement.saved(tag))
        return result

    return take_model_step


def configure_zero_optimizer(original):
    """Fit ZeRO's gradient buffers to XLA before ZeRO allocates them.

    Bucket sizes: ZeRO allocates its gradient buckets with ``torch.empty(reduce_bucket_size)``
    (default 5e8 elements) every step. CUDA leaves untouched memory unbacked; XLA materializes the
    whole buffer, every step. A bucket never holds more than every parameter, so capping the sizes
    at the parameter count changes no result.

    ``contiguous_gradients`` off unless the config sets it: the option copies each gradient into a
    slice of a flat bucket to spare CUDA's allocator fragmentation. torch_xla lowers each such copy
    as a select over the whole bucket, so a step does work of (parameters x bucket) elements, which
    dominates ZeRO-1/2's step time (docs/performance.md, 'Why the patches exist'). Off, ZeRO
    concatenates the gradients once (same values). MoE layers need it on in ZeRO-2, so they keep
    DeepSpeed's default.
    """

    @functools.wraps(original)
    def configure(self, optimizer):
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())
        numel += numel % 2  # ZeRO-1/2 assert an even all-gather bucket (4-byte alignment of 16-bit elements)
        zero = self._config.zero_config
        for field in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            if getattr(zero, field, 0) > numel:
                setattr(zero, field, numel)
        if "contiguous_gradients" not in zero.model_fields_set and not self.has_moe_layers:
            zero.contiguous_gradients = False
        return original(self, optimizer)

    return configure


SKIPPED_STEPS = "xla_skipped_steps"


def _device_skipped_steps(engine) -> int:
    counter = getattr(getattr(engine, "optimizer", None), SKIPPED_STEPS, None)
    return 0 if counter is None else counter.read()


def skipped_steps(_upstream_has_none):
    """``engine.skipped_steps`` counts the steps ``step_guard`` skipped on the device too.

    Upstream keeps an instance counter that ``_take_model_step`` bumps when the optimizer reports an
    overflow; on XLA the optimizers no longer report one. The device count is read only when
    something reads the attribute: DeepSpeed's progress log every ``steps_per_print`` steps, a
    checkpoint save, the user.
    """

    def get(self) -> int:
        return self.__dict__.get("_host_skipped_steps", 0) + _device_skipped_steps(self)

    def set(self, value: int) -> None:
        self.__dict__["_host_skipped_steps"] = value - _device_skipped_steps(self)

    return property(get, set, doc=skipped_steps.__doc__)


def configure_optimizer(original):
    """Guard the inner optimizer of every wrapper whose ``is_invalid_grad_norm`` test moved to the device.

    The wrapper's ``xla_skipped_steps`` (``step_guard.SkipCounter``) counts on the device the steps discarded
    because the gradient norm was invalid, numbered as DeepSpeed's progress log numbers them; ``engine.skipped_steps``
    adds it in, and warns of a streak of them as it reads it.
    """

    @functools.wraps(original)
    def configure(self, client_optimizer, model_parameters):
        original(self, client_optimizer, model_parameters)
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        wrapper = self.optimizer
        if isinstance(wrapper, (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer,
                                DeepSpeedZeroOptimizer_Stage3)):
            from deepspeed_xla import step_guard
            counter = step_guard.SkipCounter()
            setattr(wrapper, SKIPPED_STEPS, counter)
            step_guard.guard_step(wrapper.optimizer, lambda: wrapper._global_grad_norm,
                                  lambda skipped: counter.add(skipped, self.global_steps + 1))

    return configure


def get_shared_params(original):
    """Name tied parameters by Parameter identity: XLA tensors have no storage pointer.

    Upstream finds shared weights by ``param.data_ptr()``, which is 0 for every XLA tensor, so every
    parameter looks shared with the first one and ``zero_to_fp32`` writes the first parameter's values
    under every name. Tied weights are one Parameter object reached under several names. ZeRO-3
    identifies them by ``ds_id`` upstream and is left as it is.
    """

    @functools.wraps(original)
    def get_shared_params(self):
        from deepspeed import comm as dist
        if self.zero_optimization_partition_weights() or dist.get_rank() != 0:
            return original(self)
        first_name, shared = {}, {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) in first_name:
                shared[name] = first_name[id(param)]
            else:
                first_name[id(param)] = name
        return shared

    return get_shared_params


def ranks_agree(original):
    """Stop at ``deepspeed.initialize`` when the ranks were launched with different configs or package versions.

    Here rather than in ``DeepSpeedConfig``, which a user may build on one rank alone: every rank builds an engine,
    after the process group exists and before any collective whose shape the config decides.
    """

    @functools.wraps(original)
    def configure_with_arguments(self, args, mpu):
        from deepspeed import comm as dist
        from deepspeed_xla import rank_agreement
        rank_agreement.check(self._config._param_dict, dist.all_gather_object, dist.get_world_size())
        return original(self, args, mpu)

    return configure_with_arguments
