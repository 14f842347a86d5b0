import json

import pytest

from fsdp_verify.case import Case, CaseError, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec


def test_default_case_round_trips_through_json():
    case = Case()
    again = Case.from_json(case.to_json())
    assert again == case
    assert again.hash == case.hash


def test_hash_changes_with_any_field():
    assert Case().hash != Case(seed=1).hash
    assert Case().hash != Case().with_(**{"optim.lr": 0.5}).hash


def test_batch_that_does_not_split_names_the_field():
    with pytest.raises(CaseError) as e:
        Case(world_size=3, data=DataSpec(batch_size=8))
    assert e.value.field_path == "data.batch_size"
    assert "multiple of world_size * microbatches" in str(e.value)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"steps": -1}, "steps"),
        ({"model": {"kind": "cnn"}}, "model.kind"),
        ({"precision": {"param_dtype": "fp8"}}, "precision.param_dtype"),
        ({"optim": {"name": "lamb"}}, "optim.name"),
        ({"optim": {"lr": "fast"}}, "optim.lr"),
        ({"wrap": ["layers.0", "no.such.module", ""]}, "wrap"),
        ({"wrap": ["", "layers.0"]}, "wrap"),
        ({"colour": "blue"}, "colour"),
        ({"model": {"kind": "mlp", "widths": [4]}}, "model.widths"),
        ({"mesh_shape": [3, 2]}, "mesh_shape"),
    ],
)
def test_bad_fields_are_named(data, field):
    with pytest.raises(CaseError) as e:
        Case.from_dict(data)
    assert e.value.field_path == field, str(e.value)


def test_tied_embeddings_must_share_a_unit():
    model = ModelSpec(tie_embeddings=True)
    Case(model=model)  # default plan: both in the root unit
    with pytest.raises(CaseError, match="tied"):
        Case(model=model, wrap=("output", "layers.0", "layers.1", ""))


def test_invalid_json_is_a_case_error():
    with pytest.raises(CaseError):
        Case.from_json("{not json")


def test_case_file_is_plain_json(tmp_path):
    path = Case(precision=PrecisionSpec("bf16", "fp32")).save(tmp_path / "c.json")
    assert json.loads(path.read_text())["precision"]["param_dtype"] == "bf16"
    assert Case.load(path).precision.param_dtype == "bf16"


@pytest.mark.parametrize("bf16", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_every_dtype_spelling_is_stored_as_its_short_name(bf16):
    """One spelling printed and stored, every spelling accepted (older case files said bfloat16)."""
    spec = PrecisionSpec(param_dtype=bf16, reduce_dtype="float32", output_dtype="fp16")
    assert (spec.param_dtype, spec.reduce_dtype, spec.output_dtype) == ("bf16", "fp32", "fp16")
    assert Case(precision=spec).hash == Case(precision=PrecisionSpec("bf16", "fp32", "fp16")).hash


def test_an_unknown_dtype_names_the_field_and_the_spellings():
    with pytest.raises(CaseError, match=r"precision.param_dtype: expected null or fp32/float32, bf16/bfloat16"):
        Case(precision=PrecisionSpec(param_dtype="bf17"))


def test_json_and_hash_are_what_dataclasses_asdict_gave():
    """`to_dict` walks the Case itself (`_plain`, 3x cheaper than `dataclasses.asdict`): its
    values, and so every JSON file and hash a release wrote, must stay as asdict made them."""
    import dataclasses

    from fsdp_verify.case import _plain
    from fsdp_verify.dims.registry import DimSpecs
    from fsdp_verify.properties.draw import draw_cases
    from fsdp_verify.properties.strategies import cases

    user = ModelSpec(kind="custom", factory="tests.user.models:user_lm", seq_len=8, kwargs={"n_layers": 3})
    drawn = draw_cases(cases(hsdp=True, precisions=("fp32", "bf16", "fp16")), 40, 5)
    drawn += draw_cases(cases(custom_model=user, world_sizes=(2,)), 10, 5)
    assert any(c.loss_scaling is not None for c in drawn) and any(c.model.is_custom for c in drawn)

    def asdict(case: Case) -> dict:
        """asdict of every field but `dims` (a mapping of the packages' specs, which asdict cannot
        copy): its specs that are on, each by asdict."""
        plain = dataclasses.asdict(dataclasses.replace(case, dims=DimSpecs()))
        plain["dims"] = {n: dataclasses.asdict(s) for n, s in case.dims.items() if s != type(s)()}
        return plain

    for case in drawn:
        assert _plain(case) == asdict(case)
        assert [type(v) for v in _plain(case).values()] == [type(v) for v in asdict(case).values()]
    nested = ModelSpec(kind="custom", factory="tests.user.models:user_lm", kwargs={"a": [1, (2, 3)], "b": {"c": None}})
    assert _plain(nested) == dataclasses.asdict(nested)
    assert Case().hash == "fd77d80f9b93"  # as every release since the hash began
