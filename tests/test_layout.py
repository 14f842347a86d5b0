"""The package's shape: one import namespace, layers without import cycles, every subpackage
listed for the wheel, and the layout page (docs/layout.md) true to the tree."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import tomllib

from fsdp_verify import launch

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> the import name it installs as (pyproject.toml's package-dir).
FOLDERS = {"verify": "fsdp_verify", "reference": "fsdp_verify.reference", "properties": "fsdp_verify.properties"}


def _modules() -> dict[str, Path]:
    """Every module the package installs, by import name."""
    out = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Modules of the package that `path` imports anywhere (top level, functions, TYPE_CHECKING
    excepted): a lazy import inside a function still ties the two modules together."""
    tree = ast.parse(path.read_text())
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded |= {id(n) for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "fsdp_verify"}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_every_module_imports():
    for name in _modules():
        importlib.import_module(name)


def test_no_generic_top_level_names():
    """Installed, the package is `fsdp_verify` alone: from outside the checkout, `verify`,
    `reference` and `properties` are not ours (another project's, or nothing)."""
    code = (
        "import importlib.util, fsdp_verify\n"
        "for n in ('verify', 'reference', 'properties'):\n"
        "    s = importlib.util.find_spec(n)\n"
        f"    assert s is None or not (s.origin or '').startswith({str(ROOT)!r} + '/' + n), (n, s.origin)\n"
        "print(fsdp_verify.__file__)\n"
    )
    out = launch.run([sys.executable, "-c", code], cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(ROOT / "verify" / "__init__.py")


def test_every_subpackage_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert listed == packages


def test_layout_page_matches_the_tree():
    """Every folder the layout page names exists, and every subpackage is named."""
    section = (ROOT / "docs" / "layout.md").read_text()
    named = set(re.findall(r"`((?:verify|reference|properties)/[\w/]*?)/?`", section))
    for folder in named:
        assert (ROOT / folder).exists(), folder
    subpackages = {
        str(p.parent.relative_to(ROOT))
        for f in FOLDERS
        for p in (ROOT / f).rglob("__init__.py")
        if p.parent != ROOT / f
    }
    missing = sorted(s for s in subpackages if s not in named and not any(s.startswith(n + "/") for n in named))
    assert not missing, f"subpackages docs/layout.md does not name: {missing}"


def test_python_m_and_console_script():
    for cmd in (
        [sys.executable, "-m", "fsdp_verify", "--help"],
        [str(Path(sys.executable).parent / "fsdp-verify"), "--help"],
    ):
        out = launch.run(cmd, cwd="/", timeout=60)
        assert out.returncode == 0 and "check" in out.stdout, out.stderr
