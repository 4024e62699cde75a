"""What DeepSpeed keeps of an engine after ``destroy()``: nothing, and nothing it does when the destroyed engine is
collected, so several engines can be built one after another in one process (a notebook re-running its training cell,
``Trainer.hyperparameter_search``, a sweep script).

Upstream keeps two process-wide references to every ZeRO-3 engine's model, and with it the model's parameters,
gradients and optimizer state in device memory for the life of the process (about eight times the model: on a TPU,
HBM the next engine does not get): ``partitioned_param_coordinator``'s ``__params_to_release`` is an ``lru_cache`` on
the class, keyed by coordinator and submodule; ``parameter_offload.FWD_MODULE_STACK`` is a module-level list that
every ZeRO-3 engine appends its model to and nothing removes it from.
"""
import functools

from deepspeed_xla.patches.registry import unwrapped

_RELEASE_SETS = "_dsx_params_to_release"
_DESTROYED = "_dsx_destroyed"


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
    """``DeepSpeedEngine.destroy``: a second call does nothing. ``DeepSpeedEngine.__del__`` destroys the engine again
    when the garbage collector takes it, at whatever moment that is, and ZeRO's ``destroy`` waits for the device
    (``synchronize``): on XLA that cuts the graph another engine is tracing then, which compiles graphs again (seen
    in the last step of the next engine's run, 2 compilations)."""

    @functools.wraps(original)
    def destroy(self):
        if self.__dict__.get(_DESTROYED):
            return
        original(self)
        self.__dict__[_DESTROYED] = True

    return destroy
