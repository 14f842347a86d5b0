"""Hypothesis strategies that generate Cases (`strategies`), the named properties a Case must
satisfy (`properties`, `rerun`), running them outside pytest (`search`) and the shared Hypothesis
profiles (`profiles`).

Names are imported on first use, so `fsdp_verify.properties.profiles` (which the pytest plugin
reads while pytest parses its options) costs no torch import.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PROPERTIES": "fsdp_verify.properties.properties",
    "sharded_equals_reference": "fsdp_verify.properties.properties",
    "PropertyFailed": "fsdp_verify.properties.failure",
    "rerun_property": "fsdp_verify.properties.rerun",
    "cases": "fsdp_verify.properties.strategies",
    "models": "fsdp_verify.properties.strategies",
    "wrap_plans": "fsdp_verify.properties.strategies",
    "precision_specs": "fsdp_verify.properties.strategies",
    "optim_specs": "fsdp_verify.properties.strategies",
    "data_specs": "fsdp_verify.properties.strategies",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
