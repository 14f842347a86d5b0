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
