"""Model family adapters, registered by name.

A study config names its family; nothing else in the workflow mentions a family. Adding a
family is one module here (its class decorated with `@register`), one study config and, maybe,
one template block. The module must implement the contract (base.Family) and take a name no
other family has: either is an error when the module loads (quantstudy.registry).

A family that outgrows one module keeps its adapter in `<name>.py` and moves its parts beside it,
named for what they hold: `<name>_model.py` (the torch modules its graphs run), `<name>_data.py`
(its samples and inputs), `<name>_metrics.py` (its quality measures). Those are listed in PARTS,
so that the registry does not take them for families.
"""

from __future__ import annotations

from typing import Callable

from quantstudy import registry
from quantstudy.families.base import Family

# Modules of this package that register no family: the contract, and the parts of the families that are split.
PARTS = ("base",
         "deberta_v2_model",
         "deformable_detr_data", "deformable_detr_metrics", "deformable_detr_model",
         "fnet_model",
         "gpt_neo_data", "gpt_neo_metrics", "gpt_neo_model",
         "timm_xcit_data", "timm_xcit_model")
FAMILIES: registry.Registry[type] = registry.Registry("family", __name__, Family, helpers=PARTS)


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
