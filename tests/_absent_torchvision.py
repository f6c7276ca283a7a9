"""A stand-in for torchvision, installed only where torchvision cannot be imported, so that timm imports.

timm imports torchvision when it is imported (its data transforms and datasets, ``FrozenBatchNorm2d``),
and torchvision on the package index is a CUDA build that fails to import beside a CPU build of torch
("operator torchvision::nms does not exist"). The models a test trains never call into torchvision; every
name here is a class that raises ImportError when it is used, so a model that did would fail loudly.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Absent,), {})


class _Absent(metaclass=_Meta):
    """Stands for a torchvision name: using it raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("torchvision is not installed here: this stand-in only lets timm import")


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Absent,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0.0+absent"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextlib.contextmanager
def standing_in() -> Iterator[bool]:
    """The stand-in, while the block runs (timm's import), where torchvision cannot be imported; yields
    whether it stood in. Afterwards torchvision is absent again for everything else (transformers asks
    whether it is installed)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        pass
    else:
        yield False
        return
    drop = [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]
    for name in drop:
        del sys.modules[name]
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield True
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
