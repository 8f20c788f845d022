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

The oracle is proven on every run by controls whose KV is wrong on purpose; a run whose
controls are not all caught has no verdicts worth reading (:func:`judge_run`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


def tolerances(reference: Mapping[str, tuple[Decoded, Decoded, float | None]]
               ) -> dict[str, float]:
    """Per prompt: FACTOR x the reference pair's first-token drift, clamped to [FLOOR, CAP].

    ``reference`` maps a prompt name to (P/D decode, D's own baseline, P's own first-token
    logprob or None) of the intact pair.  A reference that already disagrees on the first token
    is no reference: ValueError."""
    out: dict[str, float] = {}
    for name, (pd, base, p_own) in reference.items():
        if not pd.token_ids or not base.token_ids or pd.token_ids[0] != base.token_ids[0]:
            raise ValueError(f"reference pair disagrees on the first token of {name!r}: "
                             f"{list(pd.token_ids[:1])} vs {list(base.token_ids[:1])}")
        out[name] = min(CAP, max(FLOOR, FACTOR * drift(pd, base, p_own)))
    return out


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def judge(pd: Decoded, base: Decoded, tol: float, p_own: float | None = None) -> Verdict:
    """Intact iff the first decoded token is the baseline's and its logprob is within ``tol``
    of the nearer reference (D's baseline, P's own first token)."""
    agree = leading_agreement(pd.token_ids, base.token_ids)
    if not pd.token_ids or not pd.logprobs:
        return Verdict(False, "no tokens decoded", float("inf"), tol, 0)
    dlp0 = drift(pd, base, p_own)
    if pd.token_ids[0] != base.token_ids[0]:
        return Verdict(False, f"first token {pd.token_ids[0]} != {base.token_ids[0]}", dlp0, tol,
                       agree)
    if dlp0 > tol:
        return Verdict(False, f"first-token logprob off by {dlp0:.2e} > {tol:.2e}", dlp0, tol,
                       agree)
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
