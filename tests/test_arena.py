"""What travels between processes on one host (verify/sharded/arena.py) comes back bit for bit,
read whole or piece by piece straight into place; the pages it reuses are really reused
(verify/sharded/allocator.py); and the memory probe's walk finds what it must."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from fsdp_verify import launch
from fsdp_verify.probes.memory import held_tensors
from fsdp_verify.sharded.arena import Arena, Fill, read_fill
from fsdp_verify.trace import Trace


def _odd_trace() -> Trace:
    t = Trace("sharded", meta={"kinds": {"1/grads/w": ["shard", 1]}})
    t.add(0, "init", "odd", torch.tensor([float("nan"), -0.0, 1e-45, float("inf")]))
    t.add(1, "logits", "logits", torch.randn(3, 7).to(torch.bfloat16))  # 42 bytes: the next is unaligned
    t.add(1, "loss", "loss", torch.tensor(1.5))
    t.add(1, "grads", "empty", torch.zeros(0, 4))
    t.add(1, "grads", "w", torch.randn(5, 3, dtype=torch.float64))
    t.add(1, "buffers", "mask", torch.tensor([True, False, True]))
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_an_arena_gives_back_every_record_and_is_rewritten_in_place(tmp_path):
    arena = Arena(str(tmp_path / "arena"))
    try:
        for round_ in range(2):  # the second fill rewrites the same file, smaller
            t = _odd_trace()
            if round_:
                del t.records[(1, "grads", "w")]
            header = arena.begin().add_trace(t).header(t.side, t.meta)
            assert all(offset % 64 == 0 for *_, offset, _ in header["records"])
            back = read_fill(header)
            assert back.side == t.side and back.meta == t.meta and list(back.records) == list(t.records)
            assert all(_same(back.records[k], v) for k, v in t.records.items())
        assert (tmp_path / "arena").stat().st_size > header["nbytes"]  # kept at its largest fill
    finally:
        arena.close()
    assert not (tmp_path / "arena").exists()


def test_a_fill_reads_a_record_straight_into_rows_of_a_larger_tensor(tmp_path):
    """As rank 0 reads another rank's rows into its full tensor: from the arena's file or from
    bytes that came through the process group, the same."""
    rows = torch.randn(3, 4)
    t = Trace("pieces", {(1, "params", "w"): rows})
    arena = Arena(str(tmp_path / "arena"))
    try:
        header = arena.begin().add_trace(t).header(t.side, t.meta)
        packed_header, buf = t.pack()
        for fill in (Fill(header), Fill(packed_header, buf)):
            full = torch.zeros(5, 4)
            fill.read_into((1, "params", "w"), full[2:5])
            assert torch.equal(full[2:], rows) and not full[:2].any()
            with pytest.raises(ValueError, match="bytes into a tensor of"):
                fill.read_into((1, "params", "w"), full[1:5])  # a row too many
            fill.close()
    finally:
        arena.close()


def test_freed_memory_is_reused_without_faulting_pages_in_again():
    """After keep_freed_memory, a case's worth of freed 1 MB blocks (a medium model's records)
    is handed out again: filling them faults no pages. The mutant hands blocks back: glibc's
    mmap threshold pinned at its starting 128 KiB, so every block is mapped and unmapped and
    every 4 KB page faults anew. (Untuned glibc moves that threshold as blocks come and go, so
    whether it hands them back depends on the history: measured both ways.) In a fresh
    interpreter each, so that this process's allocator stays as it was."""
    script = textwrap.dedent(
        """
        import ctypes, resource, sys, torch
        from fsdp_verify.sharded.allocator import keep_freed_memory
        if sys.argv[1] == "keep":
            kept = keep_freed_memory()
        else:
            kept = not ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        faults = []
        for _ in range(6):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [torch.ones(1 << 18) for _ in range(32)]  # 32 x 1 MB, filled
            del blocks
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        print(kept, min(faults[2:]))  # the heap settles in a round or two (the first faults all in)
        """
    )
    out = {}
    for how in ("keep", "hand back"):
        done = launch.run([sys.executable, "-c", script, how], timeout=120)
        assert done.returncode == 0, done.stderr
        kept, faults = done.stdout.split()
        out[how] = (kept == "True", int(faults))
    pages = (32 << 20) // 4096
    assert out["keep"][0] is True and out["hand back"][0] is False
    assert out["keep"][1] < pages // 20, out  # a settled round reuses the earlier rounds' pages
    assert out["hand back"][1] > pages // 2, out  # the mutant faults them in every round, settled or not


def test_the_memory_walk_finds_tensors_through_attributes_containers_closures_and_grads():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.kept = {"a": [torch.ones(4)], "b": (torch.zeros(2),)}
            self.skipped = Trace("x", {(0, "init", "t"): torch.ones(7)})  # a skipped type's tensor

    m = Holder()
    captured = torch.full((5,), 2.0)
    m.register_forward_hook(lambda *_: captured.sum())  # a hook's closure
    m.lin.weight.grad = torch.ones(2, 3)
    m.cycle = [m.kept]  # cycles are walked once
    found = {id(t) for t in held_tensors(m, skip=(Trace,))}
    expected = [m.lin.weight, m.lin.bias, m.lin.weight.grad, m.kept["a"][0], m.kept["b"][0], captured]
    assert all(id(t) in found for t in expected)
    assert id(m.skipped.records[(0, "init", "t")]) not in found
    assert len(found) == len(expected)
