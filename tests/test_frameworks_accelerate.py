"""Accelerate's own FSDP2 preparation (`fsdp2_prepare_model`, accelerate 1.15.0) as a user's engine
(verify/frameworks/accelerate.py, docs/frameworks/accelerate.md): on a CPU, past its device
check, on the toolkit's mesh, its wrap policy and its load of rank 0's full state dict into the
sharded model; equivalent to the one-device reference where it is correct, and the bugs planted
around it (verify/zoo/accelerate.py) caught and located. Each case is the tiny Llama, 1-2 steps."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import pytest

from fsdp_verify.case import Case
from fsdp_verify.commands.cli import main
from fsdp_verify.commands.selftest import hunt
from fsdp_verify.frameworks import preset
from fsdp_verify.frameworks.accelerate import prepare
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.validation import CaseError
from fsdp_verify.zoo.catalog import BY_NAME
from tests.conftest import require
from tests.in_process import run_cli

require("accelerate")
require("transformers")

LLAMA = "fsdp_verify.models.hf:tiny_llama"
UNITS = ("model.layers.0", "model.layers.1", "model.embed_tokens", "model.norm+lm_head", "")
BF16 = {"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"}
MUTANTS = ("accel_rope_buffer_left_zero", "accel_full_state_dict_stale", "accel_mixed_precision_dropped")


def _case(world: int, steps: int = 2, **changes) -> Case:
    return Case().with_(
        **{**preset("accelerate", None), "world_size": world, "steps": steps, "data.batch_size": 2 * world, **changes}
    )


def test_the_preset_is_accelerates_units_for_the_tiny_llama():
    """Accelerate 1.15's units: each LlamaDecoderLayer (its wrap policy, by the class names the
    plan's blocks have), the input embeddings, one unit over [final norm, lm_head], the root."""
    fields = preset("accelerate", None)
    assert fields["wrap"] == UNITS
    assert fields["engine"] == "fsdp_verify.frameworks.accelerate:prepare"
    assert fields["model"].factory == LLAMA and fields["reshard_after_forward"] is False


@pytest.mark.parametrize(("world", "precision"), [(2, {}), (3, {}), (2, BF16), (3, BF16)])
def test_accelerates_fsdp2_is_equivalent_to_one_device(world, precision):
    """Every record agrees, the ownership check among them: the units Accelerate built are the
    plan's. The other ranks start from the meta device: their values are rank 0's, broadcast by
    Accelerate (tests/engines/accelerate_probe.py asserts that layout before Accelerate runs)."""
    case = _case(world, engine="tests/engines/accelerate_probe.py:prepare_from_meta", **precision)
    verdict = check_case(case, pool=get_pool(world))
    assert verdict.ok, verdict.failures[:3]
    phases = {f.phase for f in verdict.findings}
    assert {"ownership", "init", "grads", "params", "comm", "memory", "precision"} <= phases, phases


def test_the_command_line_runs_it_as_one_flag(tmp_path):
    out = run_cli(["check", "--framework", "accelerate", "--steps", "1", "--clip-norm", "0.01"], cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "EQUIVALENT: fsdp_verify.frameworks.accelerate:prepare vs the reference" in out.stdout, out.stdout


def test_accelerates_default_reshard_keeps_its_tail_unsharded_which_the_contracts_take_per_unit():
    """With reshard_after_forward true (the plugin's default) Accelerate still keeps [norm, lm_head]
    unsharded from forward to backward, by design ("Tail gets False"). The engine declares that it
    decides each unit's reshard (`Capabilities(reshard_per_unit=True)`), so the communication and
    memory contracts hold each unit to what fsdp2_prepare_model built and the run is equivalent;
    without that declaration the knobs check names the tail as a unit built otherwise."""
    case = _case(2, steps=1, reshard_after_forward=True)
    verdict = check_case(case, pool=get_pool(2))
    assert verdict.ok, verdict.failures
    undeclared = replace(prepare.capabilities, reshard_per_unit=False)
    with patch.object(prepare, "capabilities", undeclared):
        failing = check_case(case, pool=get_pool(2)).failures
    assert [(f.phase, f.comparator) for f in failing] == [("build", "KnobsApplied")], failing
    assert "unit 'model.norm+lm_head' was built with False" in failing[0].message, failing[0].message


def test_no_false_alarm_over_drawn_cases():
    """The correct engine over the zoo's draws (micro-batches, clipping, frozen parameters,
    activation checkpointing, optimizers, bf16): never caught."""
    correct = replace(
        BY_NAME["accel_rope_buffer_left_zero"], name="correct", engine="fsdp_verify.frameworks.accelerate:prepare"
    )
    result = hunt(correct, 6, world_sizes=(2,))
    assert (result.status, result.examples, result.crashes) == ("uncaught", 6, 0), result.detail or result.crash_detail


@pytest.mark.parametrize(
    ("mutant", "where", "comparator"),
    [
        ("accel_rope_buffer_left_zero", (0, "buffers", "model.rotary_emb.inv_freq"), "BufferRanksCheck"),
        ("accel_full_state_dict_stale", (0, "init", "lm_head.weight"), "InitParamsComparator"),
        ("accel_mixed_precision_dropped", (1, "precision", "backward_grads:lm_head.weight"), "PrecisionContract"),
    ],
)
def test_a_bug_planted_around_accelerates_code_is_caught_and_located(mutant, where, comparator):
    """Each mutant calls Accelerate's fsdp2_prepare_model unchanged and changes one thing around
    it: the first divergence names the step, the phase, the tensor and the check that saw it."""
    case = _case(2, steps=1, engine=f"fsdp_verify.zoo.accelerate:{mutant}", **BF16)
    first = check_case(case, pool=get_pool(2)).first_divergence
    assert first is not None and (first.step, first.phase, first.name) == where, first
    assert first.comparator == comparator, first


def test_selftest_catches_the_planted_bugs(capsys):
    assert main(["selftest", "--bugs", *MUTANTS, "--world-sizes", "2", "--max-examples", "3"]) == 0
    out = capsys.readouterr().out
    assert "3/3 bugs caught" in out, out


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"reshard_after_forward": 2, "world_size": 4}, "reshard_after_forward", "true or false"),
        ({"mesh_shape": (2, 2), "world_size": 4}, "mesh_shape", "a 1-D mesh"),
    ],
)
def test_what_accelerates_plugin_cannot_take_is_refused_naming_the_field(changes, field, says):
    with pytest.raises(CaseError) as e:
        check_case(_case(2, **changes))
    assert e.value.field_path == field and says in str(e.value), str(e.value)


def test_a_tied_model_is_refused_naming_the_model():
    """Accelerate shards a tied model's [norm, embed_tokens, lm_head] in that order, which a plan
    cannot spell (a group is in the model's order): refused, not run with another unit."""
    with pytest.raises(CaseError) as e:
        preset("accelerate", "fsdp_verify.models.hf:tiny_qwen2")
    assert e.value.field_path == "model" and "tied" in str(e.value)
