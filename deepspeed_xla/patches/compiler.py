"""DeepSpeed's ``runtime.compiler``: the ``compile()`` decorator builds torch.compile's backend at the first call.

Upstream ``compile()`` returns ``torch.compile``, which sets up its inductor backend (importing inductor, seconds of
CPU) when it decorates. DeepSpeed's Muon module decorates three functions at import and every engine imports it, so
every worker paid that start-up whether or not it trains with Muon (figures: docs/performance.md). torch.compile
compiles at the first call anyway; only the backend's set-up moves there.
"""
import functools
import inspect
from typing import Callable


def _defer(decorator: Callable) -> Callable:
    """``decorator`` (``torch.compile`` or DeepSpeed's no-op), applied to a function at its first call."""

    def deferred(fn=None, **kwargs):
        if fn is None:
            return lambda f: deferred(f, **kwargs)
        if not inspect.isfunction(fn):  # a module: torch.compile returns a module, which cannot wait
            return decorator(fn, **kwargs)
        compiled = None

        @functools.wraps(fn)
        def call(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = decorator(fn, **kwargs)
            return compiled(*args, **call_kwargs)

        return call

    return deferred


def deferred_compile(upstream: Callable) -> Callable:
    """Wraps ``deepspeed.runtime.compiler.compile``."""

    @functools.wraps(upstream)
    def compile():
        return _defer(upstream())

    return compile
