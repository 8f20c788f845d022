"""What a patch keeps at run time, declared in one form for every patch.

Each patch module defines one small dataclass deriving from :class:`State` -- its counters,
decisions taken after install, once-only flags -- and names it in its
:class:`pdpatch.registry.Patch` (``state=``).  The installer creates one per process
(``pdpatch.installer.state_of(NAME)``), ``pdpatch.installer.reset_state()`` replaces them all,
and ``pdpatch.installer.counters()`` reads every field declared with :func:`counter` or
:func:`counter_by`: so "where does this patch keep its state, and how is it reset?" has one
answer, the patch's ``State`` class.

What a patch keeps on one vLLM object (a NIXL worker, a scheduler half) is not here but in
:mod:`pdpatch.attached`.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

_COUNTER = "pdpatch_counter"      # field metadata: the counter's help text
_LABEL = "pdpatch_label"          # field metadata: the label of a counter kept per key


def counter(help: str) -> Any:
    """A field counting events since the process started (or the last reset)."""
    return field(default=0, metadata={_COUNTER: help})


def counter_by(label: str, help: str) -> Any:
    """A counter kept per value of ``label`` (a dict ``value -> count``)."""
    return field(default_factory=dict, metadata={_COUNTER: help, _LABEL: label})


class Counter(NamedTuple):
    """One counter of one patch, as :func:`pdpatch.installer.counters` lists it."""

    name: str                    # "<patch>_<field>", e.g. "read_guard_failures_contained"
    value: int
    help: str
    labels: tuple[tuple[str, str], ...] = ()


@dataclass
class State:
    """Base of a patch's per-process state.  Wrappers of several threads (the model runner,
    handshake threads) count concurrently: :meth:`bump` counts under the state's lock."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def bump(self, name: str, by: int = 1, label: str | None = None) -> int:
        """Add ``by`` to the counter ``name`` (to its ``label`` entry for a
        :func:`counter_by` field); returns the new value."""
        with self.lock:
            if label is None:
                value = getattr(self, name) + by
                setattr(self, name, value)
                return value
            per = getattr(self, name)
            per[label] = value = per.get(label, 0) + by
            return value

    def counters(self, patch: str) -> list[Counter]:
        """This state's counters, named after ``patch``."""
        out: list[Counter] = []
        with self.lock:
            for f in dataclasses.fields(self):
                help_text = f.metadata.get(_COUNTER)
                if help_text is None:
                    continue
                value = getattr(self, f.name)
                label = f.metadata.get(_LABEL)
                name = f"{patch}_{f.name}"
                if label is None:
                    out.append(Counter(name, int(value), help_text))
                else:
                    out += [Counter(name, int(n), help_text, ((label, str(key)),))
                            for key, n in sorted(value.items(), key=lambda kv: str(kv[0]))]
        return out
