"""Model family adapters, registered by name.

A study config names its family; nothing else in the workflow mentions a family. Adding a
family is one module here (decorated with `@register`), one study config and, maybe, one
template block.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    def decorate(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return decorate


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get(name: str):
    """The adapter instance of a family."""
    _discover()
    if name not in _REGISTRY:
        raise KeyError(f"unknown family {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()
