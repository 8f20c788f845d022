"""The code of patch ``layout``, loaded when vLLM imports the connector, its KV-layout resolvers or
the NIXL worker (the patch and why it exists: :mod:`pdpatch.patches.layout`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from pdpatch import config, kvcached, vllm_sites
from pdpatch.installer import state_of
from pdpatch.log import logger
from pdpatch.patches.layout import NAME
from pdpatch.state import State

FORCE_KEY = "layout_force"
FORCE_ENV = config.LAYOUT_FORCE.var
PERMUTE_KEY = "layout_permute"
PERMUTE_ENV = config.LAYOUT_PERMUTE.var
DECODE_ROLES = ("kv_consumer", "kv_both")


class LayoutForcedError(RuntimeError):
    """The token-major layout pdpatch asked for is not the one in force."""


@dataclass
class LayoutState(State):
    decided: str = ""          # the last decision, for status_line()
    reason: str = ""
    hinted: bool = False       # the operator hint about the peer was logged
    checked: bool = False      # the layout in force was verified (<=0.28 per process)


# ----------------------------------------------------------------------------------- decision


def _version() -> Version:
    return vllm_sites.running_release()


def _extra_config(vllm_config: Any) -> Mapping | None:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) if ktc is not None else None
    return extra if isinstance(extra, Mapping) else None


def _setting(extra: Mapping | None, key: str, setting: config.Setting,
             env: Mapping[str, str] | None = None) -> tuple[bool | None, str]:
    """A boolean pdpatch setting of this deployment: the extra-config key wins over the
    environment; ``(None, "")`` where neither sets it."""
    env = os.environ if env is None else env
    section = (extra or {}).get(config.EXTRA_CONFIG_KEY)
    if isinstance(section, Mapping) and key in section:
        value = section[key]
        if not isinstance(value, bool):
            raise config.ConfigError(
                f'kv_connector_extra_config["{config.EXTRA_CONFIG_KEY}"]["{key}"] must be '
                f"true or false, got {value!r}")
        return value, f'kv_connector_extra_config["pdpatch"]["{key}"]={str(value).lower()}'
    if setting.var in env:
        value = setting.parse(env[setting.var])
        return value, f"{setting.var}={int(value)}"
    return None, ""


def _forced(extra: Mapping | None, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    value, why = _setting(extra, FORCE_KEY, config.LAYOUT_FORCE, env)
    return bool(value), why if value else ""


def decide(vllm_config: Any, state: kvcached.KvcachedState | None = None,
           env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether this engine needs the token-major override, and why (for logs and status)."""
    extra = _extra_config(vllm_config)
    if not config.extra_config_allows(NAME, extra):
        return False, 'switched off by kv_connector_extra_config["pdpatch"]'
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return False, "no model config (vLLM falls back to its default)"
    if getattr(model_config, "use_mla", False):
        return False, "MLA model: the layout does not matter, vLLM's choice stands"
    forced, why = _forced(extra, env)
    if forced:
        return True, f"forced by {why}"
    state = kvcached.read_state() if state is None else state
    if state.in_deployment:
        return True, state.describe()
    return False, "kvcached not running in this process; vLLM's choice stands"


# ------------------------------------------------------------------------ classmethod wrapper


def _vllm_config_arg(args: tuple, kwargs: dict) -> Any:
    return kwargs["vllm_config"] if "vllm_config" in kwargs else (args[0] if args else None)


def required_layout(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``get_required_kvcache_layout`` (a classmethod; ``instance`` is the class)."""
    original = wrapped(*args, **kwargs)
    vllm_config = _vllm_config_arg(args, kwargs)
    active, reason = decide(vllm_config)
    state = state_of(NAME)
    if not active:
        state.decided, state.reason = "vllm", reason
        return original
    token_major, head_major = vllm_sites.layout_names(_version())
    state.decided, state.reason = "token-major", reason
    if original != token_major:
        logger.info("pdpatch layout: %s asked for KV layout %s; answering %s (%s)",
                    getattr(instance, "__name__", instance), original, token_major, reason)
    _hint_peer(vllm_config, token_major, head_major)
    return token_major


def _hint_peer(vllm_config: Any, token_major: str, head_major: str) -> None:
    state = state_of(NAME)
    with state.lock:
        if state.hinted:
            return
        state.hinted = True
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(ktc, "kv_role", None)
    version = _version()
    if role in DECODE_ROLES and version in vllm_sites.RECEIVE_PERMUTE_SOUND:
        reorder, why = _reorder_setting(vllm_config)
        if reorder is not False:
            logger.info("pdpatch layout: this engine uses %s and a stock peer %s; its NIXL "
                        "workers run with enable_permute_local_kv, so vLLM reorders a "
                        "head-major peer's blocks after receive.", token_major, head_major)
            return
        advice = (f"set kv_transfer_config.enable_permute_local_kv=true on this decode engine "
                  f"({why} keeps pdpatch from doing it), or run the prefill engine with "
                  f"pdpatch's layout override too")
    elif role in DECODE_ROLES:
        if getattr(ktc, "enable_permute_local_kv", False):
            logger.info("pdpatch layout: this engine uses %s; a stock peer uses %s, and "
                        "enable_permute_local_kv=true on this decode engine makes the pair "
                        "work.", token_major, head_major)
            return
        advice = ("set kv_transfer_config.enable_permute_local_kv=true on this decode engine "
                  "(it then permutes received blocks), or run the prefill engine with "
                  "pdpatch's layout override too")
    else:
        advice = ("vLLM rejects a token-major prefill paired with a head-major decode; run "
                  "the decode engine with the same override (pdpatch layout_force, or "
                  "VLLM_KV_CACHE_LAYOUT=NHD)")
    logger.warning("pdpatch layout: this engine uses KV layout %s; a stock vLLM peer (no "
                   "kvcached) uses %s and the handshake will fail unless you %s.",
                   token_major, head_major, advice)


def _reorder_setting(vllm_config: Any) -> tuple[bool | None, str]:
    """The operator's word on turning on ``enable_permute_local_kv`` (None: not said)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if getattr(ktc, "enable_permute_local_kv", False):
        return True, "kv_transfer_config.enable_permute_local_kv=true"
    return _setting(_extra_config(vllm_config), PERMUTE_KEY, config.LAYOUT_PERMUTE)


def let_decode_reorder(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of the NIXL worker's ``register_kv_caches``: a decode worker whose layout pdpatch
    made token-major turns on vLLM's own ``enable_permute_local_kv`` first.

    Prefill engines are stock (head-major) and cannot know that some decode engine runs
    kvcached; without the flag every request from them fails at the handshake ("Heterogeneous
    TP expects same kv_cache_layout").  With it the release accepts a head-major peer and
    permutes the received blocks in place (its own code path, which vLLM's XPU platform turns
    on unconditionally); token-major peers are unaffected.  Set here, in the worker, on the
    config object the worker reads: from 0.29 the layout is resolved in EngineCore, whose
    config is not the one multiprocess workers hold.
    """
    vllm_config = getattr(instance, "vllm_config", None)
    ktc = getattr(instance, "kv_transfer_config", None)
    token_major, _ = vllm_sites.layout_names(_version())
    if _version() in vllm_sites.RECEIVE_PERMUTE_SOUND and \
            getattr(ktc, "kv_role", None) in DECODE_ROLES and \
            getattr(instance, "kv_cache_layout", None) == token_major and \
            not getattr(ktc, "enable_permute_local_kv", True) and decide(vllm_config)[0]:
        reorder, why = _setting(_extra_config(vllm_config), PERMUTE_KEY, config.LAYOUT_PERMUTE)
        if reorder is False:
            logger.info("pdpatch layout: enable_permute_local_kv left off (%s)", why)
        else:
            ktc.enable_permute_local_kv = True
            logger.warning("pdpatch layout: turned on kv_transfer_config.enable_permute_local_kv "
                           "on this %s decode worker, so vLLM accepts head-major (stock) "
                           "prefill engines and reorders their blocks after receive (%s=0 "
                           "keeps it off)", token_major, PERMUTE_ENV)
    return wrapped(*args, **kwargs)


def _blocks_first(cache: Any) -> bool:
    """Whether ``cache`` is a blocks-first ``[N, 2, bs, H, D]`` cache (K and V per block)."""
    return getattr(cache, "ndim", None) == 5 and cache.shape[1] == 2


def reorder_in_memory_order(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of vLLM's ``kv_postprocess_layout_on_receive(cache, indices)`` and
    ``kv_postprocess_blksize_and_layout_on_receive(cache, indices, block_size_ratio)``
    (0.19-0.31), which read a cache's *logical* shape as ``[N, bs, H, D]`` and its bytes in that
    order.

    * a blocks-first cache ``[N, 2, bs, H, D]`` (Triton/FlashInfer <= 0.25, FlashAttention
      0.23-0.25) is reordered as its K and its V views; stock raises in ``get_finished`` and
      the decode worker dies on the first block it receives.  Not with a block-size ratio:
      the release's READ into such a cache overruns into the next block (its V descriptors
      are not divided by the ratio), and :func:`blocks_first_ratio_guard` refuses that peer;
    * a token-major cache whose logical shape is head-major ``[N, H, bs, 2D]`` with its bytes in
      ``[N, bs, H, 2D]`` order (0.26-0.31's packed K|V; from 0.29 the LBNHC cache of kvcached's
      Model Runner V2 pools) is handed over as its memory-order view; stock reinterprets the
      bytes in logical order and the received blocks come out scrambled, with no error.
    Any other cache is the release's own case."""
    cache = args[0] if args else kwargs.get("cache")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    rest = args[2:]
    extra = {k: v for k, v in kwargs.items() if k not in ("cache", "indices")}
    if _blocks_first(cache) and not rest and not extra:   # no block-size ratio
        for kv in (0, 1):
            wrapped(cache[:, kv], indices)
        return None
    # not a tensor (no ndim): the release's own error
    if getattr(cache, "ndim", None) == 4 and cache.stride(2) > cache.stride(1) \
            and cache.shape[1] > 1 and cache.shape[2] > 1:
        return wrapped(cache.permute(0, 2, 1, 3), indices, *rest, **extra)
    return wrapped(*args, **kwargs)


# -------------------------------------------------------------------------- layout in force


def _diagnose(vllm_config: Any, token_major: str, supported: list[list[str]] | None,
              preset: str | None, connector_error: Exception | None = None) -> str:
    """Name the component that forced a head-major layout, and what to change."""
    causes: list[str] = []
    if preset is not None and preset != token_major:
        causes.append(f"cache_config.kv_cache_layout was already {preset} before resolution "
                      f"(set by the caller or a plugin); leave it unset")
    env_layout = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if env_layout and env_layout not in (token_major, "NHD"):
        causes.append(f"VLLM_KV_CACHE_LAYOUT={env_layout} is set; unset it or set it to "
                      f"{token_major}")
    if supported:
        first = supported[0]
        if token_major not in first:
            backend = _backend_name(vllm_config)
            causes.append(f"the attention backend{backend} supports only {first}; choose a "
                          f"backend that supports {token_major} (e.g. FLASH_ATTN; FlashInfer on "
                          f"Blackwell and CPU attention are head-major only) or do not use "
                          f"kvcached on this engine")
    override = _backend_override()
    if override and override != token_major:
        causes.append(f"the attention backend forced {override} (set_kv_cache_layout; e.g. "
                      f"FlashInfer on Blackwell, CPU attention); choose another backend")
    causes += _sibling_causes(vllm_config, token_major, connector_error)
    if not causes:
        causes.append("no single cause found; check VLLM_KV_CACHE_LAYOUT, the attention backend "
                      "and every connector of a MultiConnector")
    return "; ".join(causes)


def _backend_name(vllm_config: Any) -> str:
    att = getattr(vllm_config, "attention_config", None)
    backend = getattr(att, "backend", None)
    return f" ({getattr(backend, 'name', backend)})" if backend else ""


def _backend_override() -> str | None:
    """<=0.28: the layout an attention backend forced with ``set_kv_cache_layout``."""
    import sys

    mod = sys.modules.get("vllm.v1.attention.backends.utils")
    return getattr(mod, "_KV_CACHE_LAYOUT_OVERRIDE", None) if mod is not None else None


def _sibling_causes(vllm_config: Any, token_major: str, error: Exception | None) -> list[str]:
    """MultiConnector: every sub-connector that asks for another layout."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        ktc = vllm_config.kv_transfer_config
        cls = KVConnectorFactory.get_connector_class(ktc)
        if not hasattr(cls, "_get_connector_classes_and_configs"):
            return [f"connector {cls.__name__} asks for another layout ({error})"] if error else []
        out = []
        for sub_cls, sub_cfg in cls._get_connector_classes_and_configs(vllm_config):
            want = sub_cls.get_required_kvcache_layout(sub_cfg)
            if want is not None and want not in (token_major, "NHD"):
                out.append(f"MultiConnector sibling {sub_cls.__name__} requires {want}; remove it "
                           f"from kv_connector_extra_config['connectors'] on this engine, or do "
                           f"not use kvcached here")
        return out
    except Exception as exc:  # diagnosis is best effort; never mask the real failure
        return [f"({type(exc).__name__} while inspecting connectors: {exc})"] if error else []


def _fail(vllm_config: Any, in_force: str, token_major: str, reason: str, causes: str,
          error: Exception | None = None) -> LayoutForcedError:
    what = f"KV layout {in_force} is in force" if in_force else f"KV layout resolution failed " \
        f"({error})"
    return LayoutForcedError(
        f"pdpatch layout: {what}, but this engine needs {token_major} ({reason}): {causes}. "
        f"Without {token_major}, vLLM re-strides the KV tensors, which kvcached's views cannot "
        f"take. To run anyway, switch the override off with PDPATCH_LAYOUT=0 "
        f'(or kv_connector_extra_config["pdpatch"]["layout"]=false).')


def resolve_checked(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``resolve_kv_cache_layout`` (>=0.29, EngineCore): verify the result."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    active, reason = decide(vllm_config)
    if not active:
        return wrapped(*args, **kwargs)
    token_major, _ = vllm_sites.layout_names(_version())
    supported = kwargs.get("supported_layouts", args[1] if len(args) > 1 else None)
    preset = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    try:
        layout = wrapped(*args, **kwargs)
    except ValueError as exc:
        raise _fail(vllm_config, "", token_major, reason,
                    _diagnose(vllm_config, token_major, supported, preset, exc), exc) from exc
    name = getattr(layout, "name", str(layout))
    if name != token_major:
        raise _fail(vllm_config, name, token_major, reason,
                    _diagnose(vllm_config, token_major, supported, preset))
    state_of(NAME).checked = True
    logger.info("pdpatch layout: %s in force (%s)", name, reason)
    return layout


def get_layout_checked(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``get_kv_cache_layout`` (<=0.28, each worker): verify once per process.

    The function is lru_cached and called on hot paths, so after the first call that has a
    vLLM config at hand this is a flag test.
    """
    state = state_of(NAME)
    if state.checked:
        return wrapped(*args, **kwargs)
    vllm_config = _current_vllm_config()
    active, reason = decide(vllm_config) if vllm_config is not None else (False, "")
    try:
        layout = wrapped(*args, **kwargs)
    except ValueError as exc:
        if not active:
            raise
        token_major, _ = vllm_sites.layout_names(_version())
        raise _fail(vllm_config, "", token_major, reason,
                    _diagnose(vllm_config, token_major, None, None, exc), exc) from exc
    if vllm_config is None:
        return layout
    if active:
        token_major, _ = vllm_sites.layout_names(_version())
        if layout != token_major:
            raise _fail(vllm_config, str(layout), token_major, reason,
                        _diagnose(vllm_config, token_major, None, None))
        logger.info("pdpatch layout: %s in force (%s)", layout, reason)
    state.checked = True
    return layout


def _current_vllm_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
    except Exception:
        return None
    return cfg if getattr(cfg, "model_config", None) is not None else None


# --------------------------------------------------------------------- 0.19 hetero-TP guard


def hetero_tp_guard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.19 ``_validate_remote_agent_handshake``: add the check vLLM 0.20 introduced.

    Runs after vLLM's own validation (which may switch ``enable_permute_local_kv`` on) in the
    handshake thread, so a rejection fails the requests for that peer, not the worker.
    """
    result = wrapped(*args, **kwargs)
    meta = kwargs.get("nixl_agent_meta", args[0] if args else None)
    worker = instance
    if meta is None or getattr(worker, "use_mla", False):
        return result
    topo = vllm_sites.any_topology(worker)
    if topo is None:
        return result
    remote = meta.engine_id
    tp_ratio = topo.tp_ratio_from_engine_id(remote)
    layout = (worker.kv_cache_layout if not getattr(worker, "use_host_buffer", False)
              else worker.host_buffer_kv_cache_layout)
    if (abs(tp_ratio) != 1 and not topo.is_kv_replicated(remote) and layout != "HND"
            and not getattr(worker, "enable_permute_local_kv", False)):
        raise RuntimeError(
            f"pdpatch layout: heterogeneous TP (ratio {tp_ratio}) with remote engine {remote} "
            f"needs head-dimension splitting, which requires contiguous heads (HND); this "
            f"engine's KV layout is {layout}. vLLM 0.19 would slice the blocks as if they "
            f"were HND and corrupt the KV silently, so the handshake is refused. Use the same "
            f"TP size on both engines, or HND on both (no kvcached).")
    return result


# ------------------------------------------------- 0.19-0.25 blocks-first block-size ratio


def blocks_first_ratio_guard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.19-0.25 ``_validate_remote_agent_handshake``: refuse a head-major peer with smaller
    blocks than this token-major decode worker's blocks-first cache, which the release would
    reorder on receive.

    Why: the release's READ into such a cache overruns into the next block, and its
    block-size-and-layout reorder then raises in ``get_finished``: the decode worker dies
    (``vllm_sites.BLOCKS_FIRST_RATIO_OVERRUN``).  Stock refuses a head-major peer of a
    token-major worker here unless ``enable_permute_local_kv`` is on, and pdpatch turns that
    on for the token-major decode engines it makes.  Raised in the handshake thread after the
    release's own checks: that peer's requests fail, the worker serves on."""
    result = wrapped(*args, **kwargs)
    meta = kwargs.get("nixl_agent_meta", args[0] if args else None)
    token_major, head_major = vllm_sites.layout_names(_version())
    if meta is None or not getattr(instance, "enable_permute_local_kv", False) \
            or getattr(instance, "kv_cache_layout", None) != token_major \
            or getattr(meta, "kv_cache_layout", None) != head_major:
        return result
    local_bs, remote_bs = getattr(instance, "block_size", None), getattr(meta, "block_size", None)
    if not (isinstance(local_bs, int) and isinstance(remote_bs, int) and remote_bs < local_bs):
        return result
    cache = next(iter((getattr(instance, "device_kv_caches", None) or {}).values()), None)
    if _blocks_first(cache):
        raise RuntimeError(
            f"pdpatch layout: remote engine {meta.engine_id} sends {head_major} blocks of "
            f"{remote_bs} tokens, and this decode engine's {local_bs}-token blocks-first "
            f"{token_major} blocks would be reordered on receive (enable_permute_local_kv); "
            f"vLLM {_version()} reads such blocks past their end and then fails in that "
            f"reorder, which kills the worker, so the handshake is refused.  Run both engines "
            f"with the same --block-size, or this decode engine head-major (no kvcached, no "
            f"PDPATCH_LAYOUT_FORCE).")
    return result


# ----------------------------------------------------------------------------------- status


def status_line(state: LayoutState) -> str:
    """Short, for ``pdpatch.status()``: who decides the KV layout in this process."""
    if not state.decided:
        return "layout=not-consulted"
    if state.decided == "vllm":
        return "layout=vllm"
    return "layout=token-major" + ("(checked)" if state.checked else "")
