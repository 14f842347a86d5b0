"""The data check: at each step the sharded ranks' batches together must be the reference's
global batch, each sample exactly once. Samples are matched by the hash of their bytes, so the
check needs no indices from the user's sampler and holds for any dataset.

The classic bugs it names: a sampler that is not sharded (every rank reads the same samples),
DistributedSampler's padding (drop_last=False repeats samples so the ranks come out even), and
ranks that shuffle differently (another seed, or a set_epoch call missing on some rank).
"""

from __future__ import annotations

from collections import Counter

import torch

from fsdp_verify.compare.finding import Finding


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> "0-3, 7"."""
    out, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2] -> "0, 1 and 2"."""
    return str(ranks[0]) if len(ranks) == 1 else ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def check(call: int, ref: list[torch.Tensor], got: list[torch.Tensor]) -> Finding:
    base = dict(step=call, phase="data", name="batch", comparator="DataCheck", mode="exact")
    ref_h = [int(h) for r in ref for h in r.tolist()]
    want = Counter(ref_h)
    holders: dict[int, list[int]] = {}
    for rank, hashes in enumerate(got):
        for h in hashes.tolist():
            holders.setdefault(int(h), []).append(rank)
    have = Counter({h: len(rs) for h, rs in holders.items()})
    if have == want:
        return Finding(ok=True, kind="check", why="every sample of the reference's batch on exactly one rank", **base)
    index = {}
    for i, h in enumerate(ref_h):
        index.setdefault(h, []).append(i)
    problems, hints = [], []
    dup: dict[tuple[int, ...], list[int]] = {}
    for h, rs in holders.items():
        if have[h] > want.get(h, 0) and h in want:
            dup.setdefault(tuple(sorted(set(rs))), []).extend(index[h])
    for rs, idx in sorted(dup.items()):
        problems.append(
            f"samples {_ranges(sorted(idx))} seen by {'ranks ' + _ranks(list(rs)) if len(rs) > 1 else f'rank {rs[0]} twice'}"
        )
    missing = sorted(i for h, idx in index.items() if have.get(h, 0) < want[h] for i in idx[have.get(h, 0) :])
    if missing:
        problems.append(f"samples {_ranges(missing)} of the reference's batch seen by no rank")
    extra = sum(n for h, n in have.items() if h not in want)
    if extra:
        problems.append(f"{extra} samples on the ranks are not in the reference's batch at this step")
    per_rank = [sorted(g.tolist()) for g in got]
    if len(got) > 1 and all(r == per_rank[0] for r in per_rank):
        hints.append(
            "each rank read the same samples: is the sampler sharded (DistributedSampler, or a slice per rank)?"
        )
    elif dup and not missing and not extra:
        hints.append("samples repeated to even out the ranks: DistributedSampler(drop_last=False) pads the last batch")
    elif extra:
        hints.append(
            "the ranks read other samples than the reference at this step: another shuffle seed, a set_epoch"
            " missing on some rank, or a per-rank batch size that does not add up to the reference's"
        )
    message = "; ".join(problems) + (f" ({' '.join(hints)})" if hints else "")
    return Finding(ok=False, kind="data", message=message, why="each sample of the global batch exactly once", **base)
