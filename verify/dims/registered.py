"""The registered dimension packages (verify/dims/registry.py), one line each: adding a dimension
is its package and its line here."""

PACKAGES = ("fsdp_verify.dims.float8",)
