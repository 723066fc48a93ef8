"""The package logger: one line per event to stderr, like vLLM's, unless the application
configured logging itself (then its handlers win)."""
from __future__ import annotations

import logging
import sys

from . import env

_FORMAT = "%(asctime)s numa_runtime %(levelname)s: %(message)s"


def init_logger() -> logging.Logger:
    log = logging.getLogger("numa_runtime")
    if not log.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(env.log_level())
    return log
