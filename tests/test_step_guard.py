"""The device-side step skip: one graph, no host read, and the same result as skipping on the host."""
import pytest
import torch

from deepspeed_xla import step_guard, xla_runtime

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, foreach=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _model(device):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 4).to(device)), torch.nn.Parameter(torch.randn(4).to(device))]


def _train(device, make, norms, guarded):
    """One step per entry of ``norms`` (the norm DeepSpeed would have computed); returns params and state.

    Unguarded, a step with an invalid norm is skipped on the host, as DeepSpeed does.
    """
    params = _model(device)
    optimizer = make(params)
    current, skips = [None], []
    if guarded:
        step_guard.guard_step(optimizer, lambda: current[0], skips.append)
    for i, norm in enumerate(norms):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        current[0] = torch.tensor(norm, device=device)
        if guarded or (norm == norm and 0 <= norm < float("inf")):
            optimizer.step()
        if device.type == "xla":
            xla_runtime.sync()
    state = [v for p in params for v in optimizer.state[p].values() if torch.is_tensor(v) and v.device == device]
    return [t.detach().cpu() for t in params + state], [bool(s.cpu()) for s in skips]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("norms", [[1.0, float("nan"), 2.0], [1.0, -1.0, float("inf"), 3.0]], ids=["nan", "sentinel-inf"])
def test_guarded_steps_match_host_skips(name, norms, xla_device):
    device = xla_device
    invalid = [not (n == n and 0 <= n < float("inf")) for n in norms]
    if name == "adamw":  # its host step counter advances on a device skip: the steps after one differ
        norms = norms[:invalid.index(True) + 1]
    expected, _ = _train(device, OPTIMIZERS[name], norms, guarded=False)
    got, skips = _train(device, OPTIMIZERS[name], norms, guarded=True)
    assert len(got) == len(expected) > 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert skips == invalid[:len(norms)]


def test_lr_scheduler_made_after_the_guard_counts_the_guarded_step(xla_device):
    """A torch LR scheduler made over a guarded optimizer (the Trainer makes its schedule over DeepSpeed's optimizer
    after ``deepspeed.initialize``) wraps the guarded step, sees it called, and the step still skips."""
    import warnings
    params = _model(xla_device)
    optimizer = OPTIMIZERS["sgd"](params)
    norm = [torch.tensor(1.0, device=xla_device)]
    step_guard.guard_step(optimizer, lambda: norm[0], lambda flag: None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().cpu() for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" if the step went unseen
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.05]
    moved = [p.detach().cpu() for p in params]
    assert all(not torch.equal(old, new) for old, new in zip(before, moved))
    norm[0] = torch.tensor(float("nan"), device=xla_device)
    optimizer.step()
    assert all(torch.equal(p.detach().cpu(), old) for p, old in zip(params, moved))


def test_skipped_first_step_leaves_zero_state(xla_device):
    device = xla_device
    params = _model(device)
    before = [p.detach().cpu() for p in params]
    optimizer = OPTIMIZERS["sgd"](params)
    step_guard.guard_step(optimizer, lambda: torch.tensor(float("nan"), device=device), lambda flag: None)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p, old in zip(params, before):
        torch.testing.assert_close(p.detach().cpu(), old)
        assert optimizer.state[p]["momentum_buffer"].abs().sum().item() == 0


def test_guarded_step_is_one_graph_without_host_reads(xla_device):
    device = xla_device
    params = _model(device)
    optimizer = OPTIMIZERS["adamw"](params)
    flags = []
    step_guard.guard_step(optimizer, lambda: (params[0].grad.norm()), flags.append)
    for step in range(4):
        if step == 2:
            before = xla_runtime.graph_counters()
        loss = (params[0].sum(0) * params[1]).pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        xla_runtime.sync()
    after = xla_runtime.graph_counters()
    assert {k: after[k] - before[k] for k in after} == {"compilations": 0, "executions": 2, "transfers_to_host": 0}
    assert len(flags) == 4


def test_host_parameters_are_checked_on_the_host(xla_device):
    """ZeRO offload: the optimizer's parameters live in host memory, the norm on the device."""
    params = _model(torch.device("cpu"))
    before = [p.detach().clone() for p in params]
    optimizer = OPTIMIZERS["sgd"](params)
    step_guard.guard_step(optimizer, lambda: torch.tensor(float("inf"), device=xla_device),
                          lambda flag: None)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not optimizer.state
