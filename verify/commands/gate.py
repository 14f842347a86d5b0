"""`fsdp-verify gate`: is a torch release safe for our sharded training? The same drawn cases (a
sweep seed, optionally the bug zoo, optionally your model or step) run under two or more torch
releases, each in its own cached virtual environment (verify/torch_envs.py), and `report diff`
says, record by record, what passes under one and fails under another.

The first environment is the baseline; each other one is diffed against it. Exit 0: nothing got
worse; 1: a case or zoo bug got worse under a later release; 2: bad input (a release that does not
install, an interpreter without fsdp-verify); 3: a run of some environment crashed."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from fsdp_verify.commands.options import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INFRA, EXIT_OK, engine_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--torch",
        nargs="+",
        default=[],
        metavar="VERSION",
        help="torch releases to gate, oldest (the baseline) first: 2.12.0 2.13.0; each in a cached venv",
    )
    p.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an interpreter of your own (with torch and fsdp-verify installed) as one more environment;"
        " listed after the --torch ones (repeatable)",
    )
    p.add_argument("--seed", type=int, default=0, help="the sweep's seed: every environment draws the same cases")
    p.add_argument("--cases", type=int, default=50, help="cases drawn per environment (default 50)")
    p.add_argument("--engine", type=engine_name, default="fsdp2", help="the engine under test (default fsdp2)")
    p.add_argument("--zoo", action="store_true", help="also run the bug zoo (selftest) in every environment")
    p.add_argument(
        "--sweep-args",
        default="",
        metavar="'ARGS'",
        help="more sweep options, quoted: '--model my/models.py:build --world-sizes 2 4'",
    )
    p.add_argument("--out", type=Path, required=True, help="folder: one report per environment, gate.json")
    p.add_argument("--cache", type=Path, help="where the environments live (default ~/.cache/fsdp-verify/torch-envs)")
    p.add_argument(
        "--project", help="what to install beside torch (default: this checkout, or this fsdp-verify release)"
    )
    p.add_argument(
        "--pip-args",
        default="",
        metavar="'ARGS'",
        help="more pip options for making an environment, quoted: '--index-url https://download.pytorch.org/whl/cpu'",
    )
    p.add_argument("--factor", type=float, default=2.0, help="a ratio moving by more than this is reported")


def _bad(message: str) -> int:
    print(f"fsdp-verify: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _environments(args):
    from fsdp_verify import torch_envs

    cache = args.cache or torch_envs.default_cache()
    project = [args.project] if args.project else torch_envs.project_requirement()
    pip_args = shlex.split(args.pip_args)
    envs = [torch_envs.ensure(v, cache, project, pip_args) for v in args.torch]
    envs += [torch_envs.given(spec) for spec in args.python]
    return envs


def _run_in(env, args, folder: Path) -> dict:
    """The zoo (optional) then the sweep under one environment; what it took and how it ended."""
    base = [str(env.python), "-m", "fsdp_verify"]
    row = {"name": env.name, "torch": env.torch, "python": str(env.python), "made_seconds": env.made_seconds}
    row["disk_bytes"] = env.disk_bytes()
    start = time.monotonic()
    sweep = [*base, "sweep", "--seed", str(args.seed), "--cases", str(args.cases), "--engine", args.engine]
    sweep += [*shlex.split(args.sweep_args), "--out", str(folder), "--no-progress"]
    if args.zoo:
        zoo_json = folder / "zoo.json"
        folder.mkdir(parents=True, exist_ok=True)
        # Each bug at its own world sizes: some show only on a (2, 2) mesh.
        # Its report (folder/zoo/report.json) keeps the mutants' library warnings; `report diff`
        # reads only the sweep's report.json beside it.
        zoo = subprocess.run([*base, "selftest", "--json", str(zoo_json), "--out", str(folder / "zoo")])
        row["zoo_exit"] = zoo.returncode
        if zoo_json.exists():
            sweep += ["--zoo", str(zoo_json)]
    done = subprocess.run(sweep)
    row["sweep_exit"] = done.returncode
    row["seconds"] = round(time.monotonic() - start, 1)
    report = folder / "report.json"
    if report.exists():
        data = json.loads(report.read_text())
        cases = data.get("cases") or []
        row["cases"] = len(cases)
        row["failed"] = sum(c.get("status") != "pass" for c in cases)
        row["zoo_caught"] = [z["bug"] for z in data.get("zoo") or [] if z.get("caught")]
        row["zoo_missed"] = [z["bug"] for z in data.get("zoo") or [] if not z.get("caught")]
    return row


def _table(rows: list[dict]) -> str:
    lines = ["| environment | torch | cases | failed | zoo caught | sweep exit | seconds | disk |", "|---" * 8 + "|"]
    for r in rows:
        disk = f"{r['disk_bytes'] / 2**30:.1f} GiB" if r.get("disk_bytes") else "-"
        zoo = f"{len(r.get('zoo_caught') or [])}/{len(r.get('zoo_caught') or []) + len(r.get('zoo_missed') or [])}"
        lines.append(
            f"| {r['name']} | {r['torch']} | {r.get('cases', '-')} | {r.get('failed', '-')} | "
            f"{zoo if 'zoo_exit' in r else '-'} | {r['sweep_exit']} | {r['seconds']} | {disk} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from fsdp_verify import torch_envs
    from fsdp_verify.reports.diff import diff, text

    if len(args.torch) + len(args.python) < 2:
        return _bad("gate: expected at least two environments (--torch A B, or --python NAME=PATH)")
    try:
        shlex.split(args.sweep_args)  # a quoting error is bad input, before anything is made
        envs = _environments(args)
    except (ValueError, torch_envs.EnvironmentFailed) as e:
        return _bad(f"gate: {e}")
    names = [e.name for e in envs]
    if len(set(names)) != len(names):
        return _bad(f"gate: environment names must differ, got {names}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [_run_in(env, args, args.out / env.name) for env in envs]
    print(_table(rows))
    crashed = [r["name"] for r in rows if r["sweep_exit"] not in (EXIT_OK, EXIT_DIVERGED)]
    diffs = {}
    for env in envs[1:]:
        if {envs[0].name, env.name} & set(crashed):
            continue
        result = diff(args.out / envs[0].name, args.out / env.name, args.factor)
        diffs[env.name] = result
        print(f"\n== {envs[0].name} -> {env.name} ==\n{text(result)}")
    summary = {"schema": "fsdp-verify/gate/1", "baseline": envs[0].name, "environments": rows, "diffs": diffs}
    (args.out / "gate.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"\nGate: {args.out / 'gate.json'}")
    if crashed:
        print(f"fsdp-verify: gate: the sweep did not finish under {', '.join(crashed)}", file=sys.stderr)
        return EXIT_INFRA
    return EXIT_DIVERGED if any(d["worse"] for d in diffs.values()) else EXIT_OK
