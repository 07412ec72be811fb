"""Model family adapters, registered by name.

A study config names its family; nothing else in the workflow mentions a family. Adding a
family is one module here (its class decorated with `@register`), one study config and, maybe,
one template block. The module must implement the contract (base.Family) and take a name no
other family has: either is an error when the module loads (quantstudy.registry).
"""

from __future__ import annotations

from typing import Callable

from quantstudy import registry
from quantstudy.families.base import Family

FAMILIES: registry.Registry[type] = registry.Registry("family", __name__, Family, helpers=("base",))


def register(name: str) -> Callable[[type], type]:
    def decorate(cls: type) -> type:
        cls.name = name
        return FAMILIES.add(name, cls, registry.origin(cls))
    return decorate


def names() -> list[str]:
    return FAMILIES.names()


def get(name: str):
    """The adapter instance of a family."""
    return FAMILIES.get(name)()
