"""``host_reads``: each read of a device value in the user's code between the engine's calls is named by its line
and what read it; reads in DeepSpeed's and this package's code are not. (The reads of a whole training loop, and
that watching changes nothing traced: tests/test_compile_watch.py.)"""
import warnings
from pathlib import Path

from deepspeed_xla import compile_watch, host_reads, xla_runtime

_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    return next(number for number, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# {marker}"))


def _user_code(device) -> None:
    """A stretch of user code that reads the device four ways, and calls this package's own read once."""
    import torch
    values = [torch.ones(3, device=device) * n for n in range(5)]
    values[0].sum().item()  # item
    float(values[1].sum())  # float
    print(values[2])  # print
    (values[3] + 1).cpu()  # cpu
    xla_runtime.to_host([values[4] + 1])  # package


def test_each_read_in_the_users_code_is_named_by_its_line(xla_device):
    """Watched from the warm-up's end on (warm-up 0 here): four lines read in two steps running, each named once
    with what read, in the second; the package's own read, called from the user's line, is not the user's."""
    reads = host_reads.Reads(compile_watch.Settings(True, 0, 10.0), rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (0, 1):
            reads.stretch_begins(step)
            _user_code(xla_device)
            reads.stretch_ends(step)
    named = {(w.lineno, str(w.message).split("transfer(s): ")[1].split(")")[0]) for w in caught}
    assert {line for line, _ in named} == {_line(marker) for marker in ("item", "float", "print", "cpu")}, named
    assert (_line("item"), "item") in named and (_line("cpu"), "cpu") in named, named
    assert (_line("float"), "a scalar read") in named, named
    assert all(w.filename == __file__ and "between optimizer steps 1 and 2" in str(w.message) for w in caught)


def test_a_read_every_other_step_is_not_warned_of(xla_device):
    """A value read when it is logged, not in every step (watched or counted steps alike), warns of nothing."""
    import torch
    reads = host_reads.Reads(compile_watch.Settings(True, 0, 10.0), rank=0)
    value = torch.ones(2, device=xla_device).sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2 * host_reads.WATCHED_STEPS + 2):
            reads.stretch_begins(step)
            if step % 2 == 0:
                value.item()
            reads.stretch_ends(step)
    assert caught == [], [str(w.message) for w in caught]


def test_after_the_watched_steps_a_scalar_read_has_the_next_step_watched(xla_device):
    """Past the first steps after the warm-up, a stretch is only counted; a scalar read in it watches the next
    step's stretches, which name the line that read in both (and a step that read watches the next again)."""
    import torch
    reads = host_reads.Reads(compile_watch.Settings(True, 0, 10.0), rank=0)
    late = host_reads.WATCHED_STEPS
    value = torch.ones(2, device=xla_device).sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (late, late + 1, late + 2):
            reads.stretch_begins(step)
            value.item()  # late read
            reads.stretch_ends(step)
    assert [w.lineno for w in caught] == [_line("late read")] * 2, [str(w.message) for w in caught]
    assert f"between optimizer steps {late + 1} and {late + 2}" in str(caught[0].message)
