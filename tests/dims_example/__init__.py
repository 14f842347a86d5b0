"""A dimension package written outside the toolkit, as the registry's proof (verify/dims/registry.py):
everything of it here, registered by one line (FSDP_VERIFY_DIMS=tests.dims_example, the way a user's
own package registers; the toolkit's own are listed in verify/dims/registered.py), no file of the
toolkit edited. It scales every floating-point parameter by `factor` before sharding, on the ranks
and in the reference alike (a stand-in for a conversion such as float8's); `mutants.wrong_factor`
scales the ranks' model otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_verify.commands.flag import Flag, number, or_none
from fsdp_verify.dims.registry import DimensionPackage
from fsdp_verify.dims.together import NotModelled
from fsdp_verify.validation import check


@dataclass(frozen=True)
class ScaleSpec:
    factor: float | None = None  # off

    def validate(self, prefix: str = "dims.scale_init") -> None:
        ok = self.factor is None or (isinstance(self.factor, (int, float)) and self.factor > 0)
        check(ok, f"{prefix}.factor", "null or a positive number", self.factor)


def _scale(model: torch.nn.Module, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


def convert(model, mesh, spec: ScaleSpec, case) -> None:
    _scale(model, spec.factor)


def convert_reference(model, spec: ScaleSpec, case) -> None:
    _scale(model, spec.factor)


PACKAGE = DimensionPackage(
    name="scale_init",
    what="a scaled initialisation",
    spec=ScaleSpec,
    applies="every parameter scaled before sharding: ShardSpec.convert",
    flags=(
        Flag(
            "--scale-init",
            "dims.scale_init.factor",
            "an example dimension",
            "scale every parameter by F",
            or_none(number),
            "F",
        ),
    ),
    not_modelled=(NotModelled("tp", 1, "tensor parallelism"),),
    runtime=__name__,
    mutants=__name__ + ".mutants",
)
