"""What the widget and the self-contained page get for a CUDA memory snapshot: every number equal to
the snapshot functions' answers (themselves checked against an independent replay in
test_snapshot.py), the payload bounded whatever the trace's length, the widget's state from Python,
and the text summary's wording. The page in a real browser is in test_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _snapshots import FakeAllocator, MiB, Oom, frames, snapshot, training_snapshot

import gradscope as gs
from gradscope._views.snapshot_payload import SNAPSHOT_GROUPS
from gradscope.snapshot import (
    allocation_role,
    bytes_by_line,
    bytes_by_role,
    live_blocks,
    memory_by_group,
    memory_by_role,
    snapshot_data,
)
from gradscope.widget import payload_json, payload_of, snapshot_payload


@pytest.fixture(scope="module")
def rec() -> gs.Recording:
    return gs.load_snapshot(training_snapshot(steps=14, oom_step=11).snap, label="train.pickle cuda:0")


def test_memory_by_group_for_every_grouping(rec: gs.Recording) -> None:
    p = snapshot_payload(rec, points=60, top=3)
    d = snapshot_data(rec)
    S = p["strings"]
    for g in SNAPSHOT_GROUPS:
        want = memory_by_group(d, g, top=3, points=60)
        assert p["positions"] == list(want.positions)
        assert [S[i] for i in p["groupings"][g]["names"]] == list(want.groups)
        assert p["groupings"][g]["bytes"] == [list(r) for r in want.bytes]
    assert p["total"] == list(want.total) and p["reserved"] == list(want.reserved)
    assert p["t"] == [round(t, 7) for t in want.t_s]
    assert p["oom"]["at"] == d.oom.at and p["positions"][p["oom"]["index"]] == d.oom.at
    assert p["peak"]["bytes"] == d.peak_bytes == rec.peak_bytes and p["positions"][p["peak"]["index"]] == d.peak_at
    assert p["positions"][p["default"]] == d.default_at


def test_the_largest_live_blocks_at_every_moment_with_their_frames(rec: gs.Recording) -> None:
    p = snapshot_payload(rec, points=60, blocks=5)
    d = snapshot_data(rec)
    S, B = p["strings"], p["blocks"]
    frames_of = [[(S[p["frames"]["file"][f]], p["frames"]["line"][f], S[p["frames"]["name"][f]]) for f in st]
                 for st in p["stacks"]]
    for k, pos in enumerate(p["positions"]):
        want = live_blocks(d, pos)
        assert p["moments"]["counts"][k] == len(want)
        got = p["moments"]["blocks"][k]
        assert [(B["size"][r], B["alloc_at"][r], B["address"][r]) for r in got] == [
            (a.size, a.alloc_at, a.address) for a in want[:5]]
        for r, a in zip(got, want, strict=False):
            assert B["free_at"][r] == (-1 if a.free_at is None else a.free_at)
            assert S[B["line"][r]] == a.label
            assert frames_of[B["stack"][r]] == [(f.filename, f.line, f.name) for f in a.frames]
    # each block travels once, however many moments show it
    shown = {r for ids in p["moments"]["blocks"] for r in ids}
    assert shown == set(range(len(B["size"])))


def test_memory_by_role_and_each_blocks_role(rec: gs.Recording) -> None:
    p = snapshot_payload(rec, points=60, blocks=5)
    d = snapshot_data(rec)
    S, B = p["strings"], p["blocks"]
    want = memory_by_role(d, points=60)
    assert [S[i] for i in p["groupings"]["role"]["names"]] == list(want.groups)
    assert p["groupings"]["role"]["bytes"] == [list(r) for r in want.bytes] and want.positions == tuple(p["positions"])
    for k, pos in enumerate(p["positions"]):  # the roles add up to what was allocated, at every moment
        assert sum(r[k] for r in p["groupings"]["role"]["bytes"]) == p["total"][k] == d.live_bytes(pos)
    for k, pos in enumerate(p["positions"]):
        for r, a in zip(p["moments"]["blocks"][k], live_blocks(d, pos), strict=False):
            assert S[B["role"][r]] == allocation_role(d, a.index).label
    assert p["diagnosis"]["by_role"] == [[r.role.label, r.bytes, r.blocks] for r in bytes_by_role(d)]
    assert all("code" not in f for f in p["diagnosis"]["findings"])


def test_the_diagnosis_travels_with_it(rec: gs.Recording) -> None:
    p = snapshot_payload(rec)
    d = gs.diagnose(rec)
    assert p["diagnosis"]["text"] == d.text()
    assert [f["pattern"] for f in p["diagnosis"]["findings"]] == [f.pattern for f in d.findings]
    assert p["diagnosis"]["by_line"] == [[r.key, r.bytes, r.blocks] for r in bytes_by_line(snapshot_data(rec))[:8]]


def test_the_payload_is_bounded_whatever_the_length_of_the_trace() -> None:
    """A trace 20 times longer (a leak that keeps growing, so more blocks live at the end) gives
    the same number of moments, at most `blocks` rows per moment, and a payload about as large."""
    sizes = {}
    for steps in (120, 2400):
        r = gs.load_snapshot(training_snapshot(steps=steps, leak=True, capacity=8000 * MiB).snap)
        p = snapshot_payload(r)  # 1000 moments, 20 blocks each
        d = snapshot_data(r)
        assert len(p["positions"]) <= 1000 + 2 + len(d.ooms)  # the samples, before the trace, the peak, the OOMs
        assert len(p["blocks"]["size"]) <= 20 * len(p["positions"])
        sizes[steps] = (d.events, len(payload_json(r).encode()))
    (e1, b1), (e2, b2) = sizes[120], sizes[2400]
    assert e1 > 2000 and e2 > 19 * e1 and b2 < 1.3 * b1, sizes


def test_show_gives_the_snapshot_widget_and_python_sees_the_moment(rec: gs.Recording) -> None:
    pytest.importorskip("anywidget")
    from gradscope.widget import SnapshotWidget, bundle_path

    if not bundle_path().exists():
        pytest.skip("front end not built")
    w = gs.show(rec)
    d = snapshot_data(rec)
    assert isinstance(w, SnapshotWidget) and w.position == d.oom.at and w.group == "line"
    assert json.loads(w.data) == payload_of(rec)
    assert [a.index for a in w.live_blocks()] == [a.index for a in live_blocks(d, d.oom.at)]
    w.position = 40
    assert [a.index for a in w.live_blocks(limit=3)] == [a.index for a in live_blocks(d, 40, 3)]
    bundle = rec._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/plain"] == rec.summary()


def test_the_page_is_the_snapshot_view(rec: gs.Recording, tmp_path: Path) -> None:
    assert rec.to_html(tmp_path / "snap.html") == str(tmp_path / "snap.html")
    page = (tmp_path / "snap.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="gradscope-data">(.*?)</script>', page,
                                re.S).group(1))
    assert data == json.loads(payload_json(rec))
    assert data["kind"] == "snapshot" and "default-src 'none'" in page and page.count("<script") == 2


def test_frame_names_are_data_in_the_page(tmp_path: Path) -> None:
    evil = ("/home/u/</script><img src=x onerror=alert(1)>.py", 1, "<b>f</b>")
    a = FakeAllocator(40 * MiB)
    a.malloc(30 * MiB, frames(evil))
    with pytest.raises(Oom):
        a.malloc(30 * MiB, frames(evil))
    r = gs.load_snapshot(snapshot(a), label="</title><script>alert(2)</script>")
    page = r.to_html()
    assert page.lower().count("</script") == 2 and "<img src=x" not in page
    assert evil[0] in json.loads(payload_json(r))["strings"]


def test_summary_says_what_a_snapshot_is(rec: gs.Recording) -> None:
    d = snapshot_data(rec)
    text = rec.summary()
    lines = text.splitlines()
    assert lines[0] == "gradscope recording train.pickle cuda:0 (INCOMPLETE: CUDA out of memory)"
    assert lines[1] == "  device cuda:0, memory source: cuda snapshot"
    alive = sum(1 for f in d.alloc_free_at if f < 0)
    assert lines[2].startswith(f"  a CUDA memory snapshot (torch.cuda.memory._dump_snapshot): {d.events} trace events "
                               f"over {d.t_s(d.events - 1):.3f} s, {d.allocations} allocations ({alive} still alive")
    assert "no autograd graph" in lines[2] and "no autograd graph was built inside this block" not in text
    assert lines[3].startswith(f"  peak: {gs.recording.format_bytes(rec.peak_bytes)} ({rec.peak_bytes} bytes) "
                               f"allocated at trace event {d.peak_at}")
    oom = d.oom
    assert lines[4] == (f"  OOM at trace event {oom.at}: tried to allocate {gs.recording.format_bytes(oom.requested)} "
                        f"from model.py:20 forward with {gs.recording.format_bytes(oom.allocated)} allocated, "
                        f"{gs.recording.format_bytes(oom.reserved)} reserved, "
                        f"{gs.recording.format_bytes(oom.device_free)} free on the device")
    assert lines[5] == "  live at the OOM by source line:"
    assert lines[6:11] == [f"    {r}" for r in bytes_by_line(d)[:5]]
