"""One definition per figure: each figure against a computation written out by hand, and the same
number in the summary, the widget's payload and the diagnosis; one registry every view reads; the
one downsampler against a brute-force computation; the one interner."""

from __future__ import annotations

import random

import pytest
import torch
from _recordings import tiny_recording

import gradscope as gs
from gradscope import figures as F
from gradscope._base.series import Interner, bucket_width, downsample
from gradscope.recording import Category, Kind, MemoryPoint, Node, Phase, Recording, SavedTensor
from gradscope.widget import recording_payload

A, OT, CG, GR = Category.ACTIVATION, Category.OTHER, Category.CREATE_GRAPH, Category.GRADIENT


def _categorized() -> Recording:
    """Seven allocations and frees with known categories: +100 act, +200 other, -100 other,
    +500 create_graph, +50 gradient, -500 create_graph, -100 act."""
    pts = [(100, A, Phase.FORWARD), (300, OT, Phase.FORWARD), (200, OT, Phase.FORWARD),
           (700, CG, Phase.BACKWARD), (750, GR, Phase.BACKWARD), (250, CG, Phase.BACKWARD),
           (150, A, Phase.OPTIMIZER)]
    tl = tuple(MemoryPoint(t_s=i * 1e-3, live=v, phase=ph, label=f"op{i}", category=c)
               for i, (v, c, ph) in enumerate(pts))
    return Recording(timeline=tl, peak_bytes=750, baseline_bytes=4096)


def test_memory_by_category_is_the_running_sum_of_each_categorys_changes():
    s = F.memory_by_category(_categorized())
    assert s.note is None
    assert s.categories == (A, CG, GR, OT)  # stacking order, only those present
    # written out from the docstring of _categorized, not computed
    assert s.values == (
        (100, 100, 100, 100, 100, 100, 0),
        (0, 0, 0, 500, 500, 0, 0),
        (0, 0, 0, 0, 50, 50, 50),
        (0, 200, 100, 100, 100, 100, 100),
    )
    # at every point the bands add up to the live bytes
    live = [p.live for p in _categorized().timeline]
    assert [sum(col[i] for col in s.values) for i in range(7)] == live
    assert s.at(4) == {"activation": 100, "create_graph": 500, "gradient": 50, "other": 100}
    assert F.peak_index(_categorized()) == 4


def test_memory_by_category_refuses_to_guess_after_dropped_points():
    rec = Recording(timeline=_categorized().timeline[::2], timeline_dropped=3)
    s = F.memory_by_category(rec)
    assert s.categories == () and s.values == ()
    assert s.note is not None and "3 timeline points were dropped" in s.note


def test_memory_by_category_flags_frees_tagged_with_another_category():
    tl = (MemoryPoint(0.0, 100, Phase.FORWARD, "a", category=A),
          MemoryPoint(0.1, 0, Phase.FORWARD, "b", category=OT))
    s = F.memory_by_category(Recording(timeline=tl))
    assert s.values == () and "other falls below zero" in (s.note or "")


def test_recorded_categories_add_up_to_live():
    # the recorder tags each point: the bands add up to live at every point, and each band holds
    # what the graph says: tanh saves its 64x64 result, w's gradient is 64x64, the gradients
    # flowing through backward are 64x64 temporaries
    w = torch.randn(64, 64, requires_grad=True)
    with gs.record(memory="cpu") as rec:
        (w @ w).tanh().sum().backward()
    r = rec.recording
    s = F.memory_by_category(r)
    assert s.note is None
    assert [sum(v[i] for v in s.values) for i in range(len(r.timeline))] == [p.live for p in r.timeline]
    band = dict(zip(s.categories, s.values, strict=True))
    size = 64 * 64 * 4
    assert max(band[Category.ACTIVATION]) == size and band[Category.ACTIVATION][-1] == 0
    assert band[Category.GRADIENT][-1] == size == w.grad.numel() * 4
    assert band[Category.BACKWARD_TEMP][-1] == 0 and max(band[Category.BACKWARD_TEMP]) >= size
    assert set(s.categories) <= {Category.ACTIVATION, Category.GRADIENT, Category.BACKWARD_TEMP, OT}


def test_saved_activation_figures_leave_parameters_out():
    rec = tiny_recording()
    # node 1 saved a 512-byte activation and a 64-byte weight; node 3 a 256-byte input
    assert F.saved_activations_by_node(rec) == [0, 512, 512, 0, 0, 0]
    assert F.saved_activation_bytes(rec) == 512  # storage 1 saved by nodes 1 and 2: once
    assert F.parameters_saved_bytes(rec) == 64 + 256
    assert F.saved_activations_by_module(rec) == {"0": 512, "1": 512}
    largest = F.largest_saved_by_node(rec)
    assert largest[0] is None and largest[1].attribute == "self" and largest[3].kind is Kind.INPUT


def test_module_prefixes_and_groups():
    nodes = (Node(0, "A", module="layers.0.a"), Node(1, "B", module="layers.0.b"), Node(2, "C", module="layers.1.a"))
    saved = tuple(
        SavedTensor(i, "x", (4,), "float32", "cpu", b, i, Kind.ACTIVATION, n.module)
        for i, (n, b) in enumerate(zip(nodes, (16, 32, 64), strict=True))
    )
    rec = Recording(nodes=nodes, saved=saved)
    assert F.saved_activations_by_module(rec, depth=2) == {"layers.1": 64, "layers.0": 48}
    assert F.saved_activations_by_module(rec, groups=[0, 0, -1]) == {"0": 48}


def test_one_module_figure_in_summary_widget_and_diagnosis():
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32)).eval()
    z = torch.randn(8, 32)
    y = torch.randn(8, 32, requires_grad=True)
    from gradscope.strategies import mixed_grad

    with gs.record(memory="cpu", modules={"G": G}) as rec:
        mixed_grad(lambda a, b: ((a + b) ** 3).sum(), G, z, y, method="create_graph")
    r = rec.recording
    alive = F.alive_at_peak_by_module(r)
    assert alive is not None
    # independent: the held rows summed by module, as listed in the recording
    assert r.held is not None
    rows = r.held.to_dict()["rows"]
    by_hand: dict[str, int] = {}
    for row in rows:
        by_hand[row.get("module") or "(no module)"] = by_hand.get(row.get("module") or "(no module)", 0) + row["bytes"]
    for m, b in (r.held.to_dict().get("omitted_by_module") or {}).items():
        by_hand[m] = by_hand.get(m, 0) + b
    assert alive == by_hand
    assert sum(alive.values()) == r.peak_bytes  # everything alive at the peak has one module (or none)
    top_module, top_bytes = next(iter(alive.items()))
    # the diagnosis lists the same number for the same module
    diag = gs.diagnose(r)
    assert dict(diag.by_module)[top_module] == top_bytes
    # so does the summary
    assert f"{gs.recording.format_bytes(top_bytes):>10}  {top_module}" in r.summary()
    # and the widget's module table
    p = recording_payload(r)
    S = p["strings"]
    mods = dict(zip([S[i] for i in p["modules"]["name"]], p["modules"]["alive_at_peak"], strict=True))
    assert mods[top_module] == top_bytes
    assert p["figures"]["alive_at_peak"]["definition"] == F.ALIVE_AT_PEAK.definition


def test_step_numbers_start_at_one():
    assert F.step_number(0) == 1 and F.step_number(52) == 53


# ----- one registry ----------------------------------------------------------------------------
def test_one_registry_with_one_meaning_per_label():
    figs = list(F.FIGURES.values())
    assert all(isinstance(f, F.Figure) and f.name and f.label and f.definition and callable(f.function)
               for f in figs)
    assert [f.name for f in figs] == list(F.FIGURES)
    labels = [f.label for f in figs]
    assert len(set(labels)) == len(labels)  # one label, one figure, one meaning
    assert dict(F.DEFINITIONS) == {f.name: f.definition for f in figs}
    assert F.figures_payload() == {f.name: {"label": f.label, "definition": f.definition} for f in figs}
    # "saved (total)" counts activations only; every save, parameters included, is "saved (all kinds)"
    assert F.SAVED_TOTAL.label == "saved (total)" and "activation" in F.SAVED_TOTAL.definition
    assert F.SAVED_ALL.label == "saved (all kinds)" and "parameters" in F.SAVED_ALL.definition
    assert not hasattr(gs.recording, "FIGURES")  # the data model keeps no second registry


def test_registry_functions_compute_the_figures():
    rec = tiny_recording()
    assert F.SAVED_ALL.function(rec) == rec.saved_bytes == 512 + 64 + 256
    assert F.SAVED_TOTAL.function(rec) == F.saved_activation_bytes(rec) == 512
    assert F.PARAMETERS_SAVED.function(rec) == 64 + 256
    assert F.PEAK.function(rec) == rec.peak_bytes and F.BASELINE.function(rec) == rec.baseline_bytes
    assert F.NODE_SAVED.function(rec, 1) == rec.node_saved_bytes(1)
    assert F.MODULE_SAVED.function(rec) == rec.saved_bytes_by_module()
    assert F.FREED.function(rec) == [s.freed_bytes for s in rec.steps]
    assert F.SAVED_ALL.computed_by == "gradscope.recording.Recording.saved_bytes"
    assert F.SAVED_TOTAL.computed_by == "gradscope.figures.saved_activation_bytes"


def test_every_view_titles_its_columns_from_the_registry():
    from gradscope.job import Job, RankEntry, RankStatus, job_payload

    w = torch.randn(16, 16, requires_grad=True)
    with gs.record(memory="cpu") as rec:
        (w @ w).tanh().sum().backward()
    r = rec.recording
    p = recording_payload(r)
    assert p["figures"] == F.figures_payload()
    assert (p["by_line"]["saved_label"], p["by_line"]["saved_definition"]) == (
        F.LINE_SAVED.label, F.LINE_SAVED.definition)
    job = Job((RankEntry(0, RankStatus.COMPLETE, r), RankEntry(1, RankStatus.COMPLETE, r)))
    text = job.summary()
    assert F.PEAK.label in text and F.SAVED_ALL.label in text and F.BASELINE.label in text
    assert f"title='{F.SAVED_ALL.definition}'>{F.SAVED_ALL.label}</th>" in job._repr_html_()
    assert job_payload(job)["figures"] == F.figures_payload()
    assert f"{F.LINE_SAVED.label} ({F.LINE_SAVED.definition})" in r.summary() or not r.lines


# ----- one downsampler -------------------------------------------------------------------------
def _brute_force(values: list[int], limit: int, must: tuple[int, ...]) -> list[int]:
    """What downsample keeps, written out: per bucket its first point, its first lowest and first
    highest point, the last point, the first global maximum and ``must``."""
    n = len(values)
    w = bucket_width(n, limit, len(must))
    out = {0, n - 1, values.index(max(values)), *must}
    for lo in range(0, n, w):
        seg = values[lo : lo + w]
        out.add(lo)
        out.add(lo + seg.index(min(seg)))
        out.add(lo + seg.index(max(seg)))
    return sorted(out)


@pytest.mark.parametrize(("spread", "limit"), [(1000, 600), (10**9, 600), (5, 1000), (10**6, 7)])
def test_downsample_matches_brute_force(spread: int, limit: int):
    rng = random.Random(spread + limit)
    values = [rng.randrange(spread) for _ in range(20_000)]  # small spreads: many equal values
    must = (3, 12_345, 19_998)
    keep = downsample(values, limit, must)
    assert keep == _brute_force(values, limit, must)
    assert keep == sorted(set(keep))  # sorted by time, each once
    assert len(keep) <= max(limit, 5 + len(must))
    kept = set(keep)
    w = bucket_width(len(values), limit, len(must))
    for lo in range(0, len(values), w):  # every bucket's lowest and highest value survive
        seg = values[lo : lo + w]
        shown = [values[i] for i in keep if lo <= i < lo + w]
        assert min(shown) == min(seg) and max(shown) == max(seg)
    assert values.index(max(values)) in kept and {0, len(values) - 1, *must} <= kept
    # a tensor gives the same points
    assert downsample(torch.tensor(values), limit, must) == keep


def test_downsample_keeps_short_series_whole():
    assert downsample([5, 1, 4], 3) == [0, 1, 2]
    assert downsample([], 10) == []
    assert downsample([2.5, 9.0, 1.0, 3.0, 0.5, 7.0, 8.0], 5) == [0, 1, 4, 6]  # one bucket
    assert downsample([2.5, 9.0, 1.0, 3.0, 0.5, 7.0, 8.0], 7) == list(range(7))


def test_widget_and_job_timelines_use_the_one_downsampler():
    from gradscope.job import Job, RankEntry, RankStatus, job_view

    rng = random.Random(3)
    lives = [rng.randrange(10**6) for _ in range(9000)]
    rec = Recording(timeline=tuple(MemoryPoint(i * 1e-4, v, Phase.FORWARD, "op") for i, v in enumerate(lives)),
                    peak_bytes=max(lives))
    p = recording_payload(rec, max_timeline_points=500)
    assert p["timeline"]["live"] == [lives[i] for i in downsample(lives, 500)]
    series = job_view(Job((RankEntry(0, RankStatus.COMPLETE, rec),))).timelines[0]
    from gradscope.job import _TIMELINE_POINTS

    assert [v for _, v in series.points] == [lives[i] for i in downsample(lives, _TIMELINE_POINTS)]


# ----- one interner ----------------------------------------------------------------------------
def test_interner_gives_each_value_one_index_in_order_of_first_sight():
    s: Interner[str] = Interner()
    assert [s("b"), s("a"), s("b"), s(None), s("c"), s("a")] == [0, 1, 0, -1, 2, 1]
    assert s.table == ["b", "a", "c"] and len(s) == 3 and "a" in s and "z" not in s
    p = recording_payload(tiny_recording())
    assert len(set(p["strings"])) == len(p["strings"])  # each string travels once

