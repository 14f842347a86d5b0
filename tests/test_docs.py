"""Documentation that runs: every console block of README.md and docs/*.md is executed and its
exit codes and shown lines compared (the convention: tests/doc_examples.py, docs/contributing.md);
blocks marked nightly run under `pytest -m slow`. A drifted example must fail; the command
reference is generated from the parsers themselves."""

from __future__ import annotations

import dataclasses

import pytest

from tests.doc_examples import ROOT, Command, blocks, doc_files, execute, fences, judge, mismatch, run_block, workdir

BLOCKS = blocks()


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.nightly else []) for b in BLOCKS],
)
def test_documented_command_runs_as_shown(block, tmp_path):
    failures = run_block(block, workdir(tmp_path))
    assert not failures, "\n\n".join(failures)


def test_the_documentation_has_blocks_for_ci_and_for_the_nightly():
    default = [b for b in BLOCKS if not b.nightly]
    assert len(default) >= 5 and len(BLOCKS) - len(default) >= 5, [b.name for b in BLOCKS]
    assert any(b.path.name == "README.md" for b in default)


def test_every_prompt_is_in_a_console_block():
    """A `$ ` transcript in a block the test does not read would drift unseen."""
    stray = []
    for path in doc_files():
        for lineno, info, body in fences(path.read_text()):
            if info.split()[:1] != ["console"] and any(ln.startswith("$ ") for ln in body):
                stray.append(f"{path.relative_to(ROOT)}:{lineno} ({info or 'no language'})")
    assert not stray, f"blocks with `$ ` prompts that are not ```console: {stray}"


def test_every_nightly_marker_stands_on_a_console_block():
    """A marker elsewhere would leave its block running by default (or nothing marked at all)."""
    from tests.doc_examples import NIGHTLY

    stray = []
    for path in doc_files():
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            marker = line.strip().startswith("<!-- docs-test")
            if marker and not (line.strip() == NIGHTLY and lines[i + 1].startswith("```console")):
                stray.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not stray, f"nightly markers not on the line before a ```console fence: {stray}"


def _readme_mutant_block():
    return next(
        b
        for b in BLOCKS
        if b.path.name == "README.md" and any("grads_divided_twice" in c.line for c in b.commands) and not b.nightly
    )


def _drift(block, command_index: int, **change):
    commands = list(block.commands)
    commands[command_index] = dataclasses.replace(commands[command_index], **change)
    return dataclasses.replace(block, commands=commands)


def test_a_drifted_example_fails(tmp_path):
    """The README's caught-mutant example, run once: its output passes the example as written, and
    fails it once its exit code, its verdict line or one cell of its table says something else."""
    block = _readme_mutant_block()
    ran = execute(block, workdir(tmp_path))
    assert not judge(block, ran)
    shown = block.commands[0].expected
    verdict = next(i for i, ln in enumerate(shown) if ln.startswith("DIVERGED"))
    row = next(i for i, ln in enumerate(shown) if ln.startswith("1 "))
    drifts = {
        "exit code": _drift(block, 0, exit_code=0),
        "verdict": _drift(block, 0, expected=[*shown[:verdict], shown[verdict].replace("step 1", "step 2")]),
        "table row": _drift(
            block, 0, expected=[*shown[:row], shown[row].replace("exact", "0.5", 1), *shown[row + 1 :]]
        ),
    }
    for what, drifted in drifts.items():
        assert drifted != block, what
        failures = judge(drifted, ran)
        assert len(failures) == 1, f"a drifted {what} passed"
        assert failures[0].startswith(f"{block.name}: $ fsdp-verify check") and "grads_divided_twice" in failures[0]


def test_the_matcher():
    out = "header\nstep  a   b\n0     ok  exact\n1     -   FAIL x6\nDIVERGED: at step 1 (12.3 s)\n"
    assert mismatch(["step a b", "0 ok exact", "1 - FAIL x6"], out) is None  # widths may change
    assert mismatch(["step a b", "...", "DIVERGED: at step 1 (... s)"], out) is None
    assert mismatch(["DIVERGED: at step 2 (... s)"], out) is not None  # a changed verdict
    assert mismatch(["step a b", "1 - FAIL x6"], out) is not None  # shown lines are consecutive
    assert mismatch(["1 - FAIL x6", "0 ok exact"], out) is not None  # and in order
    assert mismatch(["0 ok exact", "...", "1 - FAIL x6"], out) is None
    assert mismatch([], out) is None


def test_the_transcript_parser():
    body = ["$ fsdp-verify check \\", "    --model mlp", "table", "$ echo $?", "1", "$ ls", "x"]
    from tests.doc_examples import parse_console

    assert parse_console(body) == [
        Command("fsdp-verify check --model mlp", ["table"], 1),
        Command("ls", ["x"], 0),
    ]
    with pytest.raises(ValueError, match="exit code"):
        parse_console(["$ true", "$ echo $?", "$ ls"])


def test_the_command_reference_is_generated_from_the_parsers():
    """docs/cli.md is the marker alone; the hook fills in every command and every option of it."""
    import argparse

    from fsdp_verify.commands.cli import build_parser
    from mkdocs_hooks import MARKER, _subcommands, cli_reference, on_page_markdown

    page = (ROOT / "docs" / "cli.md").read_text()
    assert MARKER in page and "usage:" not in page  # nothing copied by hand
    text = on_page_markdown(page, None, None, None)
    assert text == page.replace(MARKER, cli_reference())
    parser = build_parser()
    for name, _, sub in _subcommands(parser):
        assert f"## `fsdp-verify {name}`" in text
        for action in sub._actions:
            for option in action.option_strings:
                assert option in text, (name, option)
        for inner, _, _ in _subcommands(sub):
            assert f"`fsdp-verify {name} {inner}`" in text
    assert isinstance(parser, argparse.ArgumentParser) and "--version" in text


def test_every_documentation_page_is_in_the_sites_navigation():
    """A page left out of mkdocs.yml's nav builds (mkdocs only logs it) but cannot be found from the menu."""
    import yaml

    def pages(entries) -> set[str]:
        out: set[str] = set()
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out |= pages(value) if isinstance(value, list) else {value}
        return out

    nav = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk - nav == set(), f"docs pages missing from mkdocs.yml's nav: {sorted(on_disk - nav)}"
    assert nav - on_disk == set(), f"mkdocs.yml's nav names pages that do not exist: {sorted(nav - on_disk)}"
