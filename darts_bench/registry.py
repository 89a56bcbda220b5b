"""A small generic registry: names -> objects, each registered as the object itself or lazily as a
``"module:attribute"`` string that is imported on first use (lm-eval's ``MODEL_MAPPING`` idea), so
looking a name up imports only the entry asked for and listing names imports nothing.

Used for the generation backends (:data:`darts_bench.evaluate.engines.BACKENDS`); meant to be
reused for tasks and methods.

Example::

    BACKENDS = Registry("backend", {"hf": "darts_bench.evaluate.engines.hf:HFBackend"})

    @BACKENDS.register("mine")
    class MyBackend: ...

    BACKENDS.get("hf")  # imports darts_bench.evaluate.engines.hf, returns HFBackend
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of one kind of thing (``kind``: e.g. ``"backend"``, used in error messages) mapped to
    objects or to lazy ``"module:attribute"`` targets.

    Args:
        kind: what the names name, for messages ("unknown backend 'x'; known backends: ...").
        entries: initial ``name -> object | "module:attribute"`` entries.

    Raises:
        ValueError: a lazy target that is not of the form ``"package.module:attribute"``.
    """

    def __init__(self, kind: str, entries: Mapping[str, T | str] | None = None):
        self.kind = kind
        self._entries: dict[str, T | str] = {}  # as registered
        self._loaded: dict[str, T] = {}  # lazy targets once imported
        for name, target in (entries or {}).items():
            self.register(name, target)

    def register(self, name: str, target: T | str | None = None) -> Callable[[T], T] | T | str:
        """Register ``target`` under ``name``; without ``target``, a decorator that registers the
        decorated object. Registering the same target again is a no-op.

        Raises:
            ValueError: ``name`` is already registered to something else, or a string target is
                not ``"module:attribute"``.
        """
        if target is None:
            def deco(obj: T) -> T:
                self.register(name, obj)
                return obj

            return deco
        if isinstance(target, str):
            mod, _, attr = target.partition(":")
            if not mod or not attr:
                raise ValueError(f"{self.kind} {name!r}: lazy target {target!r} is not 'module:attribute'")
        old = self._entries.get(name)
        if old is not None and old is not target and old != target:
            raise ValueError(f"{self.kind} {name!r} registered twice ({old!r} and {target!r})")
        self._entries[name] = target
        return target

    def get(self, name: str) -> T:
        """The object registered as ``name`` (a lazy target is imported once and kept).

        Raises:
            KeyError: ``name`` is not registered (the message lists the known names).
            ImportError / AttributeError: a lazy target's module or attribute does not exist
                (the message names the entry).
        """
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; known {self.kind}s: {self.names()}")
        target = self._entries[name]
        if not isinstance(target, str):
            return target
        if name not in self._loaded:
            mod, _, attr = target.partition(":")
            try:
                self._loaded[name] = getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError) as e:
                raise type(e)(f"{self.kind} {name!r}: cannot load {target!r}: {e}") from e
        return self._loaded[name]

    def names(self) -> list[str]:
        """Registered names, in registration order (nothing is imported)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
