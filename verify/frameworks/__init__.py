"""The frameworks people train with, their own FSDP2 code run as a user's engine (docs/frameworks/).

`--framework NAME --model MODEL:FLAVOR` is a shorthand on the command line: it stands for the case
fields a framework's run has (its model factory and kwargs, its engine, its units as its own code
builds them, its loss and gradient reduction, its precision policy), which the case then holds as
any case does, so a case file or a repro needs no framework to replay. Flags given beside it
(world size, mesh, dtypes, steps) apply on top.
"""

from __future__ import annotations

from typing import Any

from fsdp_verify.validation import CaseError

FRAMEWORKS = ("torchtitan", "accelerate")


def preset(
    framework: str, model: str | None, kwargs: dict[str, Any] | None = None, seq_len: int | None = None
) -> dict[str, Any]:
    """The case fields `--framework framework --model model` stands for (field path -> value)."""
    if framework not in FRAMEWORKS:
        raise CaseError("--framework", f"one of {list(FRAMEWORKS)}", framework)
    if framework == "accelerate":
        from fsdp_verify.frameworks import accelerate

        return accelerate.preset(model, kwargs or {}, seq_len)
    from fsdp_verify.frameworks import torchtitan

    return torchtitan.preset(model or "llama3:debugmodel", kwargs or {}, seq_len)
