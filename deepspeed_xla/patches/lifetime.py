"""What DeepSpeed keeps of an engine after ``destroy()``: nothing, and nothing it does when the destroyed engine is
collected, so several engines can be built one after another in one process (a notebook re-running its training cell,
``Trainer.hyperparameter_search``, a sweep script).

Upstream keeps two process-wide references to every ZeRO-3 engine's model, and with it the model's parameters,
gradients and optimizer state in device memory for the life of the process (about eight times the model: on a TPU,
HBM the next engine does not get): ``partitioned_param_coordinator``'s ``__params_to_release`` is an ``lru_cache`` on
the class, keyed by coordinator and submodule; ``parameter_offload.FWD_MODULE_STACK`` is a module-level list that
every ZeRO-3 engine appends its model to and nothing removes it from.

A model has one training engine at a time: ``deepspeed.initialize`` on a model whose earlier engine is still alive
(DeepSpeed's ``test_load_immediate_save``, a notebook re-running its cell) destroys that engine first when its
gradient hooks are on the model's parameters, since they would act on the new engine's backward too.
"""
import functools
import weakref

from deepspeed_xla.patches.registry import unwrapped

_RELEASE_SETS = "_dsx_params_to_release"
_DESTROYED = "_dsx_destroyed"
# The handles of the hooks DeepSpeedEngine puts on the user's model (__init__, _configure_tensor_parallel_states).
_MODEL_HOOKS = ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check")
_LIVE = weakref.WeakSet()  # engines built and not destroyed
SUPERSEDED = ("deepspeed_xla: deepspeed.initialize was called again on this engine's model while this engine was "
              "alive, and the new engine took the model over: this engine was destroyed then (its gradient hooks on "
              "the model's parameters would have acted on the new engine's backward). Train with the engine the "
              "later deepspeed.initialize returned, or give each engine a model of its own.")


def params_to_release_per_coordinator(original):
    """``PartitionedParameterCoordinator.__params_to_release``: the same sets, computed once per (submodule, step) as
    upstream's cache does, but kept by the coordinator itself, so that they go with it. A live engine releases
    exactly what it released before (each set is still computed once, on first use)."""
    compute = unwrapped(original)

    @functools.wraps(compute)
    def params_to_release(self, submodule_to_release, step_id):
        release_sets = self.__dict__.setdefault(_RELEASE_SETS, {})
        key = (submodule_to_release, step_id)
        if key not in release_sets:
            release_sets[key] = compute(self, submodule_to_release, step_id)
        return release_sets[key]

    return params_to_release


def destroy_forgets_the_model(original):
    """``DeepSpeedZeRoOffload.destroy`` (called by the ZeRO-3 optimizer's and so the engine's ``destroy``): the model
    leaves ``FWD_MODULE_STACK`` too, where ``setup_zero_stage3_hooks`` put it; other engines' entries stay."""

    @functools.wraps(original)
    def destroy(self):
        original(self)
        from deepspeed.runtime.zero import parameter_offload
        stack = parameter_offload.FWD_MODULE_STACK
        stack[:] = [module for module in stack if module is not self.module]

    return destroy


def destroy_once(original):
    """``DeepSpeedEngine.destroy``: a second call does nothing, and the engine's forward hooks leave the model.

    ``DeepSpeedEngine.__del__`` destroys the engine again when the garbage collector takes it, at whatever moment
    that is, and ZeRO's ``destroy`` waits for the device (``synchronize``): on XLA that cuts the graph another engine
    is tracing then, which compiles graphs again (seen in the last step of the next engine's run, 2 compilations).
    Upstream leaves the hooks the engine put on the user's model (its forward prologue and epilogue, the first
    forward's tensor-parallel input check): a model that outlives its engine kept the engine, its gradients and
    optimizer state alive, and ran the destroyed engine's prologue in every later engine's forward."""

    @functools.wraps(original)
    def destroy(self):
        if self.__dict__.get(_DESTROYED):
            return
        original(self)
        for hook in _MODEL_HOOKS:
            handle = self.__dict__.get(hook)
            if handle is not None:
                handle.remove()
        self.__dict__[_DESTROYED] = True
        _LIVE.discard(self)

    return destroy


def one_training_engine_per_model(original):
    """``DeepSpeedEngine._configure_distributed_model``: a live engine whose gradient hooks are on this model's
    parameters is destroyed before the new engine takes the model. Left alive, ZeRO-1/2's hooks fill the old engine's
    reduce bucket with the new engine's gradients and, once it is full (at once on XLA, whose buckets hold the model;
    at 5e8 elements elsewhere), fail ("has already been reduced"); ZeRO-3's module hooks fetch and release the
    parameters the new engine manages. The old engine's forward, backward and step then raise ``SUPERSEDED``."""

    @functools.wraps(original)
    def configure(self, model):
        for earlier in list(_LIVE):
            if _holds_gradient_hooks(earlier) and _shares_parameters(earlier.module, model):
                _supersede(earlier)
        original(self, model)
        _LIVE.add(self)

    return configure


def _holds_gradient_hooks(engine) -> bool:
    """ZeRO-2's and ZeRO-3's optimizers (ZeRO-1's, with ``overlap_comm``), a bf16 optimizer updating at once, and a
    ZeRO-3 engine without an optimizer (its module hooks gather the parameters)."""
    return bool(getattr(engine.optimizer, "_grad_acc_hooks", None)) or engine.zero_optimization_partition_weights()


def _shares_parameters(module, model) -> bool:
    mine = {id(param) for param in module.parameters()}
    return any(id(param) in mine for param in model.parameters())


def _supersede(engine) -> None:
    from deepspeed.utils import logger
    logger.warning("deepspeed_xla: this model's parameters carry the gradient hooks of an earlier engine that is "
                   "still alive; destroying it so that the new engine alone trains them (call destroy() on an "
                   "engine before initializing another on its model to skip this).")
    engine.destroy()

    def refuse(*args, **kwargs):
        raise RuntimeError(SUPERSEDED)

    for method in ("forward", "backward", "step"):
        object.__setattr__(engine, method, refuse)
