"""The torch range: a release older than the minimum is refused as bad input before any rank
starts, and the private DTensor cache names fall back when a release lacks them."""

from __future__ import annotations

import pytest
import torch

from fsdp_verify.commands.cli import main
from fsdp_verify.torch_support import MINIMUM, clear_dtensor_caches, unsupported_torch


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


def test_a_torch_without_a_private_name_is_refused_naming_it(monkeypatch, capsys):
    """A release that renamed one of them: exit 2 before any rank starts, the name and its use said."""
    import torch.distributed.tensor._utils as utils

    monkeypatch.delattr(utils, "compute_local_shape_and_global_offset")
    assert main(["check", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "lacks what fsdp-verify reaches for" in err
    assert "torch.distributed.tensor._utils.compute_local_shape_and_global_offset (the Recorder's" in err
