"""fsdp-verify: differential testing of sharded data-parallel training against a single-device
reference. Data flow: Case -> reference trainer and rank pool + engine -> Traces -> comparators
-> Verdict."""

from verify.case import Case, CaseError, DataSpec, ModelSpec, OptimSpec, PrecisionSpec

__all__ = ["Case", "CaseError", "DataSpec", "ModelSpec", "OptimSpec", "PrecisionSpec"]
__version__ = "0.1.0"
