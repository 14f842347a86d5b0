"""Which code a case file may run. A Case file is data that travels (nightly artifacts, repros on
bug reports, `git bisect run` replays), yet it names code by import string (a model factory called
with the file's own kwargs, a step, a data or loss function, an engine): loading it imports and
calls that code. As `transformers` runs a model's own code only with `trust_remote_code=True`, a
case read from a file names only code allowed here, checked before anything is imported:

- the toolkit's own callables (`fsdp_verify.zoo.mutants:NAME`, `fsdp_verify.models.hf:tiny_llama`;
  built-in models and engines by short name name no code at all);
- what the command line of this invocation typed (`--model mymodel.py:make`, `--engine e.py:shard`);
- everything, with `--trust-code` or `FSDP_VERIFY_TRUST_CODE=1` (unattended runs);
- the `trusted` patterns of the nearest pyproject.toml (from the current directory upward):
  `[tool.fsdp-verify] trusted = ["mypkg.*", "models/*.py"]`, module patterns against the dotted
  module (fnmatch), file patterns against the file's path relative to the pyproject's folder.

Anything else is refused as bad input (CaseError: exit 2; 125 under `repro`), naming every
refused field, its import string, and the three ways to allow it.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdp_verify.validation import CaseError

ENV = "FSDP_VERIFY_TRUST_CODE"
TOOLKIT = "fsdp_verify"
# The one field whose callable gets the case file's own arguments (model.kwargs): a toolkit
# callable there must be one of the toolkit's models. Anywhere else a toolkit function is called
# with tensors, modules or the Case, never with a string the file chose; as a factory, one that
# imports by name (`fsdp_verify.engines:resolve_engine` with `{"name": "evil.py:x"}`) would not be.
# torchtitan's model factory is one too: its kwargs are a flavor looked up in torchtitan's registry,
# layer and sequence counts and an attention choice ("sdpa" | "flex"), none of them imported.
TOOLKIT_FACTORIES = ("fsdp_verify.models", "fsdp_verify.frameworks.torchtitan")
_NOT_CODE = ("model.kwargs",)  # JSON values handed to the factory, never imported


class UntrustedCode(CaseError):
    """A case file names code nobody allowed: bad input, raised before any of it is imported."""

    def __init__(self, source: str, refused: list[tuple[str, str]], allow_line: str):
        self.field_path = refused[0][0]
        self.refused = refused
        names = "\n".join(f"  {field}: {name!r}" for field, name in refused)
        ValueError.__init__(
            self,
            f"{refused[0][0]}: {source} names code it would import and run, refused (a case file is data;"
            f" it runs only code you allow):\n{names}\n"
            f"Allow it if you trust the file: add --trust-code, set {ENV}=1, or list it in your project's"
            f" pyproject.toml:\n{allow_line}",
        )


def add_trust_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-code",
        action="store_true",
        help=f"run the code a case file names (model factory, step, data, loss, engine); without it only"
        f" the toolkit's own, what this command line names, and pyproject.toml's [tool.fsdp-verify] trusted"
        f" patterns ({ENV}=1 does the same)",
    )


def typed(args: argparse.Namespace) -> set[str]:
    """Every string this command line holds: what the user typed is the user's own choice."""
    out: set[str] = set()
    for value in vars(args).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        out.update(v for v in values if isinstance(v, str))
    return out


def code_names(data: Any, path: str = "") -> list[tuple[str, str]]:
    """(field, import string) for every string of a raw case that names code (`module:NAME` or
    `file.py:NAME`), whatever field holds it, so a field added later is covered too."""
    from fsdp_verify.models.spec import is_import_path

    if path in _NOT_CODE:
        return []
    if isinstance(data, dict):
        return [hit for k, v in data.items() for hit in code_names(v, f"{path}.{k}" if path else str(k))]
    if isinstance(data, list):
        return [hit for i, v in enumerate(data) for hit in code_names(v, f"{path}[{i}]")]
    return [(path, data)] if is_import_path(data) else []


def refuse_untrusted(data: Any, source: str | Path, trust_code: bool = False, allowed: Iterable[str] = ()) -> None:
    """Raise UntrustedCode unless every import string of the raw case `data` (read from
    `source`) is allowed. Imports nothing but toolkit modules."""
    from fsdp_verify.models.spec import is_import_path

    if trust_code or env_trusts():
        return
    names = code_names(data)
    if not names:
        return
    typed_keys = {_key(a) for a in allowed if is_import_path(a)}
    project = pyproject()
    patterns = trusted_patterns(project)
    refused = [
        (field, name)
        for field, name in names
        if not (_key(name) in typed_keys or is_toolkit(field, name) or _matches(name, patterns, project))
    ]
    if refused:
        raise UntrustedCode(str(source), refused, _allow_line(refused, project))


def env_trusts() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_toolkit(field: str, name: str) -> bool:
    """`fsdp_verify.MODULE:NAME` whose object that module (or, for a package, one of its own
    submodules: the zoo's mutants) defines, not one it imported, as `subprocess.run` or
    `import_where`, nor reached through attributes; a model factory only among the toolkit's
    models."""
    where, attr = name.rsplit(":", 1)
    if where.endswith(".py") or not (where == TOOLKIT or where.startswith(TOOLKIT + ".")) or not attr.isidentifier():
        return False
    if field == "model.factory" and not any(where == f or where.startswith(f + ".") for f in TOOLKIT_FACTORIES):
        return False
    try:  # a toolkit module runs only the toolkit's code; one that does not import names nothing
        obj = getattr(importlib.import_module(where), attr, None)
    except Exception:
        return True  # load_object then reports it as not importable, naming the field
    module = getattr(obj, "__module__", None) or ""
    return obj is None or module == where or module.startswith(where + ".")


def pyproject(start: Path | None = None) -> Path | None:
    """The nearest pyproject.toml from the current directory upward."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder / "pyproject.toml"
    return None


def trusted_patterns(project: Path | None) -> list[str]:
    """`[tool.fsdp-verify] trusted` of `project` ([] without one). A value that is not a list of
    strings is bad input naming the key."""
    if project is None:
        return []
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli, a dependency there (pyproject.toml)
        import tomli as tomllib
    try:
        config = tomllib.loads(project.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []  # not ours to judge; nothing in it is trusted
    value = config.get("tool", {}).get("fsdp-verify", {}).get("trusted", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise CaseError(f"{project} [tool.fsdp-verify] trusted", "a list of module or file patterns", value)
    return value


def _is_file_pattern(pattern: str) -> bool:
    return pattern.endswith(".py") or "/" in pattern


def _matches(name: str, patterns: list[str], project: Path | None) -> bool:
    where = name.rsplit(":", 1)[0]
    if where.endswith(".py"):
        relative = _relative(where, project.parent) if project is not None else None
        return relative is not None and any(fnmatch.fnmatchcase(relative, p) for p in patterns if _is_file_pattern(p))
    return any(
        fnmatch.fnmatchcase(where, p) or (p.endswith(".*") and where == p[:-2])
        for p in patterns
        if not _is_file_pattern(p)
    )


def _relative(where: str, folder: Path) -> str | None:
    """A file's path (read from the current directory, as the import reads it) relative to
    `folder`, or None outside it."""
    try:
        return Path(where).resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        return None


def _key(name: str) -> tuple[str, str]:
    """One spelling per import string: a file by its absolute path (`./m.py:f` is `m.py:f`)."""
    where, attr = name.rsplit(":", 1)
    return (str(Path(where).resolve()) if where.endswith(".py") else where), attr


def _allow_line(refused: list[tuple[str, str]], project: Path | None) -> str:
    """The pyproject.toml lines that would allow `refused` (a file outside its folder cannot be
    listed: --trust-code then)."""
    root = project.parent if project is not None else Path.cwd()
    entries: list[str] = []
    outside = False
    for _, name in refused:
        where = name.rsplit(":", 1)[0]
        entry = _relative(where, root) if where.endswith(".py") else where
        outside = outside or entry is None
        if entry is not None and entry not in entries:
            entries.append(entry)
    at = str(project) if project is not None else f"{root / 'pyproject.toml'}, your project's root"
    note = "; a file outside its folder needs --trust-code" if outside else ""
    listed = ", ".join(f'"{e}"' for e in entries)
    return f"  [tool.fsdp-verify]  # in {at}{note}\n  trusted = [{listed}]"
