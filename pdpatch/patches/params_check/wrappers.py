"""The code of patch ``params_check``, loaded when vLLM imports the API server's input processing
(the patch and why it exists: :mod:`pdpatch.patches.params_check`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.version import Version

from pdpatch import config, metrics, vllm_sites
from pdpatch.patches.params_check import NAME
from pdpatch.registry import Wrapper

STR_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host")
# The peer's parallel sizes, as the NIXL connector reads them from the params (0.34.0
# metadata.py L308-311): a positive count each.
COUNT_FIELDS = ("tp_size", "pp_size", "dcp_size")
# Every optional field some release reads (what `problems` checks unless told the release).
EVERY_RELEASE = frozenset(name for name, _ in vllm_sites.RECV_PARAMS_READ)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def problems(params: Any, max_blocks: int, max_groups: int,
             reads: frozenset[str] = EVERY_RELEASE, readback: bool = True) -> list[str]:
    """What is wrong with one request's ``kv_transfer_params`` (empty when nothing is);
    ``max_blocks`` is the model's ``max_model_len``, ``reads`` the optional fields the release
    reads (:func:`pdpatch.vllm_sites.recv_params_read`), ``readback`` whether it has the KV
    readback (0.21+)."""
    if params is None:
        return []
    if not isinstance(params, Mapping):
        return [f"must be an object, got {type(params).__name__}"]
    out = []
    for flag in ("do_remote_prefill", "do_remote_decode"):
        if flag in params and not isinstance(params[flag], bool):
            out.append(f"{flag} must be true or false, got {params[flag]!r}")
    if readback and params.get("do_remote_prefill") is not True and _readback_shaped(params):
        # The pull scheduler's readback branch computes `min(remote_num_tokens or 0,
        # num_prompt_tokens)` in EngineCore for such params, queued or not (0.21.0
        # scheduler.py L343-345; 0.34.0 pull_scheduler.py L85-87): a string raises there and
        # the engine core dies.  Nothing else of them is read unless the readback is queued.
        n = params.get("remote_num_tokens")
        if n and not _is_int(n):
            out.append(f"remote_num_tokens must be an integer, got {_short(n)}")
    if params.get("do_remote_prefill") is not True:
        return out
    for key in STR_FIELDS:
        v = params.get(key)
        if not isinstance(v, str) or not v:
            out.append(f"{key} must be a non-empty string, got {v!r}")
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        out.append(f"remote_port must be an integer in 1..65535, got {port!r}")
    for key in COUNT_FIELDS:
        if key in reads and key in params and params[key] is not None and (
                not _is_int(params[key]) or not 1 <= params[key] <= 65536):
            out.append(f"{key} must be a positive integer, got {params[key]!r}")
    n = params.get("remote_num_tokens")
    if "remote_num_tokens" in reads and n is not None and (
            not _is_int(n) or not 0 <= n <= max_blocks):
        out.append("remote_num_tokens must be a non-negative integer of at most max_model_len "
                   f"({max_blocks}), got {_short(n)}")
    t = params.get("remote_blocks_expiry_time")
    if "remote_blocks_expiry_time" in reads and t is not None and (
            not isinstance(t, (int, float)) or isinstance(t, bool)):
        out.append(f"remote_blocks_expiry_time must be a number, got {t!r}")
    # compared with an int as it is (0.34.0 pull_worker.py L147): None or a string raises there
    g = "remote_registration_generation"
    if g in reads and g in params and not isinstance(params[g], (int, float)):
        out.append(f"{g} must be a number, got {_short(params[g])}")
    out += _block_id_problems(params.get("remote_block_ids"), max_blocks, max_groups)
    return out


def _readback_shaped(params: Mapping) -> bool:
    """The params the pull scheduler takes for a KV readback (every release with one)."""
    return bool(params.get("do_remote_decode")) and bool(params.get("remote_block_ids")) and \
        all(k in params for k in ("remote_engine_id", "remote_request_id", "remote_host",
                                  "remote_port"))


def _block_id_problems(ids: Any, max_blocks: int, max_groups: int) -> list[str]:
    what = "remote_block_ids must be a non-empty list of groups, each a list of block ids"
    if not isinstance(ids, list) or not ids:
        return [f"{what}, got {_short(ids)}"]
    if len(ids) > max_groups:
        return [f"remote_block_ids has {len(ids)} groups; this model has at most {max_groups} "
                "KV-cache groups (one per layer)"]
    for g, group in enumerate(ids):
        if not isinstance(group, list):
            return [f"{what}; group {g} is {_short(group)}"]
        if len(group) > max_blocks:
            return [f"remote_block_ids group {g} has {len(group)} blocks; at most "
                    f"{max_blocks} (max_model_len) can hold a prompt"]
        bad = next((b for b in group if not _is_int(b) or b < 0), None)
        if bad is not None:
            return [f"remote_block_ids group {g} holds {bad!r}; block ids are non-negative "
                    "integers"]
    return []


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _limits(processor: Any) -> tuple[int, int]:
    model_config = getattr(processor, "model_config", None)
    max_blocks = int(getattr(model_config, "max_model_len", 0) or 1 << 20)
    try:
        max_groups = int(model_config.get_total_num_hidden_layers())
    except Exception:
        max_groups = 1024
    return max_blocks, max(1, max_groups)


def _kv_connector_extra(processor: Any) -> Mapping | None:
    ktc = getattr(getattr(processor, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else None


def make_check(version: Version) -> Wrapper:
    reads = vllm_sites.recv_params_read(vllm_sites.release_of(version))
    readback = vllm_sites.lookup(vllm_sites.READBACK_MATCH, version) is not None

    def check_kv_transfer_params(wrapped: Any, instance: Any, args: tuple,
                                 kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        params = kwargs["params"] if "params" in kwargs else args[0]
        extra_args = getattr(params, "extra_args", None)
        if not extra_args or "kv_transfer_params" not in extra_args:
            return result
        if not config.extra_config_allows(NAME, _kv_connector_extra(instance)):
            return result
        found = problems(extra_args["kv_transfer_params"], *_limits(instance), reads, readback)
        if found:
            metrics.count(None, metrics.REFUSALS, NAME)         # the API server's own
            msg = "invalid kv_transfer_params: " + "; ".join(found) + " [pdpatch params_check]"
            try:
                from vllm.exceptions import VLLMValidationError
            except ImportError:                   # pragma: no cover - every checked release has it
                raise ValueError(msg) from None
            raise VLLMValidationError(msg, parameter="kv_transfer_params")
        return result

    return check_kv_transfer_params
