"""GPU tests of the sm90 kernel's pair form for few tiles (``csrc/kda/sm90/pair_intra_math.cuh``).

With at most half as many (sequence, value head) tiles as SMs and safe gates, the pair form runs
each tile on a cluster of two CTAs: each CTA on 64 of the 128 value columns, rank 0 forming A_kk,
the inverse and M - I, rank 1 A_qk, each handing its matrix to the other by a bulk copy into the
peer's shared memory. ``CULA_KDA_PAIR=1`` takes it wherever it can run (read per call);
``CULA_KDA_PAIR=0`` and ``CULA_KDA_COOPERATIVE=0`` give the fused kernel, one CTA per tile.

The pair form runs the fused kernel's arithmetic, element for element (the same A products, each
on its CTA; the same prep on 128 threads instead of 256; the state's value columns never mix), so
its results must be **bitwise** the fused kernel's, and within the contract of the fp32 recurrence.
A hand-off that lands in the wrong stage, a copy that overtakes a read, or a rank that computes
the other rank's columns shows up as a difference.

Cases: sequences shorter than one chunk, lengths on and off chunk edges, one tile (B1 H1), 66
tiles (132 CTAs on an H100: every SM), varlen mixes of long, short, length-1 and empty sequences
with initial states, both state layouts, GVA, precomputed gates without l2norm, bf16 beta; also
determinism and a CUDA-graph capture. (The host launches one cluster per tile, 2 x tiles <= SMs,
so a cluster never has a second tile.)
"""

from __future__ import annotations

import pytest
import torch

from test_sm90 import Spec, compare_to_reference, gpu_sm90, make_inputs, run_sm90, varlen

CASES = [
    Spec(B=1, T=1024, H=64, HV=64, h0=True, layout="kv"),  # the few-tile target row: 64 tiles
    Spec(B=1, T=1000, H=1, HV=1, h0=True, layout="vk"),  # one tile, 16 chunks, the last one short
    Spec(B=1, T=40, H=1, HV=2, h0=True, layout="kv"),  # shorter than a chunk
    Spec(B=2, T=777, H=2, HV=8, h0=True, layout="vk", gate="given", l2norm=False, beta="bf16"),
    Spec(B=1, T=2048, H=4, HV=16, h0=False, layout="kv", gate="lb_dtb", l2norm=False),  # GVA
    Spec(B=1, T=640, H=66, HV=66, h0=True, layout="vk"),  # 132 CTAs: every SM of an H100
    varlen("mix", [3000, 1, 0, 64, 65, 130, 2000], H=2, HV=4, h0=True, layout="vk"),
    varlen("long_short", [6000, 37, 100, 1], H=8, HV=8, h0=True, layout="kv", gate="lb_alog"),
    varlen("empties", [0, 0, 129, 0], H=1, HV=1, h0=True, layout="kv", cu64=True),
]


def _run(inp: dict, pair: str, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One call with the fused kernel (``pair`` "0") or the pair form ("1")."""
    monkeypatch.setenv("CULA_KDA_COOPERATIVE", "0")
    monkeypatch.setenv("CULA_KDA_PAIR", pair)
    return run_sm90(inp)


def _launch_name(spec: Spec) -> str:
    """The launch the dispatch chooses for ``spec`` (with the environment as set)."""
    from cula._ext import get_ext
    return get_ext().kda_prefill_sm90_launch_name(
        batch=spec.B, seqlen=spec.T, num_seqs=spec.N, num_qk_heads=spec.H, num_v_heads=spec.HV,
        varlen=spec.cu is not None, general_gates=False,
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count)


@gpu_sm90
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.id) for s in CASES])
def test_pair_bitwise_fused_and_reference(spec: Spec, seed: int, monkeypatch):
    inp = make_inputs(spec)
    o_fused, s_fused = _run(inp, "0", monkeypatch)
    o, s = _run(inp, "1", monkeypatch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if 2 * spec.N * spec.HV <= sms:
        assert _launch_name(spec) == "pair"  # CULA_KDA_PAIR=1 is still set
    compare_to_reference(spec, inp, o, s, what=f"{spec.id} pair")
    assert torch.equal(o, o_fused), f"o: pair vs fused differ ({(o.float() - o_fused.float()).abs().max():.3e})"
    assert torch.equal(s, s_fused), f"state: pair vs fused differ ({(s - s_fused).abs().max():.3e})"


@gpu_sm90
def test_pair_deterministic(seed: int, monkeypatch):
    spec = varlen("det", [2000, 1, 0, 700], H=2, HV=4, h0=True, layout="vk")
    inp = make_inputs(spec)
    o1, s1 = _run(inp, "1", monkeypatch)
    o2, s2 = _run(inp, "1", monkeypatch)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@gpu_sm90
def test_pair_cuda_graph(seed: int, monkeypatch):
    """The pair form captured in a CUDA graph and replayed on new inputs gives the eager results."""
    spec = Spec(B=1, T=1024, H=8, HV=8, h0=True, layout="kv")
    inp = make_inputs(spec)
    monkeypatch.setenv("CULA_KDA_COOPERATIVE", "0")
    monkeypatch.setenv("CULA_KDA_PAIR", "1")
    run_sm90(inp)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = run_sm90(inp)
    fresh = make_inputs(spec)
    for key, val in fresh.items():
        if isinstance(val, torch.Tensor) and isinstance(inp.get(key), torch.Tensor) and val.shape == inp[key].shape:
            inp[key].copy_(val)
    graph.replay()
    torch.cuda.synchronize()
    o, s = run_sm90(inp)
    assert torch.equal(o_g, o) and torch.equal(s_g, s)


@gpu_sm90
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_pair_state_pool_bitwise_fused(dtype: torch.dtype, layout: str, seed: int, monkeypatch):
    """A state pool read and written in place by index (pad slots, a sequence starting from zeros,
    an empty one, bf16 rows): the pair form writes bitwise the fused kernel's pool rows and o, and
    leaves the other rows alone; output_final_state=False gives the same o and writes nothing."""
    spec = varlen("pool", [300, 1, 0, 129], H=2, HV=4, h0=False, layout=layout)
    inp = make_inputs(spec)
    S = 6
    pool0 = (0.1 * torch.randn(S, spec.HV, 128, 128, device="cuda")).to(dtype)
    idx = torch.tensor([3, -1, 0, 5], device="cuda", dtype=torch.int32)
    has = torch.tensor([True, True, False, True], device="cuda")
    runs = {}
    for pair in ("0", "1"):
        monkeypatch.setenv("CULA_KDA_COOPERATIVE", "0")
        monkeypatch.setenv("CULA_KDA_PAIR", pair)
        assert _launch_name(spec) == ("pair" if pair == "1" else "index")
        pool = pool0.clone()
        o, state = run_sm90(inp, initial_state=pool, state_indices=idx, has_initial_state=has)
        assert state is pool
        read_only = pool0.clone()
        o_ro, none = run_sm90(inp, output_final_state=False, initial_state=read_only, state_indices=idx,
                              has_initial_state=has)
        assert none is None and torch.equal(read_only, pool0), "output_final_state=False wrote the pool"
        assert torch.equal(o_ro, o), "o differs with output_final_state=False"
        runs[pair] = (o, pool)
    (o_f, pool_f), (o_p, pool_p) = runs["0"], runs["1"]
    assert torch.equal(o_p, o_f), f"o: pair vs fused differ ({(o_p.float() - o_f.float()).abs().max():.3e})"
    assert torch.equal(pool_p, pool_f), "pool: pair vs fused differ"
    for row in (1, 2, 4):  # no sequence's slot
        assert torch.equal(pool_p[row], pool0[row]), f"pool row {row} changed"
    for row in (0, 3, 5):  # the sequences' slots were written
        assert not torch.equal(pool_p[row], pool0[row]), f"pool row {row} not written"
