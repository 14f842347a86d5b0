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


def test_a_broken_engine_raises_alarms_and_leaves_replayable_cases(tmp_path, capsys):
    code = _load().main(
        ["--cases", "2", "--world-sizes", "2", "--engine", "verify.mutants:grads_divided_twice", "--out", str(tmp_path)]
    )
    text = capsys.readouterr().out
    assert code == 1, text
    assert "false alarms: 2" in text
    saved = sorted((tmp_path / "false_alarms").glob("*.case.json"))
    assert len(saved) == 2
    from verify.case import Case

    assert Case.load(saved[0]).engine == "verify.mutants:grads_divided_twice"
