"""The device-side step skip: one graph, no host read, and the same result as skipping on the host."""
import warnings

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


def _skip_streaks(norms, threshold):
    """The hand-written reference: (first, last) step numbers (1-based) of each run of ``threshold`` or more invalid
    norms in a row."""
    streaks, run = [], 0
    for step, norm in enumerate(norms, 1):
        run = run + 1 if not (norm == norm and 0 <= norm < float("inf")) else 0
        if run == threshold:
            streaks.append([step - run + 1, step])
        elif run > threshold:
            streaks[-1][1] = step
    return streaks


def _counted_steps(device, norms, read_at, monkeypatch, threshold=3):
    """Guarded AdamW steps with these norms, a ``SkipCounter`` counting them and read after the steps ``read_at``;
    returns what each read returned and the warnings it gave, and the graph counters of the steps between reads."""
    monkeypatch.setenv(step_guard.STREAK_ENV, str(threshold))
    params = _model(device)
    optimizer = OPTIMIZERS["adamw"](params)
    counter, norm = step_guard.SkipCounter(), [None]
    step_guard.guard_step(optimizer, lambda: norm[0], lambda skipped: counter.add(skipped, step))
    reads, step_counts = [], []
    for step, value in enumerate(norms, 1):
        before = xla_runtime.graph_counters()
        for p in params:
            p.grad = torch.full_like(p, 0.1)
        norm[0] = torch.tensor([value]).to(device)  # data (torch_xla makes some scalars graph constants): one graph
        optimizer.step()
        xla_runtime.sync()
        after = xla_runtime.graph_counters()
        step_counts.append({k: after[k] - before[k] for k in after})
        if step in read_at:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                total = counter.read()
            read = xla_runtime.graph_counters()
            reads.append((total, [str(w.message) for w in caught], {k: read[k] - after[k] for k in read}))
    return reads, step_counts


def test_a_streak_of_skipped_steps_warns_once_when_the_count_is_read(xla_device, monkeypatch):
    """Steps 3-6 skipped (inf and NaN norms), then step 9 alone: the read after step 5 warns of the streak going on,
    the next reads warn no more; the counts stay right. Nothing reads the device between reads."""
    inf, nan = float("inf"), float("nan")
    norms = [1.0, 2.0, inf, nan, -1.0, inf, 1.0, 2.0, nan, 1.0]
    read_at = (2, 5, 8, 10)
    reads, step_counts = _counted_steps(xla_device, norms, read_at, monkeypatch)
    assert _skip_streaks(norms, 3) == [[3, 6]]
    invalid = [not (n == n and 0 <= n < inf) for n in norms]
    assert [total for total, _, _ in reads] == [sum(invalid[:step]) for step in read_at]
    assert [warned for _, warned, _ in reads] == [[], [reads[1][1][0]], [], []]
    message = reads[1][1][0]
    assert "3 optimizer steps in a row were skipped (steps 3-5, and still skipping)" in message, message
    assert "lower the learning rate" in message and f"{step_guard.STREAK_ENV}=3" in message, message
    # Each read is one transfer of the counters, which the step's own execution already computed.
    assert all(counts == {"compilations": 0, "executions": 0, "transfers_to_host": 1} for _, _, counts in reads)
    # After the first two steps (compilations: the counter's creation, then its steady state), every step is one
    # execution and no transfer, skipped or not.
    steady = {"compilations": 0, "executions": 1, "transfers_to_host": 0}
    assert all(counts == steady for counts in step_counts[2:]), step_counts


def test_each_streak_is_named_with_its_steps(xla_device, monkeypatch):
    """Two streaks between two reads: the warning counts them and names the latest; a streak below the threshold
    (steps 11-12) is no warning."""
    inf = float("inf")
    norms = [1.0, inf, inf, inf, 1.0, inf, inf, inf, inf, 1.0, inf, inf, 1.0]
    reads, _ = _counted_steps(xla_device, norms, (len(norms), ), monkeypatch, threshold=3)
    assert _skip_streaks(norms, 3) == [[2, 4], [6, 9]]
    (total, warned, _), = reads
    assert total == 9 and len(warned) == 1
    assert "2 runs of 3 or more skipped steps, the latest: 4 optimizer steps in a row were skipped (steps 6-9)" \
        in warned[0], warned[0]


def test_no_invalid_norm_no_warning(xla_device, monkeypatch):
    reads, _ = _counted_steps(xla_device, [1.0] * 5, (2, 5), monkeypatch, threshold=1)
    assert [(total, warned) for total, warned, _ in reads] == [(0, []), (0, [])]


def test_streak_threshold_is_a_count(monkeypatch):
    monkeypatch.setenv(step_guard.STREAK_ENV, "several")
    with pytest.raises(ValueError, match=f"{step_guard.STREAK_ENV}='several' is not an integer"):
        step_guard.SkipCounter()
