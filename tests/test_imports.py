"""The shape of the package: its layers are its folders, gradscope's modules import each other
without a cycle and only down the layers (capture -> passes -> data model <- views), the public
modules are faces over the layers, and PyTorch's private APIs are touched in one module only."""

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
            subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
            # ``from gradscope import _passes`` imports a module, ``from gradscope import record`` the package's top
            if node.module != "gradscope" or len(subs) < len(node.names):
                out.add(node.module)
            out |= subs
    return out & modules


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    graph = {}
    for p in sorted(PKG.rglob("*.py")):
        name = _module_name(p)
        graph[name] = _imports(p, top_level_only) - {name}
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


# The package's layers, lowest first, one folder each: a module's layer is the folder under
# gradscope/ it lives in. A module imports only modules of its own layer or of a lower one
# (function-local imports included), and the whole graph has no circle.
LAYERS: list[tuple[str, str]] = [
    ("_base", "base: the root error, units, errors, the memory kind, the view registry, PyTorch's private APIs, the raw trace"),
    ("_model", "data model: the Recording and what its numbers mean"),
    ("_passes", "passes: the pure passes that make a Recording of a raw trace"),
    ("_capture", "capture: hooks, memory sources, the recorder"),
    ("_analyses", "analyses: diagnosis, prediction, comparison, snapshots, jobs, strategies"),
    ("_views", "views: text, layout, widget payloads, pages"),
    ("_notebook", "notebook: the IPython extension, the command line"),
]
# Above every layer: the faces (the public modules at the package's top, gradscope/*.py, each
# importing the names it shows from the layers) and the package's own module. They may import any
# layer; no layer imports them.
TOP = len(LAYERS)
# Edges allowed to run up a layer, each with its reason (at most two).
ALLOWED_UP: dict[tuple[str, str], str] = {}


def _layer(module: str) -> int | None:
    """The layer of a module: its folder's, or TOP for a face and the package; None for a module
    that lives in no layer's folder."""
    parts = module.split(".")
    if parts == ["gradscope"]:
        return TOP
    folders = [folder for folder, _ in LAYERS]
    if parts[1] in folders:
        return folders.index(parts[1])
    if len(parts) == 2 and (PKG / f"{parts[1]}.py").is_file():
        return TOP
    return None


def _layer_name(i: int) -> str:
    return "faces" if i == TOP else LAYERS[i][1].split(":")[0]


def test_import_graph_has_no_cycle() -> None:
    # every import counts, those inside functions too: a lazy import is still an arrow
    graph = _graph(top_level_only=False)
    assert "gradscope._capture.record" in graph and "gradscope._passes" in graph
    assert _cycle(graph) is None, _cycle(graph)


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_folders_are_the_layers() -> None:
    """Every folder of the package that holds Python is a layer (a new folder is placed in LAYERS)."""
    folders = {p.relative_to(PKG).parts[0] for p in PKG.rglob("*.py") if len(p.relative_to(PKG).parts) > 1}
    assert folders == {folder for folder, _ in LAYERS}


def test_every_import_points_down_the_layers() -> None:
    graph = _graph(top_level_only=False)
    unplaced = sorted(m for m in graph if _layer(m) is None)
    assert unplaced == [], f"move these modules into a layer's folder: {unplaced}"
    up = sorted((m, d) for m, deps in graph.items() for d in deps
                if (_layer(d) or 0) > (_layer(m) or 0) and (m, d) not in ALLOWED_UP)
    assert up == [], "imports that run up a layer: " + ", ".join(
        f"{m} ({_layer_name(_layer(m) or 0)}) -> {d} ({_layer_name(_layer(d) or 0)})" for m, d in up)
    assert len(ALLOWED_UP) <= 2
    # the checker sees an upward import where there is one
    assert _layer("gradscope._model.recording") == 1 and _layer("gradscope._views.widget") == 5
    assert _layer("gradscope._views.snapshot_payload") == 5 and _layer("gradscope._analyses.snapshot.replay") == 4
    assert _layer("gradscope.widget") == _layer("gradscope") == TOP and _layer("gradscope.capture.x") is None


def test_layers_point_one_way() -> None:
    """capture (the recorder, the memory sources) -> passes -> data model; the data model and the
    passes import no view, no hook and no memory source."""
    graph = _graph(top_level_only=False)
    views = {m for m in graph if _layer(m) in (5, 6, TOP)}
    capture = {m for m in graph if _layer(m) == 3}
    model = {m for m in graph if _layer(m) == 1}
    # the data model asks the view registry, never a view
    assert len(model) > 1 and all(_layer(d) in (0, 1) for m in model for d in graph[m])
    assert "gradscope._base.registry" in set().union(*(graph[m] for m in model))
    passes = {m for m in graph if _layer(m) == 2}
    assert passes and not set().union(*(graph[m] for m in passes)) & (views | capture)
    assert not graph["gradscope._model.held_at_peak"] & (views | capture)
    assert not graph["gradscope._base.trace"] & (views | capture | passes)


def test_faces_only_show_names() -> None:
    """A face (a public module at the package's top) holds no code of its own: imports, ``__all__``
    (and ``python -m gradscope``'s one call), and each class or function it imports is defined in the
    module it names (or says the face is its home, as the errors do)."""
    import importlib
    import inspect

    wrong = []
    for path in sorted(PKG.glob("*.py")):
        if path.name == "__init__.py":
            continue
        face = f"gradscope.{path.stem}"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body[1:]:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradscope._"):
                module = importlib.import_module(node.module or "")
                for a in node.names:
                    obj = getattr(module, a.name, None)
                    if (a.name != "*" and (inspect.isclass(obj) or inspect.isfunction(obj))
                            and obj.__module__ not in (node.module, face)):
                        wrong.append(f"{face}: {a.name} is defined in {obj.__module__}, not {node.module}")
            elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                continue
            elif path.stem == "__main__" and isinstance(node, ast.If):
                continue
            else:
                wrong.append(f"{face}:{node.lineno}: {ast.dump(node)[:60]}")
    assert wrong == []

# PyTorch's private touchpoints gradscope uses (attributes, names and the names it patches).
_PRIVATE = {
    "_C", "_get_sequence_nr", "_sequence_nr", "_top_saved_tensors_default_hooks",
    "_push_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks", "_engine_run_backward",
    "StorageWeakRef", "_python_dispatch", "_EventType", "kineto_results", "experimental_event_tree",
    "_record_function_enter_new", "_record_function_exit", "_snapshot", "_record_memory_history",
    "_fused_sdp_choice", "_prims_common", "_current_autograd_node", "_weak_ref", "_expired",
    "_free_weak_ref", "_cdata", "_version", "_is_view", "_is_zerotensor", "_pytree",
    "_disable_current_modes", "unpack_hook", "_execution_engine", "_foreach_sub", "_foreach_abs", "_foreach_abs_", "_foreach_max",
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
