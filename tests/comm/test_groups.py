"""Every kind of process group DeepSpeed (and torch.distributed for it) builds besides the default one,
handed XLA tensors on two PJRT CPU processes after ``deepspeed.init_distributed()``.

DeepSpeed 0.19.8 builds its sub-groups with ``new_group(ranks)``, which inherits the default group's
backend; groups asked for as gloo become ``xla_host`` groups (``comm/gloo_groups.py``). One 2-rank launch
runs every check; each rank prints ``PASS <check>`` after one (see ``test_host_staged.py`` for why).
"""
from typing import Callable, List

import pytest
import torch
import torch.distributed as dist

from tests.comm.host_staged_checks import expect, stale, values, xla
from tests.multiproc import run_ranks

WORLD = 2
CHECKS = []


def check(fn: Callable[[], List[tuple]]) -> Callable[[], List[tuple]]:
    """``fn()`` builds groups and returns ``(name, group)`` pairs, this rank's; each pair is exercised."""
    CHECKS.append(fn)
    return fn


def exercise(name: str, group) -> None:
    """XLA operands through each collective DeepSpeed runs on sub-groups, plus a CPU tensor and an object."""
    members = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    summed = sum(values(r, (6,)) for r in members)
    tensor = xla(values(me, (6,)))
    dist.all_reduce(tensor, group=group)
    expect(f"{name}: all_reduce", tensor, summed)
    tensor = xla(values(me, (6,), torch.bfloat16))
    dist.broadcast(tensor, src=members[-1], group=group)
    expect(f"{name}: broadcast", tensor, values(members[-1], (6,), torch.bfloat16))
    gathered = stale((len(members) * 6,))
    dist.all_gather_into_tensor(gathered, xla(values(me, (6,))), group=group)
    expect(f"{name}: all_gather_into_tensor", gathered, torch.cat([values(r, (6,)) for r in members]))
    scattered = stale((6,))
    dist.reduce_scatter_tensor(scattered, xla(values(me, (len(members) * 6,))), group=group)
    want = sum(values(r, (len(members) * 6,)) for r in members).chunk(len(members))[dist.get_rank(group)]
    expect(f"{name}: reduce_scatter_tensor", scattered, want)
    host = values(me, (6,))
    dist.all_reduce(host, group=group)
    assert torch.equal(host, summed), f"rank {me}, {name}: all_reduce of a CPU tensor gave {host}"
    objects = [None] * len(members)
    dist.all_gather_object(objects, {"rank": me}, group=group)
    assert objects == [{"rank": r} for r in members], f"rank {me}, {name}: all_gather_object gave {objects}"


def pick(groups, ranks_of) -> list:
    """This rank's group of each family: ``ranks_of(group)`` tells members."""
    return [(name, group) for name, group in groups if dist.get_rank() in ranks_of(group)]


@check
def torch_gloo_groups():
    """What frameworks ask for to move host data: on XLA these are ``xla_host`` groups."""
    pair = dist.new_group([0, 1], backend="gloo")
    spec = dist.new_group([0, 1], backend="cpu:gloo")
    alone, _ = dist.new_subgroups(group_size=1, backend="gloo")
    for group in (pair, spec, alone):
        assert dist.get_backend(group) == "xla_host", dist.get_backend(group)
    return [("new_group(backend='gloo')", pair), ("new_group(backend='cpu:gloo')", spec),
            ("new_subgroups(group_size=1, backend='gloo')", alone)]


@check
def deepspeed_world_and_data_groups():
    from deepspeed.utils import groups
    from deepspeed.runtime.zero.utils import _initialize_parameter_parallel_groups
    return [("groups._clone_world_group", groups._clone_world_group()),
            ("groups._get_data_parallel_group", groups._get_data_parallel_group()),
            ("zero.utils._initialize_parameter_parallel_groups(1)", _initialize_parameter_parallel_groups(1)),
            ("zero.utils._initialize_parameter_parallel_groups(2)", _initialize_parameter_parallel_groups(2))]


@check
def deepspeed_model_and_expert_groups():
    from deepspeed.utils import groups
    data, model = groups._create_model_parallel(2)
    groups._create_expert_and_data_parallel(2)
    groups._create_zero_param_parallel_group(2)
    local = groups._get_local_all_to_all_group()
    return [("groups._create_model_parallel: data", data), ("groups._create_model_parallel: model", model),
            ("groups expert parallel", groups._get_expert_parallel_group("ep_size_2")),
            ("groups expert data parallel", groups._get_expert_data_parallel_group("ep_size_2")),
            ("groups ZeRO param intra parallel (hpZ)", groups._get_zero_param_intra_parallel_group()),
            ("groups local all-to-all (ZeRO++)", local["local_0"])]


@check
def deepspeed_tensor_parallel_groups():
    """AutoTP builds its groups with a DeviceMesh (``initialize_mesh_device``) or with ``new_group``."""
    from deepspeed import comm
    from deepspeed.utils import groups
    mesh = comm.initialize_mesh_device((1, WORLD), ("data_parallel", "tensor_parallel"))
    groups._init_tp_groups_with_new_group(WORLD)
    return [("DeviceMesh tensor_parallel", mesh.get_group("tensor_parallel")),
            ("DeviceMesh data_parallel", mesh.get_group("data_parallel")),
            ("groups._init_tp_groups_with_new_group: tensor", groups.get_tensor_model_parallel_group()),
            ("groups._init_tp_groups_with_new_group: data", groups.get_data_parallel_group())]


@check
def deepspeed_pipeline_groups():
    from deepspeed.runtime.pipe import p2p
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=WORLD, num_dp=1))
    p2p.can_send_recv = lambda: False  # the groups of torch builds without batched send/recv
    p2p.init_process_groups(grid)
    return [("pipe data parallel", grid.get_data_parallel_group()), ("pipe stages", grid.get_pipe_parallel_group()),
            ("pipe slice", grid.get_slice_parallel_group()), ("pipe model", grid.ds_model_proc_group),
            *pick([(f"pipe p2p {i}", group) for i, group in enumerate(p2p._groups)],
                  dist.get_process_group_ranks)]


@check
def deepspeed_sequence_parallel_groups():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    parallel_state_sp.initialize_sequence_parallel(WORLD)
    return [("sequence parallel", parallel_state_sp.get_sequence_parallel_group()),
            ("sequence data parallel", parallel_state_sp.get_sequence_data_parallel_group())]


def rank_main() -> None:
    import deepspeed
    deepspeed.init_distributed()
    for fn in CHECKS:
        for name, group in fn():
            exercise(name, group)
        print(f"PASS {fn.__name__}", flush=True)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(f"{__name__}:rank_main", WORLD, env={"DS_ACCELERATOR": "xla", "LOCAL_SIZE": WORLD})


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_groups_take_xla_tensors(ranks, name):
    for rank, proc in enumerate(ranks):
        if f"PASS {name}" not in proc.stdout.splitlines():
            pytest.fail(f"rank {rank} (exit code {proc.returncode}) did not pass {name}:\n{proc.stderr[-6000:]}")


def test_ranks_exit_cleanly(ranks):
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
