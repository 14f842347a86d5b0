"""bench/sweep.py (the nightly sweep on the correct engine) on a CI-sized sample."""

import importlib.util
import json
from pathlib import Path

SWEEP = Path(__file__).resolve().parents[1] / "bench" / "sweep.py"


def _load():
    spec = importlib.util.spec_from_file_location("fsdp_verify_bench_sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_sweep_on_the_correct_engine_has_no_false_alarm(tmp_path, capsys):
    zoo = tmp_path / "zoo.json"
    zoo.write_text(json.dumps([{"bug": "b", "status": "caught", "ratio": 42.0}]))
    code = _load().main(["--cases", "4", "--world-sizes", "2", "--out", str(tmp_path), "--zoo", str(zoo)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "false alarms: 0" in text and "smallest ratio on a caught bug 42" in text
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["ok"] and r["world_size"] == 2 for r in rows)
    assert all(0 <= r["worst_ratio"] <= 1 for r in rows)
    assert not (tmp_path / "false_alarms").exists()
    assert not (tmp_path / "closest_pass.case.json").exists()  # fp32 at world size 2: all bit-exact


def test_the_closest_pass_is_kept_to_replay(tmp_path, capsys):
    # A correct engine the reference does not emulate: dividing before summing over 3 ranks rounds.
    args = ["--cases", "5", "--world-sizes", "3", "--precisions", "fp32", "--out", str(tmp_path)]
    code = _load().main(args + ["--engine", "tests/engines/reordered.py:divide_before_summing"])
    assert code == 0, capsys.readouterr().out
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    closest = max(rows, key=lambda r: r["worst_ratio"])
    assert closest["worst_ratio"] > 0
    from fsdp_verify.case import Case

    assert Case.load(tmp_path / "closest_pass.case.json").hash == closest["case"]
    streamed = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["case"] for r in streamed] == [r["case"] for r in rows]


def test_a_cut_short_sweep_is_reported_from_its_streamed_rows(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    good = {"case": "a", "world_size": 2, "model": "mlp", "precision": "fp32", "ok": True, "calibrated": False}
    good |= {"worst_ratio": 0.5, "worst_at": [1, "grads", "w"], "worst_mode": "bound", "seconds": 1.0}
    bad = {"case": "b", "world_size": 3, "model": "mlp", "precision": "bf16", "ok": False}
    bad |= {"alarm": "rank failure", "detail": "rank 1 hung", "seconds": 2.0}
    rows.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code = _load().main(["--report-from", str(rows)])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "2 cases in 3 s" in text and "false alarms: 1" in text and "b (rank failure): rank 1 hung" in text
    assert "max 0.5" in text


def test_a_broken_engine_raises_alarms_and_leaves_replayable_cases(tmp_path, capsys):
    code = _load().main(
        [
            "--cases",
            "2",
            "--world-sizes",
            "2",
            "--engine",
            "fsdp_verify.zoo.mutants:grads_divided_twice",
            "--out",
            str(tmp_path),
        ]
    )
    text = capsys.readouterr().out
    assert code == 1, text
    assert "false alarms: 2" in text
    saved = sorted((tmp_path / "false_alarms").glob("*.case.json"))
    assert len(saved) == 2
    from fsdp_verify.case import Case

    assert Case.load(saved[0]).engine == "fsdp_verify.zoo.mutants:grads_divided_twice"
