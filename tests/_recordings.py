"""Hand-built recordings for front-end tests and benchmarks (no recorder needed)."""

from __future__ import annotations

from gradscope.recording import (
    Edge,
    Kind,
    MemoryPoint,
    Node,
    Peak,
    Phase,
    Recording,
    SavedTensor,
    Step,
)

__all__ = ["HOSTILE", "hostile_recording", "layered_recording", "tiny_recording"]

HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "</script><script>alert(2)</script>",
    "quote\"s 'and' `ticks`",
    "new\nline",
    "Ünïcödé.模块.🙂",
    "x" * 300,
]


def tiny_recording() -> Recording:
    """loss = (relu(x @ w1) @ w2).sum(): 6 nodes, 4 backward steps, hand-checked numbers."""
    nodes = (
        Node(0, "SumBackward0", executed=1),
        Node(1, "MmBackward0", module="1", executed=1),
        Node(2, "ReluBackward0", module="0", executed=1),
        Node(3, "MmBackward0", module="0", executed=1),
        Node(4, "AccumulateGrad", module="0", leaf="0.weight", leaf_shape=(4, 8), executed=1),
        Node(5, "AccumulateGrad", module="1", leaf="1.weight", leaf_shape=(8, 2), executed=1),
    )
    edges = (Edge(1, 0), Edge(2, 1), Edge(5, 1), Edge(3, 2), Edge(4, 3))
    saved = (
        SavedTensor(1, "self", (16, 8), "float32", "cpu", 512, 1, Kind.ACTIVATION, "1", None, 1),
        SavedTensor(1, "mat2", (8, 2), "float32", "cpu", 64, 2, Kind.PARAMETER, "1", "1.weight", 1),
        SavedTensor(2, "result", (16, 8), "float32", "cpu", 512, 1, Kind.ACTIVATION, "0", None, 2),
        SavedTensor(3, "self", (16, 4), "float32", "cpu", 256, 3, Kind.INPUT, "0", "input", 3),
    )
    steps = (
        Step(0, 0, 0, 0.010, 0.001, 1000, 1000, 0),
        Step(1, 1, 0, 0.011, 0.001, 1000, 1600, 64),
        Step(2, 2, 0, 0.012, 0.001, 1600, 1100, 512),
        Step(3, 3, 0, 0.013, 0.001, 1100, 900, 256),
    )
    timeline = (
        MemoryPoint(0.000, 256, Phase.FORWARD, "aten::mm", module="0"),
        MemoryPoint(0.002, 768, Phase.FORWARD, "aten::relu", module="0"),
        MemoryPoint(0.004, 1000, Phase.FORWARD, "aten::mm", module="1"),
        MemoryPoint(0.010, 1000, Phase.BACKWARD, "SumBackward0", step=0),
        MemoryPoint(0.011, 1600, Phase.BACKWARD, "MmBackward0", step=1, module="1"),
        MemoryPoint(0.012, 1100, Phase.BACKWARD, "ReluBackward0", step=2, module="0"),
        MemoryPoint(0.013, 900, Phase.BACKWARD, "MmBackward0", step=3, module="0"),
    )
    return Recording(
        nodes=nodes,
        edges=edges,
        saved=saved,
        steps=steps,
        timeline=timeline,
        peak_bytes=1600,
        baseline_bytes=4096,
        peak=Peak(1600, Phase.BACKWARD, 0.011, "MmBackward0", node=1, module="1", step=1),
        label="tiny",
        backward_passes=1,
    )


def layered_recording(layers: int, per_layer: int = 75, *, timeline_points: int = 4000) -> Recording:
    """A chain of ``layers`` blocks shaped like a transformer layer's autograd graph.

    Each block has ``per_layer`` nodes spread over six submodules, parameter leaves, a residual
    edge and saved tensors; ``layers=48`` gives about 3,600 nodes, ``layers=267`` about 20,000.
    """
    subs = ("self_attn", "linear1", "dropout", "linear2", "norm1", "norm2")
    nodes: list[Node] = [Node(0, "MeanBackward0", executed=1)]
    edges: list[Edge] = []
    saved: list[SavedTensor] = []
    prev_out = 0  # node consuming the block's output
    storage = 0
    for layer in range(layers - 1, -1, -1):
        base = len(nodes)
        block_out = base
        for j in range(per_layer):
            nid = base + j
            sub = subs[(j * len(subs)) // per_layer]
            module = f"layers.{layer}.{sub}"
            if j % 5 == 4:
                nodes.append(
                    Node(
                        nid,
                        "AccumulateGrad",
                        module=module,
                        leaf=f"{module}.weight",
                        leaf_shape=(256, 256),
                        executed=1,
                    )
                )
            else:
                nodes.append(
                    Node(
                        nid,
                        ("AddmmBackward0", "ViewBackward0", "GeluBackward0", "NativeLayerNormBackward0")[
                            j % 4
                        ],
                        module=module,
                        executed=1,
                    )
                )
                storage += 1
                saved.append(
                    SavedTensor(
                        nid,
                        "self",
                        (32, 256),
                        "float32",
                        "cpu",
                        32768,
                        storage,
                        Kind.ACTIVATION,
                        module,
                        None,
                        None,
                    )
                )
            if j > 0:
                # leaves feed the node before them; the other nodes form a chain that skips leaves
                target = nid - 1 if (j - 1) % 5 != 4 or j == 1 else nid - 2
                edges.append(Edge(nid, target))
        edges.append(Edge(block_out, prev_out))
        if layer % 2 == 0 and prev_out != 0:
            edges.append(Edge(base + per_layer - 2, prev_out))  # residual
        prev_out = base + per_layer - 1
    n = len(nodes)
    steps = tuple(
        Step(i, i, 0, 1.0 + i * 1e-4, 1e-4, 10_000_000 - i * 1000, 10_000_000 - (i + 1) * 1000, 1000)
        for i in range(n)
    )
    timeline = tuple(
        MemoryPoint(
            t_s=i * 1e-4,
            live=(i * 2500) if i < timeline_points // 2 else (timeline_points - i) * 2500,
            phase=Phase.FORWARD if i < timeline_points // 2 else Phase.BACKWARD,
            label="aten::addmm" if i % 2 else "AddmmBackward0",
            step=None if i < timeline_points // 2 else i - timeline_points // 2,
            module=f"layers.{(i // 40) % layers}.linear1",
        )
        for i in range(timeline_points)
    )
    return Recording(
        nodes=tuple(nodes),
        edges=tuple(edges),
        saved=tuple(saved),
        steps=steps,
        timeline=timeline,
        peak_bytes=timeline_points // 2 * 2500,
        peak=Peak(timeline_points // 2 * 2500, Phase.FORWARD, timeline_points // 2 * 1e-4, "aten::addmm"),
        label=f"layered-{layers}",
    )


def hostile_recording() -> Recording:
    """A small recording whose module, parameter and label texts are hostile (markup, quotes...)."""
    nodes = [Node(0, "SumBackward0", module=HOSTILE[0], executed=1)]
    edges = []
    saved = []
    for i, text in enumerate(HOSTILE):
        leaf = Node(i + 1, "AccumulateGrad", module=text, leaf=text, leaf_shape=(3,), executed=1)
        nodes.append(leaf)
        edges.append(Edge(i + 1, 0))
        saved.append(
            SavedTensor(
                0, f"attr {text}", (3,), "float32", "cpu", 12 * (i + 1), i, Kind.PARAMETER, text, text, 0
            )
        )
    timeline = tuple(
        MemoryPoint(i * 0.001, 100 * (i + 1), Phase.FORWARD if i < 3 else Phase.BACKWARD, text, module=text)
        for i, text in enumerate(HOSTILE)
    )
    return Recording(
        nodes=tuple(nodes),
        edges=tuple(edges),
        saved=tuple(saved),
        steps=(Step(0, 0, 0, 0.004, 0.001, 600, 400, 200),),
        timeline=timeline,
        peak_bytes=600,
        peak=Peak(600, Phase.BACKWARD, 0.005, HOSTILE[1], node=0, module=HOSTILE[0]),
        label=HOSTILE[1],
    )
