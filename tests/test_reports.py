"""The one report format (every command's report.json validates against the shipped schema) and
the nightly's readers: `report diff` between real nights, `report trend` over five of them, and
bad input refused with exit 2 naming the field."""

import html
import json
import re
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
    assert "NEW CAUSE [4 cases]: gradients (GradsComparator)" in out and "GradsComparator @ 1/grads" in out
    assert re.search(r"\nWORSE: 1 new cause \(4 newly failing cases\), \d+ ratios up\n$", out), out
    result = json.loads((tmp_path / "d.json").read_text())
    assert len(result["places"]["sweep"]["new_failures"]) == 4
    assert any(m["comparator"] == "GradsComparator" and m["by"] > 2 for m in result["places"]["sweep"]["ratios_moved"])
    assert 'id="diff"' in (tmp_path / "d.html").read_text()
    # and back: the failures are fixed, nothing got worse
    assert main(["report", "diff", str(nights / "2026-11-04"), str(nights / "2026-11-05")]) == 0
    out = capsys.readouterr().out
    assert "fixed cause [4 cases]" in out and "fixed: 4 cases pass now" in out and "nothing got worse" in out


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
    failing = next(r for r in rows if r.startswith("<th>failing cases</th>"))
    # four failing cases the night the mutant ran, back to 0 the night after: last changed on the 5th
    assert failing == (
        "<th>failing cases</th><td>0</td><td>0</td><td>0</td><td class=changed>4</td><td class=changed>0</td>"
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


def test_many_failures_are_grouped_by_cause_each_with_its_smallest_case_and_replay(reports, capsys):
    """7 of 8 cases fail by 3 causes (tests/engines/many_causes.py): the report's causes are those
    3, each holding exactly the cases of its cause (whatever world size, step count, message
    numbers or parameter name they fail with), its smallest case and the command that replays it;
    the terminal says the same a cause a paragraph."""
    from fsdp_verify.commands.sweep import summary
    from fsdp_verify.reports.causes import example
    from tests.engines.many_causes import expected_cause

    report = load(reports / "causes-nights" / "2026-12-02" / "sweep")
    rows = {r["case_hash"]: r for r in report["cases"]}
    truth: dict[str, set] = {}
    for r in report["cases"]:
        if expected_cause(r) is not None:
            truth.setdefault(expected_cause(r), set()).add(r["case_hash"])
    assert {h for h, r in rows.items() if not r["ok"]} == set().union(*truth.values())
    assert sorted(map(frozenset, truth.values()), key=sorted) == sorted(
        (frozenset(c["cases"]) for c in report["causes"]), key=sorted
    )
    assert all(len(members) >= 2 for members in truth.values())  # each cause more than once
    for c in report["causes"]:
        assert c["count"] == len(c["cases"]) and c["smallest"] in c["cases"]
        smallest = rows[c["smallest"]]
        assert all(
            (smallest["world_size"], smallest["steps"]) <= (rows[h]["world_size"], rows[h]["steps"]) for h in c["cases"]
        )
        assert (
            c["replay"]
            == f"fsdp-verify repro {reports / 'causes-nights' / '2026-12-02' / 'sweep' / 'failures' / c['smallest']}.case.json"
        )
        assert all(rows[h]["cause"] == c["signature"] for h in c["cases"])
    by_signature = {expected_cause(rows[c["smallest"]]): c["signature"] for c in report["causes"]}
    assert by_signature["gradients divided twice"].startswith("gradients (GradsComparator)")
    assert (
        by_signature["raises while sharding"]
        == "a rank raised in shard (engine): RuntimeError: engine bug: # units over # values"
    )
    assert by_signature["crash in the second forward"].startswith("a rank crashed in step # forward")
    text = summary(report)
    assert "failures: 7 (3 causes)\n" in text and "false alarm" not in text  # a user's engine
    assert text.count("      smallest: ") == 3 and text.count("      replay: fsdp-verify repro ") == 3
    assert "Traceback" not in text
    # each cause headed by its smallest case's own words, numbers kept; the signature only groups
    raised = next(c for c in report["causes"] if c["signature"] == by_signature["raises while sharding"])
    assert raised["example"] == example(rows[raised["smallest"]])
    assert re.fullmatch(
        r"a rank raised in shard \(engine\): RuntimeError: engine bug: \d+ units over \d+ values", raised["example"]
    )
    assert f"] {raised['example']}\n" in text and "#" not in text
    page = (reports / "causes-nights" / "2026-12-02" / "sweep" / "report.html").read_text()
    assert f">{raised['count']} cases: {html.escape(raised['example'])}</h3>" in page
    # a report written before `example`: the heading from the smallest case's row, the same words
    for c in report["causes"]:
        del c["example"]
    assert summary(report) == text


def test_a_night_that_turns_red_says_new_causes_not_new_failures(reports, tmp_path, capsys):
    nights = reports / "causes-nights"
    code = main(
        ["report", "diff", str(nights / "2026-12-01"), str(nights / "2026-12-02"), "--json", str(tmp_path / "d.json")]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.count("NEW CAUSE [") == 3 and "NEW FAILURE " not in out
    # a new cause said in its smallest case's words, not the signature's placeholders
    assert re.search(
        r"NEW CAUSE \[\d+ cases\]: a rank raised in shard \(engine\): RuntimeError: engine bug: \d+ units", out
    )
    assert "engine bug: # units" not in out
    assert re.search(r"\nWORSE: 3 new causes \(7 newly failing cases\), \d+ ratios up\n$", out), out
    place = json.loads((tmp_path / "d.json").read_text())["places"]["sweep"]
    assert len(place["new_failures"]) == 7 and sorted(c["cases"] for c in place["new_causes"]) == [2, 2, 3]
    # back again: the causes are gone, nothing got worse
    assert main(["report", "diff", str(nights / "2026-12-02"), str(nights / "2026-12-01")]) == 0
    out = capsys.readouterr().out
    assert out.count("fixed cause [") == 3 and "fixed: 7 cases pass now" in out and "nothing got worse" in out
    page = (reports / "causes-trend.html").read_text()
    rows = page.split("<table id=trend>")[1].split("</table>")[0].split("<tr>")
    assert next(r for r in rows if r.startswith("<th>their causes</th>")).startswith(
        "<th>their causes</th><td>0</td><td class=changed>3</td>"
    )
    assert "NEW CAUSE [" in page


def _row(status, first, summary="", **more):
    return {"ok": False, "status": status, "first_divergence": first, "summary": summary, **more}


def test_a_cause_ignores_what_varies_within_it_and_keeps_what_tells_causes_apart():
    """The signatures of a plain fully_shard engine's sweep (issue 38): numbers, ranks, case hashes
    and where the other ranks were vary within a cause; the phase, the comparator, the hint and the
    error's class and words tell causes apart."""
    from fsdp_verify.reports.causes import signature

    crash = "rank failure: rank {r} crash in phase 'step {s} backward (micro-batch {m})': process killed by signal 6"
    same = [
        [_row("error", crash.format(r=1, s=1, m=0)), _row("error", crash.format(r=0, s=3, m=2) + " (others: rank 1: 'x')")],
        [
            _row("fail", "GradsComparator @ 1/grads layers.0.w", "DIVERGED: x. Hint: the gradient is 1/2 x theirs Note: y."),
            _row("fail", "GradsComparator @ 2/grads embed.weight", "DIVERGED: x. Hint: the gradient is 1/3 x theirs"),
        ],
        [
            _row("error", "rank failure: rank 0 error in phase 'gather records': RuntimeError: record 1/grads/moe.experts.1.weight: 3 rows"),
            _row("error", "rank failure: FAILED: a rank failed on case 0123456789ab: rank 2 error in phase 'gather records':"
                 " RuntimeError: record 2/grads/moe.experts.0.weight: 12 rows"),
        ],
    ]  # fmt: skip
    for a, b in same:
        assert signature(a) == signature(b), (signature(a), signature(b))
    assert signature(same[2][0]) == (
        "a rank raised in gather records: RuntimeError: record #/grads/moe.experts.#.weight: # rows"
    )
    apart = [
        same[0][0],
        _row("error", crash.format(r=1, s=1, m=0).replace("signal 6", "signal 9")),  # another way to die
        _row("error", crash.format(r=1, s=1, m=0).replace("backward", "forward")),  # another phase
        same[1][0],
        _row("fail", "GradsComparator @ 1/grads w", "DIVERGED: x."),  # no hint
        _row("fail", "ParamsComparator @ 1/params w", "DIVERGED: x."),  # another record
        same[2][0],
        _row("error", "rank failure: rank 0 error in phase 'gather records': ValueError: record 1/grads/w: 3 rows"),
    ]
    assert len({signature(r) for r in apart}) == len(apart)
    assert signature({"ok": True, "status": "pass"}) is None


def test_each_row_carries_the_knobs_its_case_was_drawn_with(reports):
    """What a reader groups a sweep's failures by (compile, microbatches, a reduce dtype, ...):
    the case's fields that differ from the default case, beyond the row's columns; on the page
    too."""
    from fsdp_verify.case import Case
    from fsdp_verify.reports.report import case_knobs

    night = reports / "nights" / "2026-11-05" / "sweep"
    rows = load(night)["cases"]
    for row in rows:
        assert isinstance(row["knobs"], dict) and not {"seed", "data_seed", "world_size", "model"} & set(row["knobs"])
    knobs = next(r["knobs"] for r in rows if r["knobs"])
    name, value = next(iter(knobs.items()))
    assert html.escape(f"{name}={json.dumps(value, separators=(',', ':'))}") in (night / "report.html").read_text()
    assert case_knobs(Case()) == {}
    assert case_knobs(Case().with_(microbatches=2, **{"precision.reduce_dtype": "fp32"})) == {
        "microbatches": 2,
        "precision.reduce_dtype": "fp32",
    }
    assert case_knobs(Case().with_(**{"model.dropout": 0.1, "world_size": 4, "data.batch_size": 12})) == {
        "model.dropout": 0.1,  # the model's own settings beyond its kind (the row's column)
        "data.batch_size": 12,
    }
