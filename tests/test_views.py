"""One registry of views keyed by type: a view is found through the result's MRO, a subclass gets its
base's views unless it has its own, a missing one is a GradscopeError naming the type and the kind, and
what the results offer (summary, to_html, payload_of, gs.show) are those views."""

from __future__ import annotations

import dataclasses

import pytest
from _recordings import tiny_recording

import gradscope as gs
from gradscope._base import registry as _views
from gradscope._base.registry import ViewKind, render
from gradscope.html import recording_html
from gradscope.report import summary_text
from gradscope.snapshot import SnapshotRecording
from gradscope.widget import payload_of, recording_payload


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class _Relabelled(gs.Recording):
    """A subclass with no view of its own."""


def test_a_subclass_is_shown_by_its_base_and_a_snapshot_by_its_own_views() -> None:
    rec = tiny_recording()
    sub = _Relabelled(**{f.name: getattr(rec, f.name) for f in dataclasses.fields(gs.Recording)})
    assert sub.summary() == summary_text(rec) == rec.summary()  # found through the MRO: Recording's view
    assert payload_of(sub) == recording_payload(rec)
    assert _views.view(ViewKind.HTML, _Relabelled) is recording_html
    assert _views.view(ViewKind.TEXT, SnapshotRecording) is not summary_text  # the snapshot's own
    assert _views.view(ViewKind.PAYLOAD, SnapshotRecording) is not recording_payload


def test_a_missing_view_names_the_type_and_the_kind() -> None:
    d = gs.diagnose(tiny_recording(), namespace={})
    assert str(d) == d.text() == render(ViewKind.TEXT, d)  # a result's text is its TEXT view
    with pytest.raises(gs.GradscopeError, match=r"no dot view of gradscope\.diagnose\.Diagnosis \(views "
                                                r"exist for gradscope\.recording\.Recording\)"):
        render(ViewKind.DOT, d)
    with pytest.raises(gs.GradscopeError, match=r"no widget view of builtins\.int"):
        render(ViewKind.WIDGET, 3)
    with pytest.raises(gs.GradscopeError, match="register.. takes a ViewKind"):
        _views.register("text", int)  # type: ignore[arg-type]
