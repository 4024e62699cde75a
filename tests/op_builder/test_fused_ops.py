"""The pure-torch op builders on XLA against torch's own optimizers on CPU."""
import pytest
import torch

from deepspeed.ops.adam import FusedAdam


def _params(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device).requires_grad_() for shape in ((5, 3), (7, ), (1, ))]


@pytest.mark.parametrize("adam_w_mode, torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fused_adam_matches_torch_optimizer(adam_w_mode, torch_cls):
    import torch_xla
    device = torch_xla.device()
    xla_params, cpu_params = _params(device), _params("cpu")
    ours = FusedAdam(xla_params, lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ref = torch_cls(cpu_params, lr=0.01, weight_decay=0.1)
    for step in range(5):
        gen = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(p.shape, generator=gen) for p in cpu_params]
        for p, g in zip(xla_params, grads):
            p.grad = g.to(device)
        for p, g in zip(cpu_params, grads):
            p.grad = g.clone()
        ours.step()
        ref.step()
        torch_xla.sync()
    for mine, theirs in zip(xla_params, cpu_params):
        torch.testing.assert_close(mine.detach().cpu(), theirs.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["FusedAdam", "FusedLamb"])
def test_one_step_graph_for_every_step_and_learning_rate(xla_device, optimizer):
    """torch_xla bakes the Python scalars 0 and 1 into a graph: the bias corrections become exactly 1.0
    late in training (step ~370 for beta1 0.9, ~37k for beta2 0.999) and schedules pass through lr 0.
    The step's numbers reach the device in one copy, also for FusedLamb's op called once per tensor."""
    import torch_xla
    import torch_xla.debug.metrics as met
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed_xla import xla_runtime
    params = _params(xla_device)
    opt = {"FusedAdam": FusedAdam, "FusedLamb": FusedLamb}[optimizer](params, lr=0.01, weight_decay=0.1)
    compilations, copies_to_device = [], []
    for step, lr in ((1, 0.01), (2, 0.01), (3, 0.0), (400, 0.01), (40000, 0.01)):
        for p in params:
            p.grad = torch.ones_like(p)
            if opt.state[p]:
                opt.state[p]["step"] = step - 1
        opt.param_groups[0]["lr"] = lr
        torch_xla.sync()
        before = met.metric_data("TransferToDeviceTime")[0]
        opt.step()
        torch_xla.sync()
        copies_to_device.append(met.metric_data("TransferToDeviceTime")[0] - before)
        compilations.append(xla_runtime.graph_counters()["compilations"])
    assert compilations[2:] == compilations[1:2] * 3  # the first step also creates the state
    assert max(copies_to_device[1:]) <= 1  # 0 when the same numbers were copied before (cached)


def test_fused_lamb_trains_on_xla():
    import torch_xla
    from deepspeed.ops.lamb import FusedLamb
    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(device)
    opt = FusedLamb(model.parameters(), lr=0.05)
    x = torch.randn(64, 8).to(device)
    y = (x.sum(dim=1, keepdim=True) * 0.5)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(0.01 <= c <= 10.0 for c in opt.get_lamb_coeffs())
