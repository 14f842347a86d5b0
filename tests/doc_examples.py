"""Documentation that runs: the command blocks of README.md and docs/*.md that show output, read,
run and compared (tests/test_docs.py). The convention, as docs/contributing.md states it:

- A block fenced ```console is a transcript: a line starting with `$ ` is a command (a line ending
  in `\\` continues on the next), the lines after it up to the next `$ ` are its output.
- `$ echo $?` is not run: its output line is the exit code the previous command must return.
  A command not followed by one must exit 0.
- Output is compared line by line with runs of spaces counted as one (a table's column widths may
  change, its cells may not). `...` inside a line matches any text (timings, paths, hashes that
  depend on the machine). A line that is only `...` stands for any number of lines. The shown
  lines between two such lines must appear in the output consecutively and in that order; the
  output may hold more lines before the first shown line and after the last.
- An HTML comment `<!-- docs-test: nightly -->` on the line before the fence marks a block that
  runs only in the nightly (`pytest -m slow`).
- Any fenced block with a `$ ` line must be a console block: output that is only illustrative
  goes in a ```text block without a prompt.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_verify import launch
from tests.in_process import IN_SHELL, run_cli

ROOT = Path(__file__).resolve().parents[1]
NIGHTLY = "<!-- docs-test: nightly -->"
ELLIPSIS = "..."
EXIT_QUERY = "echo $?"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/frameworks/ too


@dataclass
class Command:
    line: str  # the command as typed, continuation lines joined
    expected: list[str] = field(default_factory=list)  # the output lines shown under it
    exit_code: int = 0  # from a following `$ echo $?`


@dataclass
class Block:
    path: Path
    lineno: int  # 1-based line of the opening fence
    nightly: bool
    commands: list[Command]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.lineno}"


def fences(text: str) -> list[tuple[int, str, list[str]]]:
    """(line of the opening fence, info string, body lines) of every fenced block."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append((i + 1, info.strip(), body))
        i = j + 1
    return out


def parse_console(body: list[str]) -> list[Command]:
    commands: list[Command] = []
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith("$ "):
            typed = line[2:]
            while typed.endswith("\\") and i + 1 < len(body):
                i += 1
                typed = typed[:-1].rstrip() + " " + body[i].strip()
            if typed.strip() == EXIT_QUERY:
                if not commands:
                    raise ValueError("`$ echo $?` with no command before it")
                shown = [ln for ln in body[i + 1 :] if ln.strip()][:1]
                if not shown or not shown[0].strip().isdigit():
                    raise ValueError("`$ echo $?` must be followed by the exit code")
                commands[-1].exit_code = int(shown[0])
                i += 1
                while i < len(body) and not body[i].strip():
                    i += 1
                i += 1  # the exit code line
                continue
            commands.append(Command(typed.strip()))
        elif commands:
            commands[-1].expected.append(line)
        elif line.strip():
            raise ValueError(f"output before any `$ ` command: {line!r}")
        i += 1
    return commands


def blocks(paths: list[Path] | None = None) -> list[Block]:
    """Every console block of the documentation."""
    out = []
    for path in paths or doc_files():
        text = path.read_text()
        lines = text.split("\n")
        for lineno, info, body in fences(text):
            if info.split()[:1] != ["console"]:
                continue
            nightly = lineno >= 2 and lines[lineno - 2].strip() == NIGHTLY
            out.append(Block(path, lineno, nightly, parse_console(body)))
    return out


def _normal(line: str) -> str:
    return " ".join(line.split())


def _pattern(line: str) -> re.Pattern:
    parts = [re.escape(p) for p in _normal(line).split(ELLIPSIS)]
    return re.compile("^" + ".*".join(parts) + "$")


def mismatch(expected: list[str], actual: str) -> str | None:
    """None if `actual` shows the `expected` lines as the convention says, else what is missing."""
    shown = [ln for ln in expected if ln.strip()]
    chunks: list[list[str]] = [[]]
    for ln in shown:
        if ln.strip() == ELLIPSIS:
            chunks.append([])
        else:
            chunks[-1].append(ln)
    got = [_normal(ln) for ln in actual.split("\n") if ln.strip()]
    at = 0
    for chunk in (c for c in chunks if c):
        patterns = [_pattern(ln) for ln in chunk]
        for start in range(at, len(got) - len(chunk) + 1):
            if all(p.match(got[start + k]) for k, p in enumerate(patterns)):
                at = start + len(chunk)
                break
        else:
            first = next((ln for k, ln in enumerate(chunk) if not any(patterns[k].match(g) for g in got[at:])), None)
            where = f"no output line matches {first.strip()!r}" if first else "these lines are not consecutive"
            return f"{where}; expected, in order:\n  " + "\n  ".join(ln.strip() for ln in chunk)
    return None


@dataclass
class Ran:
    """What one command of a block did."""

    command: Command
    returncode: int
    output: str  # stdout and stderr, interleaved as printed


def execute(block: Block, cwd: Path, timeout: float = 1800) -> list[Ran]:
    """Runs a block's commands in order in `cwd` (files one writes are there for the next)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("COLUMNS", "120")
    ran = []
    for command in block.commands:
        args = plain_command(command.line)
        if args is not None and not IN_SHELL:
            proc = run_cli(args, cwd=cwd, env=env, merge_stderr=True)
        else:
            proc = launch.run(["bash", "-c", command.line], cwd=cwd, env=env, timeout=timeout, merge_stderr=True)
        ran.append(Ran(command, proc.returncode, proc.stdout))
    return ran


def plain_command(line: str) -> list[str] | None:
    """The arguments of `fsdp-verify ARGS` with nothing for a shell to do (no pipe, redirection,
    variable or second command): such a command runs in this process (tests/in_process.py)."""
    if any(c in line for c in "|&;<>$`*?(){}~") or "\\" in line:
        return None
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    return words[1:] if words[:1] == ["fsdp-verify"] else None


def judge(block: Block, ran: list[Ran]) -> list[str]:
    """What the documentation says that the run did not do, one message per command, each naming
    the block and the command; empty when the block is true."""
    failures = []
    for command, result in zip(block.commands, ran, strict=True):
        problems = []
        if result.returncode != command.exit_code:
            problems.append(f"exit code {result.returncode}, the documentation says {command.exit_code}")
        if (found := mismatch(command.expected, result.output)) is not None:
            problems.append(found)
        if problems:
            tail = "\n    ".join(result.output.rstrip().split("\n")[-40:])
            failures.append(f"{block.name}: $ {command.line}\n" + "\n".join(problems) + f"\n  output:\n    {tail}")
    return failures


def run_block(block: Block, cwd: Path) -> list[str]:
    """Runs a block and judges it: the failures, empty when the block is true."""
    return judge(block, execute(block, cwd))


def workdir(tmp: Path) -> Path:
    """A scratch folder where the documentation's relative paths (examples/, tests/) resolve to the
    repository's, so commands may write files without touching the checkout."""
    for name in ("examples", "tests"):
        (tmp / name).symlink_to(ROOT / name)
    return tmp
