"""A small varlen GVA workload of the fused SM90 kernel, for compute-sanitizer.

Run by scripts/sanitizer_check.sh under memcheck, racecheck and synccheck; runs on its own too:

    python scripts/sanitizer_case.py

H=2 q/k heads, HV=4 value heads, cu_seqlens [0, 0, 1, 65, 130, 200] (an empty sequence, a
length-1 one, 64 and 65 tokens across chunk edges, a 70-token tail: 20 tiles, so the pair form
runs, two CTAs of a cluster per tile exchanging A_qk and M - I through each other's shared
memory), once per kernel instantiation (gate in kernel / given x l2norm on / off), with both state layouts, both beta
dtypes, int32 and int64 cu_seqlens, with and without an initial state, and once without the
final state; then with 70 sequences (lengths 0..130), whose 280 (sequence, head) tiles exceed one
wave, under both tile schedules (index order, and longest first on persistent CTAs); then with
GPU cu_seqlens holding bad values (decreasing, negative, past the end of the token axis), which the
kernel must clamp to [0, T] without touching memory outside its tensors (memcheck is the check);
finally two configurations and the bad cu_seqlens again in the cooperative mode
(CULA_KDA_COOPERATIVE=1: helper CTAs compute the chunks and hand them to the tile owners through a
global workspace), with one owner per tile, with two (CULA_KDA_VALUE_SPLIT=1 / =2: each owner on
half of the value columns) and with the kernel's choice per tile (unset); and in 4 segments per
tile (CULA_KDA_SEGMENTS=4: P/Q chains, fp32 fix-ups through the workspace, reruns). The
general-gate kernels (safe_gate=False: the softplus gate, the lower-bound gate at -8, precomputed
log decays down to -30 with a channel at -inf) run in index order, longest first and the
cooperative mode.
Inputs are drawn on the CPU and copied, and the reference runs on the CPU, so the GPU work that
the sanitizer instruments is the copies and the kernel itself.

Exit status: 0 when every call ran on backend "sm90" and matched the fp32 reference (relative L2
error <= 5e-3, all finite); 1 on a mismatch; 2 when the fused kernel cannot run here.
"""

from __future__ import annotations

import os
import sys

try:
    import cula  # noqa: F401  (an installed cula, or the repository on PYTHONPATH)
except ImportError:  # run from a checkout with the extension built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from cula.kda import kda_prefill, last_backend
from cula.kda.reference import kda_recurrent_reference, sequence_ranges

CU = [0, 0, 1, 65, 130, 200]
_MANY = [(7 * i) % 23 for i in range(70)]
_MANY[5], _MANY[33] = 130, 1
CU_MANY = [sum(_MANY[:i]) for i in range(len(_MANY) + 1)]  # 70 sequences, one empty (i = 0)
CU_SEGMENTS = [0, 900, 903]
H, HV, D = 2, 4, 128
RTOL = 5e-3

# (gate in kernel, l2norm, state layout, beta bf16, cu int64, initial state, final state)
CONFIGS = [
    (True, True, "kv", False, False, True, True),
    (True, False, "vk", True, True, True, True),
    (False, True, "vk", False, True, False, True),
    (False, False, "kv", True, False, True, True),
    (True, True, "vk", True, False, True, False),
]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


#: Gate forms: "safe" (decays in [-5, 0): the safe-gate kernels); the general-gate kernels
#: (safe_gate=False): "softplus" (Kimi-Linear's -exp(A_log) softplus(g + dt_bias), A_log ~ N(0, 1),
#: g ~ 2 N(0, 1): most 16-row blocks wide), "lower_bound_8" (the lower-bound gate at -8) and
#: "unbounded" (precomputed log decays down to -30, one channel per value head at -inf).
GATE_FORMS = ("safe", "softplus", "lower_bound_8", "unbounded")


def run_one(gate_in: bool, l2: bool, layout: str, beta_bf16: bool, cu64: bool, with_h0: bool,
            want_state: bool, cu: list[int] = CU, gate_form: str = "safe") -> bool:
    assert gate_form in GATE_FORMS and (gate_form == "unbounded") == (gate_form != "safe" and not gate_in)
    T, N = cu[-1], len(cu) - 1
    bf16 = torch.bfloat16
    q = torch.randn(1, T, H, D)
    k = torch.randn(1, T, H, D)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(1, T, HV, D)
    if gate_form == "softplus":
        g = 2.0 * torch.randn(1, T, HV, D)
    elif gate_form == "unbounded":
        g = -30.0 * torch.rand(1, T, HV, D)
        g[..., 3] = float("-inf")  # a channel that resets completely
    else:
        g = torch.randn(1, T, HV, D) if gate_in else (-5.0 * torch.rand(1, T, HV, D)).clamp(-5.0, -1e-3)
    beta = torch.sigmoid(torch.randn(1, T, HV))
    lower_bound = {"safe": -5.0, "lower_bound_8": -8.0}.get(gate_form) if gate_in else None
    cpu = dict(
        q=q.to(bf16), k=k.to(bf16), v=v.to(bf16), g=g.to(bf16),
        beta=beta.to(bf16) if beta_bf16 else beta,
        initial_state=0.1 * torch.randn(N, HV, D, D) if with_h0 else None,
        cu_seqlens=torch.tensor(cu, dtype=torch.int64 if cu64 else torch.int32),
        A_log=(torch.randn(HV) if gate_form == "softplus" else 0.1 * torch.randn(HV)) if gate_in else None,
        dt_bias=(0.5 if gate_form == "softplus" else 0.1) * torch.randn(HV * D) if gate_in else None,
        use_gate_in_kernel=gate_in, use_qk_l2norm_in_kernel=l2,
        lower_bound=lower_bound, state_layout=layout,
    )
    gpu = {name: x.cuda() if isinstance(x, torch.Tensor) else x for name, x in cpu.items()}

    o, fs = kda_prefill(**gpu, output_final_state=want_state, safe_gate=gate_form == "safe", backend="sm90")
    torch.cuda.synchronize()
    assert last_backend() == "sm90", last_backend()
    o, fs = o.cpu(), (fs.cpu() if fs is not None else None)

    ref_o, ref_s = kda_recurrent_reference(**cpu, output_final_state=True, dtype=torch.float32)
    finite = bool(torch.isfinite(o.float()).all()) and (fs is None or bool(torch.isfinite(fs).all()))
    eo = rel(o, ref_o)
    es = rel(fs, ref_s) if fs is not None else 0.0
    empty_ok = True
    if fs is not None:
        for n in range(N):
            if cu[n + 1] == cu[n]:
                want = cpu["initial_state"][n] if with_h0 else torch.zeros_like(fs[n])
                empty_ok &= bool(torch.equal(fs[n], want))
    ok = finite and eo <= RTOL and es <= RTOL and empty_ok and (fs is None) == (not want_state)
    print(f"{'ok  ' if ok else 'FAIL'} gate={'kernel' if gate_in else 'given':6s} form={gate_form} l2norm={int(l2)} "
          f"layout={layout} beta={'bf16' if beta_bf16 else 'fp32'} cu={'int64' if cu64 else 'int32'} "
          f"h0={int(with_h0)} final_state={int(want_state)} sequences={N}: err o {eo:.2e}, state {es:.2e}, "
          f"finite={finite}, empty-sequence state={'ok' if empty_ok else 'WRONG'}", flush=True)
    return ok


# GPU cu_seqlens that no host check sees: decreasing, negative and past-the-end values. The kernel
# clamps sequence n to [clamp(cu[n], 0, T), clamp(cu[n+1], start, T)] (tile_scheduler.cuh), as
# cula.kda.reference.sequence_ranges does.
CU_BAD = [0, 50, 30, -10, 500, 120, 7]
T_BAD = 200


def run_bad_cu_seqlens() -> bool:
    """Bad GPU cu_seqlens: every clamped sequence that overlaps no other one matches the reference."""
    bf16 = torch.bfloat16
    N = len(CU_BAD) - 1
    q, k = torch.randn(1, T_BAD, H, D), torch.randn(1, T_BAD, H, D)
    v, g = torch.randn(1, T_BAD, HV, D), torch.randn(1, T_BAD, HV, D)
    beta = torch.sigmoid(torch.randn(1, T_BAD, HV))
    common = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    A_log, dt_bias = 0.1 * torch.randn(HV), 0.1 * torch.randn(HV * D)
    h0 = 0.1 * torch.randn(N, HV, D, D)
    cu = torch.tensor(CU_BAD, dtype=torch.int32, device="cuda")  # on the GPU: not validated
    o, fs = kda_prefill(q.to(bf16).cuda(), k.to(bf16).cuda(), v.to(bf16).cuda(), g.to(bf16).cuda(),
                        beta.cuda(), initial_state=h0.cuda(), output_final_state=True, cu_seqlens=cu,
                        A_log=A_log.cuda(), dt_bias=dt_bias.cuda(), safe_gate=True, backend="sm90", **common)
    torch.cuda.synchronize()
    o, fs = o.cpu(), fs.cpu()
    ok = bool(torch.isfinite(fs).all())
    ranges = sequence_ranges(torch.tensor(CU_BAD), T_BAD)
    for n, (b, e) in enumerate(ranges):
        if b == e:  # empty after clamping: the final state is the initial state
            ok &= bool(torch.equal(fs[n], h0[n]))
            continue
        overlaps = any(m != n and bm < e and b < em for m, (bm, em) in enumerate(ranges))
        sl = slice(b, e)
        ref_o, ref_s = kda_recurrent_reference(
            q.to(bf16)[:, sl], k.to(bf16)[:, sl], v.to(bf16)[:, sl], g.to(bf16)[:, sl], beta[:, sl],
            initial_state=h0[n:n + 1], output_final_state=True, A_log=A_log, dt_bias=dt_bias,
            dtype=torch.float32, **common)
        es = rel(fs[n:n + 1], ref_s)
        ok &= es <= RTOL
        if not overlaps:  # overlapping sequences write the same output rows
            ok &= rel(o[:, sl], ref_o) <= RTOL
    print(f"{'ok  ' if ok else 'FAIL'} bad GPU cu_seqlens {CU_BAD} with T={T_BAD} -> clamped {ranges}", flush=True)
    return ok


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        print("sanitizer_case: needs an SM90 (Hopper) GPU", file=sys.stderr)
        return 2
    from cula._ext import kernels_available, kernels_unavailable_reason

    if not kernels_available():
        print(f"sanitizer_case: {kernels_unavailable_reason()}", file=sys.stderr)
        return 2
    torch.manual_seed(int(os.environ.get("CULA_TEST_SEED", "0")))
    print(f"sanitizer_case: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"H={H} HV={HV} cu_seqlens={CU}", flush=True)
    results = [run_one(*cfg) for cfg in CONFIGS]
    for schedule in ("index", "longest_first"):
        os.environ["CULA_KDA_SCHEDULE"] = schedule
        print(f"sanitizer_case: CULA_KDA_SCHEDULE={schedule}", flush=True)
        results.append(run_one(True, True, "kv", False, False, True, True, cu=CU_MANY))
    del os.environ["CULA_KDA_SCHEDULE"]
    # The general-gate kernels (safe_gate=False: each gate form x l2norm in one of the calls), in
    # index order, longest first and the cooperative mode.
    general = [(True, True, "kv", False, False, True, True, "softplus"),
               (True, False, "vk", True, True, True, True, "lower_bound_8"),
               (False, True, "vk", False, True, False, True, "unbounded"),
               (False, False, "kv", True, False, True, True, "unbounded")]
    print("sanitizer_case: general gates (safe_gate=False)", flush=True)
    for *cfg, form in general:
        results.append(run_one(*cfg, gate_form=form))
    for schedule in ("index", "longest_first"):
        os.environ["CULA_KDA_SCHEDULE"] = schedule
        print(f"sanitizer_case: general gates, CULA_KDA_SCHEDULE={schedule}", flush=True)
        for *cfg, form in general[:3:2]:
            results.append(run_one(*cfg, cu=CU_MANY, gate_form=form))
    del os.environ["CULA_KDA_SCHEDULE"]
    os.environ["CULA_KDA_COOPERATIVE"] = "1"
    print("sanitizer_case: general gates, CULA_KDA_COOPERATIVE=1", flush=True)
    for *cfg, form in general:
        results.append(run_one(*cfg, gate_form=form))
    del os.environ["CULA_KDA_COOPERATIVE"]
    results.append(run_bad_cu_seqlens())
    os.environ["CULA_KDA_COOPERATIVE"] = "1"
    for split in ("1", "2", None):  # None: one or two owners per tile, as the kernel's model decides
        if split is None:
            os.environ.pop("CULA_KDA_VALUE_SPLIT", None)
        else:
            os.environ["CULA_KDA_VALUE_SPLIT"] = split
        print(f"sanitizer_case: CULA_KDA_COOPERATIVE=1 CULA_KDA_VALUE_SPLIT={split or '(unset)'}", flush=True)
        results += [run_one(*cfg) for cfg in CONFIGS[:2]]
        results.append(run_bad_cu_seqlens())
    # The forms of the mode: a helpers' kernel with two intra-chunk warpgroups per CTA, then the
    # owners' kernel started while it runs (HELPER_KERNEL=1), with one intra warpgroup, with the
    # owners after the helpers, one kernel with both roles (the host's default picks one), and the
    # helpers releasing a stage only after its write has landed.
    for form in ({"CULA_KDA_HELPER_KERNEL": "1"}, {"CULA_KDA_HELPER_KERNEL": "1", "CULA_KDA_HELPER_INTRA": "1"},
                 {"CULA_KDA_HELPER_KERNEL": "1", "CULA_KDA_OVERLAP_OWNERS": "0"}, {"CULA_KDA_HELPER_KERNEL": "0"},
                 {"CULA_KDA_HELPER_KERNEL": "1", "CULA_KDA_EARLY_RELEASE": "0"}):
        os.environ.update(form)
        print("sanitizer_case: CULA_KDA_COOPERATIVE=1 " + " ".join(f"{k}={v}" for k, v in form.items()), flush=True)
        results += [run_one(*cfg) for cfg in CONFIGS[:2]]
        for name in form:
            del os.environ[name]
    # Segments (CULA_KDA_SEGMENTS=4: the chains of 4 segments per tile at once, fp32 fix-ups
    # through the workspace): 2 sequences x 4 heads, so the owner region (16 CTAs per tile) fits.
    os.environ["CULA_KDA_SEGMENTS"] = "4"
    print("sanitizer_case: CULA_KDA_COOPERATIVE=1 CULA_KDA_SEGMENTS=4", flush=True)
    results += [run_one(*cfg, cu=CU_SEGMENTS) for cfg in CONFIGS[:2]]
    del os.environ["CULA_KDA_SEGMENTS"]
    del os.environ["CULA_KDA_COOPERATIVE"]
    print(f"sanitizer_case: {sum(results)}/{len(results)} calls matched the reference", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
