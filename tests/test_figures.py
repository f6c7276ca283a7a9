"""One definition per figure: each figure against a computation written out by hand, and the same
number in the summary, the widget's payload and the diagnosis."""

from __future__ import annotations

import torch
from _recordings import tiny_recording

import gradscope as gs
from gradscope import figures as F
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
