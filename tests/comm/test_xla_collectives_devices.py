"""``xla_ds`` run for real across 2 and 4 XLA devices (``tests/comm/xla_threads.py``): every ProcessGroup method
DeepSpeed calls on the TPU path, on the world and on groups shaped like DeepSpeed's (aligned tiles: data or
pipe groups; strided: expert data-parallel groups), against the same call on gloo with CPU tensors.

Data are small integers, so every sum, average and maximum is exact in fp32 and bf16 and the comparison is
equality. Each op's facts (the collectives XLA got and their replica groups, the reads and graph cuts the op
asked for) come from the XLA threads themselves.
"""
import itertools
from typing import Callable, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllToAllOptions, BarrierOptions, BroadcastOptions,
                                        GatherOptions, ReduceOptions, ReduceScatterOptions, ScatterOptions)

from tests.comm import xla_threads

SHAPES = {2: [None, [0, 1], [0], [1]], 4: [None, [0, 1, 2, 3], [0, 1], [2, 3], [0, 2], [1, 3]]}
REDUCTIONS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}


def data(rank: int, key: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Rank- and call-specific small integers: exact in every sum of a few of them, in fp32 and bf16."""
    generator = torch.Generator().manual_seed(1009 * rank + 31 * key + 7)
    return torch.randint(-8, 9, shape, generator=generator).to(dtype)


def _name(group_ranks: Optional[List[int]]) -> str:
    return "world" if group_ranks is None else "g" + "-".join(map(str, group_ranks))


def _opts(kind, **fields):
    opts = kind()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def _run(rank, name: str, group, call: Callable) -> None:
    """``call(group)`` returns the tensors to compare; the op's facts are recorded on XLA."""
    before = rank.counters()
    outputs = call(group)
    after = rank.counters()
    rank.report(name, *outputs)
    if rank.is_xla:
        rank.facts[name] = {**{key: after[key] - before[key] for key in ("reads", "syncs", "waits")},
                            "collectives": after["collectives"][len(before["collectives"]):]}


def tensor_ops(rank, group, size: int, key: int):
    """(name, call) of every tensor collective on ``group``; each call returns the tensors it wrote."""
    r, device = rank.rank, rank.device
    gloo = not rank.is_xla

    def x(k, shape, dtype=torch.float32):
        return data(r, key * 100 + k, shape, dtype).to(device)

    ops = []
    for (label, op), dtype in itertools.product(REDUCTIONS.items(), (torch.float32, torch.bfloat16)):
        def allreduce(g, op=op, dtype=dtype, k=len(ops)):
            t = x(k, (5, 3), dtype)
            if gloo and op == dist.ReduceOp.AVG:  # gloo has no AVG: its sum over the group's size
                g.allreduce([t], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.SUM)).wait()
                return [t / size]
            g.allreduce([t], _opts(dist.AllreduceOptions, reduceOp=op)).wait()
            return [t]
        ops.append((f"allreduce-{label}-{str(dtype)[6:]}", allreduce))

    def allreduce_coalesced(g):
        ts = [x(50, (3,)), x(51, (2, 2))]
        g.allreduce_coalesced(ts, _opts(dist.AllreduceCoalescedOptions, reduceOp=dist.ReduceOp.SUM)).wait()
        return ts

    def allgather(g):
        outs = [torch.zeros(2, 3, device=device) for _ in range(size)]
        g.allgather([outs], [x(52, (2, 3))]).wait()
        return outs

    def allgather_into_tensor(g):
        out = torch.zeros(size * 4, device=device)
        g._allgather_base(out, x(53, (4,)), AllgatherOptions()).wait()
        return [out]

    def allgather_into_stacked_tensor(g):
        out, source = torch.zeros(size, 2, 2, device=device), x(54, (2, 2))
        if gloo:  # gloo takes the concatenated layout only: the same memory
            g._allgather_base(out.view(-1), source.view(-1), AllgatherOptions()).wait()
            return [out]
        g._allgather_base(out, source, AllgatherOptions()).wait()
        return [out]

    def allgather_coalesced(g):
        inputs = [x(55, (3,)), x(56, (2,))]
        outs = [[torch.zeros_like(t) for t in inputs] for _ in range(size)]  # torch's layout: one list per member
        g.allgather_coalesced(outs, inputs, AllgatherOptions()).wait()
        return [t for ts in outs for t in ts]

    def allgather_into_tensor_coalesced(g):
        inputs = [x(120, (3,)), x(121, (2, 2))]
        outs = [torch.zeros(size * 3, device=device), torch.zeros(size, 2, 2, device=device)]
        if gloo:  # no coalesced form: one all-gather each, in the concatenated layout
            for out, source in zip(outs, inputs):
                g._allgather_base(out.view(-1), source.view(-1), AllgatherOptions()).wait()
        else:
            g.allgather_into_tensor_coalesced(outs, inputs).wait()
        return outs

    def reduce_scatter_tensor_coalesced(g):
        inputs = [x(122, (size * 3,)), x(123, (size, 2))]
        outs = [torch.zeros(3, device=device), torch.zeros(2, device=device)]
        opts = _opts(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)
        if gloo:  # no coalesced form: one reduce-scatter each
            for out, source in zip(outs, inputs):
                g._reduce_scatter_base(out, source.view(-1), opts).wait()
        else:
            g.reduce_scatter_tensor_coalesced(outs, inputs, opts).wait()
        return outs

    def reduce_scatter_tensor(g):
        out = torch.zeros(3, device=device)
        g._reduce_scatter_base(out, x(57, (size * 3,)), _opts(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)).wait()
        return [out]

    def reduce_scatter_tensor_avg(g):
        out = torch.zeros(2, 2, device=device)
        source = x(58, (size, 2, 2))
        if gloo:  # no AVG, and the concatenated layout only
            g._reduce_scatter_base(out.view(-1), source.view(-1),
                                   _opts(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)).wait()
            return [out / size]
        g._reduce_scatter_base(out, source, _opts(ReduceScatterOptions, reduceOp=dist.ReduceOp.AVG)).wait()
        return [out]

    def reduce_scatter_list(g):
        out = torch.zeros(2, 3, device=device)
        g.reduce_scatter([out], [[x(60 + i, (2, 3)) for i in range(size)]],
                         _opts(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)).wait()
        return [out]

    def alltoall_even(g):
        out = torch.zeros(size * 2, 3, device=device)
        g.alltoall_base(out, x(70, (size * 2, 3)), [], [], AllToAllOptions()).wait()
        return [out]

    def alltoall_uneven(g):
        me = g.rank()
        send = [(peer + me) % 2 + 1 for peer in range(size)]  # rows this rank sends each peer
        recv = [(me + peer) % 2 + 1 for peer in range(size)]
        out = torch.zeros(sum(recv), 2, device=device)
        g.alltoall_base(out, x(71, (sum(send), 2)), recv, send, AllToAllOptions()).wait()
        return [out]

    def alltoall_list(g):
        inputs = [x(72 + peer, (2, 2)) for peer in range(size)]
        outs = [torch.zeros(2, 2, device=device) for _ in range(size)]
        _alltoall_list(g, outs, inputs, gloo)
        return outs

    def alltoall_list_uneven(g):
        me = g.rank()
        inputs = [x(80 + peer, ((peer + me) % 2 + 1,)) for peer in range(size)]
        outs = [torch.zeros((me + peer) % 2 + 1, device=device) for peer in range(size)]
        _alltoall_list(g, outs, inputs, gloo)
        return outs

    ops += [("allreduce_coalesced", allreduce_coalesced), ("allgather", allgather),
            ("allgather_into_tensor", allgather_into_tensor),
            ("allgather_into_stacked_tensor", allgather_into_stacked_tensor),
            ("allgather_coalesced", allgather_coalesced),
            ("allgather_into_tensor_coalesced", allgather_into_tensor_coalesced),
            ("reduce_scatter_tensor_coalesced", reduce_scatter_tensor_coalesced),
            ("reduce_scatter_tensor", reduce_scatter_tensor),
            ("reduce_scatter_tensor_avg", reduce_scatter_tensor_avg), ("reduce_scatter_list", reduce_scatter_list),
            ("alltoall_even", alltoall_even), ("alltoall_uneven", alltoall_uneven), ("alltoall_list", alltoall_list),
            ("alltoall_list_uneven", alltoall_list_uneven)]
    for root in range(size):
        ops += [(f"broadcast-root{root}", lambda g, root=root: _broadcast(g, x(90 + root, (2, 3)), root)),
                (f"reduce-root{root}", lambda g, root=root: _reduce(g, x(95 + root, (4,)), root, gloo)),
                (f"gather-root{root}", lambda g, root=root: _gather(g, x(100 + root, (3,)), root, size)),
                (f"scatter-root{root}", lambda g, root=root: _scatter(g, [x(105 + i, (2,)) for i in range(size)],
                                                                      root))]
    return ops


def _alltoall_list(g, outs, inputs, gloo: bool) -> None:
    if not gloo:
        g.alltoall(outs, inputs, AllToAllOptions()).wait()
        return
    # gloo has no list form: its all-to-all of the flattened pieces, with split sizes
    received = torch.zeros(sum(t.numel() for t in outs))
    g.alltoall_base(received, torch.cat([t.reshape(-1) for t in inputs]), [t.numel() for t in outs],
                    [t.numel() for t in inputs], AllToAllOptions()).wait()
    for out, piece in zip(outs, received.split([t.numel() for t in outs])):
        out.copy_(piece.reshape(out.shape))


def _broadcast(g, t, root):
    g.broadcast([t], _opts(BroadcastOptions, rootRank=root, rootTensor=0)).wait()
    return [t]


def _reduce(g, t, root, gloo: bool):
    """The root's result; every other member keeps its input (gloo uses theirs as scratch: the reference is the
    input itself there, as NCCL and torch_xla leave it)."""
    kept = t.clone()
    g.reduce([t], _opts(ReduceOptions, rootRank=root, reduceOp=dist.ReduceOp.SUM)).wait()
    return [kept if gloo and g.rank() != root else t]


def _gather(g, t, root, size):
    outs = [[torch.zeros_like(t) for _ in range(size)]] if g.rank() == root else []
    g.gather(outs, [t], _opts(GatherOptions, rootRank=root)).wait()
    return [t] + [o for os_ in outs for o in os_]


def _scatter(g, pieces, root):
    out = torch.zeros_like(pieces[0])
    g.scatter([out], [pieces] if g.rank() == root else [], _opts(ScatterOptions, rootRank=root)).wait()
    return [out]


def collectives_scenario(rank) -> None:
    """Every tensor collective on every group shape, the barrier, and the CPU tensors of object collectives."""
    for key, ranks in enumerate(SHAPES[rank.world]):
        group = rank.group(ranks)
        if group is None:
            continue
        for name, call in tensor_ops(rank, group, group.size(), key):
            _run(rank, f"{_name(ranks)}/{name}", group, call)
        _run(rank, f"{_name(ranks)}/barrier", group, _barrier)
        _run(rank, f"{_name(ranks)}/object_sizes", group, lambda g: _object_tensors(g, rank.rank))


def _barrier(g) -> List[torch.Tensor]:
    g.barrier(BarrierOptions()).wait()
    return []


def _object_tensors(g, r: int) -> List[torch.Tensor]:
    """What torch's object collectives hand the group: CPU int64 sizes and uint8 payloads."""
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(g.size())]
    g.allgather([sizes], [torch.tensor([r + 3])]).wait()
    payload = torch.arange(5, dtype=torch.uint8) + r
    g.broadcast([payload], _opts(BroadcastOptions, rootRank=g.size() - 1, rootTensor=0)).wait()
    assert all(t.device.type == "cpu" for t in sizes + [payload])
    return sizes + [payload]


def _reports(results: dict, world: int):
    return {rank: results[flavour][rank]["results"] for flavour in ("gloo", "xla") for rank in range(world)}


@pytest.fixture(scope="module", params=[2, 4])
def ran(request, tmp_path_factory):
    world = request.param
    return world, xla_threads.run("tests.comm.test_xla_collectives_devices:collectives_scenario", world,
                                  tmp_path_factory.mktemp(f"xla_ds_{world}"))


def test_every_op_gives_what_gloo_gives_on_every_rank(ran):
    world, results = ran
    gloo, xla = results["gloo"], results["xla"]
    for rank in range(world):
        assert gloo[rank]["results"].keys() == xla[rank]["results"].keys()
        wrong = [name for name, want in gloo[rank]["results"].items()
                 if not torch.equal(xla[rank]["results"][name], want)]
        assert not wrong, f"rank {rank}: {wrong[:10]} " + "; ".join(
            f"{n}: xla {xla[rank]['results'][n].tolist()} gloo {gloo[rank]['results'][n].tolist()}" for n in wrong[:3])


def test_the_reference_sees_different_data_on_every_rank(ran):
    """Otherwise a collective that returned its input would pass."""
    world, results = ran
    gloo = results["gloo"]
    inputs = [data(rank, 0, (5, 3)) for rank in range(world)]
    assert all(not torch.equal(inputs[0], other) for other in inputs[1:])
    assert not torch.equal(gloo[0]["results"]["world/allreduce-sum-float32"], inputs[0].reshape(-1))


def rank_size(ranks: Optional[List[int]], world: int) -> int:
    return world if ranks is None else len(ranks)


def _replica_groups(ranks: Optional[List[int]], world: int) -> str:
    if ranks is None:
        return "{}"
    members = sorted(ranks)
    if len(members) == world:
        return "{{" + ",".join(map(str, members)) + "}}"
    mesh = [[start + r - members[0] for r in members] for start in range(world)
            if all(start + r - members[0] < world for r in members)]
    tiles, covered = [], set()
    for group in mesh:
        if not covered & set(group):
            tiles.append(group)
            covered |= set(group)
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in tiles) + "}"


def test_each_op_is_one_collective_on_tiled_replica_groups_with_no_graph_cut(ran):
    world, results = ran
    for rank in range(world):
        for name, facts in results["xla"][rank]["facts"].items():
            group, op = name.split("/")
            ranks = None if group == "world" else [int(r) for r in group[1:].split("-")]
            if op == "object_sizes":  # CPU tensors staged through the device, what the op wrote read back in one
                # wait per op: the all-gather's outputs, the broadcast's tensor
                assert facts["waits"] == 2 and facts["reads"] == 1 + rank_size(ranks, world), (rank, name, facts)
                continue
            size = rank_size(ranks, world)
            # the list form sends a group of one an even split
            uneven = op == "alltoall_uneven" or (op == "alltoall_list_uneven" and size > 1)
            assert facts["syncs"] == 0, (rank, name, facts)
            assert facts["reads"] == facts["waits"] == (1 if uneven or op == "barrier" else 0), (rank, name, facts)
            expected = 2 if uneven else 1  # an uneven all-to-all first agrees on its width
            kinds = [kind for kind, _ in facts["collectives"]]
            assert len(kinds) == expected, (rank, name, facts["collectives"])
            want = {_replica_groups(ranks, world), _replica_groups(ranks or list(range(world)), world)}
            assert all(groups in want for _, groups in facts["collectives"]), (rank, name, facts["collectives"], want)


# Ops whose graph is the same on every member: run as one graph, with no cut of the harness around them.
ONE_GRAPH = ("allreduce-sum-float32", "allreduce-avg-bfloat16", "allreduce_coalesced", "allgather",
             "allgather_into_tensor", "allgather_coalesced", "allgather_into_tensor_coalesced",
             "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_list",
             "alltoall_even", "alltoall_list", "broadcast-root1", "reduce-root0")


def one_graph_scenario(rank) -> None:
    """Each op as part of one graph per rank: the graph holds one collective, the op reads nothing, and each
    rank's graph runs as one execution. A non-root's reduce of a temporary it drops at once still joins. Results
    are read at the end, so that no rank's reading overlaps another's counted op."""
    outputs_of = {}
    for key, ranks in enumerate(SHAPES[rank.world]):
        group = rank.group(ranks)
        if group is None or group.size() == 1:
            continue
        ops = dict(tensor_ops(rank, group, group.size(), key))
        ops["reduce-dropped"] = lambda g: _reduce_dropped(g, data(rank.rank, 7000 + key, (6,)).to(rank.device))
        for name in ONE_GRAPH + ("reduce-dropped",):
            rank.sync_all()
            before = rank.counters()
            rank.sync_all()
            outputs = ops[name](group)
            if rank.is_xla:
                kept = group.__dict__.get("_kept", [])  # what the group holds so that the collective runs
                rank.facts[f"{_name(ranks)}/{name}"] = {"graph": rank.graph_collectives(list(outputs) + kept)}
            rank.cut()
            rank.settle()
            after = rank.counters()
            if rank.is_xla:
                rank.facts[f"{_name(ranks)}/{name}"].update(
                    {key_: after[key_] - before[key_] for key_ in ("executions", "reads", "syncs")})
            outputs_of[f"{_name(ranks)}/{name}"] = outputs
    for name, outputs in outputs_of.items():
        rank.report(name, *outputs)


def _reduce_dropped(g, t):
    """``dist.reduce`` of a temporary, as ZeRO-2's ``allreduce_bucket`` hands it (a flattened bucket the non-roots
    never read again): only the root keeps a reference."""
    g.reduce([t * 1], _opts(ReduceOptions, rootRank=0, reduceOp=dist.ReduceOp.SUM)).wait()
    return [t]


@pytest.mark.parametrize("world", [2, 4])
def test_an_op_is_one_collective_in_one_graph_per_rank(world, tmp_path):
    results = xla_threads.run("tests.comm.test_xla_collectives_devices:one_graph_scenario", world, tmp_path,
                              isolate=False)
    for rank in range(world):
        xla, gloo = results["xla"][rank], results["gloo"][rank]
        assert xla["results"].keys() == gloo["results"].keys() and xla["results"]
        for name, want in gloo["results"].items():
            assert torch.equal(xla["results"][name], want), (rank, name)
        for name, facts in xla["facts"].items():
            group = name.split("/")[0]
            ranks = None if group == "world" else [int(r) for r in group[1:].split("-")]
            want = {_replica_groups(ranks, world), _replica_groups(ranks or list(range(world)), world)}
            assert len(facts["graph"]) == 1 and facts["graph"][0][1] in want, (rank, name, facts)
            # every rank is in one group of each tiling, and the groups of a tiling run side by side
            assert facts["executions"] == world, (rank, name, facts)
            assert facts["reads"] == facts["syncs"] == 0, (rank, name, facts)  # no device read, no graph cut
