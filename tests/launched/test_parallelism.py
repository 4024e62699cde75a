"""DeepSpeed's parallelism features on 2 XLA ranks against DeepSpeed's own CPU accelerator: MoE with expert
parallelism 2 (ZeRO-1 and ZeRO-2, as DeepSpeed's MoE tests train it), ZeRO++'s hierarchical partitioning (hpZ) on
ZeRO-3, AutoTP tensor parallelism 2 on a Llama from a config, and Ulysses sequence parallelism 2.

One 2-rank launch per accelerator trains every case in turn on a tiny model with the same data and seed; each rank
writes its per-step losses, its final weights and, on XLA, the graph counters after the warm-up steps and at the end.
"""

import pytest
import torch

from tests.multiproc import record_cases, records_on_both_accelerators, trained_alike

WORLD, STEPS, WARMUP = 2, 6, 3
VOCAB, HIDDEN, HEADS, SEQ, BATCH = 16, 8, 2, 8, 4
OUT_ENV = "DSX_TEST_PARALLELISM_OUT"


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000, **extra}


class MoEModel(torch.nn.Module):
    """An embedding, one MoE layer of 2 linear experts (one per rank with ``ep_size=2``), an output head. The capacity
    holds every token: which of the tokens tied for a full expert it would drop is ``topk``'s choice, and XLA's
    differs from the CPU's."""

    def __init__(self):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=2, ep_size=WORLD, k=1,
                       capacity_factor=2.0, min_capacity=0, use_rts=False)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, targets):
        hidden, aux_loss, _ = self.moe(torch.tanh(self.embed(tokens)))
        logits = self.out(hidden)
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)) + 0.01 * aux_loss


class UlyssesModel(torch.nn.Module):
    """Self-attention over the whole sequence while each rank holds half of it: ``DistributedAttention`` trades the
    sequence shard for a head shard (all-to-all) around a plain softmax attention, and back."""

    def __init__(self, group):
        from deepspeed.sequence.layer import DistributedAttention
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.attention = DistributedAttention(self.local_attention, group)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    @staticmethod
    def local_attention(query, key, value, *args, **kwargs):
        """[sequence, batch, heads, head_dim] each, the whole sequence and this rank's heads."""
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) / query.shape[-1]**0.5
        return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)

    def forward(self, tokens, targets):
        hidden = self.embed(tokens).transpose(0, 1)  # [local sequence, batch, hidden]
        query, key, value = self.qkv(hidden).view(*hidden.shape[:2], 3, HEADS, HIDDEN // HEADS).unbind(2)
        context = self.attention(query, key, value, 1).reshape(*hidden.shape)
        logits = self.out(context).transpose(0, 1)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class DenseModel(torch.nn.Module):
    """ZeRO++'s hierarchical partitioning (hpZ) changes where ZeRO-3's parameters are gathered from, not the model."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.hidden = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.out = torch.nn.Linear(2 * HIDDEN, VOCAB)

    def forward(self, tokens, targets):
        logits = self.out(torch.tanh(self.hidden(self.embed(tokens))))
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def moe_engine(stage: int):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    torch.manual_seed(0)
    model = MoEModel()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config(stage))
    return engine, engine


def ulysses_engine():
    import deepspeed
    from deepspeed.utils import groups
    deepspeed.init_distributed()
    mesh = deepspeed.comm.initialize_mesh_device((1, WORLD), ("data_parallel", "sequence_parallel"))
    torch.manual_seed(0)
    model = UlyssesModel(mesh.get_group(mesh_dim="sequence_parallel"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(1),
                                      mesh_param=(1, WORLD))
    assert groups._get_sequence_parallel_world_size() == WORLD
    return engine, engine


def autotp_engine():
    """A Llama that AutoTP shards (its attention and MLP projections) over the 2 ranks, from a config."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                         num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                         max_position_embeddings=SEQ, attn_implementation="eager"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(1, tensor_parallel={"autotp_size": WORLD}))
    return engine, lambda tokens, targets: engine(input_ids=tokens, labels=targets).loss


def hpz_engine():
    import deepspeed
    torch.manual_seed(0)
    model = DenseModel()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": WORLD}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**config(3), "zero_optimization": zero})
    return engine, engine


# Each case: how to build its engine and loss function, and whether every rank trains on the same batch (sequence
# and tensor parallelism split one batch) or on its own (data parallelism).
CASES = {"moe-ep2-zero1": (lambda: moe_engine(1), False), "moe-ep2-zero2": (lambda: moe_engine(2), False),
         "zero3-hpz2": (hpz_engine, False), "autotp2": (autotp_engine, True), "ulysses-sp2": (ulysses_engine, True)}


def batches(name: str, rank: int):
    """Per step: each rank's own batch, or one batch for every rank (of which Ulysses' ranks hold a half each)."""
    shared = CASES[name][1]
    gen = torch.Generator().manual_seed(1 + (0 if shared else rank))
    for _ in range(STEPS):
        tokens, targets = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))
        if name.startswith("ulysses"):
            half = SEQ // WORLD
            tokens, targets = (t[:, rank * half:(rank + 1) * half] for t in (tokens, targets))
        yield tokens, targets


def train(name: str) -> dict:
    """Case ``name``'s losses, this rank's final weights (ZeRO-3: gathered) and, on XLA, its graph counters. Losses
    are read after the counters: the steps themselves must not read the device."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups
    from deepspeed_xla.xla_runtime import graph_counters
    on_xla = get_accelerator().device_name() == "xla"
    engine, loss_of = CASES[name][0]()
    losses, counters = [], {}
    for step, (tokens, targets) in enumerate(batches(name, engine.global_rank)):
        if on_xla and step == WARMUP:
            counters["warm"] = graph_counters()
        loss = loss_of(tokens.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    if on_xla:
        counters["end"] = graph_counters()
    losses = [loss.item() for loss in losses]
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([param for _, param in named],
                                           enabled=engine.zero_optimization_stage() == 3):
        params = {pname: param.detach().float().cpu().flatten().tolist() for pname, param in named}
    engine.destroy()
    groups._release_process_group_references()  # the next case starts from no DeepSpeed groups, as a new process
    return {"losses": losses, "params": params, "counters": counters}


def rank_main() -> None:
    """One rank: every case in turn."""
    record_cases(CASES, train, OUT_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(xla, cpu)``: each a list of per-rank records, the two launches run concurrently."""
    return records_on_both_accelerators(f"{__name__}:rank_main", WORLD, tmp_path_factory.mktemp("parallelism"), OUT_ENV)


# PJRT CPU has no XLA collectives, so each host-staged collective (or batch of collectives run together) first runs the
# graph computing its operands (docs/performance.md, "Two processes on PJRT CPU"): on top of ZeRO's, MoE's all-to-alls
# around the experts, Ulysses' around the attention and AutoTP's all-reduces, forward and backward (measured).
EXECUTIONS_PER_STEP = {"moe-ep2-zero1": 9, "moe-ep2-zero2": 9, "zero3-hpz2": 4, "autotp2": 11, "ulysses-sp2": 9}


def counts_per_step(counters: dict) -> dict:
    warm, end = counters["warm"], counters["end"]
    return {key: (end[key] - warm[key]) / (1 if key == "compilations" else STEPS - WARMUP) for key in end}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_cpu_accelerator(runs, case):
    for rank, (mine, _) in enumerate(trained_alike(*runs, case)):
        # No host read in the steps, and nothing compiles after warm-up.
        assert counts_per_step(mine["counters"]) == {"compilations": 0, "executions": EXECUTIONS_PER_STEP[case],
                                                     "transfers_to_host": 0}, rank


def test_layouts_are_parallel(runs):
    """The runs above are what they claim on both accelerators: each rank holds its own expert and the same shared
    weights; AutoTP gives each rank half of a projection."""
    for accelerator, ranks in zip(("xla", "cpu"), runs):
        for case in ("moe-ep2-zero1", "moe-ep2-zero2"):
            first, second = (ranks[rank][case]["params"] for rank in range(WORLD))
            experts = {name for name in first if ".experts." in name}
            assert experts and all(first[name] != second[name] for name in experts), (accelerator, case)
            assert all(first[name] == second[name] for name in first.keys() - experts), (accelerator, case)
        shards = [ranks[rank]["autotp2"]["params"]["model.layers.0.self_attn.q_proj.weight"] for rank in range(WORLD)]
        assert [len(shard) for shard in shards] == [HIDDEN * HIDDEN // WORLD] * WORLD and shards[0] != shards[1]
