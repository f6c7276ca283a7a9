"""Python side of the widget: payloads, state synced from the front end, re-runs in a thread."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from _recordings import HOSTILE, hostile_recording, layered_recording, tiny_recording

import gradscope as gs
import gradscope._views.widget as W
from gradscope._base.registry import ViewKind, register
from gradscope._base.series import downsample as _decimate
from gradscope.errors import GradscopeError
from gradscope.widget import (
    ComparisonWidget,
    RecordingWidget,
    comparison_payload,
    mimebundle,
    payload_json,
    recording_payload,
    show,
)

needs_bundle = pytest.mark.skipif(
    not W.bundle_path().exists(), reason="front end not built (cd js && npm run build)"
)
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def test_recording_payload_columns():
    rec = tiny_recording()
    p = recording_payload(rec)
    S = p["strings"]
    assert p["kind"] == "recording"
    assert [S[i] for i in p["nodes"]["name"]] == [n.name for n in rec.nodes]
    assert [S[i] if i >= 0 else None for i in p["nodes"]["leaf"]] == [None] * 4 + ["0.weight", "1.weight"]
    assert S[p["nodes"]["leaf_shape"][4]] == "4 × 8"
    # saved bytes per node, storage-deduplicated within the node
    assert p["nodes"]["saved_bytes"] == [0, 576, 512, 256, 0, 0]
    assert p["nodes"]["saved_count"] == [0, 2, 1, 1, 0, 0]
    assert p["edges"] == [1, 0, 2, 1, 5, 1, 3, 2, 4, 3]
    assert [S[i] for i in p["saved"]["attribute"]] == ["self", "mat2", "result", "self"]
    assert [S[i] for i in p["saved"]["kind"]] == ["activation", "parameter", "activation", "input"]
    assert p["saved"]["freed"] == [1, 1, 2, 3]
    assert p["steps"]["live_after"] == [1000, 1600, 1100, 900]
    assert p["steps"]["freed"] == [0, 64, 512, 256]
    assert p["timeline"]["phase"] == [0, 0, 0, 1, 1, 1, 1]
    assert p["phases"] == ["forward", "backward", "optimizer", "other"]
    assert p["timeline"]["step"] == [None, None, None, 0, 1, 2, 3]
    # every point of the hand-made timeline is "other": one band equal to live
    assert p["timeline"]["categories"] == ["other"]
    assert p["timeline"]["by_category"] == []  # one category is all of live: sent once
    # what each node holds: activations only (node 1's 64-byte weight and node 3's input are not
    # memory of the block), and its largest saved tensor
    assert p["nodes"]["act_bytes"] == [0, 512, 512, 0, 0, 0]
    assert [S[i] if i >= 0 else None for i in p["nodes"]["largest"]] == [None, "16 × 8", "16 × 8", "16 × 4", None, None]
    assert [S[i] if i >= 0 else None for i in p["nodes"]["largest_kind"]][3] == "input"
    assert "alive" not in p["nodes"]  # nothing measured at the peak in a hand-made recording
    assert [S[i] for i in p["modules"]["name"]] == ["0", "1"]
    assert p["modules"]["saved_activations"] == [512, 512] and p["modules"]["alive_at_peak"] is None
    assert p["summary"] == {
        "nodes": 6,
        "edges": 5,
        "saved": 4,
        "saved_bytes": 832,
        "saved_activations": 512,
        "parameters_saved": 320,
        "peak_bytes": 1600,
        "baseline_bytes": 4096,
        "steps": 4,
        "device": "cpu",
        "memory": True,
        "complete": True,
        "error": None,
    }
    assert p["peak"]["node"] == 1 and p["peak"]["phase"] == "backward"
    assert p["peak"]["breakdown"] == {"other": 1600}
    assert [lv["depth"] for lv in p["levels"]] == [None]  # six nodes: nothing to fold
    assert json.loads(payload_json(rec)) == json.loads(json.dumps(p))


def test_decimate_keeps_the_peak_and_ends():
    live = [i % 97 for i in range(20_000)]
    live[12_345] = 10**9
    keep = _decimate(live, 1000)
    assert len(keep) <= 1000 + 2
    assert keep[0] == 0 and keep[-1] == 19_999 and 12_345 in keep
    assert keep == sorted(set(keep))
    assert _decimate([1, 2, 3], 10) == [0, 1, 2]


def test_payload_of_a_big_timeline_is_thinned():
    rec = layered_recording(4, timeline_points=20_000)
    p = recording_payload(rec, max_timeline_points=2000)
    assert len(p["timeline"]["t"]) <= 2002
    assert max(p["timeline"]["live"]) == max(m.live for m in rec.timeline)
    assert p["timeline"]["dropped"] == 20_000 - len(p["timeline"]["t"])


def test_encoder_sized_state_is_under_two_megabytes():
    rec = layered_recording(48)
    assert len(rec.nodes) == 3601
    assert len(payload_json(rec).encode()) < 2_000_000


def test_payload_rejects_other_objects():
    with pytest.raises(GradscopeError, match="Recording"):
        payload_json(object())
    with pytest.raises(GradscopeError, match="expected a Recording"):
        recording_payload("nope")  # type: ignore[arg-type]
    with pytest.raises(GradscopeError, match="Comparison"):
        comparison_payload(object())


def test_missing_bundle_says_how_to_build(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(W, "_STATIC", tmp_path)
    with pytest.raises(GradscopeError, match="npm run build"):
        W.bundle_text()


@needs_bundle
def test_recording_widget_state_from_the_front_end():
    rec = tiny_recording()
    w = show(rec)
    assert isinstance(w, RecordingWidget)
    # NOTE [ the script once per environment ]: the widget's own module is the loader, naming the
    # bundle by the first 16 hex digits of its SHA-256; the kernel sends the bundle when asked
    import hashlib

    name = f"widget-{hashlib.sha256(W.bundle_path().read_bytes()).hexdigest()[:16]}.js"
    assert w._esm == W.loader_text() and len(w._esm.encode()) < 8_000
    assert f'"{name}"' in w._esm and W.bundle_text() not in w._esm
    sent: list[dict] = []
    w.send = sent.append  # type: ignore[method-assign]
    w._send_bundle(w, {"type": "something else"})
    w._send_bundle(w, {"type": "gradscope-bundle", "bundle": name})
    assert sent == [{"type": "gradscope-bundle", "bundle": name, "text": W.bundle_text()}]
    assert json.loads(w.data)["summary"]["nodes"] == 6
    assert w.selected_node == -1 and w.selected is None and w.selected_saved == []
    # what the front end does on a click: set the synced trait
    w.set_state({"selected_node": 1})
    assert w.selected_node == 1
    assert w.selected.name == "MmBackward0"
    assert [(s.attribute, s.bytes) for s in w.selected_saved] == [("self", 512), ("mat2", 64)]
    w.set_state({"step": 2})
    assert w.step == 2
    import anywidget

    ours = set(RecordingWidget.class_trait_names(sync=True)) - set(
        anywidget.AnyWidget.class_trait_names(sync=True)
    )
    # _gs_inline carries the bundle only while a cell that shows the widget runs (NOTE [ a live
    # loop's script ]): empty for a widget of a finished recording, so a saved notebook keeps the loader
    assert ours == {"data", "selected_node", "step", "_gs_inline"}
    assert w._gs_inline == ""
    ours_cmp = set(ComparisonWidget.class_trait_names(sync=True)) - set(
        anywidget.AnyWidget.class_trait_names(sync=True)
    )
    assert ours_cmp == {"data", "selected", "selected_node", "step", "running", "rerun_count", "rerun_error",
                        "_gs_inline"}
    # names that clash with DOMWidget and break rendering
    assert not (ours | ours_cmp) & {"layout", "style", "tooltip", "tabbable", "keys", "comm"}


@needs_bundle
def test_a_live_widget_carries_the_bundle_only_while_its_cell_runs():
    """A widget shown as its cell starts (``RecordingWidget.live``) has the bundle in its state while
    the loop runs, since a busy kernel answers no request for it; stop() empties it, so a notebook
    saved after the cell keeps the loader only (see NOTE [ a live loop's script ] in gradscope._views.widget)."""
    model = torch.nn.Linear(4, 2)
    rec = gs.record(memory="off")
    with rec:
        w = W.RecordingWidget.live(rec, label="cell [1]")
        try:
            assert w._gs_inline == W.bundle_text() and w._esm == W.loader_text()
            model(torch.randn(3, 4)).sum().backward()
        finally:
            w.stop()
    assert w._gs_inline == ""
    w.finish(rec.recording)
    assert w._gs_inline == "" and json.loads(w.data)["summary"]["nodes"] == len(rec.recording.nodes)


def test_show_accepts_the_recorder_and_rejects_others():
    w = torch.ones(3, requires_grad=True)
    with gs.record(memory="off") as r:
        (w * 2).sum().backward()
    widget = show(r)
    assert isinstance(widget, RecordingWidget)
    assert json.loads(widget.data)["summary"]["nodes"] == len(r.recording.nodes) == 3
    with pytest.raises(GradscopeError, match="gs.show"):
        show(42)


@needs_bundle
def test_mimebundle_is_the_widget_with_a_text_summary():
    rec = tiny_recording()
    b = mimebundle(rec)
    assert WIDGET_MIME in b and b[WIDGET_MIME]["model_id"]
    assert "text/plain" in b and "6" in b["text/plain"]
    b2 = rec._repr_mimebundle_()
    assert WIDGET_MIME in b2


def test_mimebundle_without_the_widget_stack_is_text_and_html(monkeypatch):
    monkeypatch.setattr(W, "_anywidget", None)
    b = mimebundle(hostile_recording())
    assert WIDGET_MIME not in b
    assert set(b) <= {"text/plain", "text/html"}
    if W.bundle_path().exists():
        assert b["text/html"].startswith("<!doctype html>")
        assert HOSTILE[0] not in b["text/html"]  # markup arrives escaped, as data
    with pytest.raises(GradscopeError, match="anywidget"):
        show(tiny_recording())


class _Row:
    def __init__(self, name: str, peak: int):
        self.name, self.status, self.peak_bytes, self.saved_bytes = name, "ok", peak, peak
        self.time_s, self.max_abs_error, self.message, self.recording = 0.5, 0.0, "", tiny_recording()


class _SlowComparison:
    """Shaped like gradscope.compare.Comparison; rerun blocks until released."""

    reference = "a"

    def __init__(self):
        self.rows = [_Row("a", 100), _Row("b", 200)]
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def rerun(self, names):
        self.started.set()
        assert self.release.wait(10)
        self.calls.append(list(names))
        for r in self.rows:
            if r.name in names:
                r.peak_bytes += 1
        if "boom" in names:
            raise ValueError("boom")


# shaped like a Comparison, and shown as one: its widget is the comparison's
register(ViewKind.WIDGET, _SlowComparison)(lambda cmp, **_: ComparisonWidget(cmp))


@needs_bundle
def test_rerun_message_runs_in_a_thread_and_updates_rows():
    cmp = _SlowComparison()
    w = show(cmp)
    assert isinstance(w, ComparisonWidget)
    assert [r["peak_bytes"] for r in json.loads(w.data)["rows"]] == [100, 200]
    # the message the front end sends when "Re-run selected" is clicked
    w._on_custom_msg(w, {"type": "rerun", "names": ["b"]}, [])
    assert cmp.started.wait(5)
    assert w.running == ["b"]  # the handler returned while the re-run is still going
    assert w.rerun_count == 0
    with pytest.raises(GradscopeError, match="already in progress"):
        w.rerun(["a"])
    cmp.release.set()
    w.wait(10)
    assert cmp.calls == [["b"]]
    assert w.running == [] and w.rerun_count == 1 and w.rerun_error == ""
    assert [r["peak_bytes"] for r in json.loads(w.data)["rows"]] == [100, 201]


@needs_bundle
def test_rerun_through_the_comm_message_path():
    """The whole path a browser message takes: comm message -> ipywidgets -> our handler."""
    cmp = _SlowComparison()
    cmp.release.set()
    w = ComparisonWidget(cmp)
    w._handle_msg(
        {
            "content": {"data": {"method": "custom", "content": {"type": "rerun", "names": ["a"]}}},
            "buffers": [],
        }
    )
    w.wait(10)
    assert cmp.calls == [["a"]] and w.rerun_count == 1
    # state updates from the front end still work
    w._handle_msg(
        {
            "content": {
                "data": {"method": "update", "state": {"selected": "b", "step": 3}, "buffer_paths": []}
            },
            "buffers": [],
        }
    )
    assert w.selected == "b" and w.step == 3


@needs_bundle
def test_rerun_errors_are_reported_not_raised():
    cmp = _SlowComparison()
    cmp.release.set()
    w = ComparisonWidget(cmp)
    w._on_custom_msg(w, {"type": "rerun", "names": ["nope"]}, [])
    assert "no candidate named 'nope'" in w.rerun_error and w.rerun_count == 0
    w._on_custom_msg(w, {"type": "something else"}, [])
    assert w.rerun_count == 0
    cmp.rows.append(_Row("boom", 1))
    w._on_custom_msg(w, {"type": "rerun", "names": ["boom"]}, [])
    w.wait(10)
    assert w.rerun_count == 1 and "ValueError: boom" in w.rerun_error


@needs_bundle
def test_rerun_with_a_real_comparison():
    x = torch.randn(6, requires_grad=True)
    cmp = gs.compare({"sin": lambda: x.sin().sum(), "double": lambda: (2 * x).sum()}, memory="off", repeat=1)
    w = show(cmp)
    before = [r["name"] for r in json.loads(w.data)["rows"]]
    w.rerun(["double"]).join(30)
    assert w.rerun_count == 1 and w.rerun_error == ""
    rows = json.loads(w.data)["rows"]
    assert [r["name"] for r in rows] == before == ["sin", "double"]
    assert [r["status"] for r in rows] == ["ok", "wrong"]


@needs_bundle
def test_gs_show_is_the_widget_entry_point_and_collapse_passes_through():
    assert gs.show is show
    rec = layered_recording(4)
    folded = json.loads(show(rec, collapse=2).data)["levels"][0]
    assert len(folded["groups"]["key"]) == 4 and folded["depth"] == 2
    flat = json.loads(show(rec, collapse=False).data)["levels"][0]
    assert flat["groups"]["key"] == [] and set(flat["group"]) == {-1}


def test_reserved_bytes_travel_only_when_recorded():
    import dataclasses

    rec = tiny_recording()
    assert "reserved" not in recording_payload(rec)["timeline"]
    cuda = dataclasses.replace(
        rec, timeline=tuple(dataclasses.replace(p, reserved=2048 + i) for i, p in enumerate(rec.timeline))
    )
    assert recording_payload(cuda)["timeline"]["reserved"] == [2048 + i for i in range(7)]
