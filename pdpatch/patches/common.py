"""Helpers every patch's wrappers share: the per-deployment toggle and argument lookup.  (The
targets of a patch at the sites of one release, ``targets_at``, are declared with
:func:`pdpatch.registry.targets_at`: a declaration imports no wrapper helper.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdpatch import config

_MISSING = object()


def connector_extra_config(obj: Any) -> Mapping | None:
    """``kv_connector_extra_config`` of a worker, a scheduler half or a ``VllmConfig`` (every
    release keeps the ``vllm_config`` on its NIXL objects; most also ``kv_transfer_config``)."""
    ktc = getattr(obj, "kv_transfer_config", None)
    if ktc is None:
        ktc = getattr(getattr(obj, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else None


def allowed(patch_name: str, obj: Any) -> bool:
    """Per-deployment toggle: ``kv_connector_extra_config["pdpatch"]`` may switch a patch off."""
    return config.extra_config_allows(patch_name, connector_extra_config(obj))


def arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = _MISSING) -> Any:
    """A wrapped call's argument, passed by keyword or by position; ``default`` when absent
    (without one, absence raises ``KeyError`` naming the argument)."""
    if name in kwargs:
        return kwargs[name]
    if len(args) > index:
        return args[index]
    if default is _MISSING:
        raise KeyError(name)
    return default

