"""``patches/trainer.py``: in a DeepSpeed run the Trainer's torch_xla branches give way to its GPU ones. The saves,
the gradient norm, the logged-loss gather and ``parallel_mode`` are exercised by the Trainer runs of
``tests/launched/test_huggingface.py``; ``main_process_first`` (what HF example scripts wrap their dataset
preparation in) here, on 2 ranks."""
import json
import os
import time
from pathlib import Path

from tests.multiproc import last_error, run_python, run_ranks

WORLD = 2
MARKER_ENV = "DSX_TEST_MARKER_DIR"
RANK0_WORKS = 2.0  # seconds rank 0 spends inside the block, long enough for rank 1 to be seen not waiting


def main_process_first_rank() -> None:
    """Run by ``run_ranks``: ``TrainingArguments(deepspeed=...)``, then ``main_process_first`` patched and, on a
    second marker, upstream's; rank 1 reports whether rank 0 had left each block when it entered."""
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=os.environ[MARKER_ENV], report_to="none", deepspeed={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}})
    seen = {}
    for name, main_process_first in (("patched", type(args).main_process_first),
                                     ("upstream", type(args).main_process_first.__wrapped__)):
        marker = Path(os.environ[MARKER_ENV]) / name
        with main_process_first(args, desc=name):
            if args.process_index == 0:
                time.sleep(RANK0_WORKS)
                marker.write_text("done")
            else:
                seen[name] = marker.exists()
        args.distributed_state.wait_for_everyone()
    print(json.dumps({"rank": args.process_index, "world": args.world_size, "seen": seen}))


def test_main_process_first_holds_the_other_ranks_back(tmp_path):
    """Patched, rank 1 enters the block only after rank 0 has finished it; upstream's (``xm.rendezvous``, which sees
    one process per PJRT CPU rank) lets it in at once, which is what the patch is for."""
    procs = run_ranks(f"{__name__}:main_process_first_rank", WORLD, timeout=300,
                      env={"DS_ACCELERATOR": "xla", MARKER_ENV: tmp_path}, after_import=(MARKER_ENV, ))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-6000:]
    reports = [json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs]
    assert [(report["rank"], report["world"]) for report in reports] == [(0, WORLD), (1, WORLD)]
    assert reports[1]["seen"] == {"patched": True, "upstream": False}, reports


# transformers 5.25 and accelerate 1.16 name TorchTPU's device "tpu" (``is_torch_tpu_available``, the "tpu_dist"
# backend, accelerate's accelerator backend); with torch_xla imported and torch_tpu absent, none of them is chosen.
TORCH_TPU_WORDS = """
import importlib.util, json
import torch, torch_xla
from accelerate.utils.imports import get_torch_accelerator_backend
from transformers.distributed.utils import DISTRIBUTED_BACKEND_MAP
from transformers.utils.import_utils import get_current_accelerator, is_torch_tpu_available
accelerator = get_current_accelerator()
print(json.dumps({"torch_tpu": importlib.util.find_spec("torch_tpu") is not None, "tpu": is_torch_tpu_available(),
                  "accelerate": get_torch_accelerator_backend()[0],
                  "torch accelerator": accelerator and accelerator.type, "tpu_dist": DISTRIBUTED_BACKEND_MAP["tpu"]}))
"""


def test_torch_xla_is_never_taken_for_torchtpu():
    """On a host that says TPU (``PJRT_DEVICE=TPU``), torch_xla imported: no library sees a TorchTPU device, so
    nothing picks ``tpu:0`` or ``tpu_dist`` (the Trainer runs check their device and backend too)."""
    proc = run_python(TORCH_TPU_WORDS, DS_ACCELERATOR="xla", PJRT_DEVICE="TPU")
    assert proc.returncode == 0, last_error(proc)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen.pop("torch accelerator") != "tpu"  # the build's (torch 2.9.0 for CUDA): cuda, with no GPU
    assert seen == {"torch_tpu": False, "tpu": False, "accelerate": None, "tpu_dist": "tpu_dist"}
