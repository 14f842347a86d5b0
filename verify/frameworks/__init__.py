"""The frameworks people train with, their own FSDP2 code run as a user's engine (docs/frameworks/).

`--framework NAME --model MODEL:FLAVOR` is a shorthand on the command line: it stands for the case
fields a framework's run has (its model factory and kwargs, its engine, its units as its own code
builds them, its loss and gradient reduction, its precision policy), which the case then holds as
any case does, so a case file or a repro needs no framework to replay. Flags given beside it
(world size, mesh, dtypes, steps) apply on top.
"""

from __future__ import annotations

import importlib
from typing import Any

from fsdp_verify.validation import CaseError

# Each framework's module here (torchtitan.py, ...), with how to install the release it was run
# with beside the toolkit: torchtitan and verl without their declared dependencies (their training
# stacks'; docs/frameworks/), what their FSDP2 code imports coming from the toolkit's extras.
FRAMEWORKS = {
    "torchtitan": "pip install 'fsdp-verify[torchtitan]' && pip install --no-deps torchtitan==0.3.0",
    "accelerate": "pip install 'fsdp-verify[accelerate,hf]'",
    "verl": "pip install 'fsdp-verify[hf]' && pip install --no-deps verl==0.9.1",
}


def preset(
    framework: str,
    model: str | None,
    kwargs: dict[str, Any] | None = None,
    seq_len: int | None = None,
    tp: bool = False,
    pp: bool = False,
) -> dict[str, Any]:
    """The case fields `--framework framework --model model` stand for (field path -> value);
    without `model`, the framework's default (torchtitan's llama3:debugmodel, the tiny Llama).
    `tp`, `pp`: a degree above 1 is asked for (the framework's fields of that dimension are added:
    its `TP_FIELDS`, `PP_FIELDS`)."""
    if framework not in FRAMEWORKS:
        raise CaseError("--framework", f"one of {list(FRAMEWORKS)}", framework)
    module = importlib.import_module(f"fsdp_verify.frameworks.{framework}")
    fields = module.preset(model or module.DEFAULT_MODEL, kwargs or {}, seq_len)
    for asked, extra in ((tp, "TP_FIELDS"), (pp, "PP_FIELDS")):
        if asked:
            fields = {**fields, **getattr(module, extra, {})}
    return fields
