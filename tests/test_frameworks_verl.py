"""verl's own FSDP2 code (`apply_fsdp2`, `fsdp2_load_full_state_dict`, `fsdp2_clip_grad_norm_`,
verl 0.9.1 installed with --no-deps) as a user's engine (verify/frameworks/verl.py,
docs/frameworks/verl.md): `verl.utils.fsdp_utils` imported alone, with stubs for what it does not
use, and verl's platform set to a CPU one; equivalent to the one-device reference. The tiny
transformers models, 2 steps."""

from __future__ import annotations

import importlib.util

import pytest

from fsdp_verify.case import Case
from fsdp_verify.frameworks import preset
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import get_pool
from tests.conftest import require

if importlib.util.find_spec("verl") is None:  # its package __init__ imports Ray: import_fsdp_utils skips it
    require("verl")
require("transformers")

BF16 = {"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"}


def _case(world: int, model: str | None = None, **changes) -> Case:
    fields = {**preset("verl", model), "world_size": world, "steps": 2, "data.batch_size": 2 * world}
    return Case().with_(**{**fields, **changes})


def test_the_preset_is_verls_units():
    """apply_fsdp2's units: embed_tokens (an nn.Embedding), each decoder layer, lm_head, the root;
    tied (Qwen2), the layers and the root only."""
    assert preset("verl", None)["wrap"] == ("model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head", "")
    assert preset("verl", "fsdp_verify.models.hf:tiny_qwen2")["wrap"] == ("model.layers.0", "model.layers.1", "")


@pytest.mark.parametrize(
    ("world", "model", "changes"),
    [
        (2, None, {"clip_norm": 0.01}),
        (3, None, {**BF16, "reshard_after_forward": False}),
        (2, "fsdp_verify.models.hf:tiny_qwen2", BF16),
    ],
)
def test_verls_fsdp2_is_equivalent_to_one_device(world, model, changes):
    """Every record and contract agrees: verl's units are the plan's, its load broadcast rank 0's
    weights into the other ranks' meta-device parameters, its clip clips by the global norm."""
    verdict = check_case(_case(world, model, **changes), pool=get_pool(world))
    assert verdict.ok, verdict.failures[:3]
    assert {"ownership", "init", "grads", "comm", "memory"} <= {f.phase for f in verdict.findings}


def test_what_the_import_took():
    """The package __init__s of verl and verl.utils skipped, verl.utils.model stubbed (and peft
    where it is absent), verl's platform set to the CPU one: nothing else."""
    from fsdp_verify.frameworks.verl import STUBBED, import_fsdp_utils

    fsdp_utils = import_fsdp_utils()
    assert callable(fsdp_utils.apply_fsdp2) and callable(fsdp_utils.fsdp2_clip_grad_norm_)
    names = [s.split(" ", 1)[0] for s in STUBBED]
    assert {"verl", "verl.utils", "verl.utils.model", "verl's"} <= set(names), STUBBED
    assert set(names) <= {"verl", "verl.utils", "verl.utils.model", "peft.utils.save_and_load", "verl's"}, STUBBED


def test_a_clip_by_the_local_shards_norm_around_verls_code_is_caught_at_the_norm():
    """verl's apply_fsdp2 and load unchanged, the clip handed each rank's local shards
    (verify/zoo/verl.py): the first divergence is the clip norm of the first step."""
    case = _case(2, engine="fsdp_verify.zoo.verl:verl_clip_by_local_norm", steps=1, clip_norm=0.01)
    first = check_case(case, pool=get_pool(2)).first_divergence
    assert first is not None and (first.step, first.phase, first.name) == (1, "grad_norm", "total_norm"), first


def test_no_false_alarm_over_drawn_cases():
    """verl's correct engine over the zoo's draws for its bug (clipping, micro-batches, frozen
    parameters, activation checkpointing, optimizers): never caught."""
    from dataclasses import replace

    from fsdp_verify.commands.selftest import hunt
    from fsdp_verify.zoo.catalog import BY_NAME

    correct = replace(BY_NAME["verl_clip_by_local_norm"], name="correct", engine="fsdp_verify.frameworks.verl:apply")
    result = hunt(correct, 6, world_sizes=(2,))
    assert (result.status, result.examples, result.crashes) == ("uncaught", 6, 0), result.detail or result.crash_detail


def test_the_import_leaves_peft_as_it_found_it():
    """peft is stubbed for fsdp_utils' import alone: afterwards the process finds it exactly as
    before (transformers asks whether it is installed; a stub left behind answered yes, and
    find_spec raised on its missing __spec__)."""
    import sys

    from fsdp_verify.frameworks.verl import import_fsdp_utils

    before = importlib.util.find_spec("peft") is None
    sys.modules.pop("verl.utils.fsdp_utils", None)  # import it again here, whatever ran before
    import_fsdp_utils()
    assert (importlib.util.find_spec("peft") is None) == before
    if before:  # not installed: no stub left in the process either
        assert not [name for name in sys.modules if name == "peft" or name.startswith("peft.")]
