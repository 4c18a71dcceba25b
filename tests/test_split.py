"""GPU tests of the sm90 kernel's modes for few tiles (``docs/kernel.md``, "Few tiles").

With few (sequence, value head) tiles the host does not run one fused CTA per tile: by default the
cooperative mode (one CTA per SM; the CTAs without a tile compute chunks for the tile owners and
hand them over through a workspace), or the split mode (two launches: every chunk in parallel,
then the recurrence per tile). ``CULA_KDA_SPLIT=0`` / ``=1`` / ``=2`` forces fused / split /
cooperative (read per call), so every case here runs all three:

* each mode against the fp32 recurrence (the numerics contract, as in ``test_sm90.py``);
* split and cooperative against fused **bitwise**: the state warpgroups consume byte copies of the
  stages the fused kernel would have handed over, so any difference is a bug (a chunk at the wrong
  slot, a missing, stale or early-read stage), not rounding.

Cases: chunk-slot ranges that start and end inside and on chunk edges, sequences shorter than one
chunk, one head over all SMs, varlen mixes of long, short, length-1 and empty sequences with
initial states, both state layouts, GVA, precomputed gates, bf16 beta, T = 65536 with an initial
state; also a CUDA-graph capture (the workspace comes from the graph's pool) and determinism.
"""

from __future__ import annotations

import pytest
import torch

from test_sm90 import Spec, compare_to_reference, gpu_sm90, make_inputs, run_sm90, varlen

SPLIT_CASES = [
    Spec(B=1, T=4096, H=2, HV=4, h0=True, layout="kv"),
    Spec(B=1, T=1000, H=1, HV=1, h0=True, layout="vk"),  # one head: ~one chunk slot per CTA
    Spec(B=1, T=40, H=1, HV=2, h0=True, layout="kv"),  # shorter than a chunk
    Spec(B=2, T=777, H=2, HV=8, h0=True, layout="vk", gate="given", l2norm=False, beta="bf16"),
    Spec(B=1, T=2048, H=4, HV=16, h0=False, layout="kv", gate="lb_dtb", l2norm=False),  # GVA
    varlen("mix", [3000, 1, 0, 64, 65, 130, 2000], H=2, HV=4, h0=True, layout="vk"),
    varlen("long_short", [6000, 37, 100, 1], H=8, HV=8, h0=True, layout="kv", gate="lb_alog"),
    varlen("empties", [0, 0, 129, 0], H=1, HV=1, h0=True, layout="kv", cu64=True),
]


def _run(inp: dict, split: str, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setenv("CULA_KDA_SPLIT", split)
    return run_sm90(inp)


MODES = {"split": "1", "cooperative": "2"}


@gpu_sm90
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.id) for s in SPLIT_CASES])
def test_modes_match_fused_and_reference(spec: Spec, seed: int, monkeypatch):
    inp = make_inputs(spec)
    o_fused, s_fused = _run(inp, "0", monkeypatch)
    for name, value in MODES.items():
        o, s = _run(inp, value, monkeypatch)
        compare_to_reference(spec, inp, o, s, what=f"{spec.id} {name}")
        assert torch.equal(o, o_fused), f"o: {name} and fused differ, max {(o.float() - o_fused.float()).abs().max()}"
        assert torch.equal(s, s_fused), f"state: {name} and fused differ, max {(s - s_fused).abs().max()}"


@gpu_sm90
@pytest.mark.parametrize("mode", list(MODES))
def test_long_sequence_with_initial_state(mode: str, seed: int, monkeypatch):
    """T = 65536 on one head: 1025 chunk slots over the SMs, 1024 chunks of recurrence."""
    spec = Spec(B=1, T=65536, H=1, HV=1, h0=True, layout="kv")
    inp = make_inputs(spec)
    o, fs = _run(inp, MODES[mode], monkeypatch)
    compare_to_reference(spec, inp, o, fs, what=f"{spec.id} {mode}")


@gpu_sm90
def test_cooperative_is_the_default_for_few_tiles(seed: int, monkeypatch):
    """Without the variable, a call with few tiles takes the cooperative mode: bitwise the forced one."""
    spec = Spec(B=1, T=700, H=2, HV=4, h0=True)
    inp = make_inputs(spec)
    o_forced, s_forced = _run(inp, "2", monkeypatch)
    monkeypatch.delenv("CULA_KDA_SPLIT")
    o_auto, s_auto = run_sm90(inp)
    assert torch.equal(o_auto, o_forced) and torch.equal(s_auto, s_forced)


@gpu_sm90
@pytest.mark.parametrize("mode", list(MODES))
def test_deterministic(mode: str, seed: int, monkeypatch):
    spec = varlen("det", [1500, 3, 700], H=2, HV=4, h0=True)
    inp = make_inputs(spec)
    o1, s1 = _run(inp, MODES[mode], monkeypatch)
    for _ in range(3):
        o2, s2 = _run(inp, MODES[mode], monkeypatch)
        assert torch.equal(o1, o2) and torch.equal(s1, s2)


@gpu_sm90
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_graph(mode: str, seed: int, monkeypatch):
    """Captured with its workspace from the graph's pool; a replay on new inputs written in place
    equals the eager call on them."""
    monkeypatch.setenv("CULA_KDA_SPLIT", MODES[mode])
    spec = varlen("graph", [900, 64, 1], H=2, HV=4, h0=True)
    inp = make_inputs(spec)
    run_sm90(inp)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = run_sm90(inp)
    fresh = make_inputs(spec)
    for key in ("q", "k", "v", "g", "beta", "initial_state"):
        inp[key].copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    o_e, s_e = run_sm90(inp)
    assert torch.equal(o_g, o_e) and torch.equal(s_g, s_e)
