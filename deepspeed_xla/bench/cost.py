"""The cost of a step graph, read from its HLO text (torch_xla's module before XLA's optimizations).

What the graph asks of a device, independent of how fast this machine runs it: matmul FLOPs, element operations,
the bytes it reads and writes at its boundary, and its collectives. Before optimizations there are no fusions, so
every instruction is one operation; computations that ``reduce``, ``all-reduce``, ``scatter``, ``sort`` ... apply
per element (``to_apply=``) are not model work and are not counted themselves.
"""
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

#: bytes per element of each HLO element type
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
               "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
               "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
#: one operation per output element
ELEMENTWISE = frozenset(
    "abs add and atan2 cbrt ceil clamp compare complex convert cosine divide erf exponential exponential-minus-one "
    "floor imag is-finite log log-plus-one logistic map maximum minimum multiply negate not or popcnt power real "
    "remainder round-nearest-afz round-nearest-even rsqrt select shift-left shift-right-arithmetic "
    "shift-right-logical sign sine sqrt subtract tan tanh xor clz".split())
#: data moved element by element (output elements), apart from the arithmetic
MOVEMENT = frozenset("concatenate copy dynamic-slice dynamic-update-slice gather pad reverse scatter slice sort "
                     "transpose".split())
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
#: computations an instruction runs as part of the graph (counted), as opposed to ``to_apply`` (per element)
_CALLED = re.compile(r"\b(?:calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")  # a signature is optional
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclass
class Instruction:
    """One HLO instruction: what the counts need of it."""
    name: str
    shape: str  # the result's shape text: ``f32[4,8]{1,0}`` or a tuple ``(f32[4], s32[])``
    opcode: str
    operands: List[str]  # operand instruction names
    attributes: str
    root: bool = False
    literal: str = ""  # a constant's value as printed


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at ``start`` (``(`` or ``{``)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        char = text[i]
        if char in pairs:
            stack.append(pairs[char])
        elif stack and char == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 80]!r}")


def _top_level(text: str) -> List[str]:
    """``text`` split at its commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def arrays(shape: str) -> List[Tuple[str, List[int]]]:
    """Each array of a shape (a tuple's leaves in order) as (element type, dimensions); layouts and comments
    (``/*index=5*/``) are skipped."""
    shape = re.sub(r"/\*.*?\*/", "", shape)
    shape = re.sub(r"\{[^{}]*\}", "", shape)  # layouts
    return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _ARRAY.findall(shape)
            if dtype in DTYPE_BYTES]


def elements(shape: str) -> int:
    """Elements of a shape, a tuple's leaves summed."""
    return sum(math.prod(dims) for _, dims in arrays(shape))


def nbytes(shape: str) -> int:
    """Bytes of a shape, a tuple's leaves summed."""
    return int(sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims in arrays(shape)))


def parse_instruction(line: str) -> Optional[Instruction]:
    """The instruction of one line of a computation's body; None for other lines."""
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    root, name, rest = match.groups()
    if rest.startswith("("):
        end = _closing(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode_end = rest.index("(")
    opcode = rest[:opcode_end]
    close = _closing(rest, opcode_end)
    operand_text = rest[opcode_end + 1:close - 1]
    # operands are ``%name`` or ``f32[4]{0} %name``; constants and parameters hold literals, not operands
    operands = [] if opcode in ("constant", "parameter", "iota") else [
        token.split()[-1].lstrip("%") for token in _top_level(operand_text) if token.strip()]
    literal = operand_text.strip() if opcode == "constant" else ""
    return Instruction(name, shape, opcode, operands, rest[close:].lstrip(", "), bool(root), literal)


def parse_module(text: str) -> Tuple[Dict[str, List[Instruction]], str]:
    """The module's computations by name, and the entry computation's name."""
    computations: Dict[str, List[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            header = _HEADER.match(stripped)
            if header:
                current = header[2]
                computations[current] = []
                entry = current if header[1] else entry
            continue
        if stripped == "}":
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction:
            computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text: pass a module's text (an XLA dump's "
                         "*.before_optimizations.txt)")
    return computations, entry


def _dims(attributes: str, key: str) -> List[int]:
    match = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attributes)
    return [int(d) for d in match[1].split(",") if d] if match else []


def dot_flops(instruction: Instruction, shapes: Dict[str, str]) -> int:
    """2·M·N·K: two FLOPs per multiply-add, for every output element (batch dims included) and every element of
    the contracted dims."""
    lhs = arrays(shapes[instruction.operands[0]])[0][1]
    contracted = math.prod(lhs[d] for d in _dims(instruction.attributes, "lhs_contracting_dims"))
    return 2 * elements(instruction.shape) * contracted


def convolution_flops(instruction: Instruction, shapes: Dict[str, str]) -> int:
    """Two FLOPs for each output element times the kernel's elements that feed it: all but its output-feature
    dimension (``o`` of ``dim_labels``; grouped kernels already hold in/groups input features)."""
    kernel = arrays(shapes[instruction.operands[1]])[0][1]
    labels = re.search(r"dim_labels=\w+_(\w+)->", instruction.attributes)
    out_features = kernel[labels[1].index("o")] if labels else 1
    return 2 * elements(instruction.shape) * math.prod(kernel) // max(out_features, 1)


def replica_groups(attributes: str) -> Optional[List[List[int]]]:
    """``replica_groups`` as lists of ids, explicit (``{{0,1},{2,3}}``) or iota (``[2,2]<=[4]``,
    ``[2,2]<=[2,2]T(1,0)``); None when empty (all replicas)."""
    explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attributes)
    if explicit:
        groups = [[int(i) for i in group.split(",") if i] for group in re.findall(r"\{([0-9,]*)\}", explicit[1])]
        return groups or None
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attributes)
    if not iota:
        return None
    group_shape = [int(d) for d in iota[1].split(",")]
    reshape = [int(d) for d in iota[2].split(",")]
    ids = list(range(math.prod(reshape)))
    if iota[3]:
        ids = _transposed(ids, reshape, [int(d) for d in iota[3].split(",")])
    size = group_shape[-1]
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def _transposed(ids: List[int], dims: List[int], order: List[int]) -> List[int]:
    """``ids`` laid out as ``dims``, read in the dimension order ``order`` (row major)."""
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    out_dims = [dims[axis] for axis in order]
    result = []
    for flat in range(math.prod(out_dims)):
        index, rest = [], flat
        for size in reversed(out_dims):
            index.append(rest % size)
            rest //= size
        index.reverse()
        result.append(ids[sum(i * strides[axis] for i, axis in zip(index, order))])
    return result


def collective(instruction: Instruction, shapes: Dict[str, str]) -> dict:
    """A collective's kind, groups and bytes: the whole tensor it works on (the larger of its operands and its
    result: an all-gather's result, a reduce-scatter's operand)."""
    kind = instruction.opcode.replace("-start", "")
    operand_bytes = sum(nbytes(shapes[name]) for name in instruction.operands if name in shapes)
    entry = {"kind": kind, "bytes": max(operand_bytes, nbytes(instruction.shape)),
             "replica_groups": replica_groups(instruction.attributes)}
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", instruction.attributes)
        entry["source_target_pairs"] = [[int(i) for i in p.split(",")] for p in re.findall(r"\{([0-9,]*)\}",
                                                                                          pairs[1])] if pairs else []
    return entry


def _identity_slice(instruction: Instruction, shapes: Dict[str, str]) -> bool:
    """A slice of a whole operand: torch_xla emits one for each view of a flat buffer, and XLA's simplifier
    removes it, so it moves nothing."""
    return (instruction.opcode == "slice" and instruction.operands[0] in shapes
            and arrays(shapes[instruction.operands[0]]) == arrays(instruction.shape))


#: instructions that pass a value on unchanged: a constant seen through them is still that constant
_PASS_THROUGH = frozenset(("broadcast", "reshape", "convert", "copy"))


def _scalar_constant(name: str, by_name: Dict[str, Instruction]) -> Optional[float]:
    """The value of a constant (seen through broadcasts, reshapes and converts) that ``name`` is; None otherwise."""
    instruction = by_name.get(name)
    while instruction is not None and instruction.opcode in _PASS_THROUGH:
        instruction = by_name.get(instruction.operands[0])
    if instruction is None or instruction.opcode != "constant":
        return None
    try:
        return float(instruction.literal)
    except ValueError:  # an array or tuple literal
        return None


def is_identity(instruction: Instruction, by_name: Dict[str, Instruction]) -> bool:
    """x·1, 1·x, x/1, x+0, 0+x, x−0: torch_xla emits them (an ``add``'s alpha of 1, a division by a world size
    of 1), and XLA's algebraic simplifier removes them, so they ask no work of a device."""
    op, operands = instruction.opcode, instruction.operands
    values = [_scalar_constant(name, by_name) for name in operands]
    return ((op == "multiply" and 1.0 in values) or (op == "divide" and values[1:] == [1.0])
            or (op == "add" and 0.0 in values) or (op == "subtract" and values[1:] == [0.0]))


def _counted(computations: Dict[str, List[Instruction]], entry: str) -> List[str]:
    """The entry computation and those it runs as part of the graph (``calls``, ``while`` bodies and conditions,
    ``conditional`` branches), each once."""
    order, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name in order or name not in computations:
            continue
        order.append(name)
        for instruction in computations[name]:
            todo += _CALLED.findall(instruction.attributes)
            for branches in _BRANCHES.findall(instruction.attributes):
                todo += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
    return order


def step_cost(text: str) -> dict:
    """The counts of one HLO module (see the module's docstring): ``dot_flops`` (dots and convolutions),
    ``elementwise_ops`` (identities XLA removes left out: ``identity_ops``), ``reduction_ops`` (input elements of
    each reduce, window elements of each reduce-window), ``movement_elements`` (slices of a whole operand left out), ``bytes_read`` (the entry's parameters),
    ``bytes_written`` (the entry's root), ``collectives`` and their total ``collective_bytes``; ``while_loops``:
    bodies counted once each, their trip count being unknown here."""
    computations, entry = parse_module(text)
    cost = {"dot_flops": 0, "elementwise_ops": 0, "reduction_ops": 0, "movement_elements": 0, "bytes_read": 0,
            "bytes_written": 0, "identity_ops": 0, "instructions": 0, "while_loops": 0, "collectives": []}
    for name in _counted(computations, entry):
        shapes = {i.name: i.shape for i in computations[name]}
        by_name = {i.name: i for i in computations[name]}
        for instruction in computations[name]:
            op = instruction.opcode
            cost["instructions"] += 1
            if op == "dot":
                cost["dot_flops"] += dot_flops(instruction, shapes)
            elif op == "convolution":
                cost["dot_flops"] += convolution_flops(instruction, shapes)
            elif op in ELEMENTWISE:
                counted = "identity_ops" if is_identity(instruction, by_name) else "elementwise_ops"
                cost[counted] += elements(instruction.shape)
            elif op == "reduce":
                inputs = instruction.operands[:len(instruction.operands) // 2]
                cost["reduction_ops"] += sum(elements(shapes[i]) for i in inputs if i in shapes)
            elif op == "reduce-window":
                window = re.search(r"size=([0-9x]+)", instruction.attributes)
                size = math.prod(int(d) for d in window[1].split("x")) if window else 1
                cost["reduction_ops"] += elements(instruction.shape) * size
            elif op in MOVEMENT and not _identity_slice(instruction, shapes):
                cost["movement_elements"] += elements(instruction.shape)
            elif op.replace("-start", "") in COLLECTIVES:
                cost["collectives"].append(collective(instruction, shapes))
            elif op == "while":
                cost["while_loops"] += 1
            if name == entry and op == "parameter":
                cost["bytes_read"] += nbytes(instruction.shape)
            if name == entry and instruction.root:
                cost["bytes_written"] += nbytes(instruction.shape)
    cost["collective_bytes"] = sum(c["bytes"] for c in cost["collectives"])
    return cost


def dot_count(text: str) -> int:
    """Dots and convolutions in a module's text: how the step graph is told from the others."""
    return len(re.findall(r"\sdot\(|\sconvolution\(|stablehlo\.(?:dot_general|dot|convolution)\b", text))


def saved_graphs(text: str) -> List[str]:
    """The HLO modules of a torch_xla ``XLA_SAVE_TENSORS_FILE`` (``XLA_SAVE_TENSORS_FMT=hlo``): one per graph
    execution, in order, compiled or taken from the cache alike."""
    return re.findall(r"## BEGIN_GRAPH\n(.*?)\n## END_GRAPH", text, flags=re.S)


def _step_index(graphs: List[str]) -> int:
    """Which of the graphs (in execution or compilation order) is the step: the last of those with the most dots and
    convolutions (the forward and backward), not a first step that also creates the optimizer's state."""
    counts = [dot_count(graph) for graph in graphs]
    return max(range(len(graphs)), key=lambda index: (counts[index], index))


def step_graph(graphs: List[str]) -> str:
    """The step among executed graphs (``_step_index``)."""
    if not graphs:
        raise ValueError("no graph was executed: run the steps with XLA_SAVE_TENSORS_FILE set and "
                         "XLA_SAVE_TENSORS_FMT=hlo")
    return graphs[_step_index(graphs)]


def step_module(dump_dir: Path) -> Path:
    """The step graph among an XLA dump's ``*before_optimizations.txt`` modules (``_step_index``; module numbers
    count compilations): the step a loop runs after warm-up."""
    modules = sorted(Path(dump_dir).glob("module_*.before_optimizations.txt"))
    if not modules:
        raise FileNotFoundError(f"no module_*.before_optimizations.txt in {dump_dir}: run the system with "
                                f"XLA_FLAGS='--xla_dump_to={dump_dir} --xla_dump_hlo_as_text'")
    return modules[_step_index([path.read_text() for path in modules])]
