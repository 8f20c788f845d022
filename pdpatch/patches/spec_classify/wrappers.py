"""The code of patch ``spec_classify``, loaded when vLLM imports the NIXL worker (the patch and why
it exists: :mod:`pdpatch.patches.spec_classify`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any

from packaging.version import Version

from pdpatch.patches.common import allowed
from pdpatch.patches.spec_classify import NAME
from pdpatch.registry import Wrapper


class NoAttentionGroup(ValueError):
    """The NIXL descriptor builders need an attention KV-cache group and there is none."""


def _no_attention_group(module: str, instance: Any, what: str, version: Version
                        ) -> NoAttentionGroup | None:
    """The error to raise instead of the release's bare StopIteration, or None where the
    release's ``next()`` had an attention group to find (the StopIteration came from
    elsewhere: it propagates unchanged)."""
    types = getattr(instance, "_group_spec_types", None)
    if types is None:
        return None
    is_attention = importlib.import_module(module)._is_attention_spec
    if any(is_attention(t) for t in types):
        return None
    names = [getattr(t, "__name__", repr(t)) for t in types]
    return NoAttentionGroup(
        f"pdpatch: NIXL {what} needs an attention KV-cache group but this worker's groups "
        f"are {names or 'empty'} (vLLM {version} raises a bare StopIteration here); P/D "
        "transfer of models without attention layers is not supported by this vLLM release "
        "[spec_classify]")


def make_check(module: str, version: Version) -> Wrapper:
    """Run the release's builder; where its ``next()`` over the group types raised
    StopIteration (directly, or as PEP 479's RuntimeError inside the generator builders),
    raise :class:`NoAttentionGroup` instead.  Every other outcome is the release's own."""

    def convert(exc: BaseException, instance: Any, what: str) -> BaseException:
        better = _no_attention_group(module, instance, what, version)
        return exc if better is None else better

    def iterate(gen: Iterator[Any], instance: Any, what: str) -> Iterator[Any]:
        try:
            return (yield from gen)
        except RuntimeError as exc:
            if not isinstance(exc.__cause__, StopIteration):
                raise
            raise convert(exc, instance, what) from exc

    def require_attention_group(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not allowed(NAME, instance):
            return wrapped(*args, **kwargs)
        what = wrapped.__name__
        try:
            result = wrapped(*args, **kwargs)
        except StopIteration as exc:
            raise convert(exc, instance, what) from exc
        if inspect.isgenerator(result):
            return iterate(result, instance, what)
        return result

    return require_attention_group
