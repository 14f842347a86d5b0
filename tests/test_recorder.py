"""Your loop, recorded: the Recorder around a user's own step and `fsdp-verify compare`.

End to end (real torchrun, real FSDP2 on gloo, the example scripts as a user runs them): the
correct pair passes, an unsharded sampler is named by the data check, a gradient moved by 2e-6 on
one rank is caught at step 1. Unit tests: names, storage, bad input, the data check's diagnoses,
gradient accumulation, perturbation mode.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

from fsdp_verify import launch
from fsdp_verify.recorder import Recorder, rules
from fsdp_verify.recorder.datacheck import check as data_check
from fsdp_verify.recorder.names import strip_wrappers
from fsdp_verify.recorder.perturb import MOVE_ULPS, GradientPerturbation
from fsdp_verify.recorder.store import Run
from fsdp_verify.reports.schema import SCHEMA_PATH
from tests import recorded_runs
from tests.built_once import built_once
from tests.ranks import spawn
from tests.recorded_runs import BIN, ENV, ROOT, compare

EXAMPLES = ROOT / "examples" / "loop"
SINGLE, FSDP = EXAMPLES / "train_single.py", EXAMPLES / "train_fsdp.py"
PERTURB = {"FSDP_VERIFY_PERTURB": "1"}


# ---- end to end: the example scripts under torchrun ------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """Every run of the end-to-end tests below (the fixtures that follow name them), once per test
    run (tests/built_once.py), in four launches: the correct pair as a user types it (runs/ref,
    runs/sharded); the other 2-rank runs in one torchrun, and after them (the saving run resumed/a
    is among those) the one-process runs in one process, the 1-rank resumed runs among them
    (tests/recorded_runs.py)."""
    return built_once(tmp_path_factory, "recorded", _record)


def _record(d: Path) -> None:
    runs, unsharded, resumed, bf16 = d / "runs", d / "unsharded", d / "resumed", d / "bf16"
    recorded_runs.single(SINGLE, runs / "ref", "--full-steps", "0", "1")
    recorded_runs.sharded(FSDP, runs / "sharded", "--full-steps", "0", "1")
    recorded_runs.sharded_many(
        FSDP,
        [
            (runs / "unsharded-sampler", ["--bug", "unsharded-sampler"]),
            (runs / "grad-noise", ["--bug", "grad-noise"]),
            (unsharded / "ddp-fallback", ["--bug", "ddp-fallback"]),
            (unsharded / "not-sharded", ["--bug", "not-sharded"]),
            (unsharded / "ddp", ["--ddp"]),
            (bf16 / "sharded", ["--bf16"]),
            (bf16 / "grad-noise", ["--bf16", "--bug", "grad-noise"]),
            (resumed / "a", ["--save-after", "2", "--checkpoint", resumed / "ckpt"]),
        ],
    )
    resume = ["--resume-from", resumed / "ckpt", "--recorded-before", resumed / "a"]
    recorded_runs.single_many(
        SINGLE,
        [
            (runs / "ref-perturbed", ["--full-steps", "0", "1"], PERTURB),
            (bf16 / "ref", ["--bf16"]),
            (bf16 / "ref-perturbed", ["--bf16"], PERTURB),
        ],
        then=(FSDP, [(resumed / "b", resume), (resumed / "b-fresh-adam", [*resume, "--bug", "optimizer-not-loaded"])]),
    )


@pytest.fixture(scope="module")
def runs(recorded) -> Path:
    """The reference, its perturbed rerun, the correct sharded twin and two planted bugs."""
    return recorded / "runs"


def test_the_correct_pair_is_equivalent_and_every_rule_is_reported(runs, tmp_path, capsys):
    code, out = compare(
        runs / "ref", runs / "sharded", "--calibration", runs / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 0, out
    assert "EQUIVALENT" in out and "calibrated" in out and "bound" in out and "exact" in out
    report = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))  # the raw file, kind compare
    assert report["kind"] == "compare" and report["ok"] and report["compare"]["unjudged"] == 0
    with pytest.raises(jsonschema.ValidationError):  # kind compare without its block is refused
        jsonschema.validate({k: v for k, v in report.items() if k != "compare"}, json.loads(SCHEMA_PATH.read_text()))
    records = report["compare"]["records"]
    # Each rank's shard put back at its offset: the initial parameters stored whole match bit for bit.
    whole = [r for r in records if r["phase"] == "init" and r["name"].endswith("(whole)")]
    assert len(whole) == 21 and all(r["deviation"] == 0 for r in whole)
    assert {r["rule"] for r in records if r["step"] == 1 and r["phase"] == "grads"} == {"bound"}
    assert all(r["ok"] for r in records)
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_without_calibration_later_records_are_shown_not_judged(runs, tmp_path, capsys):
    code, out = compare(runs / "ref", runs / "sharded", "--out", tmp_path, capsys=capsys)
    assert code == 0, out
    assert "were not judged" in out and "FSDP_VERIFY_PERTURB=1" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["compare"]["unjudged"] > 0 and report["compare"]["calibration"] is None


def test_an_unsharded_sampler_is_named_by_the_data_check(runs, tmp_path, capsys):
    code, out = compare(
        runs / "ref",
        runs / "unsharded-sampler",
        "--calibration",
        runs / "ref-perturbed",
        "--out",
        tmp_path,
        capsys=capsys,
    )
    assert code == 1, out
    summary = out.split("DIVERGED:", 1)[1]
    assert "First divergence at step 1, data" in summary
    assert "samples 0-3 seen by ranks 0 and 1" in summary and "is the sampler sharded" in summary
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["compare"]["first_divergence"]["phase"] == "data"
    assert report["failures"][0]["first_divergence"] == "DataCheck @ 1/data batch"


def test_a_gradient_moved_by_2e_6_on_one_rank_is_caught_at_step_1(runs, tmp_path, capsys):
    code, out = compare(
        runs / "ref", runs / "grad-noise", "--calibration", runs / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1, out
    first = json.loads((tmp_path / "report.json").read_text())["compare"]["first_divergence"]
    assert (first["step"], first["phase"], first["rule"]) == (1, "grads", "bound"), first
    assert "First divergence at step 1, gradients" in out


# ---- a run recorded as sharded that is not (verify/recorder/sharding.py) ------------------------------
@pytest.fixture(scope="module")
def unsharded_runs(recorded) -> Path:
    """train_fsdp.py under DDP instead of fully_shard (the silent fallback of Accelerate and the
    Trainer on CPU), with nothing applied (each rank its own copy), and under DDP on purpose
    (recorded with sharded=False)."""
    return recorded / "unsharded"


def test_a_ddp_fallback_is_not_sharded_though_every_record_agrees(runs, unsharded_runs, tmp_path, capsys):
    code, out = compare(
        runs / "ref",
        unsharded_runs / "ddp-fallback",
        "--calibration",
        runs / "ref-perturbed",
        "--out",
        tmp_path,
        capsys=capsys,
    )
    assert code == 1 and "EQUIVALENT" not in out, out
    summary = out.split("NOT SHARDED:", 1)[1]
    assert "is meant to shard its parameters (it runs on 2 ranks)" in summary, summary
    assert "every one of its 21 parameters is a plain tensor on every one of its 2 ranks" in summary, summary
    assert "all 369 judged records agree with the reference" in summary, summary  # DDP is correct data parallel
    report = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    assert report["compare"]["verdict"] == "not_sharded" and not report["ok"]
    assert report["compare"]["first_divergence"] is None and report["compare"]["not_sharded"][0]["phase"] == "sharding"
    assert "NOT SHARDED" in (tmp_path / "report.html").read_text()


def test_ranks_that_train_apart_are_named_with_the_gradients_that_were_never_averaged(
    runs, unsharded_runs, tmp_path, capsys
):
    code, out = compare(runs / "ref", unsharded_runs / "not-sharded", "--out", tmp_path, capsys=capsys)
    assert code == 1, out
    summary = out.split("NOT SHARDED:", 1)[1]
    assert "at step 1, the gradients (optimizer step 1) of" in summary, summary
    assert "differ between ranks 0 and 1, which both hold them: no collective made them equal" in summary, summary
    report = json.loads((tmp_path / "report.json").read_text())["compare"]
    drift = [r for r in report["not_sharded"] if r["rule"] == "replica"]
    assert drift and drift[0]["step"] == 1 and drift[0]["ratio"] > 1e3, drift[:1]


def test_a_run_replicated_on_purpose_is_judged_and_its_replicas_checked(runs, unsharded_runs, tmp_path, capsys):
    """DDP recorded with sharded=False: EQUIVALENT, and every replica held to the replica rule
    (the check that fails the run above passes here: the all-reduce made the copies equal)."""
    code, out = compare(
        runs / "ref", unsharded_runs / "ddp", "--calibration", runs / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 0 and "EQUIVALENT" in out, out
    records = json.loads((tmp_path / "report.json").read_text())["compare"]["records"]
    replicas = [r for r in records if r["rule"] == "replica"]
    assert {r["step"] for r in replicas} == {0, 1, 2, 3, 4} and all(r["ok"] for r in replicas)
    assert Run(unsharded_runs / "ddp", "ddp").meta[0]["settings"]["sharded"] == {
        "expected": False,
        "by": "Recorder(sharded=...)",
    }


def _train_partly_sharded(rank: int, store: str, out: str, average: bool) -> None:
    """train()'s loop on two gloo ranks, each its half of every batch, with only `lin` under
    fully_shard: `out` stays a plain tensor on both ranks, its gradient averaged by the loop
    (`average`, as `ignored_params` asks of it) or by nothing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = Inner()
    fully_shard(model.lin, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model, opt, out=out)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(6, 4, generator=g)[3 * rank : 3 * rank + 3]
        logits = model(x)
        loss = logits.square().mean()
        loss.backward()
        if average:
            for p in model.out.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        opt.zero_grad()
        rec.step(loss=loss, logits=logits, batch={"x": x})
    rec.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("average", [True, False])
def test_parameters_left_out_of_sharding_are_a_note_and_held_to_the_replica_rule(tmp_path, capsys, average):
    """Some parameters plain on every rank (FSDP2's ignored_params, or a module left outside every
    fully_shard unit) is not NOT SHARDED by itself: averaged by the loop, the run is EQUIVALENT
    with a note; averaged by nothing, its replicas part at step 1 and it is NOT SHARDED."""

    train(tmp_path / "ref")
    spawn(_train_partly_sharded, args=(str(tmp_path / "store"), str(tmp_path / "run"), average), nprocs=2)
    code, out = compare(tmp_path / "ref", tmp_path / "run", "--out", tmp_path / "r", capsys=capsys)
    assert "2 of the 4 parameters of" in out and "'out.weight', 'out.bias'" in out, out
    if average:
        assert code == 0 and "EQUIVALENT" in out, out
    else:
        assert code == 1 and "NOT SHARDED" in out, out
        assert "the gradients (optimizer step 1) of 'out." in out and "no collective made them equal" in out, out


# ---- a sharded run that saved, stopped and resumed (docs/resume.md) ----------------------------------
@pytest.fixture(scope="module")
def resumed_runs(recorded) -> Path:
    """train_fsdp.py on 2 ranks saving a DCP checkpoint after step 2 and stopping (resumed/a), then
    resumed from it on 1 rank (resharded on load) through step 4: correctly (b), and with the
    optimizer not loaded (b-fresh-adam: a fresh Adam)."""
    return recorded / "resumed"


def test_a_resumed_sharded_run_is_judged_against_the_run_never_stopped(runs, resumed_runs, tmp_path, capsys):
    """Steps 1-2 from the 2-rank run, 3-4 from the 1-rank one, every record judged (calibrated),
    and the note says where it resumed."""
    code, out = compare(
        runs / "ref", resumed_runs / "b", "--calibration", runs / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 0 and "EQUIVALENT" in out, out
    assert "resumed after step 2: steps 1-2 from" in out and "(world size 2), steps 3-4 from" in out, out
    report = json.loads((tmp_path / "report.json").read_text())["compare"]
    assert report["unjudged"] == 0 and {r["step"] for r in report["records"] if r["phase"] == "optim_state"} == {
        1,
        2,
        3,
        4,
    }
    run = Run(resumed_runs / "b", "RUN")
    assert [run.world_at(c) for c in run.calls[0]] == [2, 2, 2, 1, 1]
    # The state right after the load (1 rank) held exactly to the one saved (2 ranks): every
    # parameter, optimizer state entry (Adam's step too) and hyperparameter, at step 2.
    loaded = [r for r in report["records"] if r["name"].endswith("(after the load)")]
    assert {r["step"] for r in loaded} == {2} and all(r["ok"] and r["rule"] == "exact" for r in loaded), loaded
    assert {"params", "optim_state"} == {r["phase"] for r in loaded}
    assert any("[step]" in r["name"] for r in loaded) and any(r["name"].startswith("param_groups.lr") for r in loaded)


def test_a_resume_that_does_not_load_the_optimizer_is_caught_at_the_load(runs, resumed_runs, tmp_path, capsys):
    """At step 2, the step the run saved after: the resumed Adam holds no state where the run
    before ended with some (before the load was compared, it showed at step 3)."""
    code, out = compare(
        runs / "ref",
        resumed_runs / "b-fresh-adam",
        "--calibration",
        runs / "ref-perturbed",
        "--out",
        tmp_path,
        capsys=capsys,
    )
    assert code == 1, out
    first = json.loads((tmp_path / "report.json").read_text())["compare"]["first_divergence"]
    assert (first["step"], first["phase"]) == (2, "optim_state"), first
    assert first["name"].endswith("(after the load)") and "never loaded" in out, out


@pytest.fixture(scope="module")
def bf16_runs(recorded) -> Path:
    """The example pair with --bf16: the reference under fully_shard on a one-rank mesh with the
    sharded twin's MixedPrecisionPolicy (bf16 parameters, fp32 reduce), its perturbed rerun, the
    correct twin and the grad-noise bug (rank 1's gradient shards scaled by 1 + 2e-2)."""
    return recorded / "bf16"


def test_a_bf16_pair_under_the_same_policy_is_judged_equivalent(bf16_runs, tmp_path, capsys):
    """Judged by the mixed precision bound (one bf16 ulp: each side rounds its own partial gradient
    to bf16) and calibrated limits, nothing left unjudged; under the fp32 bound (1.07e-6) the
    step-1 gradients, off by up to 5.6e-3, would fail."""
    d = bf16_runs
    code, out = compare(
        d / "ref", d / "sharded", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 0 and "EQUIVALENT" in out, out
    report = json.loads((tmp_path / "report.json").read_text())
    records = report["compare"]["records"]
    assert report["compare"]["unjudged"] == 0 and {r["rule"] for r in records} == {
        "check",
        "exact",
        "bound",
        "calibrated",
    }
    grads = {r["name"]: r for r in records if r["step"] == 1 and r["phase"] == "grads"}
    assert all(r["rule"] == "bound" for r in grads.values())
    worst = max(r["deviation"] for r in grads.values())
    assert worst > rules.bound(torch.float32, 2).limit  # the bf16 rounding is real

    # The magnitudes rounded, S (rules.bound_rounded): a matrix's rows are not parallel across the
    # ranks (S ~ 1 + sqrt(2)); an RMSNorm gain's partials add up (S ~ 2, nothing cancels). The
    # worst record, 'norm.weight' at 0.72, is no cancellation: two roundings of half an ulp each.
    def spread(r):
        return float(r["why"].split("u(bfloat16) x ")[1].split()[0]) if "u(bfloat16) x" in r["why"] else 2.0

    gains = [n for n in grads if n.endswith("norm.weight")]
    assert len(gains) == 5 and all(spread(grads[n]) < 2.05 for n in gains)
    assert all(2.1 < spread(r) < 3 for n, r in grads.items() if n not in gains and n.endswith(".weight")), grads
    assert 0.5 < grads["norm.weight"]["ratio"] < 1
    meta = Run(d / "ref", "ref").meta[0]["settings"]["precision"]
    assert meta["fully_shard"] and meta["policies"][0]["param_dtype"] == "bfloat16"


@pytest.mark.slow
def test_a_gradient_that_cancels_across_ranks_is_held_to_the_magnitudes_rounded(tmp_path, capsys):
    """tests/fixtures/cancelling_loop.py: each rank's partial gradient of `gain` ~14x the average.
    The correct pair parts by 3x the one-bf16-ulp bound (a false alarm before the magnitudes were
    recorded) and passes u(bf16) x S; a rank's loss off by 2% is still caught there."""
    loop = ROOT / "tests" / "fixtures" / "cancelling_loop.py"
    recorded_runs.single(loop, tmp_path / "ref")
    recorded_runs.sharded_many(loop, [(tmp_path / "sharded", []), (tmp_path / "bad", ["--bug"])])
    code, out = compare(tmp_path / "ref", tmp_path / "sharded", "--out", tmp_path / "ok", capsys=capsys)
    assert code == 0, out
    records = json.loads((tmp_path / "ok" / "report.json").read_text())["compare"]["records"]
    gain = next(r for r in records if (r["step"], r["phase"], r["name"]) == (1, "grads", "gain"))
    assert "the magnitudes rounded to bfloat16" in gain["why"] and gain["ratio"] < 1
    assert gain["deviation"] > 2 * rules.bound(torch.bfloat16, 2).limit  # what the plain bound would have failed
    code, out = compare(tmp_path / "ref", tmp_path / "bad", "--out", tmp_path / "bad-report", capsys=capsys)
    assert code == 1 and "First divergence at step 1, gradients, 'gain'" in out, out


def test_the_bf16_grad_noise_bug_is_caught_at_step_1(bf16_runs, tmp_path, capsys):
    d = bf16_runs
    code, out = compare(
        d / "ref", d / "grad-noise", "--calibration", d / "ref-perturbed", "--out", tmp_path, capsys=capsys
    )
    assert code == 1, out
    first = json.loads((tmp_path / "report.json").read_text())["compare"]["first_divergence"]
    assert (first["step"], first["phase"], first["rule"]) == (1, "grads", "bound"), first


def test_a_plain_reference_against_a_bf16_run_is_left_unjudged_with_a_note(runs, bf16_runs, tmp_path, capsys):
    """A plain fp32 reference rounds elsewhere than the bf16 sharded run (off by 2e-2 at step 2,
    beyond even the bf16 bound): no rule can hold that pair, so only step 0 and the data are judged."""
    code, out = compare(runs / "ref", bf16_runs / "sharded", "--out", tmp_path, capsys=capsys)
    assert "the runs round at different places" in out and "param_dtype=bfloat16" in out, out
    assert "no fully_shard, no mixed precision policy (plain)" in out and "one-rank mesh" in out, out
    report = json.loads((tmp_path / "report.json").read_text())
    judged = {r["rule"] for r in report["compare"]["records"] if r["rule"] != "unjudged"}
    assert judged == {"check", "exact"} and code == 0, out
    code, out = compare(
        bf16_runs / "ref", bf16_runs / "sharded", "--calibration", runs / "ref-perturbed", capsys=capsys
    )
    assert code == 2 and "--calibration" in out and "settings.precision" in out, out


def test_runs_record_per_rank_with_placements_and_meta(runs):
    run = Run(runs / "sharded", "RUN")
    assert run.world_size == 2 and [m["rank"] for m in run.meta] == [0, 1]
    meta = run.meta[1]
    assert meta["schema_version"] == 1 and meta["torch"] == torch.__version__
    assert meta["dtypes_seen"]["grads"] == ["float32"] and meta["optimizer"] == "Adam"
    _, header = run.load(1, 1)
    layout = {name: (rows, offset, full) for name, rows, offset, full, *_ in header["opt1/grads"]}
    rows, offset, full = layout["tok_embeddings.weight"]
    assert (rows, offset, full) == (128, 128, 256)  # rank 1 holds rows 128..255 of the 256


def test_an_optimizer_built_before_fully_shard_is_refused_at_once(tmp_path):
    """The optimizer holds the unsharded parameters fully_shard replaced, and steps them: before,
    the run recorded and `compare` found only parameters that "did not move" at step 1. One rank
    is enough: fully_shard replaces the parameters on a mesh of one as on two."""
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1"]
    script = [str(EXAMPLES / "train_fsdp.py"), "--out", str(tmp_path / "run"), "--bug", "optimizer-before-shard"]
    r = launch.run([*torchrun, *script], timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode != 0, r.stdout
    assert "optimizer: expected an optimizer over the model's parameters; 21 of its 21" in r.stderr, r.stderr[-3000:]
    assert "built before fully_shard" in r.stderr
    assert not list((tmp_path / "run").glob("rank*/step*.safetensors"))  # refused before anything is recorded


def test_the_recorder_says_at_once_when_a_run_meant_to_shard_holds_no_dtensor(tmp_path):
    torch.manual_seed(0)
    model = Inner()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"meant to shard its parameters \(Trainer\(fsdp\)\), but every one of its 4"):
        Recorder(model, opt, out=tmp_path / "a", sharded=True, sharded_by="Trainer(fsdp)").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process, nothing said: not meant to shard
        Recorder(model, opt, out=tmp_path / "b").close()


def test_an_optimizer_over_other_parameters_is_refused(tmp_path):
    torch.manual_seed(0)
    model, other = Inner(), Inner()
    with pytest.raises(ValueError, match=r"optimizer: .*; 4 of its 4 parameters are not the model's"):
        Recorder(model, torch.optim.SGD(other.parameters(), lr=0.1), out=tmp_path / "run")
    params = list(model.parameters())  # a subset of the model's (the rest frozen) is fine
    Recorder(model, torch.optim.SGD(params[:2], lr=0.1), out=tmp_path / "ok").close()


# ---- storage, names and bad input -----------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x)))


class DDPLike(nn.Module):
    """What DDP and DataParallel look like from outside: the user's model under `.module`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


def train(
    out: Path, model: nn.Module | None = None, steps: int = 3, accumulate: int = 1, batch: int = 6, **kwargs
) -> Recorder:
    torch.manual_seed(0)
    model = model or Inner()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model, opt, out=out, **kwargs)
    g = torch.Generator().manual_seed(5)
    for step in range(1, steps * accumulate + 1):
        x = torch.randn(batch, 4, generator=g)
        logits = model(x)
        loss = logits.square().mean()
        loss.backward()
        if step % accumulate == 0:
            opt.step()
            opt.zero_grad()
        rec.step(loss=loss, logits=logits, batch={"x": x})
    rec.close()
    return rec


def _resumed(out: Path, slip=None, steps: int = 4, save_after: int = 2) -> None:
    """`train`'s loop recorded as two runs: out/a stops after `save_after` steps keeping its state
    dicts (a checkpoint in memory), out/b builds the model and optimizer anew, loads them, has
    `slip(model, optimizer, saved)` change the load, and goes on with `Recorder(resumed_from=)`."""
    torch.manual_seed(0)
    model, g = Inner(), torch.Generator().manual_seed(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model, opt, out=out / "a")
    for step in range(1, steps + 1):
        if step == save_after + 1:  # stop, and resume from what was saved
            saved = {"model": model.state_dict(), "optim": opt.state_dict()}
            rec.close()
            torch.manual_seed(0)
            model = Inner()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
            if slip is not None:
                slip(model, opt, saved)
            rec = Recorder(model, opt, out=out / "b", resumed_from=out / "a")
        x = torch.randn(6, 4, generator=g)
        logits = model(x)
        loss = logits.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step(loss=loss, logits=logits, batch={"x": x})
    rec.close()


def _weight_decay_from_the_code(model, opt, saved) -> None:
    for group in opt.param_groups:
        group["weight_decay"] = 0.0


def _optimizer_not_loaded(model, opt, saved) -> None:
    opt.state.clear()


def _one_key_not_loaded(model, opt, saved) -> None:
    torch.manual_seed(0)
    model.lin.weight.data.copy_(Inner().lin.weight)  # as built: its key was dropped


@pytest.mark.parametrize(
    "slip, name, words",
    [
        (None, None, None),
        (_weight_decay_from_the_code, "param_groups.weight_decay (after the load)", "[0.0] right after the load"),
        (_optimizer_not_loaded, "lin.bias [exp_avg] (after the load)", "never loaded"),
        (_one_key_not_loaded, "lin.weight (after the load)", "its initial ones"),
    ],
    ids=["correct", "weight-decay", "optimizer-not-loaded", "key-not-loaded"],
)
def test_a_resumed_runs_load_is_compared_exactly_at_the_load(tmp_path, capsys, slip, name, words):
    """In one process: the state right after the load against the state the run before closed
    with, at the step it saved after (2); the slips are caught there, with what the values are."""
    train(tmp_path / "ref", steps=4)
    _resumed(tmp_path, slip)
    code, out = compare(tmp_path / "ref", tmp_path / "b", "--out", tmp_path / "r", capsys=capsys)
    report = json.loads((tmp_path / "r" / "report.json").read_text())["compare"]
    loaded = [r for r in report["records"] if r["name"].endswith("(after the load)")]
    assert {r["step"] for r in loaded} == {2} and len(loaded) > 12, loaded
    if slip is None:
        assert code == 0 and all(r["ok"] for r in loaded), out
        return
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["name"]) == (2, name), out
    assert words in out, out


def test_wrapper_prefixes_are_stripped():
    assert strip_wrappers("_orig_mod.layers.0._fsdp_wrapped_module.attn.wq.weight") == "layers.0.attn.wq.weight"
    assert strip_wrappers("module.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert strip_wrappers("module.module.encoder.module.w") == "encoder.module.w"  # a user's own `module` is kept


def test_a_wrapped_model_pairs_with_the_plain_one(tmp_path, capsys):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    inner = Inner()
    inner.lin = checkpoint_wrapper(inner.lin)
    wrapped = DDPLike(inner)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    train(tmp_path / "a")
    train(tmp_path / "b", model=wrapped)
    assert Run(tmp_path / "b", "b").param_names == ["lin.weight", "lin.bias", "out.weight", "out.bias"]
    code, out = compare(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "r", capsys=capsys)
    assert code == 0, out


def test_storage_is_safetensors_and_json_only(tmp_path):
    train(tmp_path / "run", full_steps=[1], full_params=["out.*"])
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert files and {p.suffix for p in files} == {".json", ".safetensors"}
    for p in files:
        assert not p.read_bytes().startswith(b"\x80"), f"{p} looks like a pickle"
    tensors, header = Run(tmp_path / "run", "run").load(0, 2)
    assert "full/opt2/params/out.weight" in tensors and "full/opt2/params/lin.weight" not in tensors
    tensors, _ = Run(tmp_path / "run", "run").load(0, 1)
    assert "full/opt1/params/lin.weight" in tensors and "full/opt1/optim.exp_avg/lin.weight" in tensors


def test_gradient_accumulation_records_per_call_and_per_optimizer_step(tmp_path, capsys):
    train(tmp_path / "a", steps=2, accumulate=2)
    run = Run(tmp_path / "a", "a")
    assert run.calls[0] == [0, 1, 2, 3, 4]
    assert [run.load(0, c)[1]["opt_steps"] for c in run.calls[0]] == [[0], [], [1], [], [2]]
    assert run.meta[0]["optimizer_steps"] == 2 and run.meta[0]["steps"] == 4
    train(tmp_path / "b", steps=2, accumulate=2)
    code, out = compare(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "r", capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out


def test_a_mutated_gradient_is_caught_in_one_process_too(tmp_path, capsys):
    """The single-process twin of the torchrun test: the same loop, one gradient scaled by 1 + 2e-6."""
    train(tmp_path / "ref")
    torch.manual_seed(0)
    model = Inner()
    model.lin.weight.register_hook(lambda g: g * (1 + 2e-6))
    train(tmp_path / "bad", model=model)
    code, out = compare(tmp_path / "ref", tmp_path / "bad", "--out", tmp_path / "r", capsys=capsys)
    assert code == 1 and "First divergence at step 1, gradients, 'lin.weight'" in out, out


def test_a_batch_of_another_size_is_a_divergence_named_not_a_crash(tmp_path, capsys):
    train(tmp_path / "a")
    train(tmp_path / "b", batch=5)
    code, out = compare(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "r", capsys=capsys)
    assert code == 1 and "First divergence at step 1, data" in out, out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    logits = [r for r in report["compare"]["records"] if r["phase"] == "logits"][0]
    assert (
        not logits["ok"]
        and "samples (5,) on the sharded run's ranks together, (6,) in the reference" in logits["message"]
    )


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "RUN_REF: {d}/missing: no such directory"),
        (lambda d: (d / "missing").mkdir(), "no rank*/meta.json"),
        (
            lambda d: train(d / "missing", model=nn.Sequential(nn.Linear(4, 2))),
            "params: the runs record different parameters",
        ),
        (
            lambda d: (train(d / "missing"), (d / "missing" / "rank0" / "step000001.safetensors").write_bytes(b"junk")),
            "{d}/missing/rank0/step000001.safetensors: not a step the recorder wrote",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_field(tmp_path, capsys, setup, message):
    train(tmp_path / "good")
    setup(tmp_path)
    code, out = compare(tmp_path / "missing", tmp_path / "good", "--out", tmp_path / "r", capsys=capsys)
    assert code == 2 and message.format(d=tmp_path) in out, out


def test_bad_meta_and_calibration_exit_2(tmp_path, capsys):
    train(tmp_path / "good")
    train(tmp_path / "other")
    code, out = compare(tmp_path / "good", tmp_path / "other", "--calibration", tmp_path / "other", capsys=capsys)
    assert code == 2 and "--calibration" in out and "settings.perturb" in out, out
    meta = tmp_path / "other" / "rank0" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "schema_version": 9}))
    code, out = compare(tmp_path / "good", tmp_path / "other", capsys=capsys)
    assert code == 2 and "RUN_SHARDED" in out and "schema_version: expected 1, got 9" in out, out
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "schema_version": 1, "world_size": 2}))
    code, out = compare(tmp_path / "good", tmp_path / "other", capsys=capsys)
    assert code == 2 and "world_size is 2 but the ranks recorded are [0]" in out, out


# ---- the data check and perturbation mode -----------------------------------------------------------


def _h(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_the_data_check_passes_each_sample_once_in_any_order():
    assert data_check(1, [_h(1, 2, 3, 4)], [_h(3, 1), _h(4, 2)]).ok


@pytest.mark.parametrize(
    "got, expected",
    [
        (
            [_h(1, 2), _h(1, 2)],
            "samples 0-1 seen by ranks 0 and 1; samples 2-3 of the reference's batch seen by no rank",
        ),
        ([_h(1, 2), _h(1, 2)], "is the sampler sharded"),
        ([_h(1, 2, 3), _h(4, 1)], "DistributedSampler(drop_last=False) pads"),
        ([_h(1, 5), _h(2, 6)], "another shuffle seed, a set_epoch"),
    ],
)
def test_the_data_check_names_the_classic_bugs(got, expected):
    f = data_check(3, [_h(1, 2, 3, 4)], got)
    assert not f.ok and f.step == 3 and expected in f.message, f.message


def test_perturbation_moves_each_nonzero_element_by_its_bound_and_leaves_zeros(tmp_path):
    g = torch.tensor([[1.0, -0.5, 0.0], [1e-9, 2.0, -3.0]])
    moved = g.clone()
    GradientPerturbation(7).move(moved)
    step = MOVE_ULPS * 2.0**-24 * 3.0
    assert moved[0, 2] == 0
    nz = g != 0
    assert (((moved - g).abs()[nz] - step).abs() <= g.abs()[nz] * 2.0**-23).all()  # the move, rounded once
    os.environ["FSDP_VERIFY_PERTURB"] = "3"
    try:
        rec = train(tmp_path / "p", steps=1)
    finally:
        del os.environ["FSDP_VERIFY_PERTURB"]
    assert rec.perturbation.seed == 3 and Run(tmp_path / "p", "p").meta[0]["settings"]["perturb"] == 3


def test_runs_of_different_lengths_are_compared_over_the_steps_both_have(tmp_path, capsys):
    """The note counts training steps, not the initial-state record (call 0)."""
    train(tmp_path / "a", steps=3)
    train(tmp_path / "b", steps=2)
    code, out = compare(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "r", capsys=capsys)
    assert "the runs recorded 3 and 2 steps; compared the 2 both have" in out, out
    # The verdict line and the report count the steps compared too (they said the reference's 3).
    assert f"{tmp_path / 'b'} (world size 1) vs {tmp_path / 'a'} (world size 1), 2 steps compared:" in out, out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["compare"]["steps"] == report["cases"][0]["steps"] == 2
    assert code == 0, out


def test_module_fingerprints_name_the_first_module_that_parts(tmp_path, capsys):
    """Recorder(modules=[...]): per-module output fingerprints, in the order the modules ran, so
    `compare` names the module (not only the logits) where a bug in the forward sits; equal runs
    stay equivalent, and a pattern that matches nothing is refused."""
    train(tmp_path / "ref", modules=["lin", "out"])
    train(tmp_path / "same", modules=["lin", "out"])
    code, out = compare(tmp_path / "ref", tmp_path / "same", "--out", tmp_path / "r0", capsys=capsys)
    assert code == 0 and "EQUIVALENT" in out, out
    torch.manual_seed(0)
    model = Inner()
    model.lin.register_forward_hook(lambda _m, _a, y: y * (1 + 1e-5))  # the bug, inside `lin`
    train(tmp_path / "bad", model=model, modules=["lin", "out"])
    code, out = compare(tmp_path / "ref", tmp_path / "bad", "--out", tmp_path / "r1", capsys=capsys)
    assert code == 1 and "First divergence at step 1, module outputs, 'lin'" in out, out
    with pytest.raises(ValueError, match="modules"):
        train(tmp_path / "none", modules=["layers.*"])


def test_the_bound_under_a_policy_takes_the_magnitudes_rounded_never_less_than_one_ulp():
    """rules.bound_rounded: u_p x S in place of the one ulp (2 u_p) where S > 2, the plain bound otherwise."""
    plain = rules.bound(torch.bfloat16, 2)
    assert rules.bound_rounded(torch.bfloat16, 2, torch.float32, 1.9, torch.bfloat16) == plain
    wide = rules.bound_rounded(torch.bfloat16, 2, torch.float32, 14.0, torch.bfloat16)
    assert wide.limit == pytest.approx(plain.limit + 12 * rules.unit_roundoff(torch.bfloat16))
    assert "u(bfloat16) x 14" in wide.why and "no terms cancel" in wide.why and "ulp" not in wide.why
