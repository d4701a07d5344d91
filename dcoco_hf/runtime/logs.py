"""The package's one progress channel: the "dcoco_hf" logger, printed to stderr as "[dcoco-hf] ..." lines.

Progress goes to stderr so that stdout holds only results (tables, JSON, generated text). It is shown by default
(INFO); `logging.getLogger("dcoco_hf").setLevel(logging.WARNING)` silences it.
"""

from __future__ import annotations

import logging
import sys


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when a line is logged (a redirect, pytest's capture), not to the
    stream that was current when the package was imported."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns it; the property wins
        pass


logger = logging.getLogger("dcoco_hf")
if not logger.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(logging.Formatter("[dcoco-hf] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log(message: str) -> None:
    """One progress line on stderr."""
    logger.info(message)


__all__ = ["log", "logger"]
