"""Each READ's timeline, logged at DEBUG: when it was posted, every poll of it and what NIXL
answered, and for a staged READ when its gather ended.

Why: vLLM's ``nixl_xfer_time`` is NIXL's own span from the post to the poll that saw the READ
done, and vLLM polls once per engine step.  A READ of one block moves its bytes in
microseconds, so that span is the engine's poll cadence, not the transfer; only the polls
themselves tell a slow transfer (several polls answered ``PROC``) from a slow step (one long
gap).  Kept only while the ``pdpatch`` logger is at DEBUG: otherwise a poll costs one empty
dict lookup."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdpatch.log import logger

SHOWN_POLLS = 8
"""Polls listed in a line: the first ones, then the last (a READ polled for seconds would
otherwise log its whole life)."""


@dataclass
class Timeline:
    kind: str                  # "staged" or "vLLM's"
    post: float                # perf_counter() when the post began (NIXL's timer starts there)
    posted_ms: float           # the post call itself
    polls: list[tuple[float, str]] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)   # host work between polls
    landed: float | None = None         # a staged READ: the poll that saw NIXL done

    def describe(self, end: str, at: float) -> str:
        """The line for a READ that ended in ``end`` at ``at`` (a ``perf_counter()``)."""
        ms = [(t - self.post) * 1e3 for t, _ in self.polls]
        shown = [f"+{m:.2f} {s}" for m, (_, s) in zip(ms, self.polls, strict=True)]
        if len(shown) > SHOWN_POLLS:
            hidden = len(shown) - SHOWN_POLLS + 1
            shown = [*shown[:SHOWN_POLLS - 2], f"... {hidden} more", shown[-1]]
        text = (f"{self.kind} READ {end} after {len(self.polls)} poll(s): post "
                f"{self.posted_ms:.2f} ms; polls at {', '.join(shown) or 'none'} (ms after "
                "the post)")
        for t, what in self.marks:
            text += f"; {what} by +{(t - self.post) * 1e3:.2f}"
        if self.landed is not None:
            text += f"; NIXL done at +{(self.landed - self.post) * 1e3:.2f}"
            if end == "DONE":
                text += f", gathered by +{(at - self.post) * 1e3:.2f}"
        return text


class ReadTimelines:
    """The open timelines of one agent's READs, by NIXL handle."""

    def __init__(self) -> None:
        self._open: dict[Any, Timeline] = {}
        self._lock = threading.Lock()

    @staticmethod
    def wanted() -> bool:
        return logger.isEnabledFor(logging.DEBUG)

    def posted(self, handle: Any, kind: str, began: float) -> None:
        """``handle`` was posted (the post began at ``began``, a ``perf_counter()``)."""
        now = time.perf_counter()
        with self._lock:
            self._open[handle] = Timeline(kind, began, (now - began) * 1e3)

    def polled(self, handle: Any, state: str) -> None:
        if not self._open:
            return
        now = time.perf_counter()
        with self._lock:
            line = self._open.get(handle)
            if line is not None:
                line.polls.append((now, str(state)))

    def mark(self, handle: Any, what: str) -> None:
        """Host work on the READ's behalf ended (e.g. its gather planned during the post)."""
        line = self._open.get(handle)
        if line is not None:
            line.marks.append((time.perf_counter(), what))

    def landed(self, handle: Any) -> None:
        line = self._open.get(handle)
        if line is not None:
            line.landed = line.polls[-1][0] if line.polls else time.perf_counter()

    def ended(self, handle: Any, state: str) -> None:
        """The READ ended in ``state`` (the last poll's answer, or ``released``)."""
        if not self._open:
            return
        with self._lock:
            line = self._open.pop(handle, None)
        if line is not None:
            logger.debug("pdpatch kv_segments: %s", line.describe(state, time.perf_counter()))
