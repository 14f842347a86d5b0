"""Float8's own check (verify/dims/float8/rounding.py): each float8 product of the reference held to
the rounding bound of its casts, against the same product in float64. A correct torchao passes it in
every recipe and dtype, every product watched; torchao patched in this process (the reference runs
here) with a scale from the wrong amax, or a dequantisation by the wrong scale, fails it, located to
the module, the product and the step. These are the bugs the differential verdict cannot see: the
reference computes the same float8 as the ranks."""

from __future__ import annotations

import pytest
import torch

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.dims.float8 import Float8Spec
from fsdp_verify.dims.float8.rounding import cast_error, check, product_bound
from tests.conftest import require

require("torchao")

MLP16 = ModelSpec(kind="mlp", widths=(16, 32, 48, 16))
LM = ModelSpec(kind="transformer", dim=32, ffn_hidden=48, vocab_size=40, n_layers=2, seq_len=4)


def _case(model: ModelSpec, recipe: str, dtype: str = "fp32", **changes) -> Case:
    case = Case(model=model, world_size=2, data=DataSpec(batch_size=8), steps=2, microbatches=2)
    case = case.with_(**{"dims.float8": Float8Spec(recipe), **changes})
    if dtype == "bf16":
        case = case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"})
    return case


@pytest.mark.parametrize(
    ("model", "recipe", "dtype"),
    [
        (MLP16, "tensorwise", "fp32"),
        (LM, "tensorwise", "bf16"),
        (LM, "rowwise", "bf16"),
        (MLP16, "rowwise_with_gw_hp", "fp32"),
    ],
)
def test_correct_float8_is_within_the_rounding_bound_of_its_casts(model, recipe, dtype):
    case = _case(model, recipe, dtype)
    (finding,) = check(case.dims.float8, case)
    assert finding.ok and finding.kind == "check", finding.message
    assert "within the rounding bound of its casts" in finding.message
    assert "the logits part from the same case without float8 by" in finding.message  # the drift, said
    # A proven bound, not a calibrated tolerance: a product of few terms (the weight's gradient
    # sums over 2 rows here) can come close to it, and never past it.
    worst = float(finding.message.split("the worst at ")[1].split(" ")[0])
    assert 0.05 < worst < 1, finding.message  # rounding happened, and the bound is not loose


def test_every_product_of_every_converted_module_is_watched():
    from fsdp_verify.dims.float8 import rounding
    from fsdp_verify.reference import train_reference

    case = _case(LM, "tensorwise", "bf16")
    with rounding.watching() as watch:
        train_reference(rounding.watched_case(case))
    seen = {(m.step, m.module, m.matmul) for m in watch.measured}
    modules = {m.module for m in watch.measured}
    assert len(modules) == 2 * 7  # q, k, v, o and three of the feed-forward per layer; the tied head is not converted
    for step in (1, 2):
        for module in modules:
            for matmul in ("forward", "grad_input", "grad_weight"):
                assert (step, module, matmul) in seen, (step, module, matmul)
    # each rank's micro-batch apart: 2 ranks x 2 micro-batches a step
    assert sum(1 for m in watch.measured if m.step == 1 and m.matmul == "forward") == 4 * len(modules)


def _amax_to_scale_four_times(monkeypatch):
    """A scale from the wrong amax: a quarter of the tensor's (its largest values saturate)."""
    from torchao.float8 import float8_utils

    original = float8_utils.amax_to_scale
    monkeypatch.setattr(float8_utils, "amax_to_scale", lambda amax, *a, **k: original(amax / 4, *a, **k))


def _dequantised_by_power_of_two(monkeypatch):
    """A dequantisation by the wrong scale: the products unscaled by the scales rounded to powers
    of two (the casts used the exact ones)."""
    from torchao.float8 import float8_ops

    original = float8_ops.addmm_float8_unwrapped

    def rounded(a_data, a_scale, b_data, b_scale, *args, **kwargs):
        two = lambda s: torch.exp2(torch.round(torch.log2(s)))  # noqa: E731
        return original(a_data, two(a_scale), b_data, two(b_scale), *args, **kwargs)

    monkeypatch.setattr(float8_ops, "addmm_float8_unwrapped", rounded)


@pytest.mark.parametrize("bug", [_amax_to_scale_four_times, _dequantised_by_power_of_two])
def test_a_float8_bug_both_sides_share_is_caught_and_located(monkeypatch, bug):
    case = _case(MLP16, "tensorwise")
    bug(monkeypatch)
    found = check(case.dims.float8, case)
    failed = [f for f in found if not f.ok]
    assert failed, [f.message for f in found]
    first = min(failed, key=lambda f: f.key)
    assert first.step == 1 and first.phase == "dims"
    assert first.name.startswith("float8.layers.") and first.name.split(".")[-1] in (
        "forward",
        "grad_input",
        "grad_weight",
    )
    assert first.ratio > 1 and "not the sharding's" in first.message
    assert "x the bound" in first.message


def test_the_cast_bound_holds_for_every_value_and_is_not_loose():
    """The elementwise cast bound against torch's own casts, over values spanning the normal and
    subnormal ranges of both formats: never exceeded, and reached to within 2x by some value."""
    from torchao.float8.config import CastConfig

    torch.manual_seed(0)
    t = torch.randn(4096, dtype=torch.float64) * torch.exp2(torch.randint(-30, 10, (4096,)).double())
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.finfo(dtype).max / t.abs().max()
        cast = (t * scale).to(torch.float32).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
        err = (cast.double() / scale - t).abs()
        bound = cast_error(t, CastConfig(target_dtype=dtype))
        assert (err <= bound).all()
        assert (err / bound).max() > 0.5


def test_a_product_bound_covers_torchs_scaled_mm():
    """The product bound against `torch._scaled_mm` itself (CPU), tensorwise casts, bf16 out."""
    from torchao.float8.config import CastConfig

    torch.manual_seed(1)
    a, b = torch.randn(8, 32, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    e4m3 = torch.float8_e4m3fn
    sa, sb = torch.finfo(e4m3).max / a.abs().max(), torch.finfo(e4m3).max / b.abs().max()
    a8 = (a * sa).float().to(e4m3)
    b8 = (b * sb).float().to(e4m3).T.contiguous().T
    got = torch._scaled_mm(a8, b8, (1 / sa).float(), (1 / sb).float(), out_dtype=torch.bfloat16)
    bound = product_bound(a, b, a @ b, CastConfig(target_dtype=e4m3), CastConfig(target_dtype=e4m3), torch.bfloat16)
    assert ((got.double() - a @ b).abs() <= bound).all()
