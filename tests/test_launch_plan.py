"""Host tests of the sm90 dispatch's launch choice (``csrc/kda/sm90/kda_prefill_dispatch.cu``), through
the extension's ``kda_prefill_sm90_launch_name`` (host only: no GPU needed, only the built
extension).

The names: "index" / "longest-first" (the fused kernel's tile schedules), or
"cooperative-{one-kernel,two-kernels}" followed by how the tiles are owned: nothing (one owner CTA
per tile), "-split" / "-split-on-device", "-<k>-tiles-per-owner" or "-<G>-segments". The rules
(``docs/kernel.md``, ``docs/perf-notes.md`` for the measurements behind the constants):

* longest first for more tiles than SMs (safe gates), index order otherwise;
* "pair" (the fused kernel on two CTAs per tile, ``csrc/kda/sm90/pair_intra_math.cuh``) instead of
  index order where two CTAs per tile fit on the SMs (safe gates);
* cooperative for at most 0.4 x the SMs in tiles (and four chunks of tokens), and up to the SM count
  where fits of the measured times put the mode (from the model of owners' chains and helpers)
  below the fused kernel;
* several tiles per owner (fixed length) where the helpers bound the launch;
* segments for very few long tiles; the one-kernel form where the owners' chains bound the launch.

Each ``CULA_KDA_*`` variable forces its choice; every case clears them first.
"""

from __future__ import annotations

import os

import pytest

import cula

pytestmark = pytest.mark.skipif(not cula.kernels_available(), reason="needs the built extension (cula._C)")

SMS = 132  # an H100 SXM


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("CULA_KDA_")]:
        monkeypatch.delenv(name)


def launch(B: int, T: int, H: int, HV: int | None = None, *, lens: list[int] | None = None,
           general: bool = False, sms: int = SMS) -> str:
    """The launch for B x T tokens (or one varlen batch of ``lens``) at H / HV heads."""
    from cula._ext import get_ext
    HV = H if HV is None else HV
    if lens is not None:
        B, T = 1, sum(lens)
    return get_ext().kda_prefill_sm90_launch_name(
        batch=B, seqlen=T, num_seqs=len(lens) if lens is not None else B, num_qk_heads=H, num_v_heads=HV,
        varlen=lens is not None, general_gates=general, sm_count=sms)


def test_fused_schedules(monkeypatch):
    lens100 = [128] * 100  # 6400 tiles of two chunks
    assert launch(1, 0, 64, lens=lens100) == "longest-first"
    assert launch(1, 0, 64, lens=lens100, general=True) == "longest-first"  # general gates alike
    assert launch(8, 1024, 64) == "longest-first"  # 512 tiles: more than one wave
    assert launch(1, 0, 64, lens=[819] * 10) == "longest-first"  # long sequences too
    assert launch(1, 0, 64, lens=[819] * 10, general=True) == "longest-first"
    assert launch(2, 8192, 64) == "index"  # 128 tiles: one per SM
    assert launch(1, 255, 4) == "pair"  # fewer than four chunks of tokens; 8 CTAs fit
    monkeypatch.setenv("CULA_KDA_PAIR", "0")
    assert launch(1, 255, 4) == "index"
    monkeypatch.delenv("CULA_KDA_PAIR")
    monkeypatch.setenv("CULA_KDA_SCHEDULE", "index")
    assert launch(1, 0, 64, lens=lens100) == "index"
    assert launch(8, 1024, 64) == "index"
    monkeypatch.setenv("CULA_KDA_SCHEDULE", "longest_first")  # the default, where it applies
    assert launch(8, 1024, 64) == "longest-first"
    assert launch(2, 64, 64) == "index"  # 128 tiles do not exceed the SMs


def test_few_tiles_cooperative():
    # B1 T32768 H8: the owners' chains bound it (512 chunks x 1.4 us against 4096 x 12 us over 116
    # helpers): one kernel, two owners per tile, no segments.
    assert launch(1, 32768, 8) == "cooperative-one-kernel-split"
    assert launch(1, 2 ** 20, 8) == "pair"  # the workspace (one stage per chunk and head) past 4 GiB: fused
    # B1 T8192 H16: the helpers bound it: two kernels.
    assert launch(1, 8192, 16) == "cooperative-two-kernels-split"
    # Fixed length: the host decides the value split (value_split_pays). Measured (H100, blocks of
    # consecutive calls, ms one owner / two owners per tile): B1 T8192 H20 0.370 / 0.307, H24 0.360
    # / 0.330, H26 0.370 / 0.355, H28 0.370 / 0.417; B1 T16384 H20 0.643 / 0.503, H28 0.681 / 0.764;
    # B1 T4096 H20 0.201 / 0.168, H24 0.205 / 0.194. The general gates keep the older constant.
    assert launch(1, 8192, 20) == "cooperative-two-kernels-split"
    assert launch(1, 8192, 26) == "cooperative-two-kernels-split"
    assert launch(1, 8192, 28) == "cooperative-two-kernels"
    assert launch(1, 16384, 20) == "cooperative-two-kernels-split"
    assert launch(1, 16384, 28) == "cooperative-two-kernels"
    assert launch(1, 4096, 24) == "cooperative-two-kernels-split"
    assert launch(1, 8192, 20, general=True) == "cooperative-two-kernels"
    # one long prompt among short ones (the mean decides the form; the kernel the split per tile)
    assert launch(1, 0, 8, lens=[30000, 100, 37, 1]) == "cooperative-two-kernels-split-on-device"
    assert launch(1, 0, 8, lens=[30000, 100, 37, 1], general=True) == "cooperative-two-kernels-split-on-device"


def test_segments():
    # The fastest G of each measured set (H100, each G in blocks of consecutive calls, eager ms):
    # B1 T65536 H4: 3 0.979, 4 0.788, 5 0.809, 6 0.941; B1 T131072 H2: 6 1.069, 7 0.995, 8 0.956,
    # 9 1.014; B1 T65536 H2: 6 0.619, 7 0.588, 8 0.603; B1 T65536 H3: 4 0.786, 5 0.672; B1 T32768
    # H4: none 0.673, 3 0.528, 4 0.448, 5 0.479; B1 T32768 H6: none 0.679, 3 0.572, 4 0.626; B1
    # T65536 H6: none 1.311, 3 1.069; B1 T16384 H4: 3 0.302, 4 0.280, 5 0.310; B1 T16384 H2: 4
    # 0.271, 5 0.281; B1 T131072 H1: 10-14 within 1.5 % (11 the fastest); B1 T32768 H8: none
    # 0.682, 3 0.720; B1 T65536 H1: 8 0.608, 11 0.645; B1 T32768 H1: 5 0.402, 6 0.392, 8 0.387 (6
    # 0.379 in the same process); B1 T16384 H5: none 0.377, 3 0.321; B1 T65536 H5: 3 1.001, 4
    # 0.954; B1 T262144 H1: 11 1.362, 14 1.308; H2: 7 1.784, 8 1.683; H3: 5 2.355, 6 2.275; H8:
    # none 5.159, 3 5.132; B1 T131072 H8: none 2.575, 3 2.626.
    assert launch(1, 65536, 4) == "cooperative-two-kernels-4-segments"
    assert launch(1, 131072, 2) == "cooperative-two-kernels-8-segments"
    assert launch(1, 65536, 2) == "cooperative-two-kernels-7-segments"
    assert launch(1, 65536, 3) == "cooperative-two-kernels-5-segments"
    assert launch(1, 32768, 4) == "cooperative-two-kernels-4-segments"
    assert launch(1, 32768, 6) == "cooperative-two-kernels-3-segments"
    assert launch(1, 65536, 6) == "cooperative-two-kernels-3-segments"
    assert launch(1, 16384, 4) == "cooperative-two-kernels-4-segments"
    assert launch(1, 16384, 2) == "cooperative-two-kernels-4-segments"
    assert launch(1, 131072, 1) == "cooperative-two-kernels-11-segments"
    assert launch(1, 32768, 8) == "cooperative-one-kernel-split"
    assert launch(1, 65536, 1) == "cooperative-two-kernels-8-segments"
    assert launch(1, 32768, 1) == "cooperative-two-kernels-6-segments"
    assert launch(1, 16384, 5) == "cooperative-two-kernels-3-segments"
    assert launch(1, 65536, 5) == "cooperative-two-kernels-4-segments"
    assert launch(1, 2 ** 18, 1) == "cooperative-two-kernels-14-segments"
    assert launch(1, 2 ** 18, 2) == "cooperative-two-kernels-8-segments"
    assert launch(1, 2 ** 18, 3) == "cooperative-two-kernels-6-segments"
    assert launch(1, 2 ** 18, 8) == "cooperative-two-kernels-3-segments"
    assert launch(1, 131072, 8) == "cooperative-one-kernel-split"


def test_tiles_per_owner_up_to_the_sm_count():
    # 64 tiles of 128 chunks: 2 per owner (32 owners, 100 helpers) by the model; measured best.
    assert launch(1, 8192, 64) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 4096, 64) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 8192, 53) == "cooperative-two-kernels-2-tiles-per-owner"
    # Between 0.4 x and 1 x the SMs the fused kernel where the fits of its and the mode's measured
    # eager times say so (cooperative_beats_fused; H100, 0d70888's kernels, each form in blocks of
    # ten consecutive calls, ms fused vs cooperative): tiles of 16 chunks from 53 tiles (B1 T1024
    # H56: 0.144 vs 0.151, H64: 0.156 vs 0.168 and 0.144 vs 0.154, H72: 0.159 vs 0.181, B2 T1024
    # H32: 0.160 vs 0.174), B1 T2048 H70 (0.273 vs 0.285) and H80, 80-112 tiles of T4096-T8192 (B1
    # T8192 H80: 0.958 vs 0.995, H96: 0.957 vs 1.053, B2 T8192 H40: 0.953 vs 0.996, B1 T4096 H80:
    # 0.495 vs 0.536), B1 T16384 H75 (1.865 vs 1.958); the cooperative mode from 24 chunks a tile at
    # 64 tiles (B1 T1536 H64: 0.202 vs 0.196, T2048: 0.269 vs 0.242, T4096: 0.520 vs 0.424, T8192:
    # 0.953 vs 0.714) and up to 74 tiles of long sequences (B1 T2048 H56: 0.280 vs 0.246, B1 T4096
    # H72: 0.495 vs 0.462, B1 T8192 H74: 0.959 vs 0.863, B2 T8192 H37: 0.953 vs 0.862, B1 T16384
    # H70: 1.869 vs 1.525).
    # (where two CTAs per tile fit, the pair form runs instead of the fused kernel: test_pair_form)
    assert launch(1, 1024, 56) == "pair"
    assert launch(1, 1024, 64) == "pair"
    assert launch(2, 1024, 32) == "pair"
    assert launch(1, 1024, 72) == "index"
    assert launch(1, 2048, 70) == "index"
    assert launch(1, 1536, 64) == "pair"  # short tiles from 48 tiles: pair_beats_cooperative
    assert launch(1, 2048, 56) == "pair"
    assert launch(1, 4096, 72) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 8192, 74) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(2, 8192, 37) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 16384, 75) == "index"
    assert launch(1, 2048, 64) == "pair"
    assert launch(1, 2048, 58) == "pair"
    assert launch(1, 8192, 68) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 8192, 71) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 16384, 70) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 4096, 80) == "index"
    assert launch(1, 8192, 80) == "index"
    assert launch(1, 8192, 96) == "index"
    assert launch(2, 8192, 40) == "index"
    assert launch(1, 8192, 112) == "index"
    assert launch(1, 1024, 96) == "index"
    assert launch(1, 2048, 120) == "index"
    # 47-48 tiles: 2 tiles per owner (measured 5-7 % faster than one on B1 T2048-T16384 H48, B1
    # T8192 H47 and B2 T8192 H24).
    assert launch(1, 16384, 48) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 8192, 47) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(2, 8192, 24) == "cooperative-two-kernels-2-tiles-per-owner"
    # The general gates' fused kernel is ~40 % slower per chunk, so the mode reaches further there
    # (softplus, ms fused vs cooperative, same sweeps: B1 T1024 H64 0.185 vs 0.163, B1 T2048 H64
    # 0.346 vs 0.259, H72 0.352 vs 0.309, B1 T4096 H86 0.670 vs 0.623, B1 T8192 H96 1.313 vs
    # 1.192), with 3 tiles per owner from 76 tiles; fused for B1 T1024 H80 (0.185 vs 0.205) and H96,
    # B1 T2048 H96 (0.351 vs 0.375) and B1 T4096 H96 (0.677 vs 0.693).
    assert launch(1, 1024, 60, general=True) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 1024, 64, general=True) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 2048, 64, general=True) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 2048, 72, general=True) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 4096, 86, general=True) == "cooperative-two-kernels-3-tiles-per-owner"
    assert launch(2, 8192, 40, general=True) == "cooperative-two-kernels-3-tiles-per-owner"
    assert launch(1, 8192, 96, general=True) == "cooperative-two-kernels-3-tiles-per-owner"
    assert launch(1, 1024, 80, general=True) == "index"
    assert launch(1, 1024, 96, general=True) == "index"
    assert launch(1, 2048, 96, general=True) == "index"
    assert launch(1, 4096, 96, general=True) == "index"
    # varlen: one tile per owner (the host does not know the lengths)
    assert launch(1, 0, 32, lens=[4096, 4096]) == "cooperative-two-kernels-split-on-device"


def test_pair_form(monkeypatch):
    """The pair form where 2 x tiles <= SMs with safe gates, instead of the fused kernel, and instead
    of the cooperative mode for fixed-length tiles of at most 32 chunks from 48 tiles (0.36 x the
    SMs) on (eager ms mode / pair at e1a6c7a: B1 T1536 H64 0.196 / 0.165, T2048 H64 0.229 / 0.209,
    B1 T1024 H48 0.132 / 0.116); the mode elsewhere (B1 T4096 H48 0.353 / 0.389, T8192 H64 0.709 /
    0.758, B1 T1024 H32 0.097 / 0.116; docs/perf-notes.md)."""
    assert launch(1, 1024, 48) == "pair"
    assert launch(1, 2048, 48) == "pair"
    assert launch(2, 1024, 24) == "pair"  # 48 tiles of 16 chunks
    assert launch(1, 2048, 47).startswith("cooperative")  # below 0.36 x the SMs
    assert launch(1, 1024, 32).startswith("cooperative")
    assert launch(1, 2112, 64).startswith("cooperative")  # 33 chunks a tile
    assert launch(1, 3072, 64).startswith("cooperative")
    assert launch(1, 0, 32, lens=[2048, 2048]).startswith("cooperative")  # varlen: the rule's choice
    assert launch(1, 1024, 42, sms=114) == "pair"  # an H100 PCIe: from 42 tiles
    monkeypatch.setenv("CULA_KDA_COOPERATIVE", "1")
    assert launch(1, 2048, 64) == "cooperative-two-kernels-2-tiles-per-owner"
    monkeypatch.delenv("CULA_KDA_COOPERATIVE")
    assert launch(1, 1024, 66) == "pair"  # 132 CTAs
    assert launch(1, 1024, 67) == "index"  # 134 CTAs: more than the SMs
    assert launch(1, 1024, 57, sms=114) == "pair"  # an H100 PCIe
    assert launch(1, 1024, 58, sms=114) == "index"
    assert launch(1, 1024, 64, general=True) == "cooperative-two-kernels-2-tiles-per-owner"  # safe gates only
    assert launch(1, 0, 8, lens=[100, 1, 0, 64]) == "pair"  # varlen: 32 tiles, 165 tokens
    assert launch(1, 2048, 64) == "pair"  # short tiles from 48 tiles: over the cooperative mode
    # where the host takes the cooperative mode
    assert launch(1, 4096, 64) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 8192, 64) == "cooperative-two-kernels-2-tiles-per-owner"
    assert launch(1, 1024, 32) == "cooperative-two-kernels"
    assert launch(1, 32768, 8) == "cooperative-one-kernel-split"
    monkeypatch.setenv("CULA_KDA_PAIR", "1")  # wherever it can run
    assert launch(1, 32768, 8) == "pair"
    assert launch(1, 8192, 64) == "pair"
    assert launch(1, 8192, 67) == "cooperative-two-kernels-2-tiles-per-owner"  # 134 CTAs do not fit
    monkeypatch.setenv("CULA_KDA_PAIR", "0")  # never: the rules without it
    assert launch(1, 1024, 64) == "index"
    assert launch(1, 1024, 32) == "cooperative-two-kernels"


def test_variables_force_their_choice(monkeypatch):
    monkeypatch.setenv("CULA_KDA_COOPERATIVE", "0")
    assert launch(1, 32768, 8) == "pair"  # the fused kernel, on two CTAs per tile
    monkeypatch.setenv("CULA_KDA_PAIR", "0")
    assert launch(1, 32768, 8) == "index"
    monkeypatch.delenv("CULA_KDA_PAIR")
    monkeypatch.setenv("CULA_KDA_COOPERATIVE", "1")
    assert launch(2, 8192, 66) == "index"  # 132 tiles: no SM left for a helper
    assert launch(1, 8192, 112) == "cooperative-two-kernels-4-tiles-per-owner"
    monkeypatch.delenv("CULA_KDA_COOPERATIVE")

    monkeypatch.setenv("CULA_KDA_VALUE_SPLIT", "1")
    assert launch(1, 32768, 8) == "cooperative-one-kernel"
    assert launch(1, 65536, 4) == "cooperative-one-kernel"  # segments need two owners per tile
    assert launch(1, 8192, 64) == "cooperative-two-kernels"  # the variable also keeps one tile per owner
    monkeypatch.setenv("CULA_KDA_VALUE_SPLIT", "2")
    assert launch(1, 32768, 8) == "cooperative-one-kernel-split"
    assert launch(1, 8192, 52) == "cooperative-two-kernels-split"
    monkeypatch.delenv("CULA_KDA_VALUE_SPLIT")

    monkeypatch.setenv("CULA_KDA_SEGMENTS", "1")
    assert launch(1, 65536, 4) == "cooperative-one-kernel-split"
    monkeypatch.setenv("CULA_KDA_SEGMENTS", "3")
    assert launch(1, 32768, 8) == "cooperative-two-kernels-3-segments"
    monkeypatch.setenv("CULA_KDA_SEGMENTS", "5")  # 8 tiles x 4 x 5 CTAs do not fit: ignored
    assert launch(1, 32768, 8) == "cooperative-one-kernel-split"
    monkeypatch.delenv("CULA_KDA_SEGMENTS")

    monkeypatch.setenv("CULA_KDA_TILES_PER_OWNER", "3")
    assert launch(1, 8192, 64) == "cooperative-two-kernels-3-tiles-per-owner"
    monkeypatch.setenv("CULA_KDA_TILES_PER_OWNER", "1")  # one tile per owner: the value split rule again
    assert launch(1, 8192, 64) == "cooperative-two-kernels"
    monkeypatch.delenv("CULA_KDA_TILES_PER_OWNER")

    monkeypatch.setenv("CULA_KDA_HELPER_KERNEL", "0")
    assert launch(1, 8192, 64) == "cooperative-one-kernel-2-tiles-per-owner"
    assert launch(1, 65536, 4) == "cooperative-one-kernel-4-segments"
    monkeypatch.setenv("CULA_KDA_HELPER_KERNEL", "1")
    assert launch(1, 32768, 8) == "cooperative-two-kernels-split"


def test_variables_by_exact_name_among_others(monkeypatch):
    """The knobs are read in one pass over the environment per call (LaunchKnobs in the dispatch):
    a name is matched whole (CULA_KDA_PAIRS is not CULA_KDA_PAIR), each of several set variables
    applies, a change between calls applies to the next call, and an empty value counts as unset."""
    monkeypatch.setenv("CULA_KDA_PAIRS", "0")
    monkeypatch.setenv("CULA_KDA_COOPERATIVE_", "0")
    monkeypatch.setenv("CULA_KDA", "0")
    assert launch(1, 1024, 64) == "pair"
    assert launch(1, 32768, 8) == "cooperative-one-kernel-split"
    for i in range(40):  # more CULA_KDA_* variables than the pass keeps (it then asks getenv)
        monkeypatch.setenv(f"CULA_KDA_UNUSED_{i}", "1")
    monkeypatch.setenv("CULA_KDA_PAIR", "0")
    assert launch(1, 1024, 64) == "index"
    for i in range(40):
        monkeypatch.delenv(f"CULA_KDA_UNUSED_{i}")
    assert launch(1, 1024, 64) == "index"
    monkeypatch.setenv("CULA_KDA_HELPER_KERNEL", "1")
    monkeypatch.setenv("CULA_KDA_VALUE_SPLIT", "1")
    assert launch(1, 32768, 8) == "cooperative-two-kernels"
    monkeypatch.setenv("CULA_KDA_VALUE_SPLIT", "")
    assert launch(1, 32768, 8) == "cooperative-two-kernels-split"
    monkeypatch.setenv("CULA_KDA_SEGMENTS", "3")
    assert launch(1, 32768, 8) == "cooperative-two-kernels-3-segments"


def test_argument_errors():
    from cula._ext import get_ext
    kw = dict(batch=2, seqlen=64, num_seqs=1, num_qk_heads=4, num_v_heads=4, varlen=False, general_gates=False,
              sm_count=SMS)
    with pytest.raises(RuntimeError, match="num_seqs must equal batch"):
        get_ext().kda_prefill_sm90_launch_name(**kw)
    with pytest.raises(RuntimeError, match="varlen needs batch == 1"):
        get_ext().kda_prefill_sm90_launch_name(**{**kw, "num_seqs": 2, "varlen": True})
    with pytest.raises(RuntimeError, match="must be >= 1"):
        get_ext().kda_prefill_sm90_launch_name(**{**kw, "num_seqs": 2, "sm_count": 0})
