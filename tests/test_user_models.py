"""Any nn.Module under test: a user's model factory (written here, outside the package) and tiny
`transformers` models go through check, fuzz, shrink and repro like the built-in models; padded
batches tell a correct loss normalisation from a per-micro-batch or per-rank mean; a factory that
builds different models on different ranks is named at step 0; a factory that fails is bad input."""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify import units
from fsdp_verify.case import Case, CaseError
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.models import ModelSpec
from fsdp_verify.properties.model_draws import _custom_wrappable
from fsdp_verify.properties.strategies import cases
from fsdp_verify.reference import train_reference
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.training.data import IGNORE_INDEX, global_batch, item_count, microbatch_slices
from tests.conftest import require

USER = "tests/user/models.py"
USER_LM = ModelSpec(kind="custom", factory=f"{USER}:user_lm", seq_len=8)
LLAMA = "fsdp_verify.models.hf:tiny_llama"
QWEN2 = "fsdp_verify.models.hf:tiny_qwen2"
NORMALISATION = ("loss_normalised_per_microbatch", "loss_normalised_per_rank")


def user_case(world_size: int = 2, padded: bool = True, **changes) -> Case:
    microbatches = changes.setdefault("microbatches", 2)
    changes.setdefault("steps", 1)
    changes.setdefault("model", USER_LM)
    changes.setdefault("wrap", ("UserBlock", ""))
    data = DataSpec(batch_size=world_size * microbatches * 2, padded=padded)
    return Case(world_size=world_size, data=data, **changes)


def check_args(model: str, world_size: int, *extra: str) -> list[str]:
    return ["check", "--model", model, "--world-size", str(world_size), "--padded", "--microbatches", "2"] + [
        "--steps",
        "2",
        "--seq-len",
        "6",
        *extra,
    ]


# ---- the Case carries the model ------------------------------------------------------------------
def test_a_user_model_case_round_trips_and_built_in_hashes_do_not_move():
    case = user_case(init="eager", model=ModelSpec(**{**USER_LM.__dict__, "kwargs": {"n_layers": 3}}))
    again = Case.from_json(case.to_json())
    assert again == case and again.hash == case.hash
    assert json.loads(case.to_json())["model"]["kwargs"] == {"n_layers": 3}
    assert Case(model=case.model.__class__(**{**case.model.__dict__, "kwargs": {"n_layers": 2}})).hash != case.hash
    # The optional fields stay out of a built-in case: its hash is the one it had before them.
    assert Case().hash == "fd77d80f9b93" and "factory" not in Case().to_json()


def test_a_class_name_in_the_plan_wraps_every_module_of_that_class_children_first():
    assert user_case(wrap=("UserBlock", "")).wrap_plan == ("blocks.0", "blocks.1", "")
    assert user_case(wrap=("Linear", "blocks.0", "")).wrap_plan == (
        "blocks.0.up",
        "blocks.0.down",
        "blocks.1.up",
        "blocks.1.down",
        "blocks.0",
        "head",
        "",
    )
    with pytest.raises(CaseError, match="^wrap: expected module names or class names"):
        user_case(wrap=("NoSuchLayer", ""))


def test_tied_parameters_must_share_a_unit():
    require("transformers")
    tied = ModelSpec(kind="custom", factory=QWEN2)
    assert Case(model=tied, wrap=("Qwen2DecoderLayer", "")).wrap_plan[-1] == ""
    with pytest.raises(CaseError, match=r"^wrap: expected the tied parameters \['model.embed_tokens.weight'"):
        Case(model=tied, wrap=("model.embed_tokens", ""))
    # Generated plans never offer a unit that would split the tie (a drawn invalid case would be
    # discarded silently, so the candidates themselves are checked).
    offered = set(_custom_wrappable(tied))
    assert {"Qwen2DecoderLayer", "Qwen2MLP", "model.layers.0", "model.layers.1.self_attn.q_proj"} <= offered
    assert not offered & {"model", "model.embed_tokens", "lm_head", "Linear", "Embedding", "Qwen2Model"}


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(custom_model=ModelSpec(kind="custom", factory=f"{USER}:user_lm", kwargs={"n_layers": 3})))
def test_generated_user_model_cases_draw_plans_from_its_tree(case):
    assert case.model.factory.endswith(":user_lm") and case.init == "eager"
    tree = {"", "UserBlock", "LayerNorm", "Linear", "Embedding", "embed", "head"} | {
        f"blocks.{i}{leaf}" for i in range(3) for leaf in ("", ".norm", ".up", ".down")
    }
    # a unit over several modules (verify/units.py): each member from the tree
    assert {m for entry in case.wrap or ("",) for m in units.members(entry)} <= tree


def test_padded_batches_hold_different_token_counts_and_pad_with_ignore_index():
    case = user_case(world_size=2, microbatches=2)
    tokens, targets = global_batch(case, 1)
    assert ((tokens == 0) | (targets != IGNORE_INDEX)).all()  # a padded position has token 0
    counts = [item_count(case, targets[s]) for r in range(2) for s in microbatch_slices(case, r)]
    assert len(set(counts)) > 1 and sum(counts) == int((targets != IGNORE_INDEX).sum())
    _, equal = global_batch(user_case(padded=False), 1)
    assert (equal != IGNORE_INDEX).all()


# ---- transformers models -------------------------------------------------------------------------
BF16 = ("--param-dtype", "bf16", "--reduce-dtype", "fp32")
# One test, one xdist worker: every rank process imports transformers once (seconds each).
HF_CASES = [
    (LLAMA, "LlamaDecoderLayer", 1, ()),
    (LLAMA, "LlamaDecoderLayer", 2, ()),
    (LLAMA, "LlamaDecoderLayer", 3, ()),
    (LLAMA, "LlamaDecoderLayer", 4, ()),
    (LLAMA, "LlamaDecoderLayer", 2, BF16),
    (QWEN2, "Qwen2DecoderLayer", 2, ()),
    (QWEN2, "Qwen2DecoderLayer", 3, BF16),
]


def _failures(configs, capsys, *extra: str) -> list[str]:
    failed = []
    for model, wrap, world_size, precision in configs:
        code = main(check_args(model, world_size, "--wrap", wrap, *precision, *extra))
        out = capsys.readouterr().out
        if code != 0 or "EQUIVALENT" not in out:
            failed.append(f"{model} --wrap {wrap} world size {world_size} {' '.join(precision)}: exit {code}\n{out}")
    return failed


def test_fsdp2_on_tiny_transformers_models_equals_the_reference_and_the_normalisation_mutant_is_caught(capsys):
    """Padded variable-length batches, 2 micro-batches, 2 steps: every record bit-exact or within
    its derived tolerance, world sizes 1-4 in fp32, bf16 params with fp32 reduction, tied
    embeddings (Qwen2). The same Llama under a per-micro-batch loss mean diverges at step 1."""
    require("transformers")
    assert not _failures(HF_CASES, capsys)
    engine = "fsdp_verify.zoo.mutants:loss_normalised_per_microbatch"
    code = main(check_args(LLAMA, 2, "--wrap", "LlamaDecoderLayer", "--engine", engine))
    out = capsys.readouterr().out
    assert code == 1 and "First divergence at step 1, loss, 'loss'" in out and "loss normalisation" in out, out


@pytest.mark.parametrize("engine", ["fsdp1", "flat"])
def test_fsdp1_and_the_flat_engine_on_tiny_transformers_models_equal_the_reference(engine, capsys):
    """The other engines on the same models, padded batches and micro-batches: Llama in fp32 at 2
    ranks, the tied Qwen2 with bf16 params and fp32 reduction at 3 (FlatParameters over a
    decoder layer's mixed shapes, a tie inside the root's unit)."""
    require("transformers")
    configs = [
        (LLAMA, "LlamaDecoderLayer", 2, ()),
        (QWEN2, "Qwen2DecoderLayer", 3, ("--param-dtype", "bf16", "--reduce-dtype", "fp32")),
    ]
    assert not _failures(configs, capsys, "--engine", engine)


@pytest.mark.slow
def test_fsdp2_on_tiny_transformers_models_in_bf16_everywhere(capsys):
    require("transformers")
    configs = [
        (model, wrap, world_size, ("--param-dtype", "bf16", "--reduce-dtype", reduce))
        for model, wrap in ((LLAMA, "LlamaDecoderLayer"), (QWEN2, "Qwen2DecoderLayer"))
        for world_size in (1, 2, 3, 4)
        for reduce in ("fp32", "bf16")
    ]
    configs += [(QWEN2, "Qwen2DecoderLayer", w, ()) for w in (1, 3, 4)]
    assert not _failures(configs, capsys)


# ---- a user's model through every command -----------------------------------------------------------
def test_a_user_model_passes_check_and_its_case_file_replays(tmp_path, capsys):
    saved = tmp_path / "case.json"
    args = check_args(f"{USER}:user_lm", 3, "--wrap", "UserBlock", "--model-kwargs", '{"n_layers": 3}')
    args += ["--init-fn", f"{USER}:normal_init", "--param-dtype", "bf16", "--reduce-dtype", "fp32"]
    assert main([*args, "--save-case", str(saved)]) == 0, capsys.readouterr().out
    case = Case.load(saved)
    assert (case.model.factory, case.model.kwargs, case.wrap) == (f"{USER}:user_lm", {"n_layers": 3}, ("UserBlock", ""))
    assert main(["repro", str(saved)]) == 0


def test_fuzz_draws_cases_of_a_user_model(tmp_path, capsys):
    code = main(
        ["fuzz", "--model", f"{USER}:user_lm", "--max-examples", "4", "--world-sizes", "2", "--seed", "3"]
        + ["--out", str(tmp_path), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 cases run, 4 passed" in out
    assert json.loads((tmp_path / "report.json").read_text())["models"] == [f"{USER}:user_lm"]


def test_shrink_lowers_the_kwargs_a_user_marks_shrinkable_then_repro_bisects_it(tmp_path, capsys):
    model = ModelSpec(**{**USER_LM.__dict__, "kwargs": {"n_layers": 3}, "shrinkable": ("n_layers",)})
    big = user_case(2, steps=2, model=model, engine="fsdp_verify.zoo.mutants:loss_normalised_per_rank")
    out = tmp_path / "small.json"
    code = main(["shrink", str(big.save(tmp_path / "big.json")), "--out", str(out), "--max-runs", "30"])
    printed = capsys.readouterr()
    assert code == 1, printed.out + printed.err
    small = Case.load(out)
    assert small.model.kwargs["n_layers"] == 1 and small.steps == 1 and small.data.padded, printed.err
    assert "first divergence in loss" in printed.out
    assert main(["repro", str(out)]) == 1
    assert main(["repro", str(out), "--engine", "fsdp2"]) == 0


@pytest.mark.parametrize("mutant", NORMALISATION)
def test_a_normalisation_mutant_is_caught_on_padded_batches_and_not_flagged_on_equal_lengths(mutant):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    padded = check_case(user_case(2, engine=engine))
    first = padded.first_divergence
    assert (first.step, first.phase) == (1, "loss"), padded.summary()
    assert "loss normalisation" in padded.hint and "dp_size / global_batch_tokens" in padded.hint
    equal = check_case(user_case(2, padded=False, engine=engine))
    assert equal.ok, equal.summary()  # the same number when every micro-batch holds as many tokens


def test_the_pytest_fixtures_take_a_user_model(fsdp_cases, fsdp_property):
    strategy = fsdp_cases(custom_model=USER_LM, world_sizes=(2,), steps=1, **{"data.padded": True})

    @settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(case):
        fsdp_property(case)

    prop()


def test_a_user_data_function_loss_and_output_fn_run_on_both_sides():
    """Dict inputs with an attention mask, a dict output read by output_fn, a label-smoothed loss
    sum: the sharded run agrees, and the loss recorded is the user's, not the default."""
    model = ModelSpec(kind="custom", factory=f"{USER}:dict_lm", output_fn=f"{USER}:scores", seq_len=5)
    data = DataSpec(batch_size=8, fn=f"{USER}:reversal_data")
    case = Case(model=model, world_size=2, microbatches=2, steps=2, data=data, loss=f"{USER}:smoothed_loss")
    inputs, targets = global_batch(case, 1)
    assert set(inputs) == {"tokens", "attention_mask"} and item_count(case, targets) == 8 * 4
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    with_default = train_reference(case.with_(loss=None)).records[(1, "loss", "loss")]
    assert train_reference(case).records[(1, "loss", "loss")] != with_default


# ---- factories that are wrong -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("factory", "why"),
    [
        ("reseeds_by_rank", "other values"),
        ("reseeds_by_env_rank", "other values"),  # pool workers set RANK, WORLD_SIZE, LOCAL_RANK as torchrun does
        # os.environ["RANK"] with no default: was a KeyError in the reference's build, refused as bad input
        ("reseeds_by_env_rank_strict", "other values"),
        ("width_by_rank", "shape (21, 12) torch.float32 vs rank 0's (20, 12)"),
    ],
)
def test_a_factory_that_builds_another_model_on_another_rank_is_named_at_step_0(factory, why, tmp_path, capsys):
    rank_before = os.environ.get("RANK")
    verdict = tmp_path / "verdict.json"
    assert main(["check", "--model", f"{USER}:{factory}", "--steps", "1", "--json", str(verdict)]) == 1
    first = json.loads(verdict.read_text())["first_divergence"]
    assert (first["step"], first["phase"], first["name"]) == (
        0,
        "build",
        "embed.weight" if "seed" in factory else "blocks.0.up.weight",
    )
    assert f"the model factory {USER}:{factory} built different parameters on rank 1" in first["message"]
    assert why in first["message"]
    assert "never from the rank (dist.get_rank(), or the RANK and LOCAL_RANK variables" in first["message"]
    assert os.environ.get("RANK") == rank_before  # the reference's build set it for its own call only


def test_a_factory_that_fails_is_bad_input_and_the_pool_stays_usable(capsys):
    assert main(["check", "--model", f"{USER}:raises"]) == 2
    err = capsys.readouterr().err
    assert "model.factory" in err and "RuntimeError: config file not found: tiny.yaml" in err
    assert main(["check", "--model", f"{USER}:no_such_factory"]) == 2
    assert "model.factory" in capsys.readouterr().err
    assert main(["check", "--model", "nowhere.at_all:f"]) == 2
    assert main(["check", "--model", f"{USER}:user_lm", "--model-kwargs", "[1, 2]"]) == 2
    assert "model.kwargs: expected a JSON object" in capsys.readouterr().err
    pool = get_pool(2)
    assert check_case(user_case(2), pool).ok  # the same ranks run the next case


def test_a_model_file_imports_the_module_beside_it_and_a_module_name_gets_the_file_hint(tmp_path, monkeypatch):
    """As `python path/to/file.py` does, the file's folder is importable (a user's step or model
    file importing its neighbour). A module name that only `python -m` would find (the console
    script does not put the current directory on sys.path) is answered with the file's spelling."""
    from fsdp_verify.imports import load_object

    (tmp_path / "neighbour_of_fsdp_verify_test.py").write_text("WIDTH = 7\n")
    (tmp_path / "model_file_of_fsdp_verify_test.py").write_text(
        "import torch\nfrom neighbour_of_fsdp_verify_test import WIDTH\n\n\n"
        "def make():\n    return torch.nn.Linear(WIDTH, 3)\n"
    )
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    model = load_object(f"{tmp_path}/model_file_of_fsdp_verify_test.py:make", "model.factory")()
    assert model.in_features == 7
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(CaseError) as e:
        load_object("model_file_of_fsdp_verify_test:make", "model.factory")
    assert "as a file here: model_file_of_fsdp_verify_test.py:make" in str(e.value)
