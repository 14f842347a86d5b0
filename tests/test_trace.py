import json

import torch

from fsdp_verify.trace import Trace


def test_trace_round_trip_without_pickle(tmp_path):
    t = Trace("reference", meta={"case": "abc"})
    t.add(0, "init", "w", torch.randn(3, 5))
    t.add(1, "logits", "logits", torch.randn(4, 2).to(torch.bfloat16))
    t.add(1, "loss", "loss", torch.tensor(1.5))
    path = t.save(tmp_path / "t.safetensors")
    assert b"pickle" not in path.read_bytes()[:64]
    back = Trace.load(path)
    assert back.side == "reference" and back.meta == {"case": "abc"}
    assert set(back.records) == set(t.records)
    for k, v in t.records.items():
        assert back.records[k].dtype == v.dtype
        assert torch.equal(back.records[k], v)


def test_keys_sort_in_execution_order():
    t = Trace("x")
    for key in [(1, "params", "a"), (1, "logits", "l"), (0, "param_sums", "a"), (0, "init", "a"), (1, "grads", "a")]:
        t.add(*key, torch.zeros(1))
    assert [k[1] for k in t.keys_sorted()] == ["init", "param_sums", "logits", "grads", "params"]


def test_pack_unpack_is_bit_identical_across_dtypes_and_shapes():
    """What a rank sends the pool (verify/sharded/worker.py): header + one buffer, records at
    aligned offsets; every record comes back with its dtype, shape and bits (NaN payloads and
    -0.0 included), whatever came before it in the buffer."""
    t = Trace("sharded", meta={"case": "abc", "dtypes": {"grads": "torch.float32"}})
    odd = torch.tensor([float("nan"), -0.0, 1e-45, float("inf")])
    t.add(0, "init", "odd", odd)
    t.add(0, "init", "w", torch.randn(3, 5, dtype=torch.float64))
    t.add(1, "logits", "logits", torch.randn(3, 7).to(torch.bfloat16))  # 42 bytes: the next is unaligned
    t.add(1, "loss", "loss", torch.tensor(1.5))  # 0-dim
    t.add(1, "grads", "empty", torch.zeros(0, 4))
    t.add(1, "rng", "r", torch.tensor([1, -(2**62)], dtype=torch.int64))
    t.add(1, "params", "h", torch.randn(5).to(torch.float16))
    t.add(1, "buffers", "mask", torch.tensor([True, False, True]))
    header, buf = t.pack()
    assert all(offset % 64 == 0 for *_, offset, _ in header["records"])
    back = Trace.unpack(json.loads(json.dumps(header)), bytearray(buf.numpy().tobytes()))
    assert back.side == "sharded" and back.meta == t.meta
    assert list(back.records) == list(t.records)
    for k, v in t.records.items():
        got = back.records[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_generator_fingerprints_sort_in_the_order_they_are_taken():
    """The first divergence is the first in time: micro-batch 10 after 9 (not after 1), and within
    one, before the forward, after it, after the backward (not alphabetically)."""
    from fsdp_verify.trace import sort_key

    taken = [(1, "rng", f"{p}.{m}") for m in range(12) for p in ("before_forward", "after_forward", "after_backward")]
    assert sorted(reversed(taken), key=sort_key) == taken
    assert sorted(
        [(2, "rng", "before_forward.0"), (1, "grads", "w"), (1, "rng", "after_backward.3")], key=sort_key
    ) == [
        (1, "rng", "after_backward.3"),
        (1, "grads", "w"),
        (2, "rng", "before_forward.0"),
    ]


def _sums(total: float) -> Trace:
    t = Trace("x")
    t.add(0, "init", "w", torch.tensor([float("inf"), -float("inf")]))
    t.add(0, "param_sums", "__total__", torch.tensor(total, dtype=torch.float64))
    return t


def test_parameter_sums_that_are_nan_on_both_sides_agree_and_on_one_side_part():
    """A run that overflowed the same way on both sides (a parameter holding inf and -inf, as
    cancellation data at scale 100 through a routed expert gave) sums to NaN on both: the same
    sum, not a divergence (it was one, found by a drawn FSDP1 case). NaN on one side only parts."""
    from fsdp_verify.compare.comparators import compare_traces

    def total_ok(ref: float, got: float) -> bool:
        findings = compare_traces(_sums(ref), _sums(got))
        return next(f for f in findings if f.phase == "param_sums").ok

    assert total_ok(float("nan"), float("nan"))
    assert not total_ok(float("nan"), 1.0)
    assert not total_ok(1.0, float("nan"))
