"""Where a result finds its views: one registry from (a kind of view, the result's type) to the
function that shows it.

NOTE [ one registry of views ]: a result (a ``Recording``, a ``Comparison``, a ``Job``, a
``Diagnosis``) is data: it lives in a layer below every view, renders nothing itself and never
imports a view. Each view is a function in the views layer, registered there for the result's type
and a :class:`ViewKind` (``@register(ViewKind.TEXT, Recording)``); a subclass gets its base's
views unless it registers its own (a ``SnapshotRecording`` has its own text, page, payload and
widget), because :func:`view` walks the type's MRO. The package's
top imports the views layer (``gradscope._views.shown``), so every view is registered before a result
asks for one. What Jupyter calls on the object (``_repr_mimebundle_``, ``_repr_html_``) and the
results' ``summary()``, ``text()``, ``to_html()``, ``to_dot()`` are one-line delegations to
:func:`render` (or to :func:`display`, the notebook's display data). Analyses are functions
(``gs.diagnose(job)``, ``job_view(job)``), never found here. A view asked of a type that has none
is a :class:`~gradscope.errors.GradscopeError` naming the type and the kind.

NOTE [ saved types ]: a subclass of Recording (``gradscope.snapshot.SnapshotRecording``) saves
its own data in ``Recording.extra`` under a key of its own. ``Recording.from_dict`` (``gs.load``)
reads the plain fields and then hands the recording to :func:`typed`, which rebuilds it as the
type declared for that key (:func:`declare_saved`, called where the type is defined), so a file
loads back as the type that wrote it without the data model importing the layer that defines it.

Example:
    >>> import torch, gradscope as gs
    >>> with gs.record() as rec:
    ...     torch.ones(2, requires_grad=True).exp().sum().backward()
    >>> render(ViewKind.TEXT, rec.recording).splitlines()[0].startswith("gradscope")
    True
    >>> render(ViewKind.DOT, 42)
    Traceback (most recent call last):
      ...
    gradscope.errors.GradscopeError: gradscope: there is no dot view of builtins.int (views exist for ...
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gradscope._base.errors import GradscopeError

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class ViewKind(enum.Enum):
    """What a view makes of a result."""

    TEXT = "text"  # plain text: ``summary()``, ``str(diagnosis)``
    HTML = "html"  # HTML: a self-contained page (``to_html``), or a small result's block of HTML
    PAYLOAD = "payload"  # the data the widget and the pages draw (JSON-able)
    WIDGET = "widget"  # the notebook widget drawing the result (``gs.show``)
    DOT = "dot"  # a graphviz graph


class WidgetUnavailable(GradscopeError):
    """No widget can be shown here: the widget stack (anywidget) or the built front end is missing.
    A WIDGET view raises it; :func:`display` then shows the result's text and HTML instead."""


_VIEWS: dict[tuple[ViewKind, type], Callable[..., Any]] = {}
_SAVED: dict[str, Callable[[Any], Any]] = {}  # key of a saved recording's extra -> rebuilds its type


def register(kind: ViewKind, cls: type) -> Callable[[F], F]:
    """Make the decorated function the ``kind`` view of ``cls`` and of its subclasses (unless one
    registers its own). Called in the views layer, where the view is defined."""
    if not isinstance(kind, ViewKind) or not isinstance(cls, type):
        raise GradscopeError(f"gradscope: register() takes a ViewKind and a type, not {kind!r} and {cls!r}.")

    def add(fn: F) -> F:
        _VIEWS[(kind, cls)] = fn
        return fn

    return add


def find(kind: ViewKind, cls: type) -> Callable[..., Any] | None:
    """The ``kind`` view of ``cls``: the one registered for the nearest class in its MRO, or None."""
    for c in cls.__mro__:
        fn = _VIEWS.get((kind, c))
        if fn is not None:
            return fn
    return None


def _public_name(cls: type) -> str:
    """A class's dotted name where users import it: the public module (a face, ``gradscope.x``) that
    lists it in its ``__all__``, else the module that defines it."""
    for name in sorted(sys.modules):
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "gradscope" and not parts[1].startswith("_"):
            module = sys.modules[name]
            if cls.__name__ in getattr(module, "__all__", ()) and getattr(module, cls.__name__, None) is cls:
                return f"{name}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def view(kind: ViewKind, cls: type) -> Callable[..., Any]:
    """The ``kind`` view of ``cls`` (see :func:`find`); a GradscopeError naming both when none."""
    fn = find(kind, cls)
    if fn is None:
        known = sorted({_public_name(c) for k, c in _VIEWS if k is kind})
        raise GradscopeError(
            f"gradscope: there is no {kind.value} view of {_public_name(cls)} (views exist for "
            f"{', '.join(known) or 'no type'}); register one in the views layer with "
            f"@register(ViewKind.{kind.name}, {cls.__qualname__})."
        )
    return fn


def render(kind: ViewKind, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``kind`` view of ``obj`` (by its type's MRO), called with ``obj`` and the arguments."""
    return view(kind, type(obj))(obj, *args, **kwargs)


def display(obj: Any) -> dict[str, Any]:
    """Jupyter's display data for ``obj`` (what its ``_repr_mimebundle_`` returns): its widget with
    its text as ``text/plain``; where no widget can be shown (the widget stack or the bundle is
    missing: its WIDGET view raises :class:`WidgetUnavailable`), its text and its HTML view."""
    try:
        text = str(render(ViewKind.TEXT, obj))
    except Exception:  # a text view that failed never hides the widget
        text = repr(obj)
    shown = find(ViewKind.WIDGET, type(obj))
    try:
        widget = shown(obj) if shown is not None else None
    except WidgetUnavailable:
        widget = None
    if widget is not None:
        got = widget._repr_mimebundle_()
        out = dict(got[0] if isinstance(got, tuple) else got)
        out["text/plain"] = text
        return out
    out = {"text/plain": text}
    try:
        out["text/html"] = str(render(ViewKind.HTML, obj))
    except GradscopeError:
        pass
    return out


def declare_saved(key: str, fn: Callable[[T], T]) -> None:
    """Make ``fn`` rebuild a recording read from a file whose ``extra`` has ``key`` as the type
    that saved it (NOTE [ saved types ])."""
    _SAVED[key] = fn


def typed(rec: T) -> T:
    """``rec``, just read from a file, as the type its ``extra`` declares; else ``rec`` itself."""
    extra = getattr(rec, "extra", None)
    if isinstance(extra, Mapping):
        for key, fn in _SAVED.items():
            if key in extra:
                return fn(rec)
    return rec
