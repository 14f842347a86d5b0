"""FSDP2's forward under explicit prefetching, replayed unit by unit: which all-gathers the forward
window issues, which of them are still pending when it ends, and what each rank holds after each
unit's forward. The communication and memory contracts (verify/checks/comm.py, memory.py) both
read it, so what one counts the other counts the same way.

Why a replay and not a rule: the prefetch lists (verify/engines/prefetch.py) follow the modules'
*registration* order, as torchtitan's recipe does, while FSDP2 acts in the order the modules
*run*. Where the two differ, a list names a unit that has already run. The built-in Transformer's
SwiGLU is such a place: `feed_forward.w2` is registered before `w3` but runs after it
(`w2(silu(w1(x)) * w3(x))`), so with `w2` and `w3` their own units `w2`'s forward list names
`w3`, which has finished. What FSDP2 then does (torch 2.13, `FSDPState._pre_forward`,
`FSDPParamGroup.unshard` / `wait_for_unshard`, read and measured) depends on where that unit is:

- resharded after its forward (`reshard_after_forward` True, or an int k: then from its
  post-forward shards, over k ranks): `unshard` gathers it again. Nothing in the forward copies
  it out (its pre-forward is over), so the gather stays pending into backward, where the unit's
  own pre-backward `unshard` returns on the pending result and `wait_for_unshard` copies it out:
  that unit's backward all-gather moves into the forward window (a fresh-seed hunt's false alarm,
  tests/regressions/f8b28b06ee82.json, 4 micro-batches at 3 ranks: "unexpected all_gather of
  576 B"). Where no backward runs through it, FSDP2's final callback discards it
  (`finalize_backward`, every micro-batch: the loop never calls `set_is_last_backward(False)`).
- still unsharded (`reshard_after_forward` False, or held by `reshard_after_backward_last`):
  `unshard` returns (`is_unsharded`), nothing is issued.

What a rank holds beyond its shards, as *other* storage (not Parameters), after a unit's forward:

- each pending gather's output (the unit's padded full parameters in param_dtype: each shard
  padded to the shard group, as all-gathered);
- the all-gather output of the unit copied out last in this forward: `wait_for_unshard` keeps
  it in `comm_ctx.all_gather_state` (synchronous all-gathers in FORWARD) until the next
  copy-out, and the root's post-forward frees it. "Last" in *run* order: a unit found unsharded
  at its pre-forward copies nothing out and leaves the previous one kept. The model said the
  last in registration order, and a SwiGLU whose `w2` is padded held `w2`'s 36 B where `w3`'s
  24 B were allowed (tests/regressions/36a0532e74ce.json: reshard_after_forward False, 3 ranks);
  the padding was not the cause, the order was;
- under an int k, the post-forward shards of the units resharded to them
  (`_sharded_post_forward_param_data`, 1/k of the unit's padded parameters), until the unit is
  copied out again;
- under `replica_sync_last`, the partial reduce outputs (memory.py, not here).

At a shard group of one nothing is all-gathered (`unshard` copies locally): no gather, no pending
output, no kept output. Without explicit lists the same replay gives FSDP2's plain forward: each
unit gathered once, at its pre-forward, unless held.

The run order is measured: the units' post-forward order in the run's first micro-batch
(verify/probes/memory.py `forward_facts`), each unit's pre-forward placed before the first unit
nested in it (module nesting is call nesting in the models whose units it replays).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Boundary:
    """What FSDP2 holds right after `unit`'s forward (its post-forward hook has run)."""

    unit: str
    pending: frozenset[str]  # gathered, not copied out yet
    kept: str | None  # the unit whose all-gather output `all_gather_state` keeps
    post_forward: frozenset[str]  # in their post-forward shards (an int reshard_after_forward)


@dataclass(frozen=True)
class ForwardPass:
    gathers: tuple[tuple[str, int], ...]  # (unit, group size) of each all-gather, in issue order
    pending: frozenset[str]  # gathered in forward and never copied out there: backward's to use
    boundaries: tuple[Boundary, ...]  # one per unit forward, in run order


def run_order(post_order: Sequence[str]) -> list[tuple[str, str]]:
    """("pre" | "post", unit) events of one forward, from the units' post-forward order: a unit's
    pre-forward before everything nested in it, its post-forward after."""
    index = {u: i for i, u in enumerate(post_order)}

    def ancestor(a: str, b: str) -> bool:
        return a != b and (a == "" or b.startswith(a + "."))

    parent = {u: max((a for a in post_order if ancestor(a, u)), key=len, default=None) for u in post_order}
    children: dict[str | None, list[str]] = {}
    for u in sorted(post_order, key=index.__getitem__):
        children.setdefault(parent[u], []).append(u)

    def events(u: str) -> list[tuple[str, str]]:
        out = [("pre", u)]
        for c in children.get(u, []):
            out += events(c)
        return out + [("post", u)]

    return [e for top in children.get(None, []) for e in events(top)]


def forward_pass(
    post_order: Sequence[str],
    grouped: set[str],
    lists: Mapping[str, Sequence[str]],
    shard: int,
    reshard_after_forward: bool | int,
    held: frozenset[str] = frozenset(),
    post_forward: frozenset[str] = frozenset(),
) -> ForwardPass:
    """One forward of FSDP2 (see the module docstring). `grouped`: the units with a parameter
    group (others neither gather nor prefetch); `lists`: each unit's forward prefetch list;
    `held`: units still unsharded at the start (`reshard_after_backward_last`); `post_forward`:
    units still in their post-forward shards at the start (gathered over k)."""
    rsf = reshard_after_forward
    k = rsf if not isinstance(rsf, bool) and 1 < rsf < shard else None
    # an int 1 is False to FSDP2, an int S is True (`_get_post_forward_mesh_info`)
    reshards = rsf is True or (not isinstance(rsf, bool) and rsf > 1)
    unsharded = set(held) & grouped
    in_post = set(post_forward) & grouped - unsharded
    pending: set[str] = set()
    gathers: list[tuple[str, int]] = []
    kept: str | None = None
    boundaries: list[Boundary] = []

    def gather(u: str) -> None:
        if shard > 1:
            gathers.append((u, k if u in in_post and k else shard))
        pending.add(u)

    events = run_order(post_order)
    root = events[0][1] if events else None  # the first unit to enter forward: FSDP2's iteration root
    for what, u in events:
        if what == "pre":
            if u in grouped and u not in unsharded:
                if u not in pending:
                    gather(u)
                pending.discard(u)  # copied out
                unsharded.add(u)
                in_post.discard(u)  # `to_unsharded` frees the post-forward shards
                kept = u if shard > 1 else None
            if u in grouped:
                for t in lists.get(u, ()):
                    if t in grouped and t not in unsharded and t not in pending:
                        gather(t)
            continue
        if u in grouped and reshards:
            unsharded.discard(u)
            if k is not None:
                in_post.add(u)
        if u == root:
            kept = None  # the root's post-forward frees the kept output
        boundaries.append(Boundary(u, frozenset(pending), kept, frozenset(in_post)))
    return ForwardPass(tuple(gathers), frozenset(pending), tuple(boundaries))
