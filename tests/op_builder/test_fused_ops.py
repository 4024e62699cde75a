"""The pure-torch op builders on XLA against torch's own optimizers on CPU, and FusedLamb against the LAMB step of
DeepSpeed's CUDA kernel, written out here in torch."""
import math

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
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    coeffs = torch.tensor(opt.get_lamb_coeffs())  # float32, like the bounds they are clamped to
    assert ((coeffs >= 0.01) & (coeffs <= 10.0)).all(), coeffs


def reference_lamb_step(params, grads, state, lr, betas, eps, weight_decay, bias_correction, max_coeff, min_coeff,
                        eps_inside_sqrt):
    """One ``deepspeed.ops.lamb.FusedLamb`` step as DeepSpeed's kernel computes it (csrc/lamb/fused_lamb_cuda_kernel.cu),
    tensor by tensor, on the CPU: Adam's moments without bias correction; the update m / (sqrt(v) + eps) (eps under
    the root with ``eps_inside_sqrt``) plus weight_decay * p; the trust ratio ||p|| / ||update|| clamped to
    [min_coeff, max_coeff], 1 when either norm is 0; and the bias corrections folded into the step size,
    lr * sqrt(1 - beta2^t) / (1 - beta1^t). Returns the trust ratios."""
    beta1, beta2 = betas
    coeffs = []
    for p, g in zip(params, grads):
        m, v = state.setdefault(id(p), (torch.zeros_like(p), torch.zeros_like(p)))
        step = state.setdefault((id(p), "step"), 0) + 1
        state[(id(p), "step")] = step
        m.mul_(beta1).add_((1 - beta1) * g)
        v.mul_(beta2).add_((1 - beta2) * g * g)
        denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
        update = m / denom + weight_decay * p
        w_norm, u_norm = p.norm().item(), update.norm().item()
        coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm != 0 and u_norm != 0 else 1.0
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if bias_correction else lr
        p.sub_(step_size * coeff * update)
        coeffs.append(coeff)
    return coeffs


@pytest.mark.parametrize("bias_correction, eps_inside_sqrt", [
    pytest.param(True, False, id="bias-correction"),
    pytest.param(False, False, id="no-bias-correction"),
    pytest.param(True, True, id="eps-inside-sqrt"),
])
def test_fused_lamb_matches_the_reference_lamb_step(xla_device, bias_correction, eps_inside_sqrt):
    """Eight steps with weight decay, a zero tensor (trust ratio 1 on the first step) and bounds that clamp some
    ratios: the weights and each step's trust ratios match ``reference_lamb_step``."""
    import torch_xla
    from deepspeed.ops.lamb import FusedLamb
    settings = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, bias_correction=bias_correction,
                    max_coeff=1.2, min_coeff=0.6)
    shapes = ((5, 3), (7, ), (4, 4))
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=gen) * scale for shape, scale in zip(shapes, (1.0, 0.05, 0.0))]
    ours = [t.to(xla_device).requires_grad_() for t in initial]
    ref = [t.clone() for t in initial]
    opt = FusedLamb(ours, eps_inside_sqrt=eps_inside_sqrt, **settings)
    state, clamped, first_coeffs = {}, set(), None
    for step in range(8):
        grads = [torch.randn(shape, generator=gen) for shape in shapes]
        for p, g in zip(ours, grads):
            p.grad = g.to(xla_device)
        opt.step()
        torch_xla.sync()
        expected = reference_lamb_step(ref, grads, state, eps_inside_sqrt=eps_inside_sqrt, **settings)
        clamped.update(c for c in expected if c in (settings["max_coeff"], settings["min_coeff"]))
        first_coeffs = first_coeffs or opt.get_lamb_coeffs()
        torch.testing.assert_close(torch.tensor(opt.get_lamb_coeffs()), torch.tensor(expected), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step}: {opt.get_lamb_coeffs()} {expected} {m}")
        for mine, theirs in zip(ours, ref):
            torch.testing.assert_close(mine.detach().cpu(), theirs, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert clamped == {settings["max_coeff"], settings["min_coeff"]}, "the bounds never clamped a ratio"
    assert first_coeffs[2] == 1.0, "the zero tensor's first ratio"


@pytest.mark.parametrize("adam_w_mode, torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fused_adam_asks_no_more_element_work_than_torch_optimizer(xla_device, adam_w_mode, torch_cls):
    """The step's graph, counted as docs/performance.md's 'Cost of a step' counts it: FusedAdam's update (weights
    and both moments) takes no more element operations than torch's own foreach optimizer on the same tensors. The
    CUDA kernel's form, ``p − lr·(m/(1 − β₁ᵗ)/denom + wd·p)``, took two per element more in AdamW mode."""
    import torch_xla
    from deepspeed_xla.bench.cost import step_cost

    def update_ops(make):
        params = _params(xla_device)
        optimizer = make(params)
        for step in range(2):  # the first step creates the state
            torch_xla.sync()
            for p in params:
                p.grad = torch.full_like(p, 0.5 + step)
            optimizer.step()
        state = [optimizer.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]
        cost = step_cost(torch_xla._XLAC._get_xla_tensors_hlo([*params, *state]))
        torch_xla.sync()
        return cost["elementwise_ops"]

    elements = sum(p.numel() for p in _params("cpu"))
    ours = update_ops(lambda params: FusedAdam(params, lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode))
    theirs = update_ops(lambda params: torch_cls(params, lr=0.01, weight_decay=0.1, foreach=True))
    assert theirs >= 8 * elements  # torch's update is counted: both moments and the weights
    assert ours <= theirs, (ours, theirs, elements)
