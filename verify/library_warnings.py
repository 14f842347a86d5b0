"""Library warnings (Python's `warnings`: FSDP2's "returned a view tensor", a user's model's;
and the libraries' WARNING log records: DTensor's sequential all-reduces, Dynamo's recompile
limit) tallied instead of printed: a rank issues the same few warnings every case, and a sweep
printed them hundreds of times around the table a user came for.

Each rank tallies what it issues (`collecting`, for the life of the rank process) and sends the
tally with its reply; the pool hands it to the command's tally where a command collects (sweep,
fuzz, selftest: `report.json`'s `warnings`, each once with its count, and one terminal line), and
otherwise issues each once again in this process, where Python's filters and pytest's warning
summary see it. A warning is one (category, message, location); its count is how many times it
was issued (the "default" action's once-per-place becomes every time while collecting, so the
count is true). Filters that ignore a warning or turn it into an error act as before. Anything
not a warning (an error, a crash's stack, a C++ library's own lines) still reaches stderr."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

Key = tuple[str, str, str]  # (category, message, location)
LOG = "log:"  # the category of a logging record: "log:torch.distributed.tensor._redistribute"

# Actions that show a warning once per place; counted every time while collecting.
_ONCE_ACTIONS = ("default", "module", "once")


class Tally:
    """Warnings by (category, message, location), with how many times each was issued."""

    def __init__(self) -> None:
        self.counts: dict[Key, int] = {}

    def add(self, key: Key, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def merge(self, entries: list[dict[str, Any]]) -> None:
        for e in entries:
            self.add((e["category"], e["message"], e["location"]), int(e["count"]))

    def entries(self) -> list[dict[str, Any]]:
        """The report's `warnings`: the most issued first."""
        ordered = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return [{"category": c, "message": m, "location": loc, "count": n} for (c, m, loc), n in ordered]

    def drain(self) -> list[dict[str, Any]]:
        """The entries so far, and an empty tally (a rank sends what it issued since its last reply)."""
        out = self.entries()
        self.counts.clear()
        return out

    def line(self, where: str | None = "report.json") -> str | None:
        return warnings_line(self.entries(), where)


def warnings_line(entries: list[dict[str, Any]] | None, where: str | None = "report.json") -> str | None:
    """The terminal's one line for a report's `warnings` ("316 library warnings (4 distinct): see
    report.json"; `where` None: no report written), or None when there was none."""
    if not entries:
        return None
    n = sum(e["count"] for e in entries)
    see = f"see {where}" if where else "--out DIR lists them in its report.json"
    return f"{n} library warning{'' if n == 1 else 's'} ({len(entries)} distinct): {see}"


_ACTIVE: list[Tally] = []  # the tallies of the `collecting` blocks open in this process, innermost last


def active() -> Tally | None:
    """The tally warnings go to now, or None (outside `collecting`)."""
    return _ACTIVE[-1] if _ACTIVE else None


def category_name(category: type) -> str:
    return category.__name__ if category.__module__ == "builtins" else f"{category.__module__}.{category.__qualname__}"


def location(filename: str, lineno: int) -> str:
    """file:line, a package's file from its package folder (the same torch file in two venvs reads alike)."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            filename = filename.rsplit(marker, 1)[1]
            break
    return f"{filename}:{lineno}"


@contextlib.contextmanager
def collecting(tally: Tally | None = None) -> Iterator[Tally]:
    """Warnings issued in this block tallied into `tally` (a new one by default), not printed:
    Python's `warnings`, and the WARNING-level records of the libraries' loggers (DTensor's
    "2 sequential all_reduce operations", Dynamo's recompile limit: torch says those through
    `logging`), category `log:<logger>`; an ERROR record, or worse, is printed as ever."""
    tally = tally if tally is not None else Tally()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        tally.add((category_name(category), str(message), location(filename, lineno)))

    saved_default = warnings.defaultaction
    with warnings.catch_warnings(), _log_warnings(tally):
        warnings.filters[:] = [(_always(f[0]), *f[1:]) for f in warnings.filters]
        warnings.defaultaction = _always(saved_default)
        warnings.showwarning = show
        _registries_forget()
        _ACTIVE.append(tally)
        try:
            yield tally
        finally:
            _ACTIVE.remove(tally)
            warnings.defaultaction = saved_default
    _registries_forget()


def _registries_forget() -> None:
    """The once-per-place registries forget what they saw (as changing the filters makes them)."""
    forget = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if forget is not None:
        with contextlib.suppress(Exception):
            forget()


class _LogWarnings(logging.Filter):
    """On every handler while collecting: a WARNING record tallied and not emitted; others pass."""

    def __init__(self, tally: Tally):
        super().__init__()
        self.tally = tally

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.name.startswith("fsdp_verify"):
            return True
        if not getattr(record, "_fsdp_verify_tallied", False):  # once, however many handlers it reaches
            record._fsdp_verify_tallied = True
            self.tally.add((f"{LOG}{record.name}", record.getMessage(), location(record.pathname, record.lineno)))
        return False


@contextlib.contextmanager
def _log_warnings(tally: Tally) -> Iterator[None]:
    """`_LogWarnings` on the handlers that exist now (every logger's, the root's, and the one
    Python uses where a logger has none), taken off again after."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    handlers = {id(h): h for lg in loggers for h in lg.handlers}
    if logging.lastResort is not None:
        handlers[id(logging.lastResort)] = logging.lastResort
    only = _LogWarnings(tally)
    for h in handlers.values():
        h.addFilter(only)
    try:
        yield
    finally:
        for h in handlers.values():
            h.removeFilter(only)


def _always(action: str) -> str:
    return "always" if action in _ONCE_ACTIONS else action


def received(entries: list[dict[str, Any]], registry: dict) -> None:
    """A rank's warnings in this process: into the collecting tally, or, outside one, each issued
    once again here (`registry`: the pool's, so that each is shown once per pool as Python shows
    a warning once per place)."""
    if not entries:
        return
    tally = active()
    if tally is not None:
        tally.merge(entries)
        return
    for e in entries:
        if e["category"].startswith(LOG):  # a log record: logged here, once per pool
            key = (e["category"], e["message"], e["location"])
            if key not in registry:
                registry[key] = True
                logging.getLogger(e["category"].removeprefix(LOG)).warning("%s", e["message"])
            continue
        filename, _, lineno = e["location"].rpartition(":")
        category, line = _category(e["category"]), int(lineno) if lineno.isdigit() else 0
        try:
            warnings.warn_explicit(e["message"], category, filename, line, module="fsdp_verify.rank", registry=registry)
        except Warning:  # an "error" filter here: the rank ran on, so this is said, not raised mid-reply
            sys.stderr.write(warnings.formatwarning(e["message"], category, filename, line))


def _category(name: str) -> type[Warning]:
    """The warning class named (UserWarning where it cannot be imported here)."""
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module or "builtins"), attr)
    except (ImportError, AttributeError, ValueError):
        return UserWarning
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
