"""Hypothesis strategies that generate Cases, and the named properties a Case must satisfy."""

from properties.properties import PROPERTIES, PropertyFailed, sharded_equals_reference
from properties.strategies import cases, data_specs, models, optim_specs, precision_specs, wrap_plans

__all__ = [
    "PROPERTIES",
    "PropertyFailed",
    "sharded_equals_reference",
    "cases",
    "models",
    "wrap_plans",
    "precision_specs",
    "optim_specs",
    "data_specs",
]

# Properties that live in their own modules register here, so PROPERTIES lists them all.
from properties.rerun import rerun_property  # noqa: E402

PROPERTIES.setdefault("rerun-is-bitwise-identical", rerun_property)
