"""The commands in README.md and docs/*.md: the CPU-runnable ones run here, every other one is checked.

A shell block's fence names the language and a tag (the table is in docs/quickstart.md):
``cpu`` blocks run from the repository root in a clean PJRT CPU environment and must exit 0; ``tpu``
(TPU hardware or a cluster), ``check`` (your own files, or what a ``cpu`` block already runs),
``install`` (changes the environment) and ``ci`` (the test suite: running it here would recurse) are
checked without running: bash syntax, DeepSpeed's own runner arguments, ``scripts/train.py`` flags
and repository paths. The README's main command runs once, and must plot a falling loss.
"""
import json
import re
import shlex
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from tests.conftest import REPO, VENV_BIN, clean_env
from tests.multiproc import ds_config, free_port, run_command

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
TAGS = {
    "cpu": "runs on PJRT CPU: executed by this test",
    "tpu": "needs a TPU VM, a pod or a cluster launcher",
    "check": "your own script or config, or what a cpu block already runs",
    "install": "installs packages",
    "ci": "the test suite itself",
}
MAIN_COMMAND = "bash scripts/run_example.sh"
# Scripts that source scripts/setup_env.sh, which reuses (or builds) the venv named by DSX_VENV.
USES_SETUP_ENV = ("run_example.sh", "run_tests.sh", "setup_env.sh")
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+([\d.]+)\s+tokens/s\s+([\d,]+)", re.MULTILINE)
REPO_PATH = re.compile(r"(?<![\w./~-])((?:scripts|docs|tests|deepspeed_xla)/[\w./-]*\w)")
PIN = re.compile(r"([A-Za-z0-9][\w.-]*)(?:\[[\w,-]+\])?==(\d[\w.]*)")
OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
MARKDOWN_LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s]+)\)")
#: What begins a line of a job's output: gloo's, DeepSpeed's logger's, a rank's prefix, ours, train.py's step line, a
#: Python warning. Later in a line, two processes wrote into each other.
LINE_START = re.compile(r"\[Gloo\]|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]|\[rank \d+\] |\[deepspeed_xla\]|"
                        r"\bstep\s+\d+\s+loss|\b\w+Warning: ")
RANK_PREFIX = re.compile(r"^\[rank \d+\] ")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    tag: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path) -> Iterator[Block]:
    """Every ``` fenced block of a markdown file, with the fence's language and tag."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^(\s*)```(.*)$", lines[index])
        index += 1
        if not opening:
            continue
        indent, info = len(opening.group(1)), opening.group(2).split()
        start, body = index, []
        while index < len(lines) and not re.match(r"^\s*```\s*$", lines[index]):
            body.append(lines[index][indent:])
            index += 1
        index += 1
        language = info[0].lower() if info else ""
        yield Block(path, start, language, " ".join(info[1:]), "\n".join(body) + "\n")


BLOCKS = [block for path in DOCUMENTS for block in fenced_blocks(path)]
SHELL_BLOCKS = [block for block in BLOCKS if block.language in SHELL_LANGUAGES]


def _is_main_command(block: Block) -> bool:
    lines = block.text.strip().splitlines()
    return len(lines) == 1 and " ".join(shlex.split(lines[0], comments=True)) == MAIN_COMMAND


def _distinct_cpu_blocks() -> List[Block]:
    """``cpu`` blocks other than the main command, each distinct text once (the docs repeat some)."""
    seen: Dict[str, Block] = {}
    for block in SHELL_BLOCKS:
        if block.tag == "cpu" and not _is_main_command(block):
            seen.setdefault(block.text.strip(), block)
    return list(seen.values())


def block_env(text: str, tmp_path: Path) -> dict:
    """A clean PJRT CPU environment. The scripts that build the venv reuse the one running these tests, a
    free port and a PNG path under ``tmp_path``.

    setup_env.sh keys its venv on requirements.txt's hash and deletes a DSX_VENV it did not finish
    building, so it is pointed at this venv only when setup_env.sh made it.
    """
    if not any(name in text for name in USES_SETUP_ENV):
        return clean_env()
    venv = VENV_BIN.parent
    assert (venv / ".complete").is_file(), (
        f"{venv} was not made by scripts/setup_env.sh, which the documented scripts reuse: run the suite "
        "with bash scripts/run_tests.sh")
    return clean_env(DSX_VENV=venv, MASTER_PORT=free_port(), LOSS_PLOT=tmp_path / "loss_curve.png")


def run_block(text: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return run_command(["bash", "-e", "-o", "pipefail", "-c", text], timeout, cwd=REPO, env=env)


def _output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def noise(output: str) -> List[str]:
    """Library noise in a job's output: gloo's connection lines, lines that two processes wrote into each other, and a
    warning written more than once (once per rank: the same text but for its numbers and DeepSpeed's time stamp)."""
    found, warnings = [], Counter()
    for line in output.splitlines():
        body = RANK_PREFIX.sub("", line)
        if "[Gloo]" in line:
            found.append(f"gloo's connection line: {line}")
        if any(start.start() > 0 for start in LINE_START.finditer(body)):
            found.append(f"two processes' text in one line: {line}")
        if "warn" in line.lower():
            warnings[re.sub(r"\d+", "N", body)] += 1
    return found + [f"written {count} times: {line}" for line, count in warnings.items() if count > 1]


def test_noise_is_found_where_the_issue_saw_it():
    """The first lines a new user read before (issue 59), and a warning of each rank."""
    seen = ("[Gloo] Rank [Gloo] Rank 1 is connected to 01 is connected to  peer ranks. 1Expected number of connected "
            "peer ranks is :  peer ranks. 1Expected number of connected peer ranks is : 1\n1\n"
            "step    0  loss 4.3103  tokens/s 5  device xla:0\n"
            "[2026-12-07 20:58:49,210] [WARNING] [engine.py:1:f] rank 0 slow\n"
            "[2026-12-07 20:58:49,211] [WARNING] [engine.py:1:f] rank 1 slow\n")
    assert [problem.split(":")[0] for problem in noise(seen)] == [
        "gloo's connection line", "two processes' text in one line", "written 2 times"]
    assert noise("[rank 1] [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks "
                 "is : 1\n") == ["gloo's connection line: [rank 1] [Gloo] Rank 1 is connected to 1 peer ranks. "
                                  "Expected number of connected peer ranks is : 1"]


def test_every_shell_block_has_a_known_tag():
    untagged = [f"{b.where}: ```{b.language} {b.tag}".rstrip() for b in SHELL_BLOCKS if b.tag not in TAGS]
    assert not untagged, ("tag these blocks (```bash <tag>), one of: "
                          + "; ".join(f"{tag} = {meaning}" for tag, meaning in TAGS.items()) + "\n"
                          + "\n".join(untagged))


def test_readme_main_command_trains_and_plots(tmp_path):
    """``bash scripts/run_example.sh`` as the README gives it: 2 processes, 20 steps, a PNG, a falling loss, and an
    output without library noise (``DS_XLA_VERBOSE`` brings gloo's lines back: ``tests/comm/test_host_staged.py``)."""
    main = [b for b in SHELL_BLOCKS if b.path.name == "README.md" and b.tag == "cpu" and _is_main_command(b)]
    assert main, f"README.md has no ```bash cpu block with `{MAIN_COMMAND}` (the main command)"
    env = block_env(main[0].text, tmp_path)
    proc = run_block(main[0].text, env, timeout=900)
    assert proc.returncode == 0, _output(proc)
    assert not noise(proc.stdout) + noise(proc.stderr), _output(proc)
    steps = [(int(m[1]), float(m[2]), float(m[3].replace(",", ""))) for m in STEP_LINE.finditer(proc.stdout)]
    assert [s[0] for s in steps] == [0, 5, 10, 15, 19], _output(proc)
    assert all(tokens_per_s > 0 for _, _, tokens_per_s in steps), steps
    assert steps[-1][1] < steps[0][1] - 0.5, f"the loss did not fall: {steps}"
    plot = Path(env["LOSS_PLOT"])
    assert f"the loss curve is in {plot}" in proc.stdout, _output(proc)
    from matplotlib.image import imread
    height, width, _ = imread(plot).shape
    assert height >= 200 and width >= 300, (height, width)


@pytest.mark.parametrize("block", _distinct_cpu_blocks(), ids=lambda b: b.where)
def test_cpu_block_runs(block, tmp_path):
    proc = run_block(block.text, block_env(block.text, tmp_path), timeout=600)
    assert proc.returncode == 0, f"{block.where}:\n{block.text}\n{_output(proc)}"


@pytest.fixture(scope="module")
def train_flags() -> set:
    """The options ``scripts/train.py`` accepts, from its own ``--help``."""
    proc = run_command([sys.executable, "scripts/train.py", "--help"], 300, cwd=REPO, env=clean_env())
    assert proc.returncode == 0, _output(proc)
    return set(re.findall(r"--[\w-]+", proc.stdout))


def _quotes_closed(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
        return True
    except ValueError:
        return False


def _logical_lines(text: str) -> Iterator[str]:
    """Lines with continuations and multi-line quotes joined, here-document bodies left out."""
    terminator, pending = None, ""
    for line in text.replace("\\\n", " ").splitlines():
        if terminator is not None:
            terminator = None if line.strip() == terminator else terminator
            continue
        pending = f"{pending}\n{line}" if pending else line
        if not _quotes_closed(pending):
            continue
        heredoc = HEREDOC.search(pending)
        terminator = heredoc.group(1) if heredoc else None
        yield pending
        pending = ""


def _without_environment(words: List[str]) -> List[str]:
    """The command after its leading ``NAME=value`` assignments and ``env [-u NAME]``."""
    while words and (ASSIGNMENT.match(words[0]) or words[0] == "env"):
        words = words[3:] if words[:2] == ["env", "-u"] else words[1:]
    return words


def _substitutions_as_words(line: str) -> str:
    """Each ``$(...)`` becomes the word ``0`` (it may stand for a number, e.g. ``--node_rank``), so its inner
    ``(``, ``)`` and ``;`` do not split the command around it."""
    out, index = [], 0
    while index < len(line):
        if not line.startswith("$(", index):
            out.append(line[index])
            index += 1
            continue
        depth, index = 1, index + 2
        while index < len(line) and depth:
            depth += {"(": 1, ")": -1}.get(line[index], 0)
            index += 1
        out.append("0")
    return "".join(out)


def simple_commands(text: str) -> Iterator[List[str]]:
    """The words of each simple command (split at ``;``, ``&&``, ``|``, ...), environment prefixes removed;
    a remote command (``gcloud ... ssh --command '...'``) is read too."""
    for line in _logical_lines(text):
        lexer = shlex.shlex(_substitutions_as_words(line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: List[str] = []
        for word in [*lexer, ";"]:
            if word not in OPERATORS:
                command.append(word)
                continue
            command = _without_environment(command)
            if command:
                yield command
            if "--command" in command[:-1]:
                yield from simple_commands(command[command.index("--command") + 1])
            command = []


def _check_train_args(words: List[str], flags: set, where: str) -> None:
    unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in flags]
    assert not unknown, f"{where}: scripts/train.py has no option {unknown}"


def _check_deepspeed_command(args: List[str], flags: set, where: str) -> None:
    from deepspeed.launcher import runner
    try:
        parsed = runner.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: DeepSpeed's runner rejects `deepspeed {' '.join(args)}`")
    assert parsed.launcher.lower() in runner.LAUNCHER_CLASSES, f"{where}: unknown --launcher {parsed.launcher}"
    if parsed.user_script.endswith("scripts/train.py"):
        _check_train_args(parsed.user_args, flags, where)


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_shell_block_is_well_formed(block, train_flags, launch_env):
    """``deepspeed`` commands are read by the runner's ``parse_args``, which makes the job's secret (``launch_env``)."""
    syntax = run_command(["bash", "-n"], 60, input=block.text)
    assert syntax.returncode == 0, f"{block.where}: {syntax.stderr}"
    for path in REPO_PATH.findall(block.text):
        assert (REPO / path).exists(), f"{block.where}: {path} does not exist"
    for words in simple_commands(block.text):
        if words[0] == "deepspeed":
            _check_deepspeed_command(words[1:], train_flags, block.where)
        elif words[0] in ("python", "python3") and words[1:2] == ["scripts/train.py"]:
            _check_train_args(words[2:], train_flags, block.where)


def _pins(text: str) -> List[Tuple[str, str]]:
    """Every ``name==version`` (``name[extra]==version`` too) in the text, names normalized."""
    return [(name.lower().replace("_", "-"), version) for name, version in PIN.findall(text)]


def test_version_pins_match_requirements():
    """Against requirements.txt and the ``[cuda]`` extra (not in the CPU venv)."""
    from deepspeed_xla.devices.cuda.wheels import requirements
    required = dict(_pins(" ".join([(REPO / "requirements.txt").read_text(), *requirements()])))
    wrong = [f"{path.relative_to(REPO)}: {name}=={version} (requirements.txt or the [cuda] extra: {required[name]})"
             for path in DOCUMENTS for name, version in _pins(path.read_text())
             if name in required and required[name] != version]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language in ("python", "json")], ids=lambda b: b.where)
def test_python_and_json_blocks_parse(block):
    if block.language == "python":
        compile(block.text, block.where, "exec")
    else:
        json.loads(block.text)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    broken = []
    for path in DOCUMENTS:
        for target in MARKDOWN_LINK.findall(path.read_text()):
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+\s+(.*)$", linked.read_text(), re.MULTILINE)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_ready_configs_are_the_tested_configs():
    """docs/quickstart.md, docs/configuration.md and docs/huggingface.md promise the parity tests' exact
    configurations."""
    from tests.launched import test_huggingface
    tested = {f"zero{stage}.json": ds_config(stage) for stage in range(4)}
    tested["bf16.json"] = ds_config(2, bf16=True)
    tested["pipe2.json"] = ds_config(0, micro_batch=2, accumulation=4)  # tests/launched/test_pipeline.py's configuration
    tested["hf_zero2.json"] = test_huggingface.ds_config(2)
    shipped = {path.name: json.loads(path.read_text()) for path in (REPO / "scripts" / "configs").glob("*.json")}
    assert shipped == tested
