"""The reference split over the ranks of a run in place (verify/sharded/shared_reference.py):
rank 0's trace is the one a single process records, bit for bit, whatever the case; a model whose
forward changes its buffers, or a rank that cannot write its passes, makes every process give up
the split together; and the whole path under a real `torchrun`: a correct engine is EQUIVALENT
(across two hosts), a mutant is caught (on one)."""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_verify import launch
from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, LossScaleSpec, PrecisionSpec
from fsdp_verify.reference import train_reference
from fsdp_verify.sharded.arena import release_arenas
from fsdp_verify.sharded.shared_reference import SharedReference, SplitUnsafe
from fsdp_verify.sharded.worker import exit_now, leave_process_group
from fsdp_verify.training.threads import rank_like_threads
from tests.conftest import lm_case, mlp_case
from tests.ranks import spawn

ROOT = Path(__file__).resolve().parent.parent

FP16 = PrecisionSpec(param_dtype="fp16", reduce_dtype="fp32")
SMALL_LM = ModelSpec(kind="transformer", vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, seq_len=6)
CASES = {
    "mlp-fp32": mlp_case(2, steps=3),
    "mlp-3-ranks-on-2-processes-clip": mlp_case(3, steps=2, clip_norm=0.05),
    "lm-dropout-microbatches-sync-last": lm_case(2, microbatches=2, sync_every_microbatch=False).with_(
        model=dataclasses.replace(SMALL_LM, dropout=0.2)
    ),
    "lm-bf16-fp32-reduce": lm_case(2, precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")),
    # scales that overflow: a skipped step on every process alike
    "mlp-fp16-loss-scaling": mlp_case(
        2, steps=4, precision=FP16, loss_scaling=LossScaleSpec(init_scale=2.0**16, growth_interval=1)
    ),
    "lm-4-ranks-on-2-processes": lm_case(4, data=DataSpec(batch_size=8)),
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads too (a skipped fp16 step's gradients hold NaN and inf)."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _split(rank: int, processes: int, init: str, directory: str, case: Case, out: str, full: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=processes)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if full and rank == 1:  # its memory directory fills up: a write past 1 KB fails
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
        try:
            with rank_like_threads():
                trace = train_reference(case, share=SharedReference(rank, processes, directory))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)  # the result is written below
        if rank == 0:
            torch.save({"records": trace.records, "meta": trace.meta}, out)
    except SplitUnsafe as e:
        torch.save({"unsafe": str(e)}, f"{out}.{rank}")
    except BaseException:
        release_arenas()
        dist.destroy_process_group()
        raise
    # As a pool worker leaves: groups freed while the interpreter is alive, then no finalisation
    # (gloo's threads racing C++ static destructors abort a rank at exit under load).
    release_arenas()
    leave_process_group()
    exit_now(0)


def _run_split(case: Case, processes: int = 2, full: bool = False) -> tuple[dict, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        spawn(_split, args=(processes, os.path.join(tmp, "init"), tmp, case, out, full), nprocs=processes)
        got = {f"unsafe.{r}": torch.load(f"{out}.{r}") for r in range(processes) if os.path.exists(f"{out}.{r}")}
        if os.path.exists(out):
            got.update(torch.load(out))
        left = sorted(n for n in os.listdir(tmp) if n.startswith("arena-"))
        return got, left


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_reference_records_what_one_process_records(name):
    case = CASES[name]
    got, left = _run_split(case)
    with rank_like_threads():
        whole = train_reference(case)
    assert set(got["records"]) == set(whole.records)
    differ = [k for k, v in whole.records.items() if not _same_bits(v, got["records"][k])]
    assert not differ, f"{len(differ)} records differ from the single process's, first {differ[0]}"
    assert got["meta"] == whole.meta
    assert left == [], "the processes' arenas were left behind"


def test_a_forward_that_changes_buffers_makes_every_process_give_up_the_split():
    case = lm_case(2).with_(model=ModelSpec(kind="custom", factory="tests.user.models:batchnorm_lm", seq_len=6))
    got, _ = _run_split(case)
    assert "records" not in got
    assert sorted(got) == ["unsafe.0", "unsafe.1"]
    assert "buffers" in got["unsafe.0"]["unsafe"]


def test_a_rank_that_cannot_write_its_passes_makes_every_process_give_up_the_split():
    got, left = _run_split(mlp_case(2), full=True)
    assert "records" not in got
    assert sorted(got) == ["unsafe.0", "unsafe.1"]
    assert "could not write" in got["unsafe.0"]["unsafe"]
    assert left == []


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    return launch.run([*cmd, "-m", "fsdp_verify", "check", *args], env=env, cwd=ROOT, timeout=300)


def test_in_place_under_torchrun_a_mutant_is_caught(tmp_path):
    """A correct engine under torchrun is EQUIVALENT in the two-hosts test below (one launch of
    three processes each: not paid twice). Here, on one host, every record before the mutant's
    gradients agrees (the initial parameters, step 1's logits and loss: the split reference's
    forward is right), and its gradients are the first to part."""
    import json

    out = tmp_path / "verdict.json"
    bad = _torchrun("--steps", "2", "--engine", "fsdp_verify.zoo.mutants:grads_not_averaged", "--json", str(out))
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    first = json.loads(out.read_text())["first_divergence"]
    assert (first["step"], first["phase"]) == (1, "grads"), first


def _two_hosts(tmp_path: Path, *args: str) -> tuple[list[subprocess.CompletedProcess], dict]:
    """`torchrun --nnodes 2 --nproc-per-node 2` with c10d rendezvous, as two launchers on this
    machine (two "hosts": torchrun's GROUP_RANK tells them apart); returns both launchers' results
    and rank 0's verdict JSON."""
    import json
    import socket

    with socket.socket() as s:  # a free port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    launcher = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2"]
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-hosts"]
    out = tmp_path / "verdict.json"
    cmd = [*launcher, *rendezvous, "-m", "fsdp_verify", "check", "--world-size", "4", "--json", str(out), *args]
    with ThreadPoolExecutor(2) as pool:  # the two launchers at once, as two hosts start them
        done = list(pool.map(lambda _: launch.run(cmd, env=env, cwd=ROOT, timeout=300), range(2)))
    said = "\n".join(
        f"launcher {i}: exit {n.returncode}\n{n.stdout[-1500:]}\n{n.stderr[-3000:]}" for i, n in enumerate(done)
    )
    assert out.exists(), f"rank 0 wrote no verdict\n{said}"  # what each launcher said, to tell why
    return done, json.loads(out.read_text())


def test_in_place_across_two_hosts_the_reference_splits_only_over_rank_0s_host(tmp_path):
    nodes, verdict = _two_hosts(tmp_path, "--steps", "2")
    for node in nodes:
        assert node.returncode == 0, node.stdout + node.stderr[-3000:]
    assert verdict["ok"] and "EQUIVALENT" in verdict["summary"]
    assert verdict["reference_ranks"] == [0, 1]  # rank 0's host; ranks 2 and 3 sit on the other


@pytest.mark.slow  # CI: a mutant caught under torchrun on one host, a correct run across two
def test_in_place_across_two_hosts_a_mutant_is_caught(tmp_path):
    nodes, verdict = _two_hosts(tmp_path, "--steps", "2", "--engine", "fsdp_verify.zoo.mutants:grads_not_averaged")
    assert [node.returncode for node in nodes] == [1, 1], [n.stderr[-2000:] for n in nodes]
    assert not verdict["ok"] and verdict["first_divergence"]["phase"] == "grads"
