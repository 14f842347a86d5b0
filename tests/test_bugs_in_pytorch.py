"""The README's "Bugs found in PyTorch" (also docs/bugs-in-pytorch.md): every line names its
standalone repro and either the public PyTorch issue or a report ready to file beside the repro,
whose script is the repro's, word for word, so a user can take it upstream in a minute."""

from __future__ import annotations

import re

import pytest

from tests.doc_examples import ROOT

UPSTREAM = ROOT / "tests" / "upstream"
SECTIONS = ("- **Torch versions tried:**", "- **Searched first:**", "## Expected", "## Actual", "## Repro")


def _rows() -> list[dict[str, str]]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("<!-- --8<-- [start:bugs] -->") : text.index("<!-- --8<-- [end:bugs] -->")]
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


ROWS = _rows()


def test_the_table_has_a_row_for_every_repro():
    named = {m for row in ROWS for m in re.findall(r"tests/upstream/(test_\w+\.py)", row["repro"])}
    on_disk = {p.name for p in UPSTREAM.glob("test_*.py")}
    assert named == on_disk, (
        f"repros without a row: {sorted(on_disk - named)}; rows without a repro: {sorted(named - on_disk)}"
    )


@pytest.mark.parametrize("row", ROWS, ids=[re.search(r"test_\w+", r["repro"]).group(0) for r in ROWS])
def test_each_row_names_the_upstream_issue_or_a_ready_report(row):
    issue = re.fullmatch(
        r"\[pytorch/(pytorch|ao|torchtitan)#(\d+)\]\(https://github\.com/pytorch/\1/issues/\2\)( \(.+\))?",
        row["upstream"],
    )
    report = re.fullmatch(r"none found; ready to file: `tests/upstream/reports/(test_\w+)\.md`", row["upstream"])
    assert issue or report, row["upstream"]
    if report:
        assert (UPSTREAM / "reports" / f"{report.group(1)}.md").is_file(), row["upstream"]
        assert f"tests/upstream/{report.group(1)}.py" in row["repro"], "the report sits beside its own repro"


REPORTS = sorted((UPSTREAM / "reports").glob("*.md"))


@pytest.mark.parametrize("path", REPORTS, ids=[p.stem for p in REPORTS])
def test_a_report_is_ready_to_file(path):
    text = path.read_text()
    title = text.splitlines()[0]
    assert title.startswith("# [") and len(title) > 20, title
    missing = [s for s in SECTIONS if s not in text]
    assert not missing, f"{path.name} lacks {missing}"
    assert "torch 2.13" in text  # the release it was seen on
    script = re.search(r"```python\n(.*)```\n", text, re.S).group(1)
    assert script == (UPSTREAM / f"{path.stem}.py").read_text(), f"{path.name}'s script is not its repro's"
    assert "fsdp_verify" not in script.replace("fsdp-verify", "")  # plain torch
