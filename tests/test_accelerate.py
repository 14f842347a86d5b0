"""A loop run by Accelerate, recorded by fsdp_verify.integrations.accelerate.recorder, end to end
with the real libraries (accelerate 1.15.0, transformers 5.24.0, torch 2.13; real torchrun, gloo):
examples/hf/train_accelerate.py on one process and on two, compared.

On this CPU-only machine Accelerate's FSDP plugin never shards: with cpu=True the model is wrapped
in DistributedDataParallel (the plugin ignored), without it each process trains alone. Both are
NOT SHARDED. What shards is FSDP2 applied by the script before `accelerator.prepare` (`--fsdp own`).
CI runs the reference and the silent fallback; the nightly the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_verify.recorder.store import Run
from tests.built_once import built_once
from tests.recorded_runs import ROOT, compare, sharded, sharded_many, single

SCRIPT = ROOT / "examples" / "hf" / "train_accelerate.py"
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "accelerate", _runs)  # once per test run (tests/built_once.py)


def _runs(d: Path) -> None:
    single(SCRIPT, d / "ref")
    sharded(SCRIPT, d / "plugin", "--fsdp", "plugin")


def test_the_fsdp_plugin_on_cpu_falls_back_to_ddp_and_is_not_sharded(runs, tmp_path, capsys):
    code, out = compare(runs / "ref", runs / "plugin", "--out", tmp_path, capsys=capsys)
    assert code == 1, out
    summary = out.split("NOT SHARDED:", 1)[1]
    assert "(ACCELERATE_USE_FSDP=true: an fsdp_plugin" in summary, summary
    assert "every one of its 21 parameters is a plain tensor on every one of its 2 ranks" in summary, summary
    assert "judged records agree with the reference" in summary, summary
    assert Run(runs / "plugin", "plugin").meta[0]["settings"]["sharded"]["expected"] is True


@pytest.fixture(scope="module")
def more_runs(runs, tmp_path_factory) -> Path:
    """The correct FSDP2 twin as a user types it; the plugin without cpu=True and DDP in one launch."""
    return built_once(tmp_path_factory, "accelerate-more", _more_runs, into=runs)


def _more_runs(d: Path) -> None:
    single(SCRIPT, d / "ref-perturbed", env={"FSDP_VERIFY_PERTURB": "1"})
    sharded(SCRIPT, d / "own", "--fsdp", "own")
    sharded_many(
        SCRIPT, [(d / "plugin-without-cpu", ["--fsdp", "plugin-without-cpu"]), (d / "ddp", ["--fsdp", "none"])]
    )


@pytest.mark.slow
def test_fsdp2_under_accelerate_is_equivalent_to_one_process(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(d / "ref", d / "own", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
    assert json.loads((tmp_path / "report.json").read_text())["compare"]["unjudged"] == 0


@pytest.mark.slow
def test_the_plugin_without_cpu_trains_a_copy_per_process_on_the_same_batches(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(
        d / "ref", d / "plugin-without-cpu", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1 and "NOT SHARDED" in out, out
    assert "the first of its records to part from the reference: step 1, data" in out, out
    assert "samples 0-3 seen by ranks 0 and 1" in out, out


@pytest.mark.slow
def test_accelerates_ddp_is_replicated_on_purpose_and_equivalent(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(d / "ref", d / "ddp", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
