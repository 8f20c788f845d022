"""The code of patch ``read_guard``, loaded when vLLM imports its read path (the patch and
why it exists: :mod:`pdpatch.patches.read_guard`)."""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from pdpatch import metrics
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.hma_failed_recv import wrappers as hma_failed_recv
from pdpatch.patches.read_guard import NAME
from pdpatch.registry import Wrapper


def make_guard(version: Version) -> Wrapper:
    def guard_read(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not allowed(NAME, instance):
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*args, **kwargs)
        except Exception as exc:
            req_id = arg(args, kwargs, 0, "req_id")
            try:
                # HMA before 0.30: through hma_failed_recv's channel (vllm#42895's SSM assert,
                # 0.23-0.26)
                hma_failed_recv.record_failure(instance, req_id, version)
            except Exception as why:
                # HMA without that channel, or a worker without the release's bookkeeping (a
                # stand-in): the original error propagates as in stock vLLM
                logger.error("pdpatch: KV load of request %s failed (%s: %s) and cannot be "
                             "failed alone: %s [read_guard]", req_id, type(exc).__name__, exc,
                             why)
                raise exc from None
            n = metrics.count(instance, metrics.FAILURES_CONTAINED, NAME)
            logger.error(
                "pdpatch: KV load of request %s failed (%s: %s); failing this request instead "
                "of the worker%s [read_guard, %d so far]", req_id, type(exc).__name__, exc,
                _advice(instance, exc), n, exc_info=logger.isEnabledFor(10))
            return None

    return guard_read


def _advice(worker: Any, exc: Exception) -> str:
    """What to change, where the failure is one every request of the deployment will hit:
    0.23-0.26's one-local-SSM-block assert, which a Mamba hybrid served with prefix caching
    and speculative decoding fails on every P/D read (vllm#42895's family)."""
    if isinstance(exc, AssertionError) and getattr(worker, "_has_mamba", False) \
            and "SSM" in str(exc):
        return ("; every P/D request of this Mamba hybrid will fail so: vLLM before 0.27 "
                "cannot pair the speculative-decoding slots of a Mamba state when prefix "
                "caching is on -- serve D without speculative decoding or prefix caching, or "
                "upgrade to vLLM 0.27+; kv_load_failure_policy=recompute computes these "
                "requests on D meanwhile")
    return ""
