"""Lightning recorded by fsdp_verify.integrations.lightning.RecorderCallback, end to end with the
real library (lightning 2.6.6, torch 2.13; real torchrun, gloo): examples/lightning/train_lightning.py
on one process and on two, compared.

Lightning's FSDPStrategy (FSDP1) refuses a CPU accelerator ("The strategy `fsdp` requires a GPU
accelerator"); ModelParallelStrategy with FSDP2 in configure_model runs on CPU, and shards. CI
runs the reference and FSDP2; the nightly a configure_model that never shards (CI checks ranks
that train apart in test_recorder.py), calibration, DDP and the other planted bugs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_verify.recorder.store import Run
from tests.built_once import built_once
from tests.recorded_runs import ROOT, compare, sharded, sharded_many, single

SCRIPT = ROOT / "examples" / "lightning" / "train_lightning.py"
pytest.importorskip("lightning")


def lightning(out: Path, *extra: str) -> None:
    sharded(SCRIPT, out, "--ranks", "2", *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "lightning", _runs)  # once per test run (tests/built_once.py)


def _runs(d: Path) -> None:
    single(SCRIPT, d / "ref")
    lightning(d / "fsdp2", "--strategy", "fsdp2")


def test_fsdp2_under_model_parallel_strategy_is_equivalent_to_one_process(runs, tmp_path, capsys):
    code, out = compare(runs / "ref", runs / "fsdp2", "--out", tmp_path, capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
    records = json.loads((tmp_path / "report.json").read_text())["compare"]["records"]
    grads = [r for r in records if r["step"] == 1 and r["phase"] == "grads"]
    # Recorded in on_before_optimizer_step: Lightning's closure runs backward inside optimizer.step.
    assert len(grads) == 21 and all(r["rule"] == "bound" and r["ok"] for r in grads)
    meta = Run(runs / "fsdp2", "fsdp2").meta[0]
    assert meta["plain_params"] == [] and meta["settings"]["sharded"]["by"] == "Trainer(strategy=ModelParallelStrategy)"


@pytest.mark.slow
def test_a_configure_model_that_never_shards_is_not_sharded(more_runs, tmp_path, capsys):
    code, out = compare(more_runs / "ref", more_runs / "no-fully-shard", "--out", tmp_path, capsys=capsys)
    assert code == 1, out
    summary = out.split("NOT SHARDED:", 1)[1]
    assert "every one of its 21 parameters is a plain tensor on every one of its 2 ranks" in summary, summary
    assert "at step 1, the gradients (optimizer step 1) of" in summary and "no collective made them equal" in summary


@pytest.fixture(scope="module")
def more_runs(runs, tmp_path_factory) -> Path:
    """The 2-rank runs in one launch (tests/recorded_runs.py; Lightning leaves the process group
    to an atexit hook: run_each.py destroys it after each run)."""
    return built_once(tmp_path_factory, "lightning-more", _more_runs, into=runs)


def _more_runs(d: Path) -> None:
    single(SCRIPT, d / "ref-perturbed", env={"FSDP_VERIFY_PERTURB": "1"})
    sharded_many(
        SCRIPT,
        [
            (d / "no-fully-shard", ["--ranks", "2", "--strategy", "fsdp2", "--bug", "no-fully-shard"]),
            (d / "ddp", ["--ranks", "2", "--strategy", "ddp"]),
            (d / "unsharded-sampler", ["--ranks", "2", "--strategy", "fsdp2", "--bug", "unsharded-sampler"]),
            (d / "accumulate-2", ["--ranks", "2", "--strategy", "fsdp2", "--accumulate", "2"]),
        ],
    )


@pytest.mark.slow
def test_calibrated_fsdp2_and_ddp_are_equivalent(more_runs, tmp_path, capsys):
    d = more_runs
    for run in ("fsdp2", "ddp"):
        code, out = compare(d / "ref", d / run, "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys)
        assert code == 0 and "EQUIVALENT" in out, out
    assert Run(d / "ddp", "ddp").meta[0]["settings"]["sharded"]["expected"] is False


@pytest.mark.slow
def test_lightnings_planted_bugs_are_caught_at_step_1(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(
        d / "ref", d / "unsharded-sampler", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1 and "First divergence at step 1, data" in out and "each rank read the same samples" in out, out
    code, out = compare(
        d / "ref", d / "accumulate-2", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1 and "First divergence at step 1, loss" in out, out
