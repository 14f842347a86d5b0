"""The one report format (every command's report.json validates against the shipped schema) and
the nightly's readers: `report diff` between real nights, `report trend` over five of them, and
bad input refused with exit 2 naming the field."""

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from fsdp_verify.commands.cli import main
from fsdp_verify.reports.schema import SCHEMA_PATH, load
from tests.report_nights import shared


@pytest.fixture(scope="session")
def reports(tmp_path_factory) -> Path:
    return shared(tmp_path_factory)


def test_every_command_writes_a_report_the_schema_accepts(reports):
    schema = json.loads(SCHEMA_PATH.read_text())
    paths = [reports / "zoo", reports / "check-ok", reports / "check-bad", reports / "fuzz"]
    paths += sorted((reports / "nights").glob("*/sweep"))
    kinds = set()
    for p in paths:
        report = json.loads((p / "report.json").read_text())
        jsonschema.validate(report, schema)  # the raw file, not only through our loader
        kinds.add(report["kind"])
        assert report["environment"]["torch"] and report["schema_version"] == 1
        assert (p / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert kinds == {"check", "fuzz", "sweep", "selftest"}
    bad = load(reports / "check-bad")
    assert not bad["ok"] and bad["failures"][0]["first_divergence"].startswith("GradsComparator @ 1/grads")
    assert bad["failures"][0]["replay"].startswith("fsdp-verify repro ")
    zoo = load(reports / "zoo")
    assert zoo["ok"] and [z["bug"] for z in zoo["zoo"]] == ["grads_divided_twice", "clip_with_local_norm"]
    assert load(reports / "nights" / "2026-11-05" / "sweep")["zoo"] == zoo["zoo"]  # sweep --zoo joins it


def test_the_schema_rejects_what_readers_could_not_use(reports):
    report = load(reports / "check-ok")
    schema = json.loads(SCHEMA_PATH.read_text())
    for broken in (
        {**report, "schema_version": 2},
        {**report, "shard": "5"},
        {**report, "counts": {"cases": 1, "passed": 1}},
        {**report, "cases": [{**report["cases"][0], "worst_ratio": -1.0}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_diff_names_the_new_failure_when_the_engine_turns_into_a_mutant(reports, tmp_path, capsys):
    nights = reports / "nights"
    code = main(
        ["report", "diff", str(nights / "2026-11-03"), str(nights / "2026-11-04")]
        + ["--json", str(tmp_path / "d.json"), "--html", str(tmp_path / "d.html")]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "NEW FAILURE" in out and "GradsComparator @ 1/grads" in out and "WORSE" in out
    result = json.loads((tmp_path / "d.json").read_text())
    assert len(result["places"]["sweep"]["new_failures"]) == 4
    assert any(m["comparator"] == "GradsComparator" and m["by"] > 2 for m in result["places"]["sweep"]["ratios_moved"])
    assert 'id="diff"' in (tmp_path / "d.html").read_text()
    # and back: the failures are fixed, nothing got worse
    assert main(["report", "diff", str(nights / "2026-11-04"), str(nights / "2026-11-05")]) == 0
    out = capsys.readouterr().out
    assert out.count("fixed ") == 4 and "nothing got worse" in out


def test_diff_of_two_identical_nights_says_no_change(reports, capsys):
    nights = reports / "nights"  # the same sweep run twice
    assert main(["report", "diff", str(nights / "2026-11-02"), str(nights / "2026-11-03")]) == 0
    assert "no change" in capsys.readouterr().out


def _copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    report = json.loads((dst / "report.json").read_text())
    edit(report)
    (dst / "report.json").write_text(json.dumps(report))
    return dst


def test_diff_says_what_else_changed(reports, tmp_path, capsys):
    night = reports / "nights" / "2026-11-02" / "sweep"

    def new_torch(r):
        r["environment"]["torch"] = "9.9.9"

    def lost_bug(r):
        r["zoo"][0]["caught"] = False

    def ratio_up(r):
        r["comparators"]["GradsComparator"]["p99"] = 0.9
        r["comparators"]["GradsComparator"]["worst"] = 0.9

    env = _copy(night, tmp_path / "env", new_torch)
    assert main(["report", "diff", str(night), str(env)]) == 0  # a new torch alone is not worse
    assert "environment torch: " in capsys.readouterr().out
    zoo = reports / "zoo"
    assert main(["report", "diff", str(zoo), str(_copy(zoo, tmp_path / "zoo", lost_bug))]) == 1
    assert "ZOO BUG NO LONGER CAUGHT: grads_divided_twice" in capsys.readouterr().out
    up = _copy(night, tmp_path / "up", ratio_up)
    assert main(["report", "diff", str(night), str(up)]) == 1
    assert "GradsComparator worst ratio UP" in capsys.readouterr().out
    assert main(["report", "diff", str(night), str(up), "--factor", "1e9"]) == 0


def test_bad_input_exits_2_naming_the_field(reports, tmp_path, capsys):
    night = reports / "nights" / "2026-11-02" / "sweep"
    old = _copy(night, tmp_path / "old", lambda r: r.update(schema_version=0))
    assert main(["report", "diff", str(old), str(night)]) == 2
    assert "schema_version: expected 1, got 0" in capsys.readouterr().err
    broken = _copy(night, tmp_path / "broken", lambda r: r["counts"].pop("failed"))
    assert main(["report", "diff", str(night), str(broken)]) == 2
    assert "counts: 'failed' is a required property" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", "diff", str(night), str(tmp_path / "empty")]) == 2
    assert "no report.json" in capsys.readouterr().err
    assert main(["report", "trend", str(tmp_path / "empty")]) == 2
    assert "no night folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["report", "diff", str(night), str(night), "--factor", "0.5"])
    assert e.value.code == 2 and "--factor" in capsys.readouterr().err


def test_trend_over_five_nights_names_the_night_each_number_changed(reports):
    page = (reports / "trend.html").read_text()
    assert "5 nights, 2026-11-01 to 2026-11-05" in page
    assert page.count('data-plot="trend-') >= 4
    rows = page.split("<table id=trend>")[1].split("</table>")[0].split("<tr>")
    assert rows[1].startswith("<th></th><th>2026-11-01</th>") and rows[1].endswith("<th>last changed</th></tr>")
    alarms = next(r for r in rows if r.startswith("<th>false alarms</th>"))
    # four false alarms the night the mutant ran, back to 0 the night after: last changed on the 5th
    assert alarms == (
        "<th>false alarms</th><td>0</td><td>0</td><td>0</td><td class=changed>4</td><td class=changed>0</td>"
        "<td>2026-11-05</td></tr>"
    )
    cases = next(r for r in rows if r.startswith("<th>cases</th>"))
    assert cases.endswith("<td>never</td></tr>")
    assert 'id="diff"' in page and "fixed" in page  # the latest night's diff


def test_a_merged_report_with_a_missing_shard_says_so_first(reports, tmp_path, capsys):
    """A night whose sweep lost a shard: the page leads with it, and the diff calls it worse."""
    shard = _copy(reports / "nights" / "2026-11-02" / "sweep", tmp_path / "s1", lambda r: None)
    report = json.loads((shard / "report.json").read_text())
    report["shard"] = "1/2"
    report["cases"] = [r for r in report["cases"] if r["index"] % 2 == 0]
    (shard / "report.json").write_text(json.dumps(report))
    assert main(["report", "merge", str(shard), "--out", str(tmp_path / "merged")]) == 3
    assert "missing shards: 2/2" in capsys.readouterr().err
    page = (tmp_path / "merged" / "report.html").read_text()
    assert page.index('id="missing-shards"') < page.index("<svg")
    assert main(["report", "diff", str(reports / "nights" / "2026-11-02" / "sweep"), str(tmp_path / "merged")]) == 1
    out = capsys.readouterr().out
    assert "MISSING SHARDS in NEW: 2/2" in out and "cases only in OLD: 2, only in NEW: 0" in out
