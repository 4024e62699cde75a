"""Checkpoints of a tiny DeepSpeed engine on XLA, its ranks forked by ``run_ranks``: an error one rank alone sees at
the end of a save is raised by every rank, a ``save_dir`` on each host's own disk (or shared against the setting)
stops every rank, and DeepSpeed's legacy forms and a tag left moved aside resume. (Launched trainings that save and
resume: ``test_checkpoint.py``.)"""
import json
import sys

import torch

from tests.multiproc import run_ranks


def _tiny_engine(config: dict):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.05}}}
    engine, *_ = deepspeed.initialize(model=model, config={**base, **config})
    return engine


def _train(engine, steps: int) -> None:
    x = torch.arange(12.0).reshape(2, 6).to(engine.device) / 10
    for _ in range(steps):
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _outcome(action) -> list:
    """[errno, message] of the OSError (or RuntimeError: errno 0) ``action`` raised; [0, ""] if it raised none."""
    try:
        action()
        return [0, ""]
    except (OSError, RuntimeError) as error:
        return [getattr(error, "errno", 0), str(error)]


def errors_one_rank_sees_at_the_end_of_a_save():
    """Run by ``run_ranks`` (2 ranks, ZeRO-1): rank 0 alone fails in turn to rename the tag, to write ``latest`` and
    to copy DeepSpeed's recovery scripts; then every rank tries a folder that every user may write to. Each save's
    outcome on this rank, and ``latest`` after each, as JSON; then one more save, which must work."""
    import errno
    import json
    import os
    from pathlib import Path
    save_dir = Path(sys.argv[1])
    engine = _tiny_engine({"zero_optimization": {"stage": 1}})
    _train(engine, 1)
    engine.save_checkpoint(str(save_dir), tag="good")
    rank, rename, replace = engine.global_rank, os.rename, os.replace

    def failing(upstream, part: str, code: int):
        def call(source, target):
            if str(target).endswith(part):
                raise OSError(code, os.strerror(code), str(source), None, str(target))
            return upstream(source, target)
        return call

    outcomes = {}
    for tag, patch in (("renamed", ("rename", failing(rename, "/renamed", errno.EXDEV))),
                       ("unnamed", ("replace", failing(replace, "/latest", errno.ENOSPC))),
                       ("recovery_script", None)):
        if rank == 0 and patch:
            setattr(os, *patch)
        if rank == 0 and tag == "recovery_script":
            (save_dir / "zero_to_fp32.py").unlink()
            (save_dir / "zero_to_fp32.py").mkdir()
        outcomes[tag] = _outcome(lambda: engine.save_checkpoint(str(save_dir), tag=tag))
        os.rename, os.replace = rename, replace
        outcomes[tag].append((save_dir / "latest").read_text())
    if rank == 0:
        (save_dir / "zero_to_fp32.py").rmdir()
        (save_dir / "shared").mkdir(mode=0o777)
        os.chmod(save_dir / "shared", 0o777)
    torch.distributed.barrier()
    outcomes["shared"] = _outcome(lambda: engine.save_checkpoint(str(save_dir / "shared"), tag="shared"))
    engine.save_checkpoint(str(save_dir), tag="after")
    outcomes["after"] = (save_dir / "latest").read_text()
    print(json.dumps(outcomes))


def test_an_error_one_rank_sees_at_the_end_of_a_save_is_raised_by_every_rank(tmp_path):
    """Rank 0 alone renames the tag, writes ``latest`` and copies the recovery scripts: upstream raised there on rank 0
    while rank 1 waited in the save's last barrier. Every rank raises the same error, naming rank 0, what failed and
    the way out; ``latest`` keeps naming the last complete checkpoint, and the ranks save on together afterwards. A
    folder every user may write to is refused by every rank before anything is written."""
    save_dir = tmp_path / "ckpt"
    procs = run_ranks("tests.launched.test_checkpoint_ranks:errors_one_rank_sees_at_the_end_of_a_save", 2,
                      args=(save_dir, ), env={"DS_ACCELERATOR": "xla", "DS_XLA_COMM_TIMEOUT": "60"})
    assert all(proc.returncode == 0 for proc in procs), "\n".join(proc.stderr[-4000:] for proc in procs)
    rank0, rank1 = (json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs)
    assert rank0 == rank1, (rank0, rank1)
    renamed, latest, script = rank0["renamed"], rank0["unnamed"], rank0["recovery_script"]
    assert renamed[0] == 18 and renamed[2] == "good", renamed
    assert (f"rank 0 could not give the complete checkpoint {save_dir}/renamed.saving the name renamed: [Errno 18] "
            "Invalid cross-device link" in renamed[1] and "a bucket with hierarchical namespace" in renamed[1]), renamed
    assert latest[0] == 28 and latest[2] == "good", latest
    assert (f"rank 0 could not point {save_dir}/latest at the checkpoint unnamed: [Errno 28] No space left on device"
            in latest[1] and f"load_checkpoint('{save_dir}', tag='unnamed') loads it" in latest[1]), latest
    assert script[0] == 21 and script[2] == "good", script
    assert (f"rank 0 could not copy DeepSpeed's recovery scripts (zero_to_fp32.py, zero_to_torch.py) into {save_dir}: "
            "[Errno 21] Is a directory" in script[1] and "This save is abandoned" in script[1]), script
    assert not (save_dir / "recovery_script").exists() and not (save_dir / "recovery_script.saving").exists()
    shared = rank0["shared"]
    assert shared[0] == 1 and f"every user may write to the checkpoint folder {save_dir / 'shared'}" in shared[1]
    assert not list((save_dir / "shared").iterdir())
    assert rank0["after"] == "after"


def resumes_of_one_rank():
    """Run by ``run_ranks`` (1 rank): DeepSpeed's legacy file format (``checkpoint_serialization: false``), its legacy
    ZeRO switch (``"zero_optimization": true``, stage 1), and a ZeRO-2 tag ``latest`` names that a save stopped
    between the move-aside renames left as ``<tag>.replaced``: save after 2 steps, load into a new engine, 1 more step
    each; what was loaded and the weights as JSON."""
    import json
    import os
    save_dir = sys.argv[1]
    results = {}
    for name, config in (("legacy_format", {"checkpoint": {"checkpoint_serialization": False},
                                            "zero_optimization": {"stage": 2}}),
                         ("zero_true", {"zero_optimization": True}),
                         ("moved_aside", {"zero_optimization": {"stage": 2}})):
        engine = _tiny_engine(config)
        _train(engine, 2)
        engine.save_checkpoint(f"{save_dir}/{name}", tag="last")
        if name == "moved_aside":  # what the first rename of promote's move-aside path leaves
            os.rename(f"{save_dir}/{name}/last", f"{save_dir}/{name}/last.replaced")
        _train(engine, 1)
        resumed = _tiny_engine(config)
        path, _ = resumed.load_checkpoint(f"{save_dir}/{name}")
        _train(resumed, 1)
        results[name] = {"loaded": path, "steps": resumed.global_steps,
                         "weights": [[p.detach().cpu().tolist() for p in e.module.parameters()]
                                     for e in (engine, resumed)]}
    print(json.dumps(results))


def test_legacy_forms_and_a_tag_moved_aside_resume(tmp_path):
    """Upstream's legacy forms load: the legacy file format failed in the ZeRO stage check (it memory-mapped a file
    torch cannot map) and ``"zero_optimization": true`` with ``'bool' object has no attribute 'get'``. A tag that a
    save stopped between its two renames left as ``<tag>.replaced`` loads from there, saying so (it was "not found").
    Resumed, each trains as the run that saved it did (same weights after one more step: the same XLA graphs on the
    same values)."""
    [proc] = run_ranks("tests.launched.test_checkpoint_ranks:resumes_of_one_rank", 1, args=(tmp_path, ),
                       env={"DS_ACCELERATOR": "xla"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == ["legacy_format", "moved_aside", "zero_true"]
    for name, result in results.items():
        tag = "last.replaced" if name == "moved_aside" else "last"
        assert result["loaded"] == str(tmp_path / name / tag / "mp_rank_00_model_states.pt"), (name, result)
        assert result["steps"] == 3, (name, result)
        saved, resumed = result["weights"]
        assert saved == resumed, name
    assert f"the checkpoint {tmp_path}/moved_aside/last is missing" in proc.stderr, proc.stderr[-3000:]
    with open(tmp_path / "legacy_format" / "last" / "mp_rank_00_model_states.pt", "rb") as file:
        assert not torch.serialization._is_zipfile(file)


def checkpoints_on_each_hosts_own_disk():
    """Run by ``run_ranks`` (2 ranks, ZeRO-1), each rank standing for a host: a relative ``save_dir`` in a working
    folder of each rank's own is a folder on each host's own disk. Saves there without node-local storage, and in one
    shared folder with it (rank 1 then stands for local rank 0 of a second host); loads where the ranks' ``latest``
    differ, and where it names one tag of different steps. Each outcome on this rank, as JSON."""
    import json
    import os
    import shutil
    from pathlib import Path
    root, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    engine = _tiny_engine({"zero_optimization": {"stage": 1}})
    _train(engine, 1)
    outcomes = {}
    os.chdir(root / "shared")
    engine.save_checkpoint("ckpt", tag="last")  # a shared folder: fine
    if rank == 0:
        shutil.copytree("ckpt", root / "host1" / "ckpt")  # a copy at step 1, on "host 1" only
    _train(engine, 1)
    engine.save_checkpoint("ckpt", tag="last")  # step 2, in the shared folder
    os.chdir(root / f"host{rank}")
    outcomes["local_save"] = _outcome(lambda: engine.save_checkpoint("local", tag="local"))
    outcomes["local_left"] = sorted(os.listdir("local")) if os.path.isdir("local") else []
    os.chdir(root / "shared")
    node_local = _tiny_engine({"zero_optimization": {"stage": 1}, "checkpoint": {"use_node_local_storage": True}})
    node_local.local_rank = 0  # every rank is its host's local rank 0
    outcomes["shared_node_local"] = _outcome(lambda: node_local.save_checkpoint("node_local", tag="n"))
    outcomes["shared_node_local_left"] = sorted(os.listdir("node_local"))
    os.chdir(root / ("shared" if rank == 0 else "host0"))  # host 0's disk has no checkpoint in "ckpt"
    outcomes["no_latest"] = _outcome(lambda: _tiny_engine({"zero_optimization": {"stage": 1}}).load_checkpoint("ckpt"))
    os.chdir(root / ("shared" if rank == 0 else "host1"))  # "last" of step 2 and its copy of step 1
    outcomes["other_step"] = _outcome(lambda: _tiny_engine({"zero_optimization": {"stage": 1}}).load_checkpoint("ckpt"))
    print(json.dumps(outcomes))


def test_a_save_dir_on_each_hosts_disk_or_shared_against_the_setting_stops_every_rank(tmp_path):
    """``save_dir`` on each host's own disk without ``use_node_local_storage``: upstream named the checkpoint on rank 0's
    host only and the other hosts resumed from nothing; with the setting on one shared folder, each host's local rank 0
    renamed the tag over the others'. Both stop every rank at the save, naming the rank, its host and the fix, and
    leave nothing. A load where the ranks' ``latest`` differ, or name one tag of different steps, stops every rank
    naming each rank's host and view, where upstream resumed some ranks only or from different steps."""
    for folder in ("shared", "host0", "host1"):
        (tmp_path / folder).mkdir()
    procs = run_ranks("tests.launched.test_checkpoint_ranks:checkpoints_on_each_hosts_own_disk", 2, args=(tmp_path, ),
                      env={"DS_ACCELERATOR": "xla"})
    assert all(proc.returncode == 0 for proc in procs), "\n".join(proc.stderr[-4000:] for proc in procs)
    rank0, rank1 = (json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs)
    for key in ("local_save", "shared_node_local", "no_latest", "other_step"):
        assert rank0[key] == rank1[key] and rank0[key][1], (key, rank0[key], rank1[key])
    assert ("rank 1 (host " in rank0["local_save"][1] and "does not see the checkpoint that rank 0 writes in local: "
            "that folder is on each host's own disk" in rank0["local_save"][1]
            and '"use_node_local_storage": true' in rank0["local_save"][1]), rank0["local_save"]
    scripts = ["zero_to_fp32.py", "zero_to_torch.py"]  # rank 0 copies DeepSpeed's recovery scripts before it knows
    assert rank0["local_left"] == scripts and rank1["local_left"] == [], (rank0["local_left"], rank1["local_left"])
    assert ("sees 2 hosts write their checkpoint in node_local with \"use_node_local_storage\": true: that folder is "
            "shared" in rank0["shared_node_local"][1]), rank0["shared_node_local"]
    assert rank0["shared_node_local_left"] == rank1["shared_node_local_left"] == scripts
    views = "rank 0 (host {0}): tag last; rank 1 (host {0}): no `latest`"
    assert "the ranks would not resume from the same checkpoint of ckpt (" in rank0["no_latest"][1], rank0["no_latest"]
    import socket
    assert views.format(socket.gethostname()) in rank0["no_latest"][1], rank0["no_latest"]
    assert (f"rank 0 (host {socket.gethostname()}): step 2; rank 1 (host {socket.gethostname()}): step 1"
            in rank0["other_step"][1]), rank0["other_step"]
