"""The transformers Trainer recorded by RecorderCallback, end to end with the real libraries
(transformers 5.24.0, accelerate 1.15.0, torch 2.13; real torchrun, gloo): the same script
(examples/hf/train_trainer.py) on one process and on two, compared.

On this CPU-only machine the Trainer's own FSDP (`fsdp` in TrainingArguments) never shards: with
use_cpu=True Accelerate wraps the model in DistributedDataParallel without a word (compare: NOT
SHARDED), without it the Trainer refuses ("Using fsdp only works in distributed training."). What
shards here is FSDP2 applied by the script before the Trainer gets the model (`--fsdp own`).
CI runs the reference and the own-FSDP2 run; the nightly adds the fallback, calibration, the
planted bugs and DDP.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fsdp_verify import launch
from fsdp_verify.recorder.store import Run
from tests.built_once import built_once
from tests.recorded_runs import ENV, ROOT, compare, sharded, sharded_many, single, single_many

SCRIPT = ROOT / "examples" / "hf" / "train_trainer.py"
pytest.importorskip("accelerate")  # the Trainer runs on it: fsdp-verify[hf,accelerate]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "hf_trainer", _runs)  # once per test run (tests/built_once.py)


def _runs(d: Path) -> None:
    single(SCRIPT, d / "ref")
    sharded(SCRIPT, d / "own", "--fsdp", "own")


def test_fsdp2_under_the_trainer_is_equivalent_to_one_process(runs, tmp_path, capsys):
    code, out = compare(runs / "ref", runs / "own", "--out", tmp_path, capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
    records = json.loads((tmp_path / "report.json").read_text())["compare"]["records"]
    step1 = {r["phase"] for r in records if r["step"] == 1 and r["rule"] == "bound"}
    assert {"loss", "logits", "grads"} <= step1, step1  # judged before any update, not waved through
    run = Run(runs / "own", "own")
    assert run.world_size == 2 and all(m["plain_params"] == [] for m in run.meta)  # every parameter a DTensor
    assert run.meta[0]["steps"] == 4 and run.meta[0]["optimizer_steps"] == 4


@pytest.mark.slow
def test_the_trainers_own_fsdp_on_cpu_falls_back_to_ddp_and_is_not_sharded(more_runs, tmp_path, capsys):
    """Accelerate's silent fallback, as the Trainer meets it (CI checks it in test_accelerate.py)."""
    code, out = compare(more_runs / "ref", more_runs / "trainer-fsdp", "--out", tmp_path, capsys=capsys)
    assert code == 1 and "EQUIVALENT" not in out, out
    summary = out.split("NOT SHARDED:", 1)[1]
    assert "is meant to shard its parameters (TrainingArguments.fsdp=" in summary, summary
    assert "every one of its 21 parameters is a plain tensor on every one of its 2 ranks" in summary, summary
    assert "judged records agree with the reference" in summary, summary  # DDP itself trains correctly
    report = json.loads((tmp_path / "report.json").read_text())["compare"]
    assert report["verdict"] == "not_sharded"


def test_accumulated_micro_batches_are_steps_and_the_loss_is_the_trainers(tmp_path):
    """One process, gradient accumulation 2: a step per micro-batch, an optimizer step every
    second one, and the loss recorded is what training_step returned (the Trainer's own scaling)."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(SCRIPT.parent)!r})
from common import Tokens, make_model
from transformers import Trainer, TrainingArguments
from fsdp_verify.integrations.trainer import RecorderCallback
args = TrainingArguments(output_dir={str(tmp_path / "t")!r}, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    max_steps=2, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=make_model(), args=args, train_dataset=Tokens())
seen = []
step = trainer.training_step
trainer.training_step = lambda *a, **k: seen.append(step(*a, **k)) or seen[-1]
cb = RecorderCallback(trainer, out={str(tmp_path / "run")!r})
trainer.train()
print(repr([float(x) for x in seen]))
"""
    r = launch.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = eval(r.stdout.strip().splitlines()[-1])
    run = Run(tmp_path / "run", "run")
    assert run.calls[0] == [0, 1, 2, 3, 4]
    assert [run.load(0, c)[1]["opt_steps"] for c in run.calls[0]] == [[0], [], [1], [], [2]]
    recorded = [float(run.load(0, c)[0]["loss"]) for c in run.calls[0][1:]]
    assert recorded == pytest.approx(losses, rel=1e-7) and len(losses) == 4
    assert run.meta[0]["settings"]["sharded"]["expected"] is False  # one process


# ---- the nightly: calibration, planted bugs, DDP ----------------------------------------------------


@pytest.fixture(scope="module")
def more_runs(runs, tmp_path_factory) -> Path:
    """Two launches: the one-process runs in one, the 2-rank runs in another (tests/recorded_runs.py)."""
    return built_once(tmp_path_factory, "hf_trainer-more", _more_runs, into=runs)


def _more_runs(d: Path) -> None:
    single_many(
        SCRIPT,
        [
            (d / "ref-perturbed", [], {"FSDP_VERIFY_PERTURB": "1"}),
            (d / "ref-per-rank-mean", ["--bug", "per-rank-mean"]),
        ],
    )
    sharded_many(
        SCRIPT,
        [
            (d / "trainer-fsdp", ["--fsdp", "trainer"]),
            (d / "own-per-rank-mean", ["--fsdp", "own", "--bug", "per-rank-mean"]),
            (d / "ddp-per-rank-mean", ["--bug", "per-rank-mean"]),
            (d / "own-accumulate-2", ["--fsdp", "own", "--grad-accum", "2"]),
            (d / "ddp", ["--fsdp", "none"]),
        ],
    )


@pytest.mark.slow
def test_calibrated_every_record_of_fsdp2_under_the_trainer_is_judged_and_agrees(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(d / "ref", d / "own", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
    assert json.loads((tmp_path / "report.json").read_text())["compare"]["unjudged"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("run", ["own-per-rank-mean", "ddp-per-rank-mean"])
def test_a_per_rank_mean_loss_is_caught_at_step_1(more_runs, run, tmp_path, capsys):
    """The same buggy script on one process (where a rank's mean is the global mean) and on two
    (where the ranks hold different numbers of tokens): the loss parts at step 1."""
    d = more_runs
    code, out = compare(
        d / "ref-per-rank-mean", d / run, "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1, out
    assert "First divergence at step 1, loss" in out, out


@pytest.mark.slow
def test_gradient_accumulation_changed_between_the_runs_is_caught_at_step_1(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(
        d / "ref", d / "own-accumulate-2", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1 and "First divergence at step 1, loss" in out, out


@pytest.mark.slow
def test_the_trainers_ddp_is_replicated_on_purpose_and_equivalent(more_runs, tmp_path, capsys):
    d = more_runs
    code, out = compare(d / "ref", d / "ddp", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
    assert Run(d / "ddp", "ddp").meta[0]["settings"]["sharded"]["expected"] is False
