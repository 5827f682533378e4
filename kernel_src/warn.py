"""One-time warnings: ``warn_once`` says a thing (a fallback, a resolved default) once per process."""

from __future__ import annotations

import warnings

__all__ = ["warn_once"]

_WARNED: set[str] = set()


def warn_once(message: str, key: str | None = None) -> None:
    """Emit ``message`` as a ``UserWarning`` the first time its ``key`` (default: the message
    itself) is seen in this process."""
    key = message if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)
