"""The shape of the package: gradscope's modules import each other without a cycle (capture ->
passes -> data model <- views), the data model imports no view and no hook, and PyTorch's private
APIs are touched in one module only."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "gradscope"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """gradscope modules ``path`` imports (``from gradscope import x`` counts as ``gradscope.x``
    when x is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    body = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.If) and top_level_only:  # `if TYPE_CHECKING:` imports nothing at run time
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("gradscope")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradscope"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return out & modules


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    graph = {}
    for p in sorted(PKG.rglob("*.py")):
        name = _module_name(p)
        graph[name] = _imports(p, top_level_only) - {name, "gradscope"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    for start in graph:
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


# The package's layers, lowest first: a module imports only modules of its own layer or of a
# lower one (function-local imports included), and the whole graph has no circle. A name is a
# module or a package (a package's modules are in its layer unless named in another).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base: units, errors, the view registry, PyTorch's private APIs, the raw trace",
     ("gradscope._base", "gradscope._base.errors", "gradscope._base.error", "gradscope._base.units", "gradscope.errors", "gradscope._base.memory_kind", "gradscope._base.registry", "gradscope._base.stderr", "gradscope._base.source",
      "gradscope._base.compat", "gradscope._base.trace", "gradscope._base.frames", "gradscope._base.series", "gradscope._base.page", "gradscope._base.gc")),
    ("data model: the Recording and what its numbers mean",
     ("gradscope.recording", "gradscope._model", "gradscope.figures", "gradscope._model.held_at_peak", "gradscope._model.names", "gradscope._model.lines",
      "gradscope._model.job", "gradscope._model.growth")),
    ("capture: hooks, memory sources, the passes that make a Recording",
     ("gradscope._capture", "gradscope._capture.native", "gradscope._capture.walk", "gradscope._passes", "gradscope.memory", "gradscope._capture.memory", "gradscope._capture.compiled",
      "gradscope._capture", "gradscope.record", "gradscope._passes.iterations")),
    ("analyses: strategies, snapshots, prediction, comparison, diagnosis, jobs",
     ("gradscope.strategies", "gradscope._snapshot", "gradscope.snapshot", "gradscope.predict", "gradscope._predict",
      "gradscope.compare", "gradscope.graph", "gradscope.diagnose", "gradscope.jobs", "gradscope.distributed")),
    ("views: text, layout, widget payloads, pages",
     ("gradscope.report", "gradscope.layout", "gradscope._layered", "gradscope._simplex", "gradscope.widget", "gradscope._snapshot.payload", "gradscope.html",
      "gradscope.jobs.text", "gradscope.jobs.payload", "gradscope.jobs.page", "gradscope.job",
      "gradscope.diagnose.text", "gradscope._snapshot.text", "gradscope._shown")),
    ("notebook and the package's top",
     ("gradscope.ipython", "gradscope.__main__", "gradscope")),
]
# Edges allowed to run up a layer, each with its reason (at most two).
ALLOWED_UP: dict[tuple[str, str], str] = {}


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    return None if best is None else best[0]


def test_import_graph_has_no_cycle() -> None:
    # every import counts, those inside functions too: a lazy import is still an arrow
    graph = _graph(top_level_only=False)
    assert "gradscope.record" in graph and "gradscope._passes" in graph
    assert _cycle(graph) is None, _cycle(graph)


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_import_points_down_the_layers() -> None:
    graph = _graph(top_level_only=False)
    unplaced = sorted(m for m in graph if _layer(m) is None)
    assert unplaced == [], f"place these modules in LAYERS: {unplaced}"
    up = sorted((m, d) for m, deps in graph.items() for d in deps
                if (_layer(d) or 0) > (_layer(m) or 0) and (m, d) not in ALLOWED_UP)
    assert up == [], "imports that run up a layer: " + ", ".join(
        f"{m} ({LAYERS[_layer(m) or 0][0].split(':')[0]}) -> {d} ({LAYERS[_layer(d) or 0][0].split(':')[0]})"
        for m, d in up)
    assert len(ALLOWED_UP) <= 2
    # the checker sees an upward import where there is one
    assert _layer("gradscope.recording") == 1 and _layer("gradscope.widget") == 4
    assert _layer("gradscope._snapshot.payload") == 4 and _layer("gradscope._snapshot.replay") == 3


def test_layers_point_one_way() -> None:
    """capture (record, memory) -> passes -> data model; the data model and the passes import no
    view, no hook and no memory source."""
    graph = _graph(top_level_only=False)
    views = {"gradscope.report", "gradscope.html", "gradscope.widget", "gradscope.layout", "gradscope.compare",
             "gradscope.diagnose", "gradscope.ipython"}
    capture = {"gradscope.record", "gradscope.memory"}
    base = set(LAYERS[0][1])
    # the data model (its face and its private parts) asks the view registry, never a view
    model = {m for m in graph if m == "gradscope.recording" or m.startswith("gradscope._model")}
    assert len(model) > 1 and all(graph[m] - model <= base for m in model)
    assert not graph["gradscope._passes"] & (views | capture)
    assert not graph["gradscope._model.held_at_peak"] & (views | capture)
    assert not graph["gradscope._base.trace"] & (views | capture | {"gradscope._passes"})


# PyTorch's private touchpoints gradscope uses (attributes, names and the names it patches).
_PRIVATE = {
    "_C", "_get_sequence_nr", "_sequence_nr", "_top_saved_tensors_default_hooks",
    "_push_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks", "_engine_run_backward",
    "StorageWeakRef", "_python_dispatch", "_EventType", "kineto_results", "experimental_event_tree",
    "_record_function_enter_new", "_record_function_exit", "_snapshot", "_record_memory_history",
    "_fused_sdp_choice", "_prims_common", "_current_autograd_node", "_weak_ref", "_expired",
    "_free_weak_ref", "_cdata", "_version", "_is_view", "_is_zerotensor", "_pytree",
    "_disable_current_modes", "unpack_hook", "_execution_engine",
}
_SAVED = ("_raw_saved", "_saved_")  # a node's saved variables, read as attributes


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Import):
            name = next((a.name.rsplit(".", 1)[-1] for a in node.names
                         if a.name.startswith("torch") and a.name.rsplit(".", 1)[-1] in _PRIVATE), None)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            name = next((p for p in parts if p in _PRIVATE), None)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            name = node.value if node.value in _PRIVATE else None
        if name is not None and (name in _PRIVATE or (isinstance(node, ast.Attribute) and name.startswith(_SAVED))
                                 or (isinstance(node, ast.Constant) and name.startswith(_SAVED))):
            out.append(f"{path.name}:{getattr(node, 'lineno', '?')}: {name}")
    return out


def test_private_torch_apis_only_in_compat() -> None:
    """Every private PyTorch touchpoint of the package (subpackages included) lives in
    gradscope._base.compat."""
    offenders = [u for p in sorted(PKG.rglob("*.py")) if p != PKG / "_base" / "compat.py" for u in _private_uses(p)]
    assert offenders == []
    assert len(_private_uses(PKG / "_base" / "compat.py")) > 20  # the checker does see them where they are


def _faces() -> dict[str, str]:
    """Each public name of ``gradscope`` -> the module the package takes it from (its imports, its
    lazy table, or the package itself for what it defines)."""
    tree = ast.parse((PKG / "__init__.py").read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradscope"):
            out |= {a.asname or a.name: node.module for a in node.names}
        elif isinstance(node, ast.FunctionDef) and node in tree.body:
            out[node.name] = "gradscope"
        elif (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_LAZY"]
              and isinstance(node.value, ast.Dict)):
            out |= {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(node.value.keys, node.value.values, strict=True)
                    if k is not None}
    return out


def test_public_names_come_from_public_faces() -> None:
    """Every name of ``gradscope.__all__`` is taken from a public module (no ``_`` in its path) that
    names it in its own ``__all__``: a face says where each public name is, whichever private
    module defines it."""
    import importlib

    import gradscope

    faces = _faces()
    wrong = []
    for name in gradscope.__all__:
        face = faces.get(name)
        if face is None or any(part.startswith("_") for part in face.split(".")):
            wrong.append(f"{name} (from {face})")
        elif face != "gradscope" and name not in getattr(importlib.import_module(face), "__all__", ()):
            wrong.append(f"{name} (not in {face}.__all__)")
        elif getattr(importlib.import_module(face), name) is not getattr(gradscope, name):
            wrong.append(f"{name} (not the object {face} holds)")
    assert wrong == []
    assert faces["release"] == "gradscope.record" and faces["load_snapshot"] == "gradscope.snapshot"
