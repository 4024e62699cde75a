"""XLA's refusal of a graph, told in the user's terms.

torch_xla traces ops without checking everything CPU and CUDA kernels check (two float dtypes in one op, for one),
so some mistakes reach XLA's compiler, which names HLO instructions (``%add.71``) at the next sync: for a training
step, inside ``engine.step()``, far from the line that made them. The error raised instead says that the compiler
refused a graph, which graph, the usual cause of what it refused, and how to see the Python line behind the
instruction (or that line, when torch_xla recorded it).
"""
import contextlib
import re
from typing import Iterator, Optional

#: How XLA's compiler passes prefix what they refuse (``during context [hlo verifier]: ...``).
_COMPILER_CONTEXT = "during context ["
_SOURCE = re.compile(r'source_file="([^"]+)" source_line=(\d+)')
_METADATA = re.compile(r", metadata=\{[^}]*\}")
DEBUG_LINES = "XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1"
MIXED_PRECISION = ("two float dtypes met in one operation that torch_xla lowers without a cast (the bias add of a "
                   "Linear layer or of baddbmm, scatter_add); CPU and CUDA refuse such an op where it is called. The "
                   "usual cause is a float32 batch fed to a bfloat16 model: cast the batch to the model's dtype before "
                   "the forward (batch.to(torch.bfloat16)), or cast one operand to the other's dtype.")


class GraphCompileError(RuntimeError):
    """XLA's compiler refused a traced graph; the compiler's own text is the cause (``__cause__``)."""


def refused_graph(error: BaseException, graph: str) -> Optional[GraphCompileError]:
    """The ``GraphCompileError`` for ``error`` raised while compiling ``graph`` (a description: "optimizer step 3's
    graph ..."), or None when ``error`` is not the compiler refusing it."""
    text = str(error)
    if _COMPILER_CONTEXT not in text:
        return None
    refusal = _METADATA.sub("", next(line for line in text.splitlines() if _COMPILER_CONTEXT in line).strip())
    cause = f" This is {MIXED_PRECISION}" if "mixed precision is disallowed" in text else ""
    source = _SOURCE.search(text)
    where = (f" torch_xla traced the instruction at {source.group(1)}:{source.group(2)}." if source else
             f" To see the Python line behind the instruction, run again with {DEBUG_LINES}: the compiler's message "
             "then names it.")
    return GraphCompileError(f"deepspeed_xla: XLA could not compile {graph}. The compiler said: {refusal}.{cause}"
                             f"{where}")


@contextlib.contextmanager
def naming_refusals(graph: str) -> Iterator[None]:
    """Raise a refusal of XLA's compiler inside the block (a sync) as ``GraphCompileError``, naming ``graph``."""
    try:
        yield
    except (RuntimeError, ValueError) as error:
        refused = refused_graph(error, graph)
        if refused is None:
            raise
        raise refused from error
