"""Objects a Case names by import path (`pkg.module:NAME` or `path/to/file.py:NAME`): a user's
model factory, init, output, data or loss function. Loaded the same way in this process and on
every rank, so a Case file replays the user's code, not a copy of it."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from fsdp_verify.validation import CaseError


def load_object(path: str, field: str, callable_only: bool = True) -> Any:
    """The callable `path` names (any object, with `callable_only=False`: a tensor-parallel plan
    may be a dict). A module that does not import, or a name it lacks, is a CaseError naming
    `field` (exit code 2; `repro` turns it into 125)."""
    if not isinstance(path, str) or ":" not in path:
        raise CaseError(field, "'pkg.module:NAME' or 'path/to/file.py:NAME'", path)
    where, attr = path.rsplit(":", 1)
    try:
        module = import_where(where)
    except Exception as e:
        hint = ""
        if isinstance(e, ModuleNotFoundError) and Path(where.replace(".", "/") + ".py").is_file():
            # `fsdp-verify` (a console script) does not put the current directory on sys.path
            # as `python -m` does: the file's path always works.
            hint = f"; as a file here: {where.replace('.', '/')}.py:{attr}"
        raise CaseError(field, f"an importable module ({where!r} raised {type(e).__name__}: {e}{hint})", path) from e
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None or (callable_only and not callable(obj)):
        raise CaseError(field, f"a {'callable named' if callable_only else 'name'} {attr!r} in {where!r}", path)
    return obj


def import_where(where: str):
    """The module `where` names: a dotted module path, or a file (`path/to/file.py`) loaded once
    under a name derived from its absolute path (engines and users' code alike)."""
    return _load_file(where) if where.endswith(".py") else importlib.import_module(where)


def _load_file(path: str):
    file = Path(path).resolve()
    if not file.is_file():
        relative = (
            "" if Path(path).is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        )
        raise FileNotFoundError(f"no such file: {file}{relative}")
    mod_name = "fsdp_verify_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:10]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    # As `python path/to/file.py` does, the file's folder is importable: a step or model file can
    # import the module beside it. Appended, so that it never shadows an installed package.
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module
