"""torch_xla's saved StableHLO of a step graph, made ready for another compiler: the step's module cut from the
saved file, and the buffer donors of torch_xla's own compile of it put back on its arguments.

torch_xla saves a graph (``XLA_SAVE_TENSORS_FMT=stablehlo``) before it compiles it, so the saved module carries no
aliasing (``mhlo.input_output_alias = []``); its compile then marks the parameters it updates in place as buffer
donors, which XLA aliases to outputs of the same shape. The XLA dump of that compile (``before_optimizations``) lists
them, and ``jax.buffer_donor`` on the same arguments of the StableHLO has libtpu alias them alike.
"""
import math
import re
from typing import Set

from deepspeed_xla.bench.cost import dot_count, saved_graphs

_SIGNATURE = re.compile(r"func\.func (?:public )?@main\((.*?)\) ->", re.S)
_ARGUMENT = re.compile(r"%arg(\d+): (tensor<[^>]*>)")
_DONORS = re.compile(r"(?:buffer_donor|input_output_alias)=\{(.*?) \}")
_BOOLEANS = re.compile(r'dense<"0x([0-9A-Fa-f]+)"> : tensor<([0-9x]*)xi1>')
_HLO_PARAMETERS = re.compile(r"entry_computation_layout=\{\((.*?)\)->")


def step_stablehlo(saved_text: str) -> str:
    """The step's module among the graphs torch_xla saved as StableHLO (``XLA_SAVE_TENSORS_FMT=stablehlo``): the
    last of those with the most dots."""
    graphs = saved_graphs(saved_text)
    if not graphs:
        raise ValueError("no graph was saved: trace the steps with XLA_SAVE_TENSORS_FMT=stablehlo")
    counts = [dot_count(graph) for graph in graphs]
    return module_text(graphs[max(range(len(graphs)), key=lambda index: (counts[index], index))])


def module_text(graph: str) -> str:
    """A saved graph's module, without the ``Graph Hash`` line after it that MLIR cannot parse, and with its boolean
    constants in bytes (``bytewise_booleans``)."""
    return bytewise_booleans(graph.rsplit("\nGraph Hash:", 1)[0].strip() + "\n")


def bytewise_booleans(module: str) -> str:
    """torch_xla 2.9's MLIR prints a boolean array constant in hex as bits, 8 elements a byte, the lowest bit first;
    the newer MLIR of the compile-only venv reads a byte per element ("elements hex data size is invalid")."""
    def unpacked(match: re.Match) -> str:
        bits, count = bytes.fromhex(match[1]), math.prod(int(d) for d in match[2].split("x") if d)
        if len(bits) != (count + 7) // 8:
            return match[0]  # already a byte per element
        values = bytes((bits[i // 8] >> (i % 8)) & 1 for i in range(count))
        return f'dense<"0x{values.hex().upper()}"> : tensor<{match[2]}xi1>'
    return _BOOLEANS.sub(unpacked, module)


def donors(hlo_text: str) -> Set[int]:
    """The entry parameters torch_xla gave XLA to reuse for outputs (``buffer_donor``, or ``input_output_alias``
    where the user configured aliasing): what it updates in place."""
    header = hlo_text.split("\n", 1)[0]
    found = set()
    for listed in _DONORS.findall(header):
        found.update(int(number) for number in re.findall(r"\((\d+),", listed))
    return found


def _parameter_count(hlo_text: str) -> int:
    layout = _HLO_PARAMETERS.search(hlo_text.split("\n", 1)[0])
    return len(re.findall(r"[a-z][a-z0-9]*\[[0-9,]*\]", layout[1])) if layout else 0


def mark_donors(stablehlo: str, hlo_text: str) -> str:
    """``stablehlo`` with ``jax.buffer_donor`` on the arguments the compiled HLO of the same graph (an XLA dump's
    ``before_optimizations``) donates; XLA then aliases them to outputs as it did for torch_xla."""
    signature = _SIGNATURE.search(stablehlo)
    arguments = _ARGUMENT.findall(signature[1]) if signature else []
    if len(arguments) != _parameter_count(hlo_text):
        raise ValueError(f"the compiled graph has {_parameter_count(hlo_text)} parameters and the saved StableHLO "
                         f"{len(arguments)} arguments: they are not the same graph")
    marked = set(donors(hlo_text))
    start, end = signature.span(1)
    arguments_text = _ARGUMENT.sub(lambda m: m[0] + (" {jax.buffer_donor = true}" if int(m[1]) in marked else ""),
                                   stablehlo[start:end])
    return stablehlo[:start] + arguments_text + stablehlo[end:]
