"""Which runs measured the same code: the reviewed table the report pools by.

A figure pools every run of its configuration on one code path, never the best or the oldest.
So each run of a scenario belongs to an *epoch*: the runs since the last change of the code its
requests went through.  What a request goes through is a set of *paths* (:func:`paths_of`); a
:class:`Change` names the first run that measured it, the commit, the paths it touched and why
it could move the figures.  A run's epoch for a set of paths is the last change touching any of
them at or before it; a cell whose paths a later change touched is no longer the current code
(the report says so), and where no run measured that change yet, the cell has no successor.

:data:`KEPT` lists changes on a measured path that do *not* start a new cell, each with why,
so that the judgement is as visible as the boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from lab.gpu.pd import SCENARIOS
from lab.report.records import run_order

REQUEST = "request"       # every pdpatch request: block_keys, the guards, metrics' stats
STAGED = "staged"         # READs through pdpatch's staging agent (converted or coalesced)
COALESCED = "coalesced"   # PDPATCH_KV_COALESCE=1 on D
HEAD_SLICES = "head-slices"   # staged READs of head slices (D's TP larger than P's)
KVCACHED = "kvcached"     # D's KV in a kvcached pool
REORDER = "reorder"       # a token-major D that reorders what a head-major P sends


def paths_of(scenario: str, release: str) -> frozenset[str]:
    """The code paths a scenario's requests go through on ``release`` (none for a stock pair).
    Staging serves converted peers on 0.19-0.25 (a kvcached D's split-half cache, mixed
    backends' layouts) and, opted in, same-layout peers on every release."""
    sc = SCENARIOS[scenario]
    if not sc.pdpatch:
        return frozenset()
    paths = {REQUEST}
    converted = sc.d_kvcached or sc.p_backend != sc.d_backend
    if sc.d_env.get("PDPATCH_KV_COALESCE") == "1":
        paths |= {STAGED, COALESCED}
    elif converted and Version(release) < Version("0.26"):
        paths.add(STAGED)
    if STAGED in paths and sc.d_tp > sc.p_tp:
        paths.add(HEAD_SLICES)
    if sc.d_kvcached:
        paths |= {KVCACHED, REORDER}
    if sc.d_env.get("PDPATCH_LAYOUT_FORCE") == "1":
        paths.add(REORDER)
    return frozenset(paths)


@dataclass(frozen=True)
class Change:
    """A change of the measured code: the first run on it, the commit, what it touched and why
    it could move the figures; ``releases`` (lowest, highest or None) where it applies."""

    first_run: str
    commit: str
    paths: frozenset[str]
    why: str
    releases: tuple[str | None, str | None] = (None, None)

    def applies(self, paths: frozenset[str], release: str) -> bool:
        low, high = self.releases
        v = Version(release)
        return bool(self.paths & paths) and (low is None or v >= Version(low)) and \
            (high is None or v <= Version(high))


def _c(first_run: str, commit: str, paths: set[str], why: str,
       releases: tuple[str | None, str | None] = (None, None)) -> Change:
    return Change(first_run, commit, frozenset(paths), why, releases)


CHANGES: tuple[Change, ...] = (
    _c("o", "883a5db", {STAGED}, "chunked READs copy under inference mode (every chunked READ "
       "of run n failed)"),
    _c("s", "4e647a0", {STAGED}, "the copier uploads its indices on its own stream (run q's "
       "race under load)"),
    _c("ab", "bd43bea", {KVCACHED}, "READs into kvcached's memory staged even where they merge "
       "few (straight into the pool they crossed TCP)"),
    _c("ab", "5009d95", {STAGED}, "a READ posts lists of its own runs; nothing prepared for a "
       "peer at first contact"),
    _c("af", "fa8bff6", {STAGED}, "the worker's own list's table built at start-up; a small "
       "gather waited for in the poll that sees its READ land (594ba26)"),
    _c("af", "0704109", {KVCACHED}, "the rig's kvcached D keeps freed blocks for prefix hits "
       "without a cap (KVCACHED_MAX_CACHED_TOKENS=-1): hit-full pulls one block as stock's does"),
    _c("al", "7af7a08", {STAGED}, "a gather of few copies is one fused copy"),
    _c("an", "62f271c", {STAGED}, "the gather's copy kernels loaded at start-up"),
    _c("ap", "9d5f8ef", {STAGED}, "the gather as one driver batch copy (taken out again)"),
    _c("at", "2603947", {STAGED}, "the batch copy taken out (5edbff2); a gather is one index op "
       "over the span of its arenas"),
    _c("bb", "f296111", {HEAD_SLICES}, "head slices of a request larger than the staging buffer "
       "read across their gaps in chunks"),
    _c("bc", "239e689", {HEAD_SLICES}, "the chunk driver thread takes the staging buffer's GPU "
       "(run bb's rank 1 made a context on GPU 0 in its first chunked READ)"),
    _c("bg", "6a4d291", {REQUEST}, "block_keys: D judges a match from the input digests, its "
       "key chain only where a digest differs; P's params computed ahead (c5b83ed)"),
    _c("cd", "f3eaa15", {REORDER}, "a token-major D turns vLLM's receive reorder on, handed "
       "the cache's memory-order view (6deea53); before it 0.30's reorder scrambled the blocks",
       ("0.29", "0.31")),
    _c("cl", "399274e", {HEAD_SLICES}, "head slices of more runs than RUN_LIST_MAX that fit the "
       "buffer are gap-read (run ck fell back to vLLM's READ)"),
    _c("cu", "e7a19bb", {KVCACHED}, "a kvcached D's READs into its own pool no longer staged "
       "for the transport's sake"),
    _c("cv", "059b2fa", {COALESCED}, "with coalescing on, the staging buffer is made at "
       "start-up, not in the first request's READ"),
    _c("cw", "bf116e4", {STAGED}, "a READ whose descriptors average 256 KiB or more goes as "
       "vLLM built it"),
    _c("cz", "d5cda29", {STAGED}, "a chunked READ's whole gather prepared once at its first "
       "post"),
    _c("cz", "e8135b2", {REQUEST}, "lease_guard: D checks P's lease before each READ",
       ("0.26", None)),
    _c("db", "73f1843", {HEAD_SLICES}, "a gap READ's chunks gather from the READ's gather "
       "prepared once"),
)
"""Every change that starts a new cell, in run order.  Commits between two runs on a path
that only refactor, log, or touch releases or paths a cell does not run are not listed."""

KEPT: tuple[Change, ...] = (
    _c("bj", "d3adaaa", {REQUEST}, "P sends the input digests without its key chain (its "
       "background thread gone): P's params at 16,000 tokens 0.30 ms of CPU where the key "
       "chain took 1.29, far under one start's +-3-4 % of TTFT"),
    _c("bk", "8033890", {REQUEST}, "metrics' stats wrappers return at once with nothing "
       "counted: ~25 us of a ~16 ms engine step (wrapper clock of run bg)"),
    _c("bn", "83dcc8e", {REQUEST}, "get_finished's guard returns at once when no receive "
       "failed: 36 us a step on D (wrapper clock of run bg)"),
    _c("bo", "328a52c", {REQUEST}, "the owners of undrained counts held weakly: the same fast "
       "path, kept on where an owner is collected"),
)
"""Changes on the request path the TTFT starts since ``bg`` ran through that are kept inside
that epoch: each moves a step or a request by far less than a start resolves, so the starts
since ``bg`` measure one path (the step clock of runs bk-br: pdpatch's wrappers ~35-45 us of a
~16 ms step)."""

STOCK_FROM = {"dj": "dk"}
"""Runs that kept no stock pair of their own, and the run whose stock pair (the same seeded
model and prompts, their digests equal in both files) their ratios are taken against: dj and dk
each hit their time limit after their first pair (dj the kvcached D, dk the stock pair)."""


def epoch(run: str, paths: frozenset[str], release: str) -> tuple[Change, ...]:
    """The changes that began ``run``'s epoch on ``paths`` (the latest first run at or before
    ``run`` among the changes touching them; empty: before every listed change)."""
    touching = [c for c in CHANGES if c.applies(paths, release)
                and run_order(c.first_run) <= run_order(run)]
    if not touching:
        return ()
    last = max(run_order(c.first_run) for c in touching)
    return tuple(c for c in touching if run_order(c.first_run) == last)


def superseded(start: tuple[Change, ...], paths: frozenset[str], release: str
               ) -> tuple[Change, ...]:
    """The changes after the epoch that began with ``start`` that touch its paths: the cell is
    the current code only where there are none."""
    after = run_order(start[0].first_run) if start else (0, "")
    return tuple(c for c in CHANGES if c.applies(paths, release)
                 and run_order(c.first_run) > after)
