"""Wait on a condition with a deadline, and say what was waited for on failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
) -> T:
    """Poll ``condition`` until it returns a truthy value; return that value.

    Raises:
        TimeoutError: naming ``what`` and the last value or exception seen.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
            if value:
                return value
            last = value
        except Exception as exc:  # the condition may fail while things settle
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval)
