"""Tolerances for a user's own loop, derived from the run itself (no emulation is possible: the
loop is the user's). Four rules; every record says which one held it.

* exact: the initial parameters (step 0). Both scripts start from the same values (same seed or
  checkpoint), sharding moves bits, nothing rounds; the fingerprints are float64 sums of those
  values, so they may differ only by the order of a float64 sum: 2 n u64 of the row's norm.
* bound: records computed before any optimizer update can differ (the loss and logits of the
  steps before the first optimizer step, the gradients of the first one). The sharded run computes
  each as the same sums in another order: per-rank partial sums over its share of the batch, then
  the data-parallel average over W ranks in the reduce dtype. Two orders of one sum of n terms
  differ by a few units of roundoff u of its magnitude; tolerance.py's floor, FLOOR_ULPS fp32
  units (9.5e-7 of the largest element; one more ulp of a coarser record dtype), plus 2 u for each
  halving of the terms the reduction adds (2 ceil(log2 W) u: a data-parallel average of W ranks).
* bound under a mixed precision policy (both runs under FSDP2 with the same MixedPrecisionPolicy:
  the reference `fully_shard` on a one-rank mesh). Both sides cast the same fp32 parameters to
  param_dtype before each forward (the same bits), compute each sample the same way, and reduce in
  reduce_dtype; what differs is where the gradient is rounded to param_dtype: the sharded run rounds
  each rank's partial gradient (its share of the batch), the reference the whole batch's once. Two
  different values rounded once each: up to u_p of their magnitude each way, 2 u_p (u_p: param
  dtype's unit roundoff; the partial sums' magnitude standing for the result's, as above), which is
  tolerance.py's "one ulp of a coarser dtype" (a bf16 logit flipped once is the same 2 u_p); then the
  average over W ranks costs 2 u_r per halving in the reduce dtype. So bound(param_dtype, W,
  reduce_dtype): 9.5e-7 + 7.8e-3 + 2 ceil(log2 W) u_r for bf16 parameters; an fp32 noise of 2e-6
  cannot be seen through bf16, and a bug must move a record by more than a bf16 ulp.
* the same, for the first optimizer step's gradients, with the magnitudes that were rounded (the
  Recorder records them under a coarse policy): "the partial sums' magnitude standing for the
  result's" fails where the terms cancel. Derivation, per element i: the reference rounds its
  whole-batch gradient once, ref_i = g_i (1 + d_0); each of the W ranks rounds its partial p_ri
  (g_i = mean_r p_ri) and the reduce averages them, got_i = mean_r p_ri (1 + d_r), |d| <= u_p. So
  |ref_i - got_i| <= u_p (|g_i| + mean_r |p_ri|), which is the sum of the magnitudes rounded, not
  the result: an RMSNorm weight's gradient, sum over tokens of x_hat * dy with terms of both signs,
  has |p_ri| up to several times |g_i|. Per row, by the triangle inequality, a row's norm moves by
  at most u_p (||g_row|| + mean_r ||p_r,row||) and its sum by sqrt(row length) times that, so
  against the normwise scale (the largest row norm of the reference's gradient) the term is
  u_p x S, S = max over rows of (A_ref + A_got) / max ||g_row||, with A a run's row norms rounded
  (summed over its backward passes: each micro-batch's gradient is rounded once), averaged over
  its ranks. Where nothing cancels A = ||g_row|| on both sides and S = 2: the 2 u_p above, which
  stays the floor (S below 2 only by rounding of the recorded magnitudes themselves).
* calibrated (with `--calibration RUN`, the reference script rerun with FSDP_VERIFY_PERTURB=seed):
  later records, where rounding differences compound through the optimizer (Adam divides by
  sqrt(v): an ulp in a small gradient is not small in the update). Limit: NOISE_MULTIPLE times the
  deviation between the reference and its perturbed rerun at that record, never below the bound.
* unjudged (no calibration run): the same later records are shown against the bound, for
  information, and cannot fail; the output says how many and how to judge them.
"""

from __future__ import annotations

import math

import torch

from fsdp_verify.compare.tolerance import NOISE_MULTIPLE, Tolerance, bound_tolerance, unit_roundoff

U64 = unit_roundoff(torch.float64)


def exact_fp64(row_len: int) -> Tolerance:
    limit = 2 * max(row_len, 2) * U64
    return Tolerance(
        "exact", limit, f"the same values; float64 fingerprints summed in another order (2 n u64 = {limit:.2g})"
    )


def bound(dtype: torch.dtype, world_size: int, reduce_dtype: torch.dtype = torch.float32) -> Tolerance:
    """dtype: the coarsest dtype the record passed through (its own, or a policy's param_dtype);
    reduce_dtype: the dtype of the data-parallel average."""
    base = bound_tolerance(dtype)
    halvings = math.ceil(math.log2(max(world_size, 1)))
    extra = 2 * halvings * unit_roundoff(reduce_dtype)
    r = str(reduce_dtype).replace("torch.", "")
    why = base.why + (
        f" + 2u({r}) x {halvings} halving(s) of a data-parallel average over {world_size} ranks" if halvings else ""
    )
    return Tolerance("bound", base.limit + extra, why)


def bound_rounded(
    dtype: torch.dtype, world_size: int, reduce_dtype: torch.dtype, spread: float, param_dtype: torch.dtype
) -> Tolerance:
    """bound() with the one-ulp term of param_dtype, 2 u_p, replaced by u_p x `spread` (S above:
    the magnitudes both runs rounded to param_dtype against the largest row's norm), never below."""
    plain = bound(dtype, world_size, reduce_dtype)
    if spread <= 2:
        return plain
    u_p = unit_roundoff(param_dtype)
    p = str(param_dtype).replace("torch.", "")
    return Tolerance(
        "bound",
        plain.limit + (spread - 2) * u_p,
        plain.why.replace(f"one {p} ulp (one rounding flip)", f"u({p}) x {spread:.4g}")
        + f" (the magnitudes rounded to {p}, each rank's partial gradient and the reference's whole,"
        f" are {spread:.4g}x the largest row's norm; 2 where no terms cancel)",
    )


def calibrated(
    dtype: torch.dtype, world_size: int, noise: float, reduce_dtype: torch.dtype = torch.float32
) -> Tolerance:
    floor = bound(dtype, world_size, reduce_dtype)
    if NOISE_MULTIPLE * noise <= floor.limit:
        return Tolerance(
            "calibrated",
            floor.limit,
            f"the bound {floor.limit:.3g} (above {NOISE_MULTIPLE:g}x the perturbed rerun's deviation {noise:.3g})",
        )
    return Tolerance(
        "calibrated",
        NOISE_MULTIPLE * noise,
        f"{NOISE_MULTIPLE:g}x the deviation {noise:.3g} of the reference's perturbed rerun (every gradient"
        " element moved by 2u max|g|, random signs, carried through the user's loop)",
    )


def unjudged(
    dtype: torch.dtype, world_size: int, reduce_dtype: torch.dtype = torch.float32, why: str | None = None
) -> Tolerance:
    b = bound(dtype, world_size, reduce_dtype)
    return Tolerance(
        "unjudged",
        b.limit,
        why
        or "after an optimizer step rounding compounds beyond any a-priori bound; shown against the bound"
        " for information only (record the reference again with FSDP_VERIFY_PERTURB=1 and pass --calibration)",
    )


def replica(dtype: torch.dtype) -> Tolerance:
    """Two ranks' copies of one replicated tensor (a plain tensor on every rank, a replicated
    DTensor): a data-parallel step gives every rank the same reduced gradient and the same update,
    so the copies hold the same values and their fingerprints, computed by the same kernels, agree
    (the bound's few units of roundoff, without a reduction between them). Ranks that train apart
    (no collective between them) differ by a learning-rate step, thousands of times more."""
    b = bound(dtype, 1)
    return Tolerance("replica", b.limit, f"replicas hold the same values on every rank ({b.why})")
