"""``tests/fork_server.py`` starts a rank as ``python -c`` would: what the rank sees, and how its end is reported."""
import json
import os
import signal
import subprocess
import sys

from tests import multiproc
from tests.multiproc import REPO, clean_env, run_ranks

ENDINGS = {"returns": 0, "raises": 1, "exits": 3, "killed": -signal.SIGKILL}
ENDING_ENV = "DSX_TEST_ENDING"


def describe_and_end() -> None:
    """A rank: print what it sees as JSON, then end as ``DSX_TEST_ENDING`` says."""
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "leads_session": os.getsid(0) ==
                      os.getpid(), "rank": os.environ["RANK"], "home": os.environ["HOME"],
                      "xla_flags": os.environ.get("XLA_FLAGS")}), flush=True)
    ending = os.environ[ENDING_ENV]
    if ending == "raises":
        raise ValueError("from the rank")
    if ending == "exits":
        sys.exit(3)
    if ending == "killed":
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_forked_rank_sees_and_ends_as_under_python_c():
    code = "import os, torch_xla; print(os.environ.get('XLA_FLAGS'))"
    fresh = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True)
    servers = []
    for ending, exit_code in ENDINGS.items():
        procs = run_ranks("tests.test_fork_server:describe_and_end", 2, {ENDING_ENV: ending},
                          after_import=(ENDING_ENV, ))
        seen = [json.loads(proc.stdout.splitlines()[0]) for proc in procs]
        for rank, (proc, rank_saw) in enumerate(zip(procs, seen)):
            assert proc.returncode == exit_code, (ending, proc.stderr[-3000:])
            if ending == "raises":  # the interpreter's traceback, then its exit code
                assert proc.stderr.strip().splitlines()[-1] == "ValueError: from the rank", proc.stderr[-3000:]
            assert rank_saw["argv"] == ["-c"] and rank_saw["path0"] == "" and rank_saw["cwd"] == str(REPO)
            assert rank_saw["leads_session"] and rank_saw["rank"] == str(rank)
            assert rank_saw["xla_flags"] == fresh.stdout.strip()  # with what torch_xla's import added
        assert seen[0]["home"] != seen[1]["home"]
        servers.append(len(multiproc._SERVERS))
    assert len(set(servers)) == 1, "runs that differ only in variables read after import got servers of their own"
