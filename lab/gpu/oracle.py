"""Did D decode from intact KV?  A verdict per request that tells numeric drift from corruption.

D's own prefill (the baseline) runs another kernel than the prefill whose KV D pulled from P, so
even intact KV gives slightly different logprobs, and a near-tie can flip a later greedy token.
Intact KV puts D's first decoded token between two references: D's own prefill (D's kernel
throughout) and P's own first token (P's kernel throughout; D's token uses P's KV and computes
only the last prompt position itself).  Corrupted KV (blocks of another prompt, one block read
in place of all) lands far from both.  So the verdict reads the first token only: the same token
id as the baseline, and a logprob within a tolerance of the nearer reference, per prompt,
derived from a reference pair that is intact by construction (stock vLLM, P and D on the same
attention backend).  Later tokens are reported (``agree``) but never decide.

Each backend's kernels drift by their own amount, and batching under load adds more, so the
tolerances are a :class:`Calibration` per backend and phase (sequential, under load): a pair
whose P and D run backends X and Y is judged with the wider of X's and Y's (:func:`widest`).
Where the reference pair itself decodes another first token than D's baseline (a near-tie its
own kernels flip), that token is accepted too (``ties``), within the same logprob tolerance.

The oracle is proven on every run by controls whose KV is wrong on purpose; a run whose
controls are not all caught has no verdicts worth reading (:func:`judge_run`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

FLOOR = 2e-3
"""Smallest tolerance: bf16 rounding of one logit moves a logprob by about 1e-3."""
FACTOR = 4.0
"""Tolerance = FACTOR x the reference pair's own first-token drift on that prompt."""
CAP = 0.25
"""Largest tolerance: a first-token logprob further off than this is never numeric drift of a
tiny model's intact KV (the corrupted controls move it by 1 or more)."""


@dataclass(frozen=True)
class Decoded:
    """What one completion returned: greedy token ids and their logprobs."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]


@dataclass(frozen=True)
class Verdict:
    intact: bool
    reason: str
    dlp0: float        # |first-token logprob difference|
    tol: float
    agree: int         # leading tokens identical to the baseline


def drift(pd: Decoded, base: Decoded, p_own: float | None = None) -> float:
    """|first-token logprob of the P/D decode - the nearer of D's baseline and P's own|."""
    d = abs(pd.logprobs[0] - base.logprobs[0])
    return d if p_own is None else min(d, abs(pd.logprobs[0] - p_own))


Sample = tuple[Decoded, Decoded, float | None]
"""One intact answer of a reference pair: (its P/D decode, D's own baseline, P's own first-token
logprob or None)."""


@dataclass(frozen=True)
class Calibration:
    """Per prompt, how far a stock same-backend pair's intact answers drift: the tolerance, and
    the first tokens that pair itself decoded where D's baseline has another.  ``source`` names
    the reference(s) measured, for the record of what judged a scenario."""

    source: str
    tol: dict[str, float]
    ties: dict[str, list[int]] = field(default_factory=dict)


def calibrate(samples: Mapping[str, Sequence[Sample]], source: str) -> Calibration:
    """Per prompt: FACTOR x the largest first-token drift of its samples, clamped to
    [FLOOR, CAP]; a sample whose first token is not the baseline's is a near-tie the reference
    flips itself: its token becomes a tie and its drift (between the two tokens' logprobs,
    small for a near-tie) counts like any other.  A reference answer that decoded nothing
    measures nothing; a prompt left without one gets no tolerance (its verdicts then say so)."""
    tol: dict[str, float] = {}
    ties: dict[str, list[int]] = {}
    for name, answers in samples.items():
        got = [(pd, base, p) for pd, base, p in answers
               if pd.token_ids and pd.logprobs and base.token_ids and base.logprobs]
        if not got:
            continue
        tol[name] = min(CAP, max(FLOOR, FACTOR * max(drift(pd, base, p) for pd, base, p in got)))
        flipped = sorted({pd.token_ids[0] for pd, base, _ in got
                          if pd.token_ids[0] != base.token_ids[0]})
        if flipped:
            ties[name] = flipped
    return Calibration(source, tol, ties)


def widest(cals: Sequence[Calibration]) -> Calibration:
    """The calibration a pair of several backends is judged by: per prompt the widest
    tolerance and every backend's ties, for the prompts all of them calibrated (a prompt one
    backend never measured has no tolerance for that pair)."""
    names = set.intersection(*(set(c.tol) for c in cals))
    return Calibration(" + ".join(c.source for c in cals),
                       {n: max(c.tol[n] for c in cals) for n in sorted(names)},
                       {n: t for n in sorted(names)
                        if (t := sorted({x for c in cals for x in c.ties.get(n, [])}))})


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def judge(pd: Decoded, base: Decoded, tol: float, p_own: float | None = None,
          ties: Sequence[int] = ()) -> Verdict:
    """Intact iff the first decoded token is the baseline's (or one the reference pair itself
    decoded there, ``ties``) and its logprob is within ``tol`` of the nearer reference (D's
    baseline, P's own first token)."""
    agree = leading_agreement(pd.token_ids, base.token_ids)
    if not pd.token_ids or not pd.logprobs:
        return Verdict(False, "no tokens decoded", float("inf"), tol, 0)
    dlp0 = drift(pd, base, p_own)
    first = pd.token_ids[0]
    if first != base.token_ids[0] and first not in ties:
        return Verdict(False, f"first token {first} != {base.token_ids[0]}", dlp0, tol, agree)
    if dlp0 > tol:
        return Verdict(False, f"first-token logprob off by {dlp0:.2e} > {tol:.2e}", dlp0, tol,
                       agree)
    if first != base.token_ids[0]:
        return Verdict(True, f"first token {first}: the reference's own near-tie, logprob "
                             "within drift", dlp0, tol, agree)
    return Verdict(True, "first token and logprob within drift", dlp0, tol, agree)


@dataclass(frozen=True)
class RunJudgement:
    oracle_proven: bool
    caught: int
    controls: int
    missed: list[str]


def judge_run(control_verdicts: Mapping[str, Verdict]) -> RunJudgement:
    """The oracle is proven when every deliberately corrupted request was judged not intact."""
    missed = sorted(name for name, v in control_verdicts.items() if v.intact)
    caught = len(control_verdicts) - len(missed)
    return RunJudgement(bool(control_verdicts) and not missed, caught, len(control_verdicts),
                        missed)


def repeated_block(block_ids: Sequence[int]) -> list[int]:
    """A 'wrong blocks' control: P's first block read into every block (needs >= 2 blocks).
    (Permuting the blocks would be a weak control: attention over a permuted set of cached
    keys, their positions already rotated in, changes little.)"""
    if len(block_ids) < 2:
        raise ValueError("a wrong-blocks control needs a prompt of at least two blocks")
    return [block_ids[0]] * len(block_ids)
