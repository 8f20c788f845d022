"""Patch declarations: what a patch is, which vLLM releases it is for, what it wraps.

A patch package's ``__init__`` (``pdpatch/patches/<name>/``) declares one :class:`Patch`, which
``pdpatch.patches.all_patches()`` lists; its code (``<name>/wrappers.py``) is named there with
:class:`Lazy`, so that ``install()`` reads declarations only.  Targets name the class that
*defines* the attribute (not a subclass or an alias such as ``NixlConnector =
NixlPullConnector``), so one wrap covers every subclass; the installer refuses a target whose
class merely inherits the attribute.

A patch also declares the vLLM code its correctness rests on beyond its targets (``relies_on``:
``vllm_sites`` concepts, looked up per release): on a release newer than the ones it was verified
on, the patch applies by itself only where all of it is unchanged (:mod:`pdpatch.verified`).

A patch's run-time state is declared here too, never kept in module globals: ``state``, a
:class:`pdpatch.state.State` subclass the installer makes once per process on first use (counters,
decisions, once-only flags; ``pdpatch.installer.state_of(name)``), and ``object_state``, what it
keeps on one vLLM object (``pdpatch.installer.object_state(name, obj)``, held by
:mod:`pdpatch.attached`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from packaging.version import Version

from pdpatch import config
from pdpatch.versions import VersionRange
from pdpatch.vllm_sites import Site, lookup_all

if TYPE_CHECKING:
    from pdpatch.state import State

# wrapt's wrapper signature: (wrapped, instance, args, kwargs) -> result
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


class Lazy(NamedTuple):
    """Code of a patch named where the patch is declared, imported only when it is needed: a
    wrapper when vLLM imports the module it wraps (the installer resolves it then), a state
    class when the patch first keeps state.  A process loads the code of the patches whose
    vLLM modules it imports, not of all of them inside ``import vllm``.  ``args``: the
    attribute is a factory, called with them (``make_guard(version)``)."""

    module: str
    attr: str
    args: tuple = ()

    def resolve(self) -> Any:
        value = getattr(importlib.import_module(self.module), self.attr)
        return value(*self.args) if self.args else value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """As what it names: a state made, a status read, a wrapper called."""
        return self.resolve()(*args, **kwargs)


def lazy_from(module: str) -> Callable[..., Lazy]:
    """``lazy_from("pdpatch.patches.x.wrappers")("make_guard", version)``: references into a
    patch's wrappers module, for its declaration."""
    return lambda attr, *args: Lazy(module, attr, args)


class Target(NamedTuple):
    """One attribute to wrap.  (A NamedTuple, not a frozen dataclass: every patch module
    builds these inside ``import vllm``, where a frozen dataclass costs ~0.4 ms to define.)"""

    module: str       # module that defines the class or function
    qualname: str     # "Class.method" or "function"
    wrapper: Wrapper  # or a Lazy one, resolved when vLLM imports ``module``

    @property
    def label(self) -> str:
        return f"{self.module}:{self.qualname}"


def targets_at(version: Version, *wrapped: tuple[tuple[Site, ...], Wrapper]) -> list[Target]:
    """One target per site of each ``(sites, wrapper)`` pair that ``version`` has (a concept
    defined on several classes has several)."""
    return [Target(s.module, s.qualname, wrapper) for sites, wrapper in wrapped
            for s in lookup_all(sites, version)]


# A patch that keeps no state gets the empty base, named lazily like a patch's own class.
_NO_STATE = Lazy("pdpatch.state", "State")


@dataclass(frozen=True)
class Patch:
    name: str                                      # toggle: PDPATCH_<NAME>
    summary: str                                   # one line, for `pdpatch doctor`
    versions: VersionRange                         # vLLM releases this patch is written for
    targets: Callable[[Version], Sequence[Target]]
    why_version: str = ""                          # why the range ends where it does
    # vLLM code the patch reasons about besides its targets: where the fault lives, where an
    # upstream fix would land (each a vllm_sites concept: its sites per release).
    relies_on: tuple[tuple[Site, ...], ...] = ()
    # A short note for the summary line, given whether the patch is active here ("" = none):
    # e.g. which of two cooperating patchers is in charge.
    summary_note: Callable[[bool], str] | None = None
    # Per-process state (a `pdpatch.state.State` subclass, or a Lazy naming one in the patch's
    # code), made on first use (`pdpatch.installer.state_of`).
    state: Callable[[], State] = _NO_STATE
    # What the patch keeps on one vLLM object (a NIXL worker, a scheduler half), made on first
    # use; None: nothing.
    object_state: Callable[[], Any] | None = None
    # Runtime state for `pdpatch.status()` (decisions taken after install), read from `state`.
    runtime_status: Callable[[Any], str] | None = None

    def sites(self, version: Version) -> list[tuple[str, str]]:
        """(module, qualname) of every vLLM site this patch rests on in ``version``: its
        targets, then ``relies_on``, each once."""
        found = dict.fromkeys((t.module, t.qualname) for t in self.targets(version))
        for concept in self.relies_on:
            found.update(dict.fromkeys((s.module, s.qualname)
                                       for s in lookup_all(concept, version)))
        return list(found)

    @property
    def options(self) -> tuple[config.Setting, ...]:
        """The extra ``PDPATCH_*`` variables this patch reads (declared in ``pdpatch.config``)."""
        return tuple(s for s in config.PATCH_OPTIONS if s.patch == self.name)

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name.lower() != self.name:
            raise ValueError(f"patch name {self.name!r} must be a lower-case identifier")
        if isinstance(self.versions, str):
            object.__setattr__(self, "versions", VersionRange(self.versions))
