"""`fsdp-verify shrink`: a big failing case becomes a small one that fails the same way, and the
repro file it writes reproduces the failure; a passing case has nothing to shrink."""

import json
from dataclasses import replace
from pathlib import Path

from fsdp_verify.case import Case
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.repro.shrink import REDUCTIONS, Signature, _layers, _valid, run_once
from tests.conftest import MLP, TINY_LM, mlp_case

ROOT = Path(__file__).resolve().parent.parent


def big_failing_case() -> Case:
    """Everything on: 4 ranks, 3 layers, 3 steps, 2 micro-batches, clipping, bf16, AdamW."""
    return mlp_case(
        4,
        steps=3,
        microbatches=2,
        clip_norm=1.0,
        precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32"),
        data=DataSpec(batch_size=16),
        engine="fsdp_verify.zoo.mutants:grads_divided_twice",
    )


def test_shrink_big_mutant_case_to_a_small_one_that_fails_the_same_way(tmp_path, capsys):
    big = big_failing_case()
    assert big.model.n_blocks == 3
    before = run_once(big)
    assert before.signature == Signature("diverged", "GradsComparator", "grads")

    big.save(tmp_path / "big.json")
    out = tmp_path / "small.json"
    code = main(["shrink", str(tmp_path / "big.json"), "--out", str(out), "--max-runs", "40"])
    printed = capsys.readouterr()
    assert code == 1, printed.out + printed.err
    assert "still fails the same way; kept" in printed.err  # progress output
    assert f"Replay: fsdp-verify repro {out}" in printed.out

    small = Case.load(out)
    assert small.world_size <= 2 and small.model.n_blocks <= 2 and small.steps <= 2
    assert small.microbatches == 1 and small.clip_norm is None
    assert small.precision.is_full_precision and small.optim.name == "sgd"
    assert small.data.batch_size <= big.data.batch_size
    assert small.engine == big.engine

    # The repro command reproduces it, the same way: an independent run of the written file.
    verdict_path = tmp_path / "verdict.json"
    assert main(["repro", str(out), "--json", str(verdict_path)]) == 1
    first = json.loads(verdict_path.read_text())["first_divergence"]
    assert (first["comparator"], first["phase"]) == (before.signature.what, before.signature.phase)


def test_shrink_passing_case_has_nothing_to_shrink(tmp_path, capsys):
    path = mlp_case(2, steps=1).save(tmp_path / "ok.json")
    assert main(["shrink", str(path)]) == 0
    assert "nothing to shrink" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json"]  # no repro file written


def test_shrink_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"world_size": 0}))
    assert main(["shrink", str(bad)]) == 2
    assert "world_size" in capsys.readouterr().err
    assert main(["shrink", str(tmp_path / "missing.json")]) == 2
    good = mlp_case(2).save(tmp_path / "good.json")
    assert main(["shrink", str(good), "--engine", "no_such_file.py:shard"]) == 2


def test_every_candidate_is_a_valid_smaller_case():
    """No process needed: every candidate of a feature-rich case is a valid Case that turns
    something down, and a custom wrap plan follows the layers that remain."""
    rich_lm = Case(
        model=replace(TINY_LM, tie_embeddings=True, dropout=0.1, frozen=("norm",)),
        wrap=("layers.0", "layers.1", ""),
        world_size=4,
        mesh_shape=(2, 2),
        microbatches=2,
        sync_every_microbatch=False,
        clip_norm=0.5,
        data=DataSpec(batch_size=16),
        init="meta",
        reshard_after_forward=False,
        precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16", output_dtype="fp32"),
    )
    rich_mlp = mlp_case(3, steps=3, data=DataSpec(batch_size=12, kind="cancellation"), wrap=("layers.2", ""))
    for case in (rich_lm, rich_mlp):
        labels = []
        for group in REDUCTIONS:
            for label, candidate in _valid(case, group(case)):
                assert candidate != case, label
                assert candidate.world_size <= case.world_size and candidate.steps <= case.steps, label
                labels.append(label)
        assert any(label.startswith("world size") for label in labels)
        assert any(label.startswith("steps") for label in labels)
    lm_labels = [label for group in REDUCTIONS for label, _ in _valid(rich_lm, group(rich_lm))]
    for expected in ("mesh", "n_layers 2 -> 1", "clip_norm", "dropout", "tie_embeddings", "frozen", "init"):
        assert any(label.startswith(expected) for label in lm_labels), expected
    one_layer = dict(_valid(rich_lm, _layers(rich_lm)))["n_layers 2 -> 1"]
    assert one_layer.wrap == ("layers.0", "")  # layers.1 is gone from the plan
    mlp_one_layer = dict(_valid(rich_mlp, _layers(rich_mlp)))["layers 3 -> 1"]
    assert mlp_one_layer.model.widths == (MLP.widths[0], MLP.widths[-1])
    assert mlp_one_layer.wrap == ("",)  # layers.2 is gone; the root alone remains


def test_shrink_keeps_a_rank_crash_a_rank_crash(tmp_path, capsys):
    """An engine that kills a rank shrinks by the RankFailure kind; exit 3, as `check` would give.
    Every crash restarts the pool, so one candidate run only, and last in the file."""
    engine = str(ROOT / "tests/engines/faulty.py") + ":rank1_crashes_in_forward"
    path = mlp_case(2, steps=2, engine=engine).save(tmp_path / "crash.json")
    out = tmp_path / "small.json"
    assert main(["shrink", str(path), "--out", str(out), "--max-runs", "1", "--timeout", "60"]) == 3
    printed = capsys.readouterr()
    assert "steps 2 -> 1: still fails the same way; kept" in printed.err
    assert "Fails the same way: rank crash." in printed.out and "budget spent" in printed.out
    assert Case.load(out).steps == 1


def test_a_candidate_the_engine_cannot_take_is_no_candidate():
    """World size 3 under reshard_after_forward=2: FSDP2 refuses it before any rank starts
    (verify/engines/capabilities.py), so the shrinker never tries it (nor stops on its CaseError)."""
    case = mlp_case(4, reshard_after_forward=2)
    candidates = [("to 3", {"world_size": 3, "data.batch_size": 12}), ("to 2", {"world_size": 2, "data.batch_size": 8})]
    assert [label for label, _ in _valid(case, candidates)] == ["to 2"]
