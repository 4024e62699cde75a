"""``deepspeed.runtime.compiler.compile()`` under the XLA accelerator: torch.compile applied at the first call."""
import torch

from deepspeed_xla.patches import compiler


class Recorder:
    """A stand-in for torch.compile that records what it compiled."""

    def __init__(self):
        self.calls = []

    def __call__(self, fn, **kwargs):
        self.calls.append((fn, kwargs))
        return lambda *args, **call_kwargs: ("compiled", fn(*args, **call_kwargs))


def test_compiles_at_the_first_call_once():
    recorder = Recorder()

    def double(x, y=0):
        """Doubles."""
        return 2 * x + y

    deferred = compiler._defer(recorder)(double)
    assert recorder.calls == [] and deferred.__name__ == "double" and deferred.__doc__ == "Doubles."
    assert deferred(3, y=1) == ("compiled", 7)
    assert deferred(4) == ("compiled", 8)
    assert recorder.calls == [(double, {})]


def test_keyword_form_passes_its_options():
    recorder = Recorder()
    deferred = compiler._defer(recorder)(fullgraph=True)(abs)
    assert recorder.calls == [(abs, {"fullgraph": True})], "a builtin is not a Python function: compiled at once"
    square = compiler._defer(recorder)(dynamic=False)(lambda x: x * x)
    assert square(3) == ("compiled", 9)
    assert recorder.calls[1][1] == {"dynamic": False}
    assert deferred(-2) == ("compiled", 2)


def test_a_module_is_compiled_when_decorated():
    recorder = Recorder()
    module = torch.nn.Linear(2, 2)
    compiler._defer(recorder)(module)
    assert recorder.calls == [(module, {})]


def test_deepspeed_muon_functions_wait_for_their_first_call():
    """The patched ``compile()`` is what DeepSpeed's Muon module decorates with (tests/patches/test_stablehlo.py
    checks that a worker's start-up no longer imports inductor)."""
    from deepspeed.runtime import compiler as upstream
    from deepspeed.runtime.zero.muon import original_muon
    assert upstream.compile.__code__.co_filename == compiler.__file__
    for fn in (original_muon.zeropower_via_newtonschulz5, original_muon.muon_update):
        assert fn.__code__.co_filename == compiler.__file__, "decorated by upstream torch.compile"
        assert fn.__wrapped__.__module__ == original_muon.__name__
