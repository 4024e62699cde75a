"""Patches of DeepSpeed's engine's checkpoint save and load (``deepspeed.runtime.engine``).

The engine hands its checkpoint engine XLA tensors, names ``latest`` before every rank is done, lets an error that one
rank alone sees at a save's end stop that rank while the others wait for it, and fails late, without naming either,
on a checkpoint of another ZeRO stage or data-parallel size. These wrappers fit each of those to XLA and to pods
(files: ``checkpoint.py``; tags and ``latest``: ``checkpoint_tags.py``).
"""
import functools
import os


def create_checkpoint_engine(original):
    """Give DeepSpeed's checkpoint engine CPU tensors: checkpoints written on XLA load without torch_xla."""

    @functools.wraps(original)
    def create_checkpoint_engine(*args, **kwargs):
        from deepspeed_xla.checkpoint import CpuCheckpointEngine
        return CpuCheckpointEngine(original(*args, **kwargs))

    return create_checkpoint_engine


def _gathered(value) -> list:
    """Every rank's ``value``, in rank order (one object collective)."""
    from deepspeed import comm as dist
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _raise_first_failure(failures) -> None:
    """Every rank raises the error of the lowest rank that recorded one (``checkpoint.first_failure``), or none does:
    an error that one rank alone sees would leave the others waiting for it in the next collective."""
    from deepspeed_xla import checkpoint
    failure = checkpoint.first_failure(_gathered(failures))
    if failure is not None:
        raise failure


def _storage_problem(save_dir: str, seen: int) -> list:
    """Why the ranks' view of ``save_dir`` does not fit the storage setting, given how many writers' marks this rank
    sees (``checkpoint_tags.mark_writer``); [] where it fits."""
    if seen == 1:
        return []
    import errno
    import socket
    from deepspeed import comm as dist
    where = f"deepspeed_xla: rank {dist.get_rank()} (host {socket.gethostname()})"
    if not seen:
        return [(errno.EINVAL, (
            f"{where} does not see the checkpoint that rank 0 writes in {save_dir}: that folder is on each host's own "
            "disk, and only rank 0's host would get a complete checkpoint and `latest` (the other hosts would resume "
            "from nothing). Save to a folder every host shares, or set \"checkpoint\": {\"use_node_local_storage\": "
            "true} in the DeepSpeed config to keep a checkpoint on each host's disk. Nothing was kept."))]
    return [(errno.EINVAL, (
        f"{where} sees {seen} hosts write their checkpoint in {save_dir} with \"use_node_local_storage\": true: that "
        "folder is shared between the hosts, and each host's local rank 0 would give the tag its name over the "
        "others'. Remove \"use_node_local_storage\" from the DeepSpeed config's \"checkpoint\" section, or save to a "
        "folder on each host's own disk. Nothing was kept."))]


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
    removes ``<tag>.saving``. So does a ``save_dir`` that is not what the storage setting says (each host's own disk
    without ``use_node_local_storage``, or one shared folder with it: ``checkpoint_tags.mark_writer``, counted in
    ``CpuCheckpointEngine.create``, which upstream calls after its first barrier). Decoupled
    (asynchronous) checkpoint engines write ``latest`` when they commit and are left as they are.
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
        if writes_save_dir and not refused:
            tags.discard_unfinished(save_dir, tag)
        _raise_first_failure(refused)  # also: every writer has discarded before any marks (mark_writer)
        with self.checkpoint_engine.deferring_write_errors(
                lambda: _storage_problem(save_dir, tags.writers_seen(save_dir, tag))) as failures:
            if writes_save_dir:
                _record(failures, f"start the checkpoint {tag} in {save_dir}", "Nothing was kept.", tags.mark_writer,
                        save_dir, tag, self.global_rank)
            result = original(self, save_dir, tags.saving_tag(tag), client_state, False, exclude_frozen_parameters)
        try:
            _raise_first_failure(failures)
        except OSError:
            if writes_save_dir or not tags.writers_seen(save_dir, tag):  # none seen: this rank's own disk
                tags.discard_unfinished(save_dir, tag)
            dist.barrier()  # no rank stops before the unfinished tag is gone
            raise
        if writes_save_dir:
            tags.unmark_writer(save_dir, tag, self.global_rank)
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


def _differing(views: list) -> str:
    """"rank 0 (host a): X; ranks 1, 2 (host b): Y" for (host, view) pairs in rank order; "" when all views agree."""
    groups = {}
    for rank, (host, view) in enumerate(views):
        groups.setdefault(view, []).append((rank, host))
    if len(groups) < 2:
        return ""
    return "; ".join(f"rank{'s' * (len(members) > 1)} {', '.join(str(rank) for rank, _ in members)} (host "
                     f"{', '.join(sorted({host for _, host in members}))}): {view}" for view, members in groups.items())


def ranks_load_one_checkpoint(original):
    """Every rank resumes from the same tag and step, or every rank stops naming the ranks and hosts that differ.

    Each rank reads ``latest`` and its files from its own view of ``load_dir``: where that is each host's own disk (a
    save to it without ``use_node_local_storage`` names the checkpoint on rank 0's host only) or a copy some hosts got
    and others did not, upstream resumes some ranks and starts the others from scratch, or from another step."""

    @functools.wraps(original)
    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        import socket
        from deepspeed_xla import checkpoint_tags as tags
        named = tag if tag is not None else tags.latest_tag(load_dir, self.load_universal_checkpoint())
        found = named is not None and os.path.isdir(os.path.join(load_dir, tags.loadable_tag(load_dir, named, False)))
        view = "no `latest`" if named is None else f"tag {named}" + ("" if found else " (missing)")
        host = socket.gethostname()
        differ = _differing(_gathered((host, view)))
        if not differ:
            result = original(self, load_dir, tag, *args, **kwargs)
            differ = _differing(_gathered((host, f"step {self.global_steps}")))
        if differ:
            raise RuntimeError(
                f"deepspeed_xla: the ranks would not resume from the same checkpoint of {load_dir} ({differ}): it is "
                "on each host's own disk, or was copied to some hosts only. Load from a folder every host shares, or "
                "copy the whole checkpoint to every host; a save to each host's own disk needs \"checkpoint\": "
                "{\"use_node_local_storage\": true} in the DeepSpeed config (docs/checkpoints.md).")
        return result

    return load_checkpoint


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
