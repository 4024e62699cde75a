"""DeepSpeed's flops profiler on XLA: the profiled step's latencies are the device's, not the compiler's.

Upstream times each module of the profiled forward between two ``synchronize()`` calls. On XLA each one cuts the lazy
graph, so the profiled step ran dozens of graphs no other step runs, each compiled on the spot: a 3M-parameter model
showed a 7.3 s forward (64x low FLOPS) against a 143 ms step. Here no module is timed (each would need its own
graph); the engine's forward, backward and step timers wait for the device at their boundaries instead, on the
profiled step and on the step before it, whose three graphs (forward, backward, update) are the ones the profiled
step runs: the profiled step compiles nothing. Every rank cuts the same graphs: ranks running different graphs around
an in-graph collective hang. The timed steps' graphs are this patch's doing, so ``compile_watch`` does not warn of
them.
"""
import contextlib
import functools
import io
import os
import re

#: The upstream per-module latency fields the profile prints, replaced on XLA.
_MODULE_LATENCY = re.compile(r", [^,]* = [^,]*% latency, [^,)]*FLOPS")
_AGGREGATED_LATENCY = re.compile(r"(    fwd latency - ).*")
NOT_MEASURED = "latency not measured on XLA"
_TIMED_STEP = "_dsx_timed_step"  # set on the engine at each forward: whether its step is timed on the device
NOTE = ("deepspeed_xla: fwd, bwd and step latencies are the device's on this step: the engine's timers waited for "
        "the device at each boundary (this step and the one before it ran the step as three graphs, compiled on the "
        "step before). Per-module latencies are not measured on XLA: timing a module needs the graph cut at its "
        "start and end, which runs (and compiles) graphs that training never runs.")


def _timed_step(engine) -> bool:
    """Whether this step (the one the engine's forward starts) is the profiled one or the one before it."""
    if not engine.flops_profiler_enabled():
        return False
    return engine.global_steps in (engine.flops_profiler_profile_step() - 1, engine.flops_profiler_profile_step())


def _wait_at_a_timed_boundary(engine, timer_names) -> None:
    """On a timed step, wait for the device where the forward, backward or step timers start or stop."""
    timers = engine.engine_timers
    if engine.__dict__.get(_TIMED_STEP) and any(timer_names is group for group in (
            timers.forward_timers, timers.backward_timers, timers.step_timers)):
        from deepspeed.accelerator import get_accelerator
        get_accelerator().synchronize()


def start_timers_on_the_device(original):
    """``DeepSpeedEngine._start_timers``: on a timed step, the forward, backward and step timers start once the
    device finished what came before. Whether a step is timed is decided at its forward (``global_steps`` moves
    on inside ``step()``, before the step timers stop)."""

    @functools.wraps(original)
    def start_timers(self, timer_names):
        if timer_names is self.engine_timers.forward_timers:
            self.__dict__[_TIMED_STEP] = _timed_step(self)
            if self.__dict__[_TIMED_STEP]:
                from deepspeed_xla import compile_watch
                compile_watch.expect_compilations(self.global_rank, self.global_steps + 1)
        _wait_at_a_timed_boundary(self, timer_names)
        return original(self, timer_names)

    return start_timers


def stop_timers_on_the_device(original):
    """``DeepSpeedEngine._stop_timers``: on a timed step, the forward, backward and step timers stop once the device
    finished their part."""

    @functools.wraps(original)
    def stop_timers(self, timer_names):
        _wait_at_a_timed_boundary(self, timer_names)
        return original(self, timer_names)

    return stop_timers


def no_module_timing(original):
    """``FlopsProfiler.start_profile``: the per-module timing hooks (a ``synchronize()`` at each module's start and
    end) are removed; the FLOP, MAC and parameter counts stay."""

    @functools.wraps(original)
    def start_profile(self, ignore_list=None):
        original(self, ignore_list=ignore_list)
        for module in self.model.modules():
            for handle in ("__start_time_hook_handle__", "__end_time_hook_handle__"):
                if hasattr(module, handle):
                    getattr(module, handle).remove()
                    delattr(module, handle)

    return start_profile


def forward_latency_from_the_engine(original):
    """``FlopsProfiler.get_total_duration``: the engine's forward timer (device time on the profiled step); upstream
    sums the module timings, which XLA does not take."""

    @functools.wraps(original)
    def get_total_duration(self, as_string=False):
        if self.ds_engine is None:
            return original(self, as_string=as_string)
        from deepspeed.profiling.flops_profiler.profiler import duration_to_string
        from deepspeed.utils.timer import FORWARD_GLOBAL_TIMER
        duration = self.ds_engine.timers(FORWARD_GLOBAL_TIMER).elapsed(reset=False) / 1000.0
        return duration_to_string(duration) if as_string else duration

    return get_total_duration


def module_latencies_not_measured(original):
    """``FlopsProfiler.print_model_profile``: each module's latency (and FLOPS from it) reads "not measured on XLA",
    and a note says how the step's latencies were measured."""

    @functools.wraps(original)
    def print_model_profile(self, profile_step=1, module_depth=-1, top_modules=1, detailed=True, output_file=None):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            original(self, profile_step=profile_step, module_depth=module_depth, top_modules=top_modules,
                     detailed=detailed, output_file=None)
        text = _MODULE_LATENCY.sub(f", {NOT_MEASURED}", printed.getvalue())
        text = _AGGREGATED_LATENCY.sub(rf"\g<1>{NOT_MEASURED}", text)
        if not text:
            return
        text += NOTE + "\n"
        if output_file:
            os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
            with open(output_file, "w") as out:
                out.write(text)
        else:
            print(text, end="")

    return print_model_profile
