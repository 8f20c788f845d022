"""The ``pdpatch`` logger: one handler on stderr, level from ``PDPATCH_LOG_LEVEL``.

vLLM configures only its own ``vllm`` logger, so without a handler here our warnings would go
to Python's last-resort handler and INFO lines (the per-process summary) would be lost.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "pdpatch"
logger = logging.getLogger(LOGGER_NAME)


def configure(level: str = "INFO") -> logging.Logger:
    if not any(getattr(h, "_pdpatch_handler", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s [pdpatch] %(message)s", "%m-%d %H:%M:%S"))
        handler._pdpatch_handler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger
