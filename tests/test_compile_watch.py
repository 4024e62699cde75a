"""What a run tells the user about XLA unasked: a recompilation after the warm-up steps and a device read in the
loop, each named by the user's line (``compile_watch``, ``host_reads``), and a long compilation announced on rank 0;
none of it adds a device read or a graph cut to a step."""
import json
import os
import re
import sys
from pathlib import Path

import pytest

from deepspeed_xla import compile_watch
from tests.multiproc import run_ranks

STEPS, SHAPE_CHANGE, READ_FROM = 12, 6, 7
#: Lines of ``train_loop`` the warnings must name, found by their text below.
_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    return next(number for number, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# {marker}"))


def train_loop() -> None:
    """Run by ``run_ranks``: the main job's model (one layer, width 16) for ``STEPS`` steps; sys.argv[1] names the
    case (``steady``, ``shape``: the sequences shrink at step ``SHAPE_CHANGE``, ``read``: ``.item()`` of the loss in
    each step from ``READ_FROM``). Prints each step's graph counters and the deepspeed_xla warnings as JSON."""
    import warnings
    import deepspeed
    import torch
    from deepspeed_xla import xla_runtime
    from deepspeed_xla.bench.example import load_example
    from tests.conftest import REPO
    example = load_example(str(REPO / "scripts" / "train.py"))  # the main job's model and batches
    case = sys.argv[1]
    torch.manual_seed(0)
    model = example.TinyGPT(vocab=16, dim=16, layers=1, heads=2, seq=8)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 4}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            before = xla_runtime.graph_counters()
            seq = 6 if case == "shape" and step >= SHAPE_CHANGE else 8
            tokens, targets = example.make_batch(step, 0, 2, seq, 16)
            loss = engine(tokens.to(engine.device), targets.to(engine.device))
            engine.backward(loss)  # backward
            engine.step()  # step end
            if case == "read" and step >= READ_FROM:
                loss.item()  # read
            after = xla_runtime.graph_counters()
            counts.append({key: after[key] - before[key] for key in after})
    print(json.dumps({"counts": counts, "warnings": [str(w.message) for w in caught
                                                      if str(w.message).startswith("deepspeed_xla")]}))


@pytest.fixture(scope="module")
def runs():
    """Every case on two ranks, and the read case with the warnings off, a 2-rank run each (~7 s each)."""
    off = {compile_watch.SWITCH_ENV: "0"}
    cases = {"steady": ("steady", {}), "shape": ("shape", {}), "read": ("read", {}), "read_off": ("read", off),
             "notice": ("steady", {compile_watch.NOTICE_ENV: "0"})}
    results = {}
    for name, (case, env) in cases.items():
        procs = run_ranks("tests.test_compile_watch:train_loop", 2, args=[case], env={"DS_ACCELERATOR": "xla", **env},
                          timeout=300)
        for rank, proc in enumerate(procs):
            assert proc.returncode == 0, f"{name} rank {rank}:\n{proc.stderr[-6000:]}"
        results[name] = [(json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr) for proc in procs]
    return results


def test_a_steady_run_warns_of_nothing(runs):
    for result, _ in runs["steady"]:
        assert result["warnings"] == []


def test_a_batch_of_another_shape_after_warm_up_warns_naming_the_users_line(runs):
    """Both ranks compile new graphs from step 6 on, and say where in the loop: at ``engine.step()``, the step's
    graph, and (rank 0, whose host-staged gradient all-reduce and progress log run DeepSpeed's reads) at
    ``engine.backward()``, said to be DeepSpeed's own code. The line is the user's, never a library's."""
    lines = {f"{__file__}:{_line('step end')}", f"{__file__}:{_line('backward')}"}
    for rank, (result, _) in enumerate(runs["shape"]):
        warned = result["warnings"]
        steps = [int(re.search(rf"rank {rank} compiled a new graph in optimizer step (\d+),", text).group(1))
                 for text in warned]
        assert steps and steps[0] == SHAPE_CHANGE, warned
        assert {re.search(r", at (\S+): ", text).group(1) for text in warned} <= lines, warned
        step_end = [text for text in warned if f"{__file__}:{_line('step end')}: " in text]
        assert step_end and (rank or "Usually a batch of another shape" in step_end[0]), warned
        assert all("DeepSpeed's own code" in text for text in warned if text not in step_end), warned


def test_the_analysis_is_torch_xlas_on_the_first_process(runs):
    """Rank 0 (the host's first process) quotes torch_xla's compilation analysis; rank 1 names the same step-end
    line, from the sync's own frames where torch_xla does not analyse (whether it does on a process forked from the
    tests' fork server, which imported torch_xla before the rank's setup, depends on what that server ran before)."""
    (rank0, _), (rank1, _) = runs["shape"]
    assert any("(torch_xla's compilation analysis: \"user torch_xla.sync\", graph " in text
               for text in rank0["warnings"]), rank0["warnings"]
    step_end = f"at {__file__}:{_line('step end')}: "
    assert any(step_end in text for text in rank0["warnings"]) and any(step_end in text for text in rank1["warnings"])


def test_a_read_in_the_loop_warns_naming_its_line_a_few_times(runs):
    for rank, (result, _) in enumerate(runs["read"]):
        warned = result["warnings"]
        expected = f"rank {rank} read a device value on the host at {__file__}:{_line('read')} (1 transfer(s): item)"
        assert [expected in text for text in warned] == [True] * compile_watch.REPEATS, warned
        assert f"between optimizer steps {READ_FROM + 1} and {READ_FROM + 2}," in warned[0]  # the second step reading
        assert "does not warn of it again" in warned[-1]


def test_the_watch_adds_no_compilation_execution_or_transfer(runs):
    """Each step of the run that reads compiles, runs and transfers the same with the warnings on as off (the graph
    counters' own reads included): watching the user's code for reads changes nothing it traces."""
    for (on, _), (off, _) in zip(runs["read"], runs["read_off"]):
        assert on["counts"] == off["counts"]


def test_a_compilation_past_the_notice_time_is_one_line_on_rank_0(runs):
    """With the notice time at 0 s every step that compiled says so on rank 0, once, naming its graph; rank 1 says
    nothing, nor does rank 0 at the default 10 s (these graphs compile in well under a second)."""
    (result, stderr), (_, stderr1) = runs["notice"]
    compiled = [step for step, count in enumerate(result["counts"], 1) if count["compilations"]]
    lines = re.findall(r"deepspeed_xla: compiling the step graph \((first step|step \d+)\)\.\.\. \d+ s\n", stderr)
    assert lines == ["first step" if step == 1 else f"step {step}" for step in compiled], stderr[-3000:]
    assert "deepspeed_xla: compiling" not in stderr1
    assert all("deepspeed_xla: compiling" not in stderr for _, stderr in runs["steady"])


ANALYSIS = """
Compilation Analysis: ================================================================================
Compilation Analysis: Compilation Cause
Compilation Analysis:   most likely user code trying to access tensor value before torch_xla.sync
Compilation Analysis: Graph Info: 
Compilation Analysis:   Graph Hash: c6e10a959d322f404b9f5e34cde1baec
Compilation Analysis:   Number of Graph Inputs: 2
Compilation Analysis: Python Frame Triggered Execution: 
Compilation Analysis:   item (/venv/site-packages/torch/_tensor.py:12)
Compilation Analysis:   <module> (/work/train.py:15)
Compilation Analysis: --------------------------------------------------------------------------------
Compilation Analysis: ================================================================================

Computation hash: 3d3db1748b123c6333f47f783dee646f
Compilation Analysis: ================================================================================
Compilation Analysis: Compilation Cause
Compilation Analysis:   user torch_xla.sync
"""


def test_torch_xlas_analysis_is_read_block_by_block():
    """A complete block gives its cause, graph and frames; one still being written is left for the next read."""
    block, = compile_watch.parse_analysis(ANALYSIS)
    assert block.cause == "most likely user code trying to access tensor value before torch_xla.sync"
    assert block.graph == "c6e10a959d322f404b9f5e34cde1baec" and not block.at_step_end
    assert compile_watch.user_frame(block.frames, ("/venv/", )) == compile_watch.Frame("<module>", "/work/train.py", 15)
    assert compile_watch.explain(block, ("/venv/", ), ("/elsewhere/", )) == compile_watch._READ_CAUSE
    engine_read = block._replace(frames=(compile_watch.Frame("to_host", "/ds/staging.py", 3), *block.frames))
    assert compile_watch.explain(engine_read, ("/venv/", ), ("/ds/", )).startswith(
        "DeepSpeed's own code (to_host at /ds/staging.py:3) ran")


@pytest.mark.parametrize("name, value, error", [
    (compile_watch.WARMUP_ENV, "five", "is not a count of steps"),
    (compile_watch.NOTICE_ENV, "-1", "is negative"),
    (compile_watch.NOTICE_ENV, "soon", "is not a number"),
])
def test_bad_settings_are_refused_naming_the_fix(name, value, error):
    with pytest.raises(ValueError, match=f"{name}={value!r} {error}.*set it to"):
        compile_watch.settings({name: value})


def test_the_analysis_is_asked_for_unless_the_user_did(tmp_path):
    env = {"PJRT_LOCAL_PROCESS_RANK": "0"}
    compile_watch.enable_analysis(env)
    assert env["PT_XLA_DEBUG_LEVEL"] == "1" and os.path.isfile(env["PT_XLA_DEBUG_FILE"])
    os.remove(env["PT_XLA_DEBUG_FILE"])
    for own in ({"PT_XLA_DEBUG_LEVEL": "2"}, {"PJRT_LOCAL_PROCESS_RANK": "1"}, {compile_watch.SWITCH_ENV: "0"}):
        env = dict(own)
        compile_watch.enable_analysis(env)
        assert env == own


def test_the_files_of_processes_that_died_without_their_exit_handler_are_removed(tmp_path, monkeypatch):
    """A killed worker leaves its analysis file behind; the next process that asks for the analysis removes it, and
    not the file of a process still running."""
    import subprocess
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"deepspeed_xla-compilations-{dead.pid}-abc123.txt"
    live = tmp_path / f"deepspeed_xla-compilations-{os.getppid()}-def456.txt"
    unrelated = tmp_path / f"deepspeed_xla-compilations-{dead.pid}.log"
    for path in (orphan, live, unrelated):
        path.write_text("x")
    env = {"PJRT_LOCAL_PROCESS_RANK": "0"}
    compile_watch.enable_analysis(env)
    own = env["PT_XLA_DEBUG_FILE"]
    assert os.path.dirname(own) == str(tmp_path) and f"-{os.getpid()}-" in os.path.basename(own)
    assert not orphan.exists() and live.exists() and unrelated.exists()
    os.remove(own)


def test_a_long_compilation_is_announced_while_it_runs_and_timed_when_it_ends(monkeypatch):
    """The notice's thread writes the start of the line once the compilation (a cache miss counted) has run for the
    notice time; the end of the sync finishes the line with the time. Short or cached syncs write nothing."""
    import io
    import time
    from deepspeed_xla import xla_runtime
    compiles = [0]
    monkeypatch.setattr(xla_runtime, "uncached_compiles", lambda: compiles[0])
    out = io.StringIO()
    notice = compile_watch.Notice(0.05, out)

    def slow_compile():
        compiles[0] += 1
        deadline = time.monotonic() + 30
        while not out.getvalue() and time.monotonic() < deadline:  # until the thread announced it
            time.sleep(0.01)
        assert out.getvalue() == "deepspeed_xla: compiling the step graph (first step)..."

    for graph, sync in (("the step graph (first step)", slow_compile), ("the step graph (step 2)", lambda: None)):
        before = compiles[0]
        notice.start(graph, before)
        sync()
        notice.end(compiles[0] > before)
    assert re.fullmatch(r"deepspeed_xla: compiling the step graph \(first step\)\.\.\. \d+ s\n", out.getvalue())


def test_a_step_graph_that_misses_the_cache_is_compiling_for_the_watchdog(xla_device, monkeypatch):
    """What the heartbeat publishes (``compiling``): the graph whose end is being synced, once torch_xla missed its
    cache for it; nothing before the miss, nor after the sync."""
    import torch
    from deepspeed_xla import xla_runtime
    watch = compile_watch.Watch(compile_watch.Settings(True, 100, 1000.0), rank=1)
    monkeypatch.setattr(compile_watch, "_watch", watch)
    seen = []

    def sync():
        seen.append(compile_watch.compiling())
        kept = (torch.ones(1, 41, 3, device=xla_device) * 7.25).sum()  # a graph no other test compiles
        xla_runtime.sync()
        assert kept.device.type == "xla"
        seen.append(compile_watch.compiling())

    watch.graph_end("the step graph (first step)", 1, sync)
    assert seen[0] is None and seen[1][0] == "the step graph (first step)" and seen[1][1] >= 0, seen
    assert compile_watch.compiling() is None
