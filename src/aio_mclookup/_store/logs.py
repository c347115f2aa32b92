"""The Mooncake client's log lines: quiet by default, shown with ``AIO_MCLOOKUP_MOONCAKE_LOGS=1``.

A client's construction and ``setup()`` print ~16 glog lines to stderr (measured on the CPU
wheel: 33 for a writer and a store), two of them at error level for a normal first setup (its
own segment's "metadata not found", before registering it). ``GLOG_minloglevel`` does not change
them; the wheel's own ``MC_LOG_LEVEL`` (TRACE, INFO, WARNING or ERROR) does, read when a client
is built. Unless the process sets ``MC_LOG_LEVEL`` itself or the switch is on, the library's
clients are built with ``MC_LOG_LEVEL=ERROR``, and what ``setup()`` writes to stderr is passed on
without the lines a normal setup always prints (every other line is kept).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["LOGS_SWITCH", "quiet_logs", "quiet_settings", "setup_output"]

LOGS_SWITCH = "AIO_MCLOOKUP_MOONCAKE_LOGS"
"""Set to ``1`` to see every Mooncake log line of the library's clients."""

_EXPECTED = re.compile(
    rb"^WARNING: Logging before InitGoogleLogging\(\) is written to STDERR$"
    rb"|^E\d{4} [\d:.]+ +\d+ transfer_metadata_plugin\.cpp:\d+\] GET \S+ http=404 body: "
    rb"metadata not found$"
)
"""What every first ``setup()`` prints at warning level or above, and means nothing."""


def quiet_logs() -> bool:
    """Whether the library quiets its clients: the switch is off and ``MC_LOG_LEVEL`` unset."""
    switch = os.environ.get(LOGS_SWITCH, "").strip().lower()
    return switch in ("", "0", "false", "no") and "MC_LOG_LEVEL" not in os.environ


def quiet_settings() -> dict[str, str]:
    """The ``MC_*`` settings a quiet client is built with (none when not quiet)."""
    return {"MC_LOG_LEVEL": "ERROR"} if quiet_logs() else {}


@contextlib.contextmanager
def setup_output(quiet: bool) -> Iterator[None]:
    """While a client is set up (the caller serialises setups), with ``quiet``: stderr (fd 2)
    goes to a temporary file, then on to stderr without the :data:`_EXPECTED` lines."""
    if not quiet:
        yield
        return
    with contextlib.suppress(ValueError, OSError):
        sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                captured.seek(0)
                kept = [
                    line
                    for line in captured.read().splitlines(keepends=True)
                    if not _EXPECTED.match(line.rstrip(b"\r\n"))
                ]
                if kept:
                    os.write(2, b"".join(kept))
    finally:
        os.close(saved)
