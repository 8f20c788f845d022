"""``install()`` / ``uninstall()``: apply the declared patches in this process, reversibly.

Every way in (the ``.pth`` import hook, vLLM's general-plugin entry point, ``sitecustomize``)
ends here.  Wrapping is deferred per target module with wrapt post-import hooks, so installing
imports no vLLM submodule: a NIXL class is wrapped the moment vLLM itself imports it.

A patch's wrappers are named in its declaration and loaded when vLLM imports the module they
wrap (:class:`pdpatch.registry.Lazy`): ``install()`` itself reads declarations only, so a process
loads the code of the patches whose vLLM modules it imports (an API server: the request check;
a worker: the read path), not all of it inside ``import vllm``.

The installer also owns every patch's run-time state (:mod:`pdpatch.state`): each patch's
declared ``state``, made on first use; wrappers reach it with :func:`state_of`, and what a patch
keeps on a vLLM object with :func:`object_state`; :func:`status`, the summary line and
:func:`counters` read it, :func:`reset_state` forgets it (tests).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import threading
from typing import TYPE_CHECKING, Any

import wrapt

from pdpatch import config, log, versions
from pdpatch.registry import Lazy, Patch, Target

if TYPE_CHECKING:
    from pdpatch.state import Counter, State

logger = log.logger


class StrictModeError(RuntimeError):
    """Raised only under ``PDPATCH_STRICT=1``: an enabled patch could not apply."""


class TargetState:
    """One target of an active patch, and how wrapping it went.  (The installer's records are
    plain classes, not dataclasses: this module is imported inside every ``import vllm``, where
    each dataclass costs ~0.2 ms to define.)"""

    def __init__(self, target: Target, status: str = "armed", detail: str = "",
                 handle: Any = None, owner: Any = None) -> None:
        self.target = target
        self.status = status   # armed | wrapped | failed | cancelled | unwrapped | disabled
        self.detail = detail
        self.handle = handle
        self.owner = owner     # the class or module object holding the attribute


class PatchState:
    """Whether a patch applies in this process, why, and its targets."""

    def __init__(self, patch: Patch, status: str, reason: str,
                 targets: list[TargetState] | None = None, version_gated: bool = False,
                 changed: tuple[str, ...] = ()) -> None:
        self.patch = patch
        self.status = status                  # active | skipped
        self.reason = reason
        self.targets = [] if targets is None else targets
        self.version_gated = version_gated    # skipped only because a newer vLLM changed its code
        self.changed = changed                # then: the sites that changed

    @property
    def live(self) -> bool:
        """Consulted by every wrapper call: a wrapper we could not remove becomes a no-op."""
        return self.status == "active"


class _Process:
    """This process's installation: one instance, :data:`_state`."""

    def __init__(self) -> None:
        self.installed = False
        self.pid = 0
        self.settings: config.Settings | None = None
        self.vllm = "absent"
        self.patches: dict[str, PatchState] = {}
        self.states: dict[str, State] = {}    # patch name -> its run-time state


_lock = threading.RLock()
_state = _Process()


def install() -> dict[str, PatchState]:
    """Arm every enabled patch whose vLLM version gate matches; idempotent per process.

    Raises ``config.ConfigError`` for invalid settings and ``StrictModeError`` under
    ``PDPATCH_STRICT=1``; the bootstrap entry points decide whether to let those escape.
    """
    with _lock:
        if _state.installed:
            return _state.patches
        from pdpatch.patches import all_patches, read_settings

        patches = all_patches()
        settings = read_settings()
        log.configure(settings.log_level)
        version = versions.vllm_version()
        _state.settings = settings
        _state.vllm = str(version) if version else "absent"
        _state.pid = os.getpid()
        _state.patches = {}
        for patch in patches:
            _state.patches[patch.name] = decide(patch, settings, version)
        _state.states = {}
        _state.installed = True
        for ps in _state.patches.values():
            if ps.status == "active":
                for ts in ps.targets:
                    _arm(ps, ts)
        line = summary_line()
        (logger.warning if " foreign_pdpatch=[" in line else logger.info)(line)
        newer = newer_than_supported(_state.patches, version)
        if newer:
            logger.warning(newer)
        return _state.patches


def newer_than_supported(states: dict[str, PatchState], version: Any) -> str:
    """A warning when the installed vLLM is newer than every release pdpatch was verified on
    and patches are off for that reason ("" otherwise): those whose vLLM code changed.
    Patches whose range ends earlier were fixed upstream and are not named."""
    off = [f"{n} ({', '.join(_short(c) for c in ps.changed)})"
           for n, ps in states.items() if ps.version_gated]
    if not off:
        return ""
    from pdpatch.vllm_sites import SUPPORTED

    return (f"pdpatch: vLLM {version} is newer than the releases pdpatch was verified on "
            f"({SUPPORTED}), and the vLLM code these patches rest on changed, so they are OFF: "
            f"{'; '.join(off)}.  Upgrade pdpatch, or set PDPATCH_ALLOW_UNTESTED_VLLM=1 to "
            "apply them to this release unverified")


def _short(site: str) -> str:
    """A site label without its module, for log lines."""
    return site.rsplit(":", 1)[-1]


def decide(patch: Patch, settings: config.Settings, version) -> PatchState:
    """Whether ``patch`` applies in this process, why, and at which targets.

    Inside its declared range it applies.  Outside it, only a release *newer* than every
    release the patch was verified on can turn it on (:func:`pdpatch.vllm_sites.
    newer_than_verified`): by itself where the vLLM code at each of its sites is identical to
    its newest verified release's, or forced by ``PDPATCH_ALLOW_UNTESTED_VLLM=1``.  There it
    wraps the targets of that verified release.  An older release, or one past a range that
    ended (fixed upstream), never turns it on."""
    on, why = settings.patch_toggle(patch.name)
    if not on:
        return PatchState(patch, "skipped", f"toggled off ({why})")
    if version is None:
        return PatchState(patch, "skipped", "vLLM is not installed")
    if version in patch.versions:
        return _active(patch, version, why)
    from pdpatch import vllm_sites

    gate = f"vLLM {version} outside {patch.versions}"
    if not vllm_sites.newer_than_verified(patch.versions, version):
        return PatchState(patch, "skipped",
                          gate + (f": {patch.why_version}" if patch.why_version else ""))
    from pdpatch import verified  # reads sources: only on a release newer than verified

    verdict = verified.compare(patch)
    if verdict.identical:
        return _active(patch, verdict.reference,
                       f"vLLM {version} is newer than verified ({patch.versions}); the vLLM "
                       f"code it rests on is identical to {verdict.reference}'s")
    changed = ", ".join(_short(c) for c in verdict.changed)
    gate = f"vLLM {version} is newer than verified ({patch.versions}) and changed {changed}"
    if not settings.allow_untested:
        return PatchState(patch, "skipped", gate, version_gated=True,
                          changed=verdict.changed)
    return _active(patch, verdict.reference or version,
                   f"{gate}; applied because PDPATCH_ALLOW_UNTESTED_VLLM=1")


def _active(patch: Patch, release: Any, reason: str) -> PatchState:
    """``patch`` switched on with the targets it has in ``release``."""
    targets = [TargetState(t) for t in patch.targets(release)]
    if not targets:
        return PatchState(patch, "skipped", f"no target in vLLM {release}")
    return PatchState(patch, "active", reason, targets)


def _arm(ps: PatchState, ts: TargetState) -> None:
    def on_import(module: Any) -> None:
        with _lock:
            if ts.status != "armed":
                return
            try:
                _wrap(ps, ts, module)
            except Exception as exc:
                ts.status, ts.detail = "failed", f"{type(exc).__name__}: {exc}"
                logger.warning("pdpatch: patch %s could not wrap %s: %s",
                               ps.patch.name, ts.target.label, ts.detail)
                if _state.settings is not None and _state.settings.strict:
                    raise StrictModeError(
                        f"pdpatch (PDPATCH_STRICT=1): patch {ps.patch.name} could not wrap "
                        f"{ts.target.label}: {ts.detail}") from exc

    wrapt.register_post_import_hook(on_import, ts.target.module)


def _wrap(ps: PatchState, ts: TargetState, module: Any) -> None:
    owner, attr = resolve_owner(module, ts.target.qualname)
    current = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    mine = wrapt.find_wrapper(current, predicate=lambda w: _is_ours(w, ps.patch.name))
    if mine is not None:
        ts.status, ts.detail, ts.handle, ts.owner = "wrapped", "already wrapped", mine, owner
        return
    wrapper = ts.target.wrapper
    if isinstance(wrapper, Lazy):       # the patch's code, loaded now that vLLM's module is
        wrapper = wrapper.resolve()
    handle = wrapt.wrap_object(
        owner, attr, wrapt.FunctionWrapper, (wrapper,),
        {"enabled": lambda: ps.live})
    handle._self_pdpatch_patch = ps.patch.name
    ts.status, ts.handle, ts.owner = "wrapped", handle, owner
    logger.debug("pdpatch: %s wrapped %s", ps.patch.name, ts.target.label)


def _is_ours(wrapper: Any, name: str) -> bool:
    return getattr(wrapper, "_self_pdpatch_patch", None) == name


def resolve_owner(module: Any, qualname: str) -> tuple[Any, str]:
    """The object holding the attribute; for methods, the class must define it itself."""
    *path, attr = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    if isinstance(owner, type) and attr not in owner.__dict__:
        definer = next((c.__name__ for c in owner.__mro__ if attr in c.__dict__), None)
        where = f"it is inherited from {definer}" if definer else "it does not exist"
        raise LookupError(f"{qualname} is not defined on {owner.__name__} ({where})")
    if not isinstance(owner, type) and not hasattr(owner, attr):
        raise LookupError(f"{qualname} does not exist in {module.__name__}")
    return owner, attr


def uninstall() -> dict[str, PatchState]:
    """Restore the original objects; a wrapper buried under a foreign ``setattr`` patch (which
    wrapt cannot splice out) is switched to pass-through instead, and reported as such."""
    with _lock:
        for ps in _state.patches.values():
            if ps.status != "active":
                continue
            ps.status = "uninstalled"
            for ts in ps.targets:
                _unwrap(ts)
        _state.installed = False
        return _state.patches


def _unwrap(ts: TargetState) -> None:
    if ts.status == "armed":
        ts.status = "cancelled"
        return
    if ts.status != "wrapped":
        return
    attr = ts.target.qualname.rsplit(".", 1)[-1]
    try:
        wrapt.unwrap_object(ts.owner, attr, ts.handle)
        ts.status = "unwrapped"
    except (wrapt.WrapperNotOutermostError, wrapt.WrapperNotFoundError) as exc:
        # Another patcher replaced the attribute with a plain function that calls ours
        # (kvcached's setattr style): our wrapper cannot be taken out of its closure.
        ts.status, ts.detail = "disabled", f"left in place as a no-op: {exc}"
        logger.warning("pdpatch: %s: %s", ts.target.label, ts.detail)


def _declared(name: str) -> Patch:
    from pdpatch.patches import all_patches

    ps = _state.patches.get(name)
    if ps is not None:
        return ps.patch
    found = next((p for p in all_patches() if p.name == name), None)
    if found is None:
        raise LookupError(f"no pdpatch patch is named {name!r}")
    return found


def wraps(name: str, cls: type, attr: str) -> bool:
    """Whether patch ``name``'s live wrapper sits on method ``attr`` of ``cls`` (defined there
    or on a base): what one patch asks before it hands a request to another's channel."""
    ps = _state.patches.get(name)
    if ps is None or not ps.live:
        return False
    return any(ts.status == "wrapped" and isinstance(ts.owner, type)
               and ts.target.qualname.rsplit(".", 1)[-1] == attr and issubclass(cls, ts.owner)
               for ts in ps.targets)


def state_of(name: str) -> Any:
    """Patch ``name``'s per-process state (its declared ``State`` class), made on first use."""
    found = _state.states.get(name)
    if found is None:
        with _lock:
            found = _state.states.get(name)
            if found is None:
                found = _state.states[name] = _declared(name).state()
    return found


def object_state(name: str, obj: Any) -> Any:
    """What patch ``name`` keeps on the vLLM object ``obj`` (its declared ``object_state``),
    made on first use; held by :mod:`pdpatch.attached`."""
    from pdpatch import attached  # with the first wrapper that keeps something, not at install

    factory = _declared(name).object_state
    if factory is None:
        raise LookupError(f"patch {name!r} declares no object_state")
    return attached.entry(obj, name, factory)


def reset_state() -> None:
    """Every patch's per-process state forgotten, made anew on next use (tests: counters,
    decisions and once-only flags).  What patches keep on vLLM objects goes with those
    objects."""
    with _lock:
        _state.states = {}


def counters() -> list[Counter]:
    """Every patch's counters in this process, by patch order (zero for a patch that never
    counted); the one source for ``/metrics`` and status."""
    from pdpatch.patches import all_patches

    return [c for p in all_patches() for c in state_of(p.name).counters(p.name)]


def summary_line() -> str:
    """The one grep-able line per process (stable wording: scripts and tests match it).

    ``ready``: patches switched on and in force in this process: each target is wrapped, or
    is wrapped the moment vLLM imports its module (``pdpatch.status()`` shows which);
    ``failed`` (only when there is one): a patch a target of which could not be wrapped;
    ``skipped``: patches off here, and why; ``foreign_pdpatch`` (only then): another package's
    files share the ``pdpatch`` import name (:mod:`pdpatch.provenance`)."""
    from pdpatch import provenance

    active = [ps for ps in _state.patches.values() if ps.status == "active"]
    failed = [f"{ps.patch.name} ({ts.target.label}: {ts.detail})" for ps in active
              for ts in ps.targets if ts.status == "failed"]
    ready = [ps.patch.name for ps in active
             if not any(ts.status == "failed" for ts in ps.targets)]
    foreign = provenance.foreign_pdpatch(deep=False)
    skipped = [f"{n} ({ps.reason})" for n, ps in _state.patches.items()
               if ps.status == "skipped"]
    notes = [note for ps in _state.patches.values() if ps.patch.summary_note
             for note in [ps.patch.summary_note(ps.status == "active")] if note]
    return (f"pdpatch: pid={os.getpid()} role={process_role()} vllm={_state.vllm} "
            f"ready=[{', '.join(ready)}] "
            + (f"failed=[{'; '.join(failed)}] " if failed else "")
            + f"skipped=[{'; '.join(skipped)}]"
            + (f" notes=[{'; '.join(notes)}]" if notes else "")
            + (f" foreign_pdpatch=[{'; '.join(foreign)}]" if foreign else ""))


def process_role() -> str:
    """vLLM names its processes (``EngineCore``, ``EngineCore_DP0``, ``VllmWorker-3``)."""
    name = multiprocessing.current_process().name
    if name == "MainProcess":
        return "main"
    if name.startswith("EngineCore"):
        return "engine-core" + name[len("EngineCore"):].replace("_", "-").lower()
    if name.startswith("VllmWorker-"):
        return "worker-" + name[len("VllmWorker-"):]
    return name.replace(" ", "_")


def status() -> dict[str, Any]:
    """A snapshot for `pdpatch doctor` and tests."""
    with _lock:
        return {
            "installed": _state.installed,
            "pid": os.getpid(),
            "vllm": _state.vllm,
            "patches": {
                n: {"status": ps.status, "reason": ps.reason,
                    "runtime": (ps.patch.runtime_status(state_of(n))
                                if ps.patch.runtime_status else ""),
                    "targets": {ts.target.label: (ts.status, ts.detail) for ts in ps.targets}}
                for n, ps in _state.patches.items()
            },
            "counters": {c.name + "".join(f"{{{k}={v}}}" for k, v in c.labels): c.value
                         for c in counters()},
        }


def _after_multiprocessing_fork(_: object) -> None:
    """Forked vLLM children (EngineCore, workers) inherit the wrapped classes and skip vLLM's
    plugin loading, so nothing else would log for them.  multiprocessing runs this after it
    has named the child, which gives the summary its role."""
    if _state.installed and _state.pid != os.getpid():
        _state.pid = os.getpid()
        logger.info(summary_line())


class _ForkAnchor:
    """multiprocessing keeps after-fork callbacks in a weak registry keyed by an object."""


_fork_anchor = _ForkAnchor()
multiprocessing.util.register_after_fork(_fork_anchor, _after_multiprocessing_fork)

__all__ = ["StrictModeError", "counters", "install", "object_state", "reset_state", "state_of",
           "status", "summary_line", "uninstall"]
