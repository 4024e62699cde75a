"""``compile_errors.py``: a graph XLA's compiler refuses is named, with the compiler's words, the usual cause and the
way to its Python line."""
import pytest
import torch

from deepspeed_xla import compile_errors, xla_runtime


def _mixed_scatter_add():
    import torch_xla
    device = torch_xla.device()
    bins = torch.zeros(4, device=device)
    return bins.scatter_add(0, torch.arange(3, device=device), torch.ones(3, dtype=torch.bfloat16, device=device))


def test_a_refused_graph_is_named_with_the_cause_and_the_way_to_its_line():
    pending = _mixed_scatter_add()
    with pytest.raises(compile_errors.GraphCompileError) as refused, compile_errors.naming_refusals("the test's graph"):
        xla_runtime.sync()
    text = str(refused.value)
    assert text.startswith("deepspeed_xla: XLA could not compile the test's graph. The compiler said: during context "
                           "[hlo verifier]: Seen floating point types of different precisions in %scatter")
    assert compile_errors.MIXED_PRECISION in text and compile_errors.DEBUG_LINES in text
    assert "during context [hlo verifier]" in str(refused.value.__cause__)  # the compiler's own text, kept
    del pending


def test_the_traced_python_line_is_named_when_torch_xla_recorded_it():
    compiler = ('during context [hlo verifier]: Seen floating point types of different precisions in %add.12 = '
                'f32[4,16]{1,0} add(%dot.7, %broadcast.11), metadata={op_type="aten__addmm" op_name="aten__addmm" '
                'source_file="/work/model.py" source_line=42}, but mixed precision is disallowed.\n\nFailed after x')
    named = str(compile_errors.refused_graph(ValueError(compiler), "step 3's graph"))
    assert "%add.12 = f32[4,16]{1,0} add(%dot.7, %broadcast.11), but mixed precision" in named
    assert named.endswith("torch_xla traced the instruction at /work/model.py:42.")


def test_other_errors_are_not_taken_for_refusals():
    assert compile_errors.refused_graph(RuntimeError("buffer with id 7 is deleted"), "a graph") is None
