"""The ``dfllm`` logger: INFO to stderr unless the application configured logging itself."""

from __future__ import annotations

import logging
import os


def init_logger() -> logging.Logger:
    logger = logging.getLogger("dfllm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s dfllm: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("DFLLM_LOGGING_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger
