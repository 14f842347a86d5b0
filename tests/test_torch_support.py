"""The torch range: a release older than the minimum is refused as bad input before any rank
starts, its known bug said first; a private name the run needs is refused by name, one only a part
needs (the zoo's comm mutants, the communication probe) turns that part off with a note; the
private DTensor cache names fall back when a release lacks them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from fsdp_verify import launch
from fsdp_verify.commands.cli import main
from fsdp_verify.torch_support import MINIMUM, clear_dtensor_caches, unsupported_torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "3.0.0"])
def test_supported_releases(version):
    assert unsupported_torch(version) is None


@pytest.mark.parametrize("version", ["2.6.0", "2.8.0+cu126", "2.9.1", "2.10.0", "1.13.1"])
def test_an_older_release_is_named_with_the_minimum(version):
    why = unsupported_torch(version)
    assert why is not None and f"torch {version}" in why and f"{MINIMUM[0]}.{MINIMUM[1]}" in why


def test_check_on_an_older_torch_exits_2_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    assert main(["check", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "torch 2.8.0 is older than" in err and "install torch>=" in err


def test_report_commands_run_on_any_torch(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    main(["report", "trend", str(tmp_path), "--out", str(tmp_path / "t.html")])
    err = capsys.readouterr().err
    assert "no night folder" in err and "older than" not in err  # the command's own answer


def test_dtensor_caches_cleared_without_the_planner_cache(monkeypatch):
    """torch 2.9 has no `clear_redistribute_planner_cache`: the sharding cache is still cleared."""
    import torch.distributed.tensor._redistribute as redistribute
    import torch.distributed.tensor.debug as debug

    cleared = []
    monkeypatch.delattr(redistribute, "clear_redistribute_planner_cache", raising=False)
    monkeypatch.setattr(debug, "_clear_sharding_prop_cache", lambda: cleared.append("sharding"))
    clear_dtensor_caches()
    assert cleared == ["sharding"]


def test_every_private_name_is_there_in_this_torch():
    from fsdp_verify.torch_support import missing_private_names

    assert missing_private_names() == []


def test_a_torch_without_a_private_name_the_run_needs_is_refused_naming_it(monkeypatch, capsys):
    """A release that renamed one the run itself needs: exit 2 before any rank starts, the name and its use said."""
    import torch.distributed.fsdp._common_utils as common

    monkeypatch.delattr(common, "clean_tensor_name")
    assert main(["check", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "lacks what fsdp-verify reaches for" in err
    assert "torch.distributed.fsdp._common_utils.clean_tensor_name (the fsdp1 engine's" in err


def test_an_older_release_is_said_before_the_names_it_lacks(monkeypatch, capsys):
    """torch 2.8 lacks the zoo's collectives too (measured in its own venv: the slow test below): its known FSDP2 bug is the reason given, not a private name only the zoo needs."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    monkeypatch.delattr(collectives, "DefaultReduceScatter")
    monkeypatch.delattr(collectives, "DefaultAllGather")
    assert main(["check", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp-verify: torch 2.8.0+cu128 is older than the oldest release fsdp-verify supports (2.11)")
    assert "pytorch/pytorch#162338" in err and "sums the ranks' gradients" in err
    assert "DefaultReduceScatter" not in err and "Traceback" not in err


def _torch_2_8() -> Path | None:
    """An interpreter with torch 2.8 and this checkout: FSDP_VERIFY_TORCH_2_8, else the gate's cache
    (a user pinned at 2.8 installs torch without dependencies: pip would refuse this project's
    torch>=2.11 beside it, so the gate cannot make this one; see docs/torch-versions.md)."""
    from fsdp_verify.torch_envs import default_cache

    given = os.environ.get("FSDP_VERIFY_TORCH_2_8")
    python = Path(given) if given else default_cache() / "torch-2.8.0" / "bin" / "python"
    return python if python.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_torch_2_8() is None, reason="no torch 2.8 interpreter (FSDP_VERIFY_TORCH_2_8)")
def test_check_on_torch_2_8_itself_names_the_release_and_its_bug():
    python = _torch_2_8()
    where = launch.run(
        [str(python), "-c", "import torch, fsdp_verify; print(torch.__version__); print(fsdp_verify.__file__)"],
        timeout=300,
    )
    assert where.returncode == 0, where.stderr
    version, package = where.stdout.split()
    assert version.startswith("2.8.") and Path(package).is_relative_to(ROOT / "verify"), where.stdout
    done = launch.run([str(python), "-m", "fsdp_verify", "check", "--steps", "1"], timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"torch {version} is older than the oldest release fsdp-verify supports" in done.stderr
    assert "pytorch/pytorch#162338" in done.stderr and "Traceback" not in done.stderr
    assert "lacks" not in done.stderr  # its missing private names are symptoms, not the reason


def test_check_runs_where_only_a_part_lacks_its_name_with_a_note(monkeypatch, capsys, tmp_path):
    """The zoo's comm mutants and the communication probe are parts: without their names the user's
    check still runs, each part said off; the communication contract reads n/a, the rest is judged."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    monkeypatch.delattr(collectives, "DefaultReduceScatter")
    monkeypatch.delattr(funcol, "all_reduce")
    assert main(["check", "--steps", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "fsdp-verify: note: the bug zoo's comm mutants: off, torch 2.13" in out.err
    assert "lacks torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultReduceScatter" in out.err
    assert (
        "fsdp-verify: note: the communication contract: off" in out.err
        and "_functional_collectives.all_reduce" in out.err
    )
    assert "EQUIVALENT" in out.out
    header, row0 = out.out.splitlines()[:2]
    assert dict(zip(header.split(), row0.split()))["comm"] == "n/a"
    assert dict(zip(header.split(), row0.split()))["memory"] == "ok"


def test_the_zoo_leaves_out_what_this_torch_cannot_build_or_catch(monkeypatch, capsys):
    """Without FSDP2's DefaultAllGather the comm mutants cannot be built; without the communication
    probe's all_reduce no comm bug can be caught: both are left out, named, and the rest hunted."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    from fsdp_verify.commands.selftest import run_zoo
    from fsdp_verify.zoo.catalog import BY_NAME

    comm_caught = [b.name for b in BY_NAME.values() if "comm" in b.catchers]
    assert {"all_gather_in_fp32", "all_reduce_instead_of_reduce_scatter"} < set(comm_caught)
    assert all(b.off_here() is None for b in BY_NAME.values() if b.framework is None)  # a framework may be absent
    monkeypatch.delattr(collectives, "DefaultAllGather")
    assert "DefaultAllGather" in BY_NAME["all_gather_in_fp32"].off_here()
    assert BY_NAME["grads_divided_twice"].off_here() is None
    assert run_zoo(["all_gather_in_fp32"], progress=False) == []
    assert "all_gather_in_fp32 left out: the bug zoo's comm mutants: off" in capsys.readouterr().err
    monkeypatch.delattr(funcol, "all_reduce")
    others = [n for n in comm_caught if not BY_NAME[n].needs]  # the two comm mutants are off already
    assert others and all("the communication contract: off" in BY_NAME[n].off_here() for n in others)


def test_the_zoo_imports_without_fsdp2s_default_collectives():
    """A release without them still has the rest of the zoo; building a comm mutant says why it cannot."""
    code = (
        "import torch.distributed.fsdp._fully_shard._fsdp_collectives as c\n"
        "del c.DefaultAllGather, c.DefaultReduceScatter\n"
        "from fsdp_verify.zoo import mutants\n"
        "try:\n"
        "    mutants.all_gather_in_fp32(None, None, None)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    done = launch.run([sys.executable, "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "the bug zoo's comm mutants: off" in done.stdout and "DefaultAllGather" in done.stdout
