"""Benchmark configurations: shapes, varlen length distributions and the named suites.

Suites (``--suite``):

* ``default``: the modes of ``--mode`` (all four by default):

  * fixed: B in {1, 2, 8} x T in {1024, 4096, 8192, 16384}, H = HV = 64;
  * gva: (H, HV) in {(32, 64), (16, 64), (8, 64)} at B = 2, T = 8192;
  * varlen: {uniform, random, skewed} x {10, 20, 100} sequences x {4096, 8192, 16384} tokens,
    and 100 sequences of 128 tokens, H = HV = 64;
  * small (few heads, long sequences): (B=1, T=32768, H=8), (B=1, T=65536, H=4),
    (B=1, T=131072, H=2), and one 30000-token sequence with three short ones at H = 8.

* ``quick``: five rows across the modes (``--quick``).
* ``targets``: the nine target rows (head counts fixed, ``--heads``/``--hv`` ignored);
  the default suite holds them too.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

CHUNK = 64  # the chunk length of cula and FLA: chunk counts, flops and SM·µs per chunk-head

SUITES = ("default", "quick", "targets")
MODES = ("fixed", "gva", "varlen", "small")

# Small N*HV: one long prompt batched with three short requests (tests that a long tile does not
# wait behind short ones, and that 1-token sequences work).
LONG_PROMPT_WITH_SHORT = (30000, 100, 37, 1)


@dataclass(frozen=True)
class Config:
    """One benchmark problem.

    ``T`` is the tokens per batch row; for varlen (``lens`` given) ``B == 1`` and ``T`` is the
    total of ``lens``.
    """

    mode: str                           # fixed | gva | varlen | small | cpu | pre
    B: int
    T: int
    H: int
    HV: int
    D: int = 128
    lens: tuple[int, ...] | None = None  # varlen sequence lengths, None for fixed length
    dist: str = ""                       # varlen distribution name (uniform/random/skewed/given)

    def __post_init__(self) -> None:
        if self.lens is not None and (self.B != 1 or sum(self.lens) != self.T):
            raise ValueError(f"varlen config needs B == 1 and sum(lens) == T, got B={self.B}, "
                             f"T={self.T}, sum={sum(self.lens)}")
        if self.H < 1 or self.HV % self.H:
            raise ValueError(f"HV ({self.HV}) must be a multiple of H ({self.H})")

    @property
    def N(self) -> int:
        """Number of sequences."""
        return len(self.lens) if self.lens is not None else self.B

    @property
    def seq_lens(self) -> list[int]:
        """Length of every sequence."""
        return list(self.lens) if self.lens is not None else [self.T] * self.B

    @property
    def chunks(self) -> int:
        """64-token chunks summed over sequences (a partial chunk counts as one)."""
        return sum(math.ceil(L / CHUNK) for L in self.seq_lens)

    @property
    def name(self) -> str:
        """Row name as printed and matched by ``--configs``."""
        heads = f"H{self.H}" if self.H == self.HV else f"H{self.H}/HV{self.HV}"
        d = "" if self.D == 128 else f" D{self.D}"
        if self.lens is not None:
            return f"varlen {self.dist} N{self.N} T{self.T} {heads}{d}"
        return f"B{self.B} T{self.T} {heads}{d}"


def varlen_lengths(dist: str, n: int, total: int, seed: int) -> tuple[int, ...]:
    """Sequence lengths (each >= 1) summing to ``total``.

    uniform: equal lengths (the remainder spread over the first sequences);
    random:  n - 1 cut points drawn uniformly without replacement from 1..total-1;
    skewed:  lengths proportional to 1/(i+1)^2 (the longest holds ~60% of the tokens), in a
             shuffled order, so one long sequence dominates (tests longest-first scheduling).
    """
    if n > total:
        raise ValueError(f"{n} sequences do not fit in {total} tokens")
    rng = random.Random(f"{seed}-{dist}-{n}-{total}")
    if dist == "uniform":
        base, rem = divmod(total, n)
        return tuple(base + (1 if i < rem else 0) for i in range(n))
    if dist == "random":
        cuts = sorted(rng.sample(range(1, total), n - 1))
        edges = [0] + cuts + [total]
        return tuple(b - a for a, b in zip(edges, edges[1:]))
    if dist == "skewed":
        w = [1.0 / (i + 1) ** 2 for i in range(n)]
        s = sum(w)
        lens = [max(1, int(total * x / s)) for x in w]
        lens[0] += total - sum(lens)
        rng.shuffle(lens)
        return tuple(lens)
    raise ValueError(f"unknown varlen distribution {dist!r}")


def varlen(dist: str, n: int, total: int, H: int, HV: int, D: int, seed: int) -> Config:
    """A varlen row with lengths from :func:`varlen_lengths`."""
    return Config("varlen", 1, total, H, HV, D, varlen_lengths(dist, n, total, seed), dist)


def given_lengths(mode: str, lens: tuple[int, ...], H: int, HV: int, D: int) -> Config:
    """A varlen row with the lengths given."""
    return Config(mode, 1, sum(lens), H, HV, D, tuple(lens), "given")


def issue_suite(seed: int = 0) -> list[Config]:
    """The target rows, most telling first (so ``--time-budget`` cuts the tail)."""
    return [
        Config("fixed", 2, 8192, 64, 64),
        Config("fixed", 8, 8192, 64, 64),
        Config("fixed", 1, 8192, 64, 64),
        Config("fixed", 1, 1024, 64, 64),
        Config("gva", 2, 8192, 16, 64),
        varlen("random", 10, 8192, 64, 64, 128, seed),
        varlen("uniform", 100, 100 * 128, 64, 64, 128, seed),
        Config("small", 1, 32768, 8, 8),
        Config("small", 1, 65536, 4, 4),
    ]


def quick_suite(H: int | None, HV: int | None, D: int, seed: int) -> list[Config]:
    """Five rows across the modes (``--quick``); ``H``/``HV`` override the head counts."""
    H_def = H or 64
    HV_def = HV or H_def
    return [
        Config("fixed", 2, 8192, H_def, HV_def, D),
        Config("fixed", 1, 8192, H_def, HV_def, D),
        Config("gva", 2, 8192, H or 16, HV or 64, D),
        varlen("random", 20, 8192, H_def, HV_def, D, seed),
        Config("small", 1, 32768, H or 8, HV or H or 8, D),
    ]


def default_suite(modes: list[str], *, D: int = 128, batch: list[int] | None = None,
                  seqlen: list[int] | None = None, H: int | None = None, HV: int | None = None,
                  seed: int = 0) -> list[Config]:
    """The rows of the given modes (see the module docstring); ``H``/``HV`` override head counts
    (GVA: ``H`` alone gives the one pair (H, HV or 64); ``HV`` alone scales the three pairs)."""
    H_def = H or 64
    HV_def = HV or H_def
    cfgs: list[Config] = []
    if "fixed" in modes:
        for B in batch or [1, 2, 8]:
            for T in seqlen or [1024, 4096, 8192, 16384]:
                cfgs.append(Config("fixed", B, T, H_def, HV_def, D))
    if "gva" in modes:
        if H:
            pairs = [(H, HV or 64)]
        else:
            pairs = [(32, 64), (16, 64), (8, 64)]
            if HV:
                pairs = [(h * HV // 64, HV) for h, _ in pairs]
        for h, hv in pairs:
            if h >= 1 and hv % h == 0:
                cfgs.append(Config("gva", 2, 8192, h, hv, D))
    if "varlen" in modes:
        for total in [4096, 8192, 16384]:
            for n in [10, 20, 100]:
                for dist in ["uniform", "random", "skewed"]:
                    cfgs.append(varlen(dist, n, total, H_def, HV_def, D, seed))
        cfgs.append(varlen("uniform", 100, 100 * 128, H_def, HV_def, D, seed))   # a target row
    if "small" in modes:
        for T, h in [(32768, 8), (65536, 4), (131072, 2)]:
            cfgs.append(Config("small", 1, T, H or h, HV or H or h, D))
        cfgs.append(given_lengths("small", LONG_PROMPT_WITH_SHORT, H or 8, HV or H or 8, D))
    return cfgs


def build_suite(suite: str = "default", mode: str = "all", *, D: int = 128,
                batch: list[int] | None = None, seqlen: list[int] | None = None,
                H: int | None = None, HV: int | None = None, seed: int = 0) -> list[Config]:
    """The configurations of a named suite (``mode`` selects within ``default``)."""
    if suite == "targets":
        return issue_suite(seed)
    if suite == "quick":
        return quick_suite(H, HV, D, seed)
    if suite != "default":
        raise ValueError(f"unknown suite {suite!r}; one of {SUITES}")
    modes = list(MODES) if mode == "all" else [mode]
    return default_suite(modes, D=D, batch=batch, seqlen=seqlen, H=H, HV=HV, seed=seed)


def cpu_suite() -> list[Config]:
    """The CPU check (no SM90 GPU): two small problems with every option on, one varlen with a
    1-token sequence."""
    return [Config("cpu", 1, 256, 2, 4, 64),
            given_lengths("cpu", (100, 1, 155), 2, 4, 64)]
