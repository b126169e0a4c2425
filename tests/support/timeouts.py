"""How a test that runs past its bound (``timeout`` in ``pyproject.toml``,
pytest-timeout) ends: the test is named, every thread's stack and the test's
captured output are printed, and its process exits with status 1.

pytest-timeout's ``signal`` method raises from a SIGALRM handler wherever the
main thread is; inside a Trio run that is Trio's own scheduler, which is left
broken, so the rest of the session fails with errors that hide the timeout.
Its ``thread`` method (used here) dumps the stacks from a timer thread and
exits instead, but does not say which test it stopped: for a Trio test the
main thread's stack is the scheduler's, so the name is printed first.

Under pytest-xdist (``./dev test`` runs two workers) the process that exits
is the worker: xdist fails the test ("worker crashed while running ...") and
goes on in a new worker. A worker's terminal reaches nobody, so there the
name, the output and the stacks go to the worker's own stderr, which is the
run's.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, NoReturn

import pytest
import pytest_timeout


class _Stderr:
    """The two calls ``pytest_timeout.dump_stacks`` makes of a terminal."""

    def sep(self, char: str, title: str) -> None:
        sys.stderr.write(f"{char * 8} {title} {char * 8}\n")

    def write(self, text: str) -> None:
        sys.stderr.write(text)


def _expired_in_worker(item: pytest.Item, timeout: float) -> NoReturn:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    out = err = ""
    if capman is not None:
        capman.suspend_global_capture(item)  # fd 2 is the worker's stderr again
        out, err = capman.read_global_capture()
    try:
        terminal = _Stderr()
        terminal.write(f"\n{item.nodeid} ran past its {timeout:g} s timeout\n")
        for title, text in (("Captured stdout", out), ("Captured stderr", err)):
            if text:
                terminal.sep("~", title)
                terminal.write(text)
        pytest_timeout.dump_stacks(terminal)
    finally:
        sys.stderr.flush()
        os._exit(1)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    def expired() -> None:
        if "PYTEST_XDIST_WORKER" in os.environ:
            _expired_in_worker(item, settings.timeout)
        terminal = item.config.get_terminal_writer()
        terminal.line(f"\n{item.nodeid} ran past its {settings.timeout:g} s timeout")
        pytest_timeout.timeout_timer(item, settings)  # dumps the stacks, then os._exit(1)

    timer = threading.Timer(settings.timeout, expired)
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    # pytest-timeout's own pytest_timeout_cancel_timer calls this at teardown.
    item.cancel_timeout = cancel  # type: ignore[attr-defined]
    timer.start()
    return True
