"""Shared by every way in: check the master switch, install, report problems loudly."""

from __future__ import annotations

import os

from pdpatch import config


def activate(source: str, raise_errors: bool) -> bool:
    """Install if ``ENABLE_PDPATCH`` says so.  Returns whether pdpatch is installed.

    Invalid settings are logged as errors naming the variable (pdpatch then stays out of the
    way); they propagate when ``raise_errors`` is set or ``PDPATCH_STRICT`` is on, so an
    operator who asked for strictness gets a failed startup instead of a silent no-op.
    """
    try:
        enabled, _ = config.master_enabled()
        if not enabled:
            return False
        from pdpatch import installer

        installer.install()
        return True
    except Exception as exc:
        from pdpatch import log

        log.configure(_safe_level())
        log.logger.error("pdpatch: not active in pid %d (%s): %s", os.getpid(), source, exc)
        if raise_errors or _strict():
            raise
        return False


def _strict() -> bool:
    try:
        return config.STRICT.read()
    except config.ConfigError:
        return True


def _safe_level() -> str:
    try:
        return config.LOG_LEVEL.read()
    except config.ConfigError:
        return "INFO"
