"""pdpatch: make P/D disaggregation with stock vLLM's NixlConnector work where it breaks.

``import pdpatch`` is cheap on purpose (it runs from a ``.pth`` in every interpreter of the
environment): the installer and the patch modules load only when ``install()`` is called.
"""

from __future__ import annotations

__version__ = "0.1.0"


def install() -> object:
    """Arm every enabled patch in this process (idempotent); see ``pdpatch.installer``."""
    from pdpatch import installer

    return installer.install()


def uninstall() -> object:
    """Restore vLLM's original objects in this process."""
    from pdpatch import installer

    return installer.uninstall()


def status() -> dict[str, object]:
    from pdpatch import installer

    return installer.status()


__all__ = ["__version__", "install", "status", "uninstall"]
