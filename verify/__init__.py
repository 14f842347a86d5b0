"""fsdp-verify: differential testing of sharded data-parallel training against a single-device
reference. Data flow: Case -> reference trainer | rank pool + engine -> Traces -> comparators and
checks -> Verdict -> reports. docs/layout.md says which folder holds what.

The public names below are imported on first use: installing the pytest plugin must not make
every pytest run in the environment import torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata

try:
    __version__ = importlib.metadata.version("fsdp-verify")
except importlib.metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Case": "fsdp_verify.case",
    "DataSpec": "fsdp_verify.case",
    "OptimSpec": "fsdp_verify.case",
    "PrecisionSpec": "fsdp_verify.case",
    "ModelSpec": "fsdp_verify.models",
    "CaseError": "fsdp_verify.validation",
    "Verdict": "fsdp_verify.verdict",
    "check_case": "fsdp_verify.runner",
    "ShardSpec": "fsdp_verify.engines",
    "EngineView": "fsdp_verify.engines.view",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
