"""The `git bisect run` contract, worked end to end: a throwaway repository whose engine breaks at
one commit, and `git bisect run python -m fsdp_verify repro case.json --engine engine.py:shard` names
that commit. Every bisect step is a fresh process, as it is for a user (a cold pool start each)."""

import shutil
import sys

import pytest

from fsdp_verify import launch
from tests.conftest import mlp_case

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

GOOD_ENGINE = '''"""Our sharding engine: FSDP2 per the wrap plan."""
from fsdp_verify.engines.fsdp2 import fully_shard_engine


def shard(model, mesh, spec):
    return fully_shard_engine(model, mesh, spec)
'''

# The regression: someone "fixes" gradient averaging by hand, on top of FSDP2's own ReduceOp.AVG.
BROKEN_ENGINE = '''"""Our sharding engine: FSDP2 per the wrap plan."""
from torch.distributed.fsdp import FSDPModule

from fsdp_verify.engines.fsdp2 import fully_shard_engine


def shard(model, mesh, spec):
    fully_shard_engine(model, mesh, spec)
    world = mesh.size()
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_all_reduce_hook(lambda grad: grad.div_(world))  # average over ranks
    return model
'''


def git(repo, *args: str) -> str:
    r = launch.run(["git", *args], cwd=repo, timeout=600)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stdout}{r.stderr}"
    return r.stdout


def commit(repo, message: str, **files: str) -> str:
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def test_git_bisect_run_names_the_commit_that_broke_the_engine(tmp_path):
    repo = tmp_path / "trainer"
    repo.mkdir()
    git(repo, "init", "-q")
    for key, value in (("user.name", "Test"), ("user.email", "test@example.com"), ("commit.gpgsign", "false")):
        git(repo, "config", key, value)
    case = mlp_case(2, steps=1).to_json() + "\n"
    good = commit(repo, "engine: FSDP2 per the wrap plan", **{"engine.py": GOOD_ENGINE, "case.json": case})
    commit(repo, "docs", **{"README": "our trainer\n"})
    commit(repo, "engine: comment", **{"engine.py": GOOD_ENGINE + "# TODO: overlap communication\n"})
    breaking = commit(repo, "engine: average gradients over ranks", **{"engine.py": BROKEN_ENGINE})
    commit(repo, "docs: more", **{"README": "our trainer, sharded\n"})
    commit(repo, "engine: comment", **{"engine.py": BROKEN_ENGINE + "# TODO: overlap communication\n"})

    git(repo, "bisect", "start", "HEAD", good)
    r = launch.run(
        [
            "git",
            "bisect",
            "run",
            sys.executable,
            "-m",
            "fsdp_verify",
            "repro",
            "case.json",
            "--engine",
            "engine.py:shard",
        ],
        cwd=repo,
        timeout=900,
    )
    log = git(repo, "bisect", "log")
    git(repo, "bisect", "reset")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{breaking} is the first bad commit" in r.stdout, r.stdout + r.stderr
    # Both verdicts occurred: the good side agreed (exit 0) and the bad side diverged (exit 1).
    assert "exit 0: the engine agrees" in r.stdout and "exit 1: still diverges" in r.stdout
    assert "# bad:" in log and "# good:" in log
