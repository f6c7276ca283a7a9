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


def test_import_graph_has_no_cycle() -> None:
    graph = _graph(top_level_only=True)
    assert "gradscope.record" in graph and "gradscope._passes" in graph
    assert _cycle(graph) is None, _cycle(graph)


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_layers_point_one_way() -> None:
    """capture (record, memory) -> passes -> data model; the data model and the passes import no
    view, no hook and no memory source."""
    graph = _graph(top_level_only=True)
    views = {"gradscope.report", "gradscope.html", "gradscope.widget", "gradscope.layout", "gradscope.compare",
             "gradscope.diagnose", "gradscope.ipython"}
    capture = {"gradscope.record", "gradscope.memory"}
    assert graph["gradscope.recording"] <= {"gradscope.errors"}
    assert not graph["gradscope._passes"] & (views | capture)
    assert not graph["gradscope._held"] & (views | capture)
    assert not graph["gradscope._trace"] & (views | capture | {"gradscope._passes"})
    # the data model renders itself lazily: only its view methods import views, when called
    lazy = _graph(top_level_only=False)["gradscope.recording"] - graph["gradscope.recording"]
    assert lazy <= {"gradscope.report", "gradscope.html", "gradscope.graph", "gradscope.widget"}


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
    gradscope._compat."""
    offenders = [u for p in sorted(PKG.rglob("*.py")) if p.name != "_compat.py" for u in _private_uses(p)]
    assert offenders == []
    assert len(_private_uses(PKG / "_compat.py")) > 20  # the checker does see them where they are
