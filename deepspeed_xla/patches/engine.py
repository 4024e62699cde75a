"""Patches of DeepSpeed's engine (``deepspeed.runtime.engine``): placement, step ends, ZeRO setup, checkpoints.

``DeepSpeedEngine`` assumes an eager device: it moves the model with ``module.to`` (which on XLA replaces
the Parameters the optimizer holds), never marks a step's end (the lazy graph would grow across steps),
sizes ZeRO's buckets for CUDA's unbacked allocations, finds tied weights by storage pointer (0 on XLA)
and counts skipped steps on the host; its checkpoints would hold XLA tensors and name ``latest`` before
every rank is done. These wrappers fit each of those to XLA.
"""
import contextlib
import functools
import os


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
        try:
            with keep_parameter_objects():
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
        from deepspeed_xla import xla_runtime
        xla_runtime.sync(wait=False)
        return result

    return sync_after


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


def create_checkpoint_engine(original):
    """Give DeepSpeed's checkpoint engine CPU tensors: checkpoints written on XLA load without torch_xla."""

    @functools.wraps(original)
    def create_checkpoint_engine(*args, **kwargs):
        from deepspeed_xla.checkpoint import CpuCheckpointEngine
        return CpuCheckpointEngine(original(*args, **kwargs))

    return create_checkpoint_engine


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


def _raise_first_failure(failures) -> None:
    """Every rank raises the error of the lowest rank that recorded one (``checkpoint.first_failure``), or none does:
    an error that one rank alone sees would leave the others waiting for it in the next collective."""
    from deepspeed import comm as dist
    from deepspeed_xla import checkpoint
    failures_per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(failures_per_rank, failures)
    failure = checkpoint.first_failure(failures_per_rank)
    if failure is not None:
        raise failure


def _record(failures: list, what: str, advice: str, action, *args) -> None:
    """Run ``action``; its OS error goes into ``failures`` for every rank to raise, saying what failed and why."""
    try:
        action(*args)
    except OSError as error:
        from deepspeed import comm as dist
        failures.append((error.errno, f"deepspeed_xla: rank {dist.get_rank()} could not {what}: {error}. {advice}"))


def save_checkpoint(original):
    """Write the tag aside and name it, then ``latest``, only once every rank's files are on disk.

    Upstream rank 0 writes ``latest`` before the final barrier, so it can name a checkpoint another
    rank is still writing (or dies writing), and a tag saved again is overwritten file by file. Here
    the upstream save writes ``<tag>.saving`` and ends with a barrier that every rank reaches after its
    files; then the rank that made ``save_dir`` (upstream's choice: rank 0, or each node's with node-local
    storage) gives it the tag's name, rank 0 writes ``latest``, and every rank learns whether that worked.
    An error one rank alone sees (a file it cannot write, a ``save_dir`` others may write to, the rename, ``latest``)
    does not stop that rank while the others wait for it in a collective: every rank raises it, and a failed write
    removes ``<tag>.saving``. Decoupled (asynchronous) checkpoint engines write ``latest`` when they commit
    and are left as they are.
    """

    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        client_state = {} if client_state is None else client_state
        if self.checkpoint_engine.is_decoupled():
            return original(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        from deepspeed import comm as dist
        from deepspeed_xla import checkpoint_tags as tags
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        writes_save_dir = (self.local_rank if self.use_node_local_storage() else self.global_rank) == 0
        refused = []
        try:
            tags.check_save_dir(save_dir)
        except OSError as error:
            refused.append((error.errno, error.strerror))
        _raise_first_failure(refused)  # before any rank writes
        if writes_save_dir:  # before upstream's first barrier: no rank writes yet
            tags.discard_unfinished(save_dir, tag)
        with self.checkpoint_engine.deferring_write_errors() as failures:
            result = original(self, save_dir, tags.saving_tag(tag), client_state, False, exclude_frozen_parameters)
        try:
            _raise_first_failure(failures)
        except OSError:
            if writes_save_dir:
                tags.discard_unfinished(save_dir, tag)
            dist.barrier()  # no rank stops before the unfinished tag is gone
            raise
        ending = []
        if writes_save_dir:
            _record(ending, f"give the complete checkpoint {os.path.join(save_dir, tags.saving_tag(tag))} the name "
                            f"{tag}", f"`latest` keeps naming the last complete checkpoint. {save_dir} must let this "
                            "user rename folders in it (gcsfuse: a bucket with hierarchical namespace).",
                    tags.promote, save_dir, tag)
        if save_latest and self.global_rank == 0 and not ending:
            _record(ending, f"point {os.path.join(save_dir, tags.LATEST)} at the checkpoint {tag}",
                    f"The checkpoint is complete: load_checkpoint({save_dir!r}, tag={tag!r}) loads it; `latest` keeps "
                    "naming the one before.", tags.write_latest, save_dir, tag)
        _raise_first_failure(ending)  # also ends the save, as upstream's barrier did
        return result

    return save_checkpoint


def copy_recovery_script(original):
    """Rank 0 alone copies DeepSpeed's recovery scripts into ``save_dir`` at the end of a save: an error there is
    held for every rank to raise (``CpuCheckpointEngine.hold``), not raised while the others wait in a barrier."""

    @functools.wraps(original)
    def copy(self, save_path):
        try:
            return original(self, save_path)
        except OSError as error:
            self.checkpoint_engine.hold(OSError(error.errno, (
                f"deepspeed_xla: rank 0 could not copy DeepSpeed's recovery scripts (zero_to_fp32.py, "
                f"zero_to_torch.py) into {save_path}: {error}. This save is abandoned: `latest` keeps naming the last "
                "complete checkpoint. Fix the cause it names, or save to another save_dir.")))

    return copy


CONVERSION = ("python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state --input_folder {folder} "
              "--output_folder {folder}_universal")


def zero_checkpoint_world_size(original):
    """Name the way out when a ZeRO checkpoint is loaded on another data-parallel size.

    Upstream refuses it ("Automatic adjustment ... is not currently supported") without saying that
    DeepSpeed's universal checkpoint loads at any size: a pod job is often resumed on another number of
    chips. Same condition as upstream's, checked first so the error can name the command.
    """

    @functools.wraps(original)
    def load(self, load_dir, tag, load_optimizer_states=True):
        from deepspeed_xla import checkpoint_tags
        tag = checkpoint_tags.loadable_tag(load_dir, tag, warn=False)  # warned of in _load_checkpoint
        saved, now = self.loaded_checkpoint_dp_world_size, self.seq_dp_world_size
        if load_optimizer_states and not self.load_universal_checkpoint() and saved != now:
            from deepspeed.runtime.zero.utils import ZeRORuntimeException
            folder = os.path.join(load_dir, str(tag))
            raise ZeRORuntimeException(
                f"deepspeed_xla: this ZeRO checkpoint was saved by {saved} data-parallel ranks and is loaded by {now}. "
                f"Convert it to a universal checkpoint, which loads at any size: {CONVERSION.format(folder=folder)}; "
                f"then resume from {load_dir} with \"checkpoint\": {{\"load_universal\": true}} in the config "
                "(docs/checkpoints.md).")
        return original(self, load_dir, tag, load_optimizer_states)

    return load


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


def _saved_zero_stage(folder: str):
    """The ZeRO stage of the DeepSpeed config a checkpoint folder was saved with (None: no model file with one).

    Read from its (first) model file, memory-mapped in torch's zip format: only the pickled metadata is read, not the
    weights (a legacy-format file, ``"checkpoint_serialization": false``, cannot be mapped and is read whole). A config
    of ``"zero_optimization": true`` (DeepSpeed's legacy form) is stage 1, as DeepSpeed reads it.
    """
    import glob
    import torch
    for pattern in ("mp_rank_*_model_states.pt", "zero_pp_rank_*_mp_rank_*_model_states.pt"):
        found = sorted(glob.glob(os.path.join(glob.escape(folder), pattern)))
        if found:
            with open(found[0], "rb") as file:
                mappable = torch.serialization._is_zipfile(file)
            config = torch.load(found[0], map_location="cpu", mmap=mappable, weights_only=False).get("ds_config")
            zero = config.get("zero_optimization", {}) if isinstance(config, dict) else None
            if isinstance(zero, bool):
                return int(zero)
            return zero.get("stage", 0) if isinstance(zero, dict) else None
    return None


def _stage_change_problem(load_dir: str, tag: str, saved: int, now: int, optimizer_states: bool):
    """Why DeepSpeed cannot load a checkpoint of ZeRO stage ``saved`` into stage ``now``, with the ways out; None
    where it can: ZeRO-1 and ZeRO-2 write the same files, and stages 0 and 1-2 share their model file."""
    folder = os.path.join(load_dir, str(tag))
    saved_as = f"deepspeed_xla: this checkpoint ({folder}) was saved by ZeRO stage {saved} and is loaded by stage {now}"
    if (saved == 3) != (now == 3):
        weights = (f"python {os.path.join(load_dir, 'zero_to_fp32.py')} {load_dir} <output folder> --tag {tag} writes "
                   "them" if saved else f"they are the \"module\" entry of {os.path.join(folder, '*model_states.pt')}")
        return (f"{saved_as}. DeepSpeed names and partitions the model files of ZeRO-3 differently: it cannot load "
                "either into the other, not even converted to a universal checkpoint or without optimizer states. "
                f"Resume with \"stage\": {saved} in the config; or start stage {now} from the weights alone "
                f"({weights}) loaded into the model before deepspeed.initialize, with a new optimizer "
                "(docs/checkpoints.md).")
    if optimizer_states and (saved == 0) != (now == 0):
        return (f"{saved_as}. Optimizer states of ZeRO stage 0 and of stages 1-2 are not interchangeable in DeepSpeed. "
                f"Resume with \"stage\": {saved} in the config; or load the weights and step count alone, with a new "
                "optimizer: engine.load_checkpoint(..., load_optimizer_states=False) (docs/checkpoints.md).")
    return None


def zero_stage_of_checkpoint(original):
    """Stop with both ZeRO stages named where DeepSpeed cannot load a checkpoint of another stage.

    Upstream fails on its own later, without naming either stage: ZeRO-3 <-> any other stage with a bare
    ``AssertionError`` (no model file under the name it looks for), stage 1-2 -> 0 with ``'NoneType' object has no
    attribute 'copy'``, 0 -> 1-2 with a missing ``zero_pp_rank_0_..._optim_states.pt`` (the same on DeepSpeed's CPU
    accelerator). ZeRO-1 <-> 2 loads.
    """

    @functools.wraps(original)
    def load(self, load_dir, tag, load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=True,
             load_module_only=False, custom_load_fn=None):
        from deepspeed_xla import checkpoint_tags
        tag = checkpoint_tags.loadable_tag(load_dir, tag)
        saved = _saved_zero_stage(os.path.join(load_dir, str(tag)))
        if saved is not None:
            problem = _stage_change_problem(load_dir, tag, saved, self.zero_optimization_stage(),
                                            load_optimizer_states and not load_module_only)
            if problem:
                from deepspeed.runtime.zero.utils import ZeRORuntimeException
                raise ZeRORuntimeException(problem)
        return original(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                        load_module_only, custom_load_fn)

    return load
