"""The dimensions' two shared parts (verify/dims/): the one owner of the degrees and the mesh
(`parallel_dims.py`: a rank's coordinates are the ones the mesh it builds gives that rank, for
every layout, combined ones included) and the one table of what is not modelled together
(`together.py`: read alike by the Case's refusals and the draws)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from fsdp_verify.case import CaseError
from fsdp_verify.dims.parallel_dims import ParallelDims
from tests.conftest import mlp_case
from tests.ranks import on_threads
from tests.test_tensor_parallel import tp_case

LAYOUTS = [
    ParallelDims(1, (1,)),
    ParallelDims(3, (3,)),
    ParallelDims(4, (2, 2)),
    ParallelDims(4, (2,), tp=2),
    ParallelDims(4, (2,), pp=2),
    ParallelDims(8, (2,), pp=2, tp=2),  # torchtitan's 3-D
    ParallelDims(8, (1, 2), pp=2, tp=2),
    ParallelDims(8, (2, 2), tp=2),
    ParallelDims(4, (4,), ep=2),
]


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: d.describe().replace(" ", ""))
def test_a_ranks_coordinates_are_its_place_in_the_mesh_row_major(dims):
    grid = torch.arange(dims.world_size).view(dims.shape)
    names = dims.names
    assert math.prod(dims.shape) == dims.world_size
    for rank in range(dims.world_size):
        at = dims.coords(rank)
        where = dict(zip(names, (int(i) for i in (grid == rank).nonzero()[0]), strict=True))
        dp = where.get("replicate", 0) * dims.dp[-1] + where["shard"] if len(dims.dp) == 2 else where["shard"]
        assert (at.stage, at.dp_rank, at.tp_rank) == (where.get("pp", 0), dp, where.get("tp", 0))
        assert dims.rank_of(at.stage, at.dp_rank, at.tp_rank) == rank
        assert dims.dp_rank(rank) == dp


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        ParallelDims(4, (4,)).coords(4)


def test_the_case_asks_it():
    case = tp_case(world_size=8, mesh_shape=(2, 2))
    assert case.parallel == ParallelDims(8, (2, 2), tp=2)
    assert (case.dp_size, case.device_mesh_shape) == (4, (2, 2, 2))
    assert ParallelDims.over((2, 2), pp=2, tp=2).world_size == 16
    assert mlp_case(4, pp=2, microbatches=2, sync_every_microbatch=False).parallel.shape == (2, 2)
    with pytest.raises(CaseError, match="mesh_shape"):  # the Case words the misfit, naming its field
        tp_case(world_size=8, mesh_shape=(2, 3))


def _groups_of_the_built_mesh(dims: ParallelDims) -> dict[int, dict[str, list[int]]]:
    """Each rank's groups in the mesh `dims.build` makes, dim by dim, on PyTorch's threaded process
    group (ranks are threads: this is the mesh's layout, not a collective under test)."""

    def groups(rank: int) -> dict[str, list[int]]:
        mesh = dims.build("cpu")
        return {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in mesh.mesh_dim_names}

    return on_threads(dims.world_size, groups)


@pytest.mark.parametrize("dims", [LAYOUTS[5], LAYOUTS[6], LAYOUTS[8]], ids=lambda d: d.describe().replace(" ", ""))
def test_the_built_meshs_groups_are_the_coordinates_groups(dims):
    """A rank's tp group is the ranks of its stage and data-parallel rank; its shard group the
    ranks of its stage, replica and tp rank; its pp group its data-parallel and tp rank's stages
    (a mesh built with two dims swapped fails here)."""
    got = _groups_of_the_built_mesh(dims)
    assert sorted(got) == list(range(dims.world_size))
    for rank, groups in got.items():
        at = dims.coords(rank)
        if "tp" in groups:
            assert groups["tp"] == [dims.rank_of(at.stage, at.dp_rank, t) for t in range(dims.tp)]
        if "pp" in groups:
            assert groups["pp"] == [dims.rank_of(s, at.dp_rank, at.tp_rank) for s in range(dims.pp)]
        if dims.ep > 1:
            assert set(groups) == {"efsdp", "ep"}
            group_start = at.dp_rank - at.dp_rank % dims.ep  # the ep ranks: consecutive ranks of the shard dim
            assert groups["ep"] == [dims.rank_of(at.stage, group_start + e, at.tp_rank) for e in range(dims.ep)]
            continue
        shard, replica = dims.dp[-1], at.dp_rank // dims.dp[-1]
        assert groups["shard"] == [dims.rank_of(at.stage, replica * shard + s, at.tp_rank) for s in range(shard)], (
            groups
        )


# ---- what is not modelled together: one table (verify/dims/together.py) ---------------------------
def _plain_case(**on):
    """A stand-in with every dimension and every row's field off, then `on`."""
    from types import SimpleNamespace

    from fsdp_verify.dims.together import DIMENSIONS, NOT_MODELLED_TOGETHER

    fields = {d.field: d.off for d in DIMENSIONS.values()}
    model = {}
    for rows in NOT_MODELLED_TOGETHER.values():
        for row in rows:
            head, _, rest = row.field.partition(".")
            if rest:
                model[rest] = row.off
            else:
                fields[head] = row.off
    for name, value in on.items():
        head, _, rest = name.partition(".")
        if rest:
            model[rest] = value
        else:
            fields[head] = value
    return SimpleNamespace(**fields, model=SimpleNamespace(**model))


@pytest.mark.parametrize("dimension", ["tp", "ep", "pp", "compile"])
def test_every_row_of_the_one_table_is_refused_naming_its_field_and_drawn_off(dimension):
    from fsdp_verify.dims.together import (
        DIMENSIONS,
        NOT_MODELLED_TOGETHER,
        beside_another,
        check_together,
        drawn_off,
        not_modelled_beside,
    )

    on = {"tp": 2, "ep": 2, "pp": 2, "compile": "units"}
    check_together(_plain_case(**{dimension: on[dimension]}), dimension)  # the dimension alone: a case
    for row in NOT_MODELLED_TOGETHER[dimension]:
        for allowed in row.also:  # a value the row models beside the dimension (compile "units" under pp)
            check_together(_plain_case(**{dimension: on[dimension], row.field: allowed}), dimension)
        value = next(v for v in (on.get(row.field, "on"), "on") if v != row.off and v not in row.also)
        case = _plain_case(**{dimension: on[dimension], row.field: value})
        with pytest.raises(CaseError) as e:
            check_together(case, dimension)
        assert e.value.field_path == row.field and f"beside {DIMENSIONS[dimension].what} is not modelled" in str(
            e.value
        )
        assert not_modelled_beside(case, dimension) == row.why
        assert beside_another(dimension, case) == (row.field in DIMENSIONS)
        if row.drawn:
            assert drawn_off(dimension)[row.field] == row.off
    check_together(_plain_case(**{row.field: "on" for row in NOT_MODELLED_TOGETHER[dimension]}), dimension)  # off


def test_a_pair_modelled_together_is_a_row_removed(monkeypatch):
    """The Case asks the table and nothing else: without tp's offload row, tp beside offload is a case."""
    from fsdp_verify.dims import together

    with pytest.raises(CaseError, match=r"^offload: expected False with tp=2: CPU offload of 2-D parameters beside tp"):
        tp_case(offload=True)
    rows = tuple(r for r in together.NOT_MODELLED_TOGETHER["tp"] if r.field != "offload")
    monkeypatch.setitem(together.NOT_MODELLED_TOGETHER, "tp", rows)
    assert tp_case(offload=True).offload
    assert "offload" not in together.drawn_off("tp")
