"""The project's size rule: no module over 450 lines, so that one file holds one responsibility a reader can
take in; a file that outgrows it is split by responsibility (tests/multiproc/ is an example)."""
from pathlib import Path
from typing import Dict

from tests.conftest import REPO

MAX_LINES = 450
#: Where the project's Python lives; setup.py is the one file at the top.
CHECKED = ("deepspeed_xla", "tests", "scripts")


def _line_counts() -> Dict[str, int]:
    paths = [REPO / "setup.py", *(path for folder in CHECKED for path in (REPO / folder).rglob("*.py"))]
    return {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in paths}


def test_the_counter_reads_the_tree():
    """The rule would pass on an empty listing: make sure every checked folder's files are read."""
    counts = _line_counts()
    assert "setup.py" in counts and "tests/test_layout.py" in counts
    assert all(any(name.startswith(f"{folder}/") for name in counts) for folder in CHECKED)
    assert counts["tests/test_layout.py"] == len(Path(__file__).read_text().splitlines())


def test_no_module_over_the_line_limit():
    over = {name: lines for name, lines in sorted(_line_counts().items()) if lines > MAX_LINES}
    assert not over, (f"modules over {MAX_LINES} lines (split each by responsibility): "
                      + ", ".join(f"{name} ({lines})" for name, lines in over.items()))
