"""How a test that runs past its bound (``timeout`` in ``pyproject.toml``,
pytest-timeout) ends the run: the test is named, every thread's stack and the
test's captured output are printed, and the process exits with status 1.

pytest-timeout's ``signal`` method raises from a SIGALRM handler wherever the
main thread is; inside a Trio run that is Trio's own scheduler, which is left
broken, so the rest of the session fails with errors that hide the timeout.
Its ``thread`` method (used here) dumps the stacks from a timer thread and
exits instead, but does not say which test it stopped: for a Trio test the
main thread's stack is the scheduler's, so the name is printed first.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import pytest_timeout


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    def expired() -> None:
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
