"""The notebook widget: the autograd graph, memory timeline, backward step-through and strategy
toggles, as an anywidget whose front end is bundled from ``js/`` (no CDN); what it draws is a
payload of :mod:`gradscope._views.payloads`.

In a notebook, ``gs.show(rec.recording)`` (or a recording as a cell's last value) shows the widget.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradscope._analyses.compare import Comparison
from gradscope._analyses.snapshot.data import SnapshotRecording
from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._base.registry import ViewKind, WidgetUnavailable, register
from gradscope._model.job import Job
from gradscope._model.recording import Recording
from gradscope._views.payloads import (
    LIVE_INTERVAL_S,
    _json,
    _summary_text,
    comparison_payload,
    iterations_columns,
    job_payload,
    payload_json,
    snapshot_payload,
)

__all__ = [
    "ComparisonWidget",
    "JobWidget",
    "RecordingWidget",
    "SnapshotWidget",
    "bundle_id",
    "bundle_name",
    "bundle_path",
    "bundle_text",
    "loader_text",
    "mimebundle",
    "show",
]

_STATIC = Path(__file__).resolve().parent.parent / "static"  # gradscope/static, above _views

try:  # The widget stack is optional: payloads and the HTML page work without it.
    import anywidget as _anywidget
    import traitlets as _traitlets
except ImportError:  # pragma: no cover - exercised where the notebook extra is missing
    _anywidget = None  # type: ignore[assignment]
    _traitlets = None  # type: ignore[assignment]


# ----- the bundled front end ----------------------------------------------------------------
def bundle_path() -> Path:
    """Where the bundled front end (one ES module) lives."""
    return _STATIC / "widget.js"


def _missing(p: Path) -> GradscopeError:
    return GradscopeError(
        f"gradscope: the widget's JavaScript bundle is missing ({p.name} in gradscope/static). "
        "Reinstall gradscope with Node.js and npm available (pip install -e .), or build it: "
        "cd js && npm ci && npm run build."
    )


# NOTE [ the script once per environment ]: anywidget stores a widget's ``_esm`` in the notebook's
# widget state, once per widget: with the whole bundle inline, every output added 1.2 MB to a saved
# notebook. A widget's ``_esm`` is a loader of a few kilobytes instead (js/src/loader.js, built
# beside the bundle), all that a saved notebook keeps of the script. It imports the bundle
#   1. from the Jupyter server: a wheel installs it where JupyterLab and Notebook 7 serve extensions'
#      files, share/jupyter/labextensions/gradscope/static/widget-<id>.js, <id> naming its content
#      (bundle_id), so a page never runs another version than its kernel's (hatch_build.py);
#   2. else, for a widget shown as its cell starts, from its own state while the cell runs (NOTE [ a
#      live loop's script ]);
#   3. else from the kernel: the widget asks over its own channel (Jupyter running in another
#      environment, VS Code, an editable install whose copy is older) and the kernel sends it;
#   4. else it draws what it can: a notice saying what the view needs and the figures the widget's
#      data holds (a notebook opened where gradscope is not installed).
# Nothing comes from beyond the Jupyter server and the kernel in use; the bundle is imported once per
# page and shared by every widget of its version. The HTML pages still carry the bundle inline.
def bundle_text() -> str:
    """The bundled front end; raises GradscopeError saying how to build it when it is missing."""
    p = bundle_path()
    try:
        return p.read_text(encoding="utf-8")
    except OSError:
        raise _missing(p) from None


_ids: dict[tuple[int, int], str] = {}  # (mtime, size) of the bundle -> its id


def bundle_id() -> str:
    """The bundle named by its content: the first 16 hex digits of its SHA-256 (what
    ``hatch_build.py`` names the copy a wheel installs for the Jupyter server; see NOTE [ the
    script once per environment ])."""
    p = bundle_path()
    try:
        st = p.stat()
        key = (st.st_mtime_ns, st.st_size)
        if key not in _ids:
            _ids.clear()
            _ids[key] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        return _ids[key]
    except OSError:
        raise _missing(p) from None


def bundle_name() -> str:
    """The file name the Jupyter server serves the bundle under: ``widget-<bundle_id>.js``."""
    return f"widget-{bundle_id()}.js"


def loader_text() -> str:
    """A widget's own module (its ``_esm``, a few kilobytes): it loads the bundle ``bundle_name()``
    from the Jupyter server, else from the kernel, else draws a notice and the data's figures (see
    NOTE [ the script once per environment ])."""
    p = _STATIC / "loader.js"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError:
        raise _missing(p) from None
    if "__GRADSCOPE_BUNDLE__" not in text:
        raise GradscopeError(f"gradscope: {p} is not the widget's loader; rebuild it: cd js && npm run build.")
    return text.replace("__GRADSCOPE_BUNDLE__", bundle_name())


# ----- widgets --------------------------------------------------------------------------------
def _need_widgets() -> None:
    if _anywidget is None:
        raise WidgetUnavailable(
            "gradscope: the widget needs anywidget and ipywidgets: pip install 'gradscope[notebook]'. "
            "Without them, use rec.to_html('run.html') or print(rec.summary())."
        )


if _anywidget is not None:
    _t = _traitlets

    class _FrontEnd(_anywidget.AnyWidget):  # type: ignore[misc,name-defined]
        """What every gradscope widget shares: its ``_esm`` is the loader (a few kilobytes, what a
        saved notebook keeps of the script), and it answers the loader's request for the bundle
        where the Jupyter server does not have it (see NOTE [ the script once per environment ])."""

        # the bundle itself, only while a widget is shown as its cell runs (see NOTE [ a live loop's
        # script ]); empty otherwise, so a saved notebook does not keep it
        _gs_inline = _t.Unicode("").tag(sync=True)

        def __init__(self, **kwargs: Any) -> None:
            self._esm = loader_text()
            super().__init__(**kwargs)
            self.on_msg(self._send_bundle)

        def _send_bundle(self, _widget: Any, content: Any, _buffers: Any = None) -> None:
            if isinstance(content, dict) and content.get("type") == "gradscope-bundle":
                self.send({"type": "gradscope-bundle", "bundle": bundle_name(), "text": bundle_text()})

    class RecordingWidget(_FrontEnd):
        """A recording's graph, saved tensors, memory timeline and backward step-through.

        Synced state: ``selected_node`` (the node clicked in the graph, -1 for none) and ``step``
        (the backward step shown, -1 for none), both settable from Python too.
        """

        data = _t.Unicode("{}").tag(sync=True)
        selected_node = _t.Int(-1).tag(sync=True)
        step = _t.Int(-1).tag(sync=True)

        def __init__(
            self, recording: Recording | None, *, collapse: bool | int | str = "auto", label: str = "",
            **kwargs: Any
        ) -> None:
            data = (payload_json(recording, collapse=collapse) if recording is not None
                    else json.dumps({"kind": "live", "label": label, "count": 0, "iterations": None}))
            super().__init__(data=data, **kwargs)
            self.recording = recording
            self._feed: threading.Thread | None = None
            self._stop = threading.Event()

        @classmethod
        def live(cls, rec: Any, label: str = "") -> RecordingWidget:
            """A widget shown as a recorded cell starts (see NOTE [ a live loop ]): its per-iteration
            memory chart grows while ``rec`` (a :class:`gradscope.record`) runs; :meth:`finish` shows
            the recording."""
            # NOTE [ a live loop's script ]: the loader asks the kernel for the bundle where the
            # Jupyter server has none (an editable install, another environment), and a kernel
            # answers only once idle: while the cell runs it would not, and the live chart would
            # stay a notice until the cell ends. So a widget shown as its cell starts carries the
            # bundle in its state (the kernel may send while it is busy), and stop() empties it as
            # the cell ends: a notebook saved afterwards keeps the loader only.
            w = cls(None, label=label, _gs_inline=bundle_text())
            w._feed = threading.Thread(target=w._push, args=(rec,), name="gradscope-live", daemon=True)
            w._feed.start()
            return w

        def _push(self, rec: Any) -> None:
            """NOTE [ a live loop ]: a thread of its own sends a running loop's new iterations every
            :data:`LIVE_INTERVAL_S` (the loop's thread only makes rows, as it does anyway), so the chart
            moves at least once a second however long an iteration takes, and the loop pays the
            GIL for a few hundred rows' JSON each time (measured by benchmarks/bench_live.py).
            Messages carry the rows since the last one (the front end keeps them); the finished
            recording replaces them (:meth:`finish`)."""
            sent = 0
            while not self._stop.wait(LIVE_INTERVAL_S):
                try:
                    count, cols = rec.iterations_so_far(sent)
                    rows = len(cols.get("index", ()))
                    self.send({"type": "iterations", "count": count, "from": sent,
                               "rows": iterations_columns(cols) if rows else None})
                    sent += rows
                except Exception:  # a view that failed never stops the program
                    pass

        def _repr_mimebundle_(self, **kwargs: Any) -> Any:
            """The widget, and as text (what a front end without widgets shows) the recording's summary,
            or while a cell runs, that it is being recorded."""
            got = super()._repr_mimebundle_(**kwargs)
            data, meta = got if isinstance(got, tuple) else (got, None)
            data = dict(data or {})
            data["text/plain"] = (_summary_text(self.recording) if self.recording is not None
                                  else "gradscope: recording this cell (its iterations show here while it runs)")
            return data if meta is None else (data, meta)

        def stop(self) -> None:
            """No more updates (the cell ended); the bundle leaves the widget's state (see NOTE [ a
            live loop's script ])."""
            self._stop.set()
            if self._feed is not None:
                self._feed.join()
                self._feed = None
            self._gs_inline = ""

        def finish(self, recording: Recording, *, collapse: bool | int | str = "auto") -> None:
            """The cell ended: the live chart stops and the recording is shown in full."""
            self.stop()
            self.recording = recording
            self.data = payload_json(recording, collapse=collapse)

        @property
        def selected(self) -> Any:
            """The :class:`~gradscope.recording.Node` clicked in the graph, or None."""
            if self.recording is not None and 0 <= self.selected_node < len(self.recording.nodes):
                return self.recording.node(self.selected_node)
            return None

        @property
        def selected_saved(self) -> list[Any]:
            """Saved tensors of the clicked node."""
            return [] if self.recording is None else [s for s in self.recording.saved if s.node == self.selected_node]

    class ComparisonWidget(_FrontEnd):
        """A comparison's candidates side by side, with toggles to re-run some of them.

        The front end sends ``{"type": "rerun", "names": [...]}``; the comparison re-measures them
        in a background thread (a long run never freezes the view), then ``data``,
        ``rerun_count`` and ``running`` update. ``selected`` is the candidate whose graph is shown.
        """

        data = _t.Unicode("{}").tag(sync=True)
        selected = _t.Unicode("").tag(sync=True)
        selected_node = _t.Int(-1).tag(sync=True)
        step = _t.Int(-1).tag(sync=True)
        running = _t.List(_t.Unicode(), default_value=[]).tag(sync=True)
        rerun_count = _t.Int(0).tag(sync=True)
        rerun_error = _t.Unicode("").tag(sync=True)

        def __init__(self, comparison: Any, **kwargs: Any) -> None:
            super().__init__(data=_json(comparison_payload(comparison)), **kwargs)
            self.comparison = comparison
            self._thread: threading.Thread | None = None
            self._lock = threading.Lock()
            self.on_msg(self._on_custom_msg)

        def _on_custom_msg(self, _widget: Any, content: Any, _buffers: Any = None) -> None:
            if not isinstance(content, dict) or content.get("type") != "rerun":
                return
            names = content.get("names")
            if not isinstance(names, list):
                return
            try:
                self.rerun([str(n) for n in names])
            except GradscopeError as e:
                self.rerun_error = str(e)

        def rerun(self, names: Sequence[str]) -> threading.Thread:
            """Re-measure the named candidates in a background thread; returns the thread.

            NOTE [ re-runs in a thread ]: the kernel handles the browser's messages only while it
            is idle, and a re-run can take minutes. Running it in the comm handler would freeze
            the widget and the notebook; in a thread the kernel stays idle, so the view keeps
            answering (clicks, steps, other cells) and the result arrives as one state update.
            One re-run at a time: ``Comparison.rerun`` serializes its runs anyway.
            """
            known = [str(r.name) for r in self.comparison.rows]
            unknown = [n for n in names if n not in known]
            if unknown:
                raise GradscopeError(
                    f"gradscope: no candidate named {unknown[0]!r} in this comparison; it has {known}."
                )
            with self._lock:
                if self._thread is not None and self._thread.is_alive():
                    raise GradscopeError("gradscope: a re-run is already in progress; wait for it to finish.")
                self.rerun_error = ""
                self.running = list(names)
                self._thread = threading.Thread(
                    target=self._rerun_worker, args=(list(names),), name="gradscope-rerun", daemon=True
                )
                self._thread.start()
                return self._thread

        def _rerun_worker(self, names: list[str]) -> None:
            error = ""
            try:
                self.comparison.rerun(names)
            except Exception as e:  # shown in the widget; the kernel keeps running
                error = f"gradscope: re-running {', '.join(names)} failed: {type(e).__name__}: {e}"
            try:
                data = _json(comparison_payload(self.comparison))
            except Exception as e:
                data = self.data
                error = error or f"gradscope: could not redraw the comparison: {e}"
            with self.hold_sync():
                self.data = data
                self.rerun_error = error
                self.rerun_count = self.rerun_count + 1
                self.running = []

        def wait(self, timeout: float | None = None) -> None:
            """Block until the current re-run (if any) has finished."""
            t = self._thread
            if t is not None:
                t.join(timeout)

    class SnapshotWidget(_FrontEnd):
        """A CUDA memory snapshot: memory over time by allocating line (function, file) or by role,
        the OOM, the reserved bytes, and the largest live blocks with their roles and stacks at any
        moment.

        Synced state: ``position`` (the trace position shown, one of the sampled moments; settable
        from Python, which shows the nearest sampled moment) and ``group`` (``"line"``,
        ``"function"``, ``"file"`` or ``"role"``). :meth:`live_blocks` answers for the position exactly.
        """

        data = _t.Unicode("{}").tag(sync=True)
        position = _t.Int(-2).tag(sync=True)
        group = _t.Unicode("line").tag(sync=True)

        def __init__(self, recording: Recording, **kwargs: Any) -> None:
            payload = snapshot_payload(recording)
            default = payload["positions"][payload["default"]] if payload["positions"] else -2
            super().__init__(data=json.dumps(payload, separators=(",", ":"), allow_nan=False,
                                             ensure_ascii=False), position=default, **kwargs)
            self.recording = recording

        def live_blocks(self, limit: int | None = None) -> Any:
            """Every block alive at ``position`` (largest first, with frames), replayed exactly."""
            from gradscope._analyses.snapshot.data import snapshot_data
            from gradscope._analyses.snapshot.queries import live_blocks

            return live_blocks(snapshot_data(self.recording), None if self.position < -1 else self.position, limit)

    class JobWidget(_FrontEnd):
        """A job's ranks side by side: per-rank figures, the imbalance, overlaid timelines and
        communication spans; one rank's graph and step-through below.

        Synced state: ``selected_rank`` (the rank whose recording is shown below, -1 for none) and
        ``align`` (``"time"``, ``"normalized"`` or ``"phase"``: how the timelines are overlaid).
        """

        data = _t.Unicode("{}").tag(sync=True)
        selected_rank = _t.Int(-1).tag(sync=True)
        align = _t.Unicode("normalized").tag(sync=True)
        selected_node = _t.Int(-1).tag(sync=True)
        step = _t.Int(-1).tag(sync=True)

        def __init__(self, job: Any, **kwargs: Any) -> None:
            super().__init__(data=_json(job_payload(job)), **kwargs)
            self.job = job

else:  # pragma: no cover

    class RecordingWidget:  # type: ignore[no-redef]
        """Placeholder: the widget needs anywidget."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _need_widgets()

    class ComparisonWidget:  # type: ignore[no-redef]
        """Placeholder: the widget needs anywidget."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _need_widgets()

    class SnapshotWidget:  # type: ignore[no-redef]
        """Placeholder: the widget needs anywidget."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _need_widgets()

    class JobWidget:  # type: ignore[no-redef]
        """Placeholder: the widget needs anywidget."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _need_widgets()


# The WIDGET views, one per result type: the widget drawing it (WidgetUnavailable where none can run).
def _ready() -> None:
    _need_widgets()
    for p in (bundle_path(), _STATIC / "loader.js"):
        if not p.exists():
            raise WidgetUnavailable(str(_missing(p)))


@register(ViewKind.WIDGET, Recording)
def _recording_widget(rec: Recording, *, collapse: bool | int | str = "auto") -> Any:
    _ready()
    return RecordingWidget(rec, collapse=collapse)


@register(ViewKind.WIDGET, SnapshotRecording)
def _snapshot_widget(rec: SnapshotRecording, *, collapse: bool | int | str = "auto") -> Any:
    _ready()
    return SnapshotWidget(rec)


@register(ViewKind.WIDGET, Comparison)
def _comparison_widget(cmp: Comparison, *, collapse: bool | int | str = "auto") -> Any:
    _ready()
    return ComparisonWidget(cmp)


@register(ViewKind.WIDGET, Job)
def _job_widget(job: Job, *, collapse: bool | int | str = "auto") -> Any:
    _ready()
    return JobWidget(job)


def show(obj: Any, *, collapse: bool | int | str = "auto") -> Any:
    """The widget for a Recording (or a ``gs.record()`` recorder), a Comparison or a Job: its
    WIDGET view.

    Args:
        obj: ``rec.recording``, the ``gs.record()`` object itself, ``gs.compare(...)``'s result,
            ``gs.load_snapshot(path)`` or a job.
        collapse: for a recording, how to fold modules: ``"auto"`` (big graphs open folded by
            module), ``False`` (every node), ``True`` or a module depth (1 = top-level modules).

    Example:
        >>> import gradscope as gs  # doctest: +SKIP
        >>> gs.show(rec.recording)  # doctest: +SKIP
    """
    _need_widgets()
    shown = _views.find(ViewKind.WIDGET, type(obj))
    rec = getattr(obj, "recording", None)
    if shown is None and isinstance(rec, Recording):  # the gs.record() object: its recording
        obj, shown = rec, _views.find(ViewKind.WIDGET, type(rec))
    if shown is None:
        raise GradscopeError(
            f"gradscope: gs.show() takes a Recording (rec.recording, or gs.load_snapshot(path)), a Comparison "
            f"(gs.compare(...)) or a Job (gs.gather / gs.load_ranks), not a {type(obj).__name__}."
        )
    return shown(obj, collapse=collapse)


def mimebundle(obj: Any) -> dict[str, Any]:
    """What a Recording, Comparison or Job shows as a cell's value (:func:`gradscope._base.registry.display`):
    the widget when the widget stack and the bundle are available, otherwise the text summary and
    the self-contained HTML page."""
    return _views.display(obj)
