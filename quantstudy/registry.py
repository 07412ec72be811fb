"""One way to register named implementations: families, backends, plain implementations.

A registry belongs to a package whose modules hold the implementations (one module each, named
`<name><suffix>`), and to the Protocol they satisfy. An implementation is added under its name
when its module is imported: a class by a decorator (families, backends), or the module itself
(plain implementations, `modules=True`). Two implementations of one name are an error, as is one
that lacks a member of the protocol: both are named, with the module, when the module loads,
not when a job first calls the missing member.

A module whose own libraries do not import here (TensorRT on a machine without it) is remembered
with the reason: `get` raises ImportError with it, and `names` and `declared` still list it, so
that a config naming it gets a clear error.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class RegistryError(TypeError):
    """A module that registers what cannot be registered: a name taken, or the protocol not met."""


def protocol_members(protocol: type) -> list[str]:
    """The members a Protocol declares: its annotated attributes and its methods, those of the protocols
    it extends included."""
    members: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol, Generic) or not getattr(cls, "_is_protocol", False):
            continue
        members.update(dict.fromkeys(getattr(cls, "__annotations__", {})))
        members.update(dict.fromkeys(k for k, v in vars(cls).items()
                                     if callable(v) and (k == "__call__" or not k.startswith("_"))))
    return list(members)


def missing_members(entry: Any, protocol: type) -> list[str]:
    """The protocol's members that `entry` (a class, an instance or a module) does not have."""
    return [m for m in protocol_members(protocol) if not hasattr(entry, m)]


class Registry(Generic[T]):
    """The implementations of `protocol` found in the modules of `package`, by name.

    `kind` names one in messages ("family", "backend"); `suffix` ends the name of each implementation's
    module (backends: `_backend`); `helpers`: modules of the package that hold no implementation;
    `modules`: the module itself is the implementation, registered under its name."""

    def __init__(self, kind: str, package: str, protocol: type, suffix: str = "", helpers: tuple[str, ...] = (),
                 modules: bool = False):
        self.kind, self.package, self.protocol = kind, package, protocol
        self.suffix, self.helpers, self.modules = suffix, helpers, modules
        self._entries: dict[str, T] = {}
        self._origins: dict[str, str] = {}  # name -> what registered it (module.qualname)
        self._unavailable: dict[str, str] = {}  # module name -> why it does not import here

    def add(self, name: str, entry: T, origin: str) -> T:
        """Register `entry` under `name`; `origin` says where it is defined (module and class name). The
        same origin again (its module imported anew) replaces it; another origin is an error."""
        if name in self._origins and self._origins[name] != origin:
            raise RegistryError(f"two {self.kind} implementations are named {name!r}: {self._origins[name]} and "
                                f"{origin}; rename one of them")
        missing = missing_members(entry, self.protocol)
        if missing:
            raise RegistryError(f"{origin} does not implement the {self.kind} protocol "
                                f"({self.protocol.__module__}.{self.protocol.__qualname__}): it lacks "
                                f"{', '.join(missing)}")
        self._entries[name], self._origins[name] = entry, origin
        return entry

    def declared(self) -> list[str]:
        """The names of the package's implementation modules (less the suffix), whether or not they import here."""
        path = importlib.import_module(self.package).__path__
        return sorted(n.removesuffix(self.suffix) for _, n, _ in pkgutil.iter_modules(path)
                      if n.endswith(self.suffix) and not n.startswith("_") and n not in self.helpers)

    def _load(self, module_name: str) -> None:
        """Import one implementation module (once), which registers what it defines; an ImportError is kept."""
        if module_name in self._unavailable:
            return
        try:
            module = importlib.import_module(f"{self.package}.{module_name}{self.suffix}")
        except ImportError as e:
            self._unavailable[module_name] = str(e)
            return
        if self.modules:
            self.add(module_name, module, module.__name__)

    def names(self) -> list[str]:
        """Every implementation's name: those registered, once every module has been imported, and those
        whose modules do not import here."""
        for module_name in self.declared():
            self._load(module_name)
        return sorted(set(self._entries) | set(self._unavailable))

    def get(self, name: str) -> T:
        """The implementation registered under `name`. Its own module (`<name><suffix>`) is imported first,
        the others only where that does not register it."""
        if name not in self._entries and name in self.declared():
            self._load(name)
        if name not in self._entries and name not in self._unavailable:
            self.names()
        if name in self._entries:
            return self._entries[name]
        if name in self._unavailable:
            raise ImportError(f"{self.kind} {name!r} does not import here: {self._unavailable[name]}")
        raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")


def origin(obj: type | ModuleType) -> str:
    """Where a registered class or module is defined, as messages name it."""
    return obj.__name__ if isinstance(obj, ModuleType) else f"{obj.__module__}.{obj.__qualname__}"
