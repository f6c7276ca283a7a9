"""Where a result finds its views: one registry from (what is shown, the result's type) to the
function that shows it.

NOTE [ results ask the registry ]: a result (a ``Recording``, a ``Comparison``, a ``Job``) lives in a
layer below every view, so it never imports one: its ``summary()``, ``to_html()``, ``to_dot()`` and
``_repr_mimebundle_`` ask this registry; a result of its own type (a ``SnapshotRecording``) gets
its views by being declared for its class. The package's top (``gradscope/__init__.py``), which may
know every layer, declares each view by name; a view's module is imported on its first use, so that
``import gradscope`` loads no widget or page code. Kinds: ``"text"`` (plain-text summary),
``"html"`` (a self-contained page), ``"dot"`` (a graphviz graph), ``"mimebundle"`` (Jupyter's
display data); a job's also ``"fragment"`` (HTML without script), ``"payload"`` (the widget's data),
and its analyses ``"view"`` and ``"diagnosis"`` (NOTE [ a job asks for its analysis ] in
``gradscope.jobs.data``).

NOTE [ saved types ]: a subclass of Recording (``gradscope.snapshot.SnapshotRecording``) saves
its own data in ``Recording.extra`` under a key of its own. ``Recording.from_dict`` (``gs.load``)
reads the plain fields and then hands the recording to :func:`typed`, which rebuilds it as the
type declared for that key (:func:`declare_saved`), so a file loads back as the type that wrote it
without the data model importing the layer that defines the type.

Example:
    >>> import torch, gradscope as gs
    >>> with gs.record() as rec:
    ...     torch.ones(2, requires_grad=True).exp().sum().backward()
    >>> render("text", rec.recording).splitlines()[0].startswith("gradscope")
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gradscope.errors import GradscopeError

__all__: list[str] = []

_DECLARED: dict[tuple[str, str], str] = {}  # (kind, "module.Class") -> "module:function"
_SAVED: dict[str, str] = {}  # key of a saved recording's extra -> "module:function" rebuilding its type

T = TypeVar("T")


def declare(kind: str, cls: str, fn: str) -> None:
    """Make the function ``fn`` (``"gradscope.report:summary_text"``) the ``kind`` view of the
    class ``cls`` (``"gradscope.recording.Recording"``) and of its subclasses."""
    _DECLARED[(kind, cls)] = fn


def render(kind: str, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``kind`` view of ``obj``, from the nearest class in its MRO that has one."""
    for c in type(obj).__mro__:
        key = (kind, f"{c.__module__}.{c.__qualname__}")
        if key in _DECLARED:  # (looked up at each call: the module's attribute, as patched or reloaded)
            module, name = _DECLARED[key].split(":")
            fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
            return fn(obj, *args, **kwargs)
    raise GradscopeError(f"gradscope: there is no {kind!r} view of a {type(obj).__name__}.")


def declare_saved(key: str, fn: str) -> None:
    """Make the function ``fn`` (``"gradscope._snapshot.data:from_saved"``) rebuild a recording read
    from a file whose ``extra`` has ``key`` as the type that saved it (NOTE [ saved types ])."""
    _SAVED[key] = fn


def typed(rec: T) -> T:
    """``rec``, just read from a file, as the type its ``extra`` declares; else ``rec`` itself."""
    extra = getattr(rec, "extra", None)
    if isinstance(extra, Mapping):
        for key, target in _SAVED.items():
            if key in extra:
                module, name = target.split(":")
                fn: Callable[[T], T] = getattr(importlib.import_module(module), name)
                return fn(rec)
    return rec
