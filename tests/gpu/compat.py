"""tidal's modules by their path after the package reorganisation (#23), else before it.

The check reaches tidal through entry points (``python -m service.cli``,
``python -m examples.charlm``, pytest markers, the bench file's path); where a
worker must import a tidal module, it names both paths here, so it works on a
tree from either side of the move.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def module(new: str, old: str) -> ModuleType:
    """Import ``new``; if that module (not one of its imports) does not exist, ``old``.

    Raises:
        ModuleNotFoundError: neither exists, or an import inside it is missing.
    """
    try:
        return importlib.import_module(new)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (new == exc.name or new.startswith(exc.name + ".")):
            raise  # a dependency of the new module is missing: say so
        return importlib.import_module(old)


def name(new: str, old: str, attribute: str) -> Any:
    """``attribute`` of :func:`module` (new, old)."""
    return getattr(module(new, old), attribute)
