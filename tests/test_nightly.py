"""The nightly's wiring: the GitHub Actions workflow (N sweep shards on a runner label given as an
input, the zoo, one merge-and-diff job) and .ci/nightly (a dated folder, diffed with the previous
night, the trend page) call the commands as they are spelled today."""

import re
import shlex
from pathlib import Path

import yaml

from fsdp_verify.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "nightly.yml"


def _workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def _commands(text: str) -> list[list[str]]:
    """fsdp-verify invocations in shell text, with ${{ }} and $VAR values made concrete."""
    text = re.sub(r"\$\{\{[^}]*matrix.shard[^}]*\}\}", "1", text)
    text = re.sub(r"\$\{\{[^}]*\}\}", "x", text).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if "fsdp-verify " not in line:
            continue
        words = shlex.split(line.split("fsdp-verify ", 1)[1].split("||")[0].split(";")[0])
        out.append([re.sub(r"\$\{?(\w+)\}?", lambda m: {"SHARDS": "4"}.get(m.group(1), "7"), w) for w in words])
    return out


def test_the_workflow_shards_the_sweep_and_merges_and_diffs():
    wf = _workflow()
    inputs = wf["on"]["workflow_dispatch"]["inputs"]
    assert {"runner", "cases", "shards"} <= set(inputs) and "schedule" in wf["on"]
    jobs = wf["jobs"]
    sweep = jobs["sweep"]
    assert "inputs.runner" in sweep["runs-on"] and "inputs.runner" in jobs["zoo"]["runs-on"]
    shards = sweep["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, int(inputs["shards"]["default"]) + 1))
    assert sweep["strategy"]["fail-fast"] is False  # one shard's alarm must not cancel the others
    run = "\n".join(s.get("run", "") for s in sweep["steps"])
    assert '--shard "${{ matrix.shard }}/$SHARDS"' in run and "--seed" in run
    merge = jobs["merge-and-diff"]
    assert set(merge["needs"]) == {"sweep", "zoo"} and merge["if"] == "always()"
    text = "\n".join(s.get("run", "") for s in merge["steps"])
    assert "report merge" in text and "report diff" in text and "report trend" in text


def test_every_fsdp_verify_command_in_the_nightly_parses():
    """The workflow and .ci/nightly call commands and options that exist."""
    parser = build_parser()
    texts = [s.get("run", "") for job in _workflow()["jobs"].values() for s in job["steps"]]
    texts.append((ROOT / ".ci" / "nightly").read_text())
    commands = [c for t in texts for c in _commands(t)]
    assert {c[0] for c in commands} >= {"sweep", "selftest", "report", "fuzz"}
    for words in commands:
        parser.parse_args(words)  # exits 2 (SystemExit) on an unknown option


def test_the_nightly_script_writes_a_dated_folder_diffs_and_draws_the_trend():
    text = (ROOT / ".ci" / "nightly").read_text()
    assert "date -u +%Y-%m-%d" in text and "bench/sweep.py" not in text
    assert re.search(r"report diff \"\$previous\" \"\$OUT\"", text)
    assert "report trend" in text
