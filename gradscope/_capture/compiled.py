"""What a recording learns about the tensors a ``torch.compile``'d region saves for backward.

A compiled region runs as one ``CompiledFunctionBackward`` node whose saves arrive as
``saved_tensors[i]``: the operations that made them are inside the compiled program. While a block
records, :class:`Observer` watches AOTAutograd partition each graph compiled inside the block (see
NOTE [ observing compiled saves ] in :mod:`gradscope._base.compat`) and keeps, for each saved output of
the forward graph, the op that produced it and the module and source line of that op and of the
forward ops whose gradients read it (the backward graph's users of the save). At the end the
regions are matched with the recording's ``CompiledFunctionBackward`` nodes by their saves' shapes
and dtypes, and written to ``Recording.extra["compiled"]`` (plain JSON):

``{"mode": ..., "observed": bool, "regions": [{"node": id, "saves": [{"index", "op", "kind",
"module", "file", "line", "function", "used_by": [[module, file, line], ...], "bytes",
"storage"}]}], "unattributed_nodes": [ids]}``

NOTE [ which module a compiled save belongs to ]: in an eager recording a saved tensor belongs to
the module of the node that saved it, that is of the forward op whose gradient needs it (a ReLU's
output is saved by the ReLU and by the next Linear, and counts once in each). A compiled save is
attributed the same way, to the modules of the forward ops whose backward reads it (the backward
graph's users keep their forward op's module stack), so :func:`saved_bytes_by_module` compares
with an eager recording's :meth:`~gradscope.Recording.saved_bytes_by_module`. ``module``/``line``
of a save name its producer (an input or parameter: its first forward user).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError

__all__ = ["MODES", "CompiledSave", "Observer", "compiled_bytes_by_module", "compiled_saves",
           "saved_bytes_by_module"]

MODES = ("attribute", "eager", "off")
"""``compiled=`` of gs.record: ``"attribute"`` observes graphs compiled inside the block,
``"eager"`` runs the block with torch.compile set aside, ``"off"`` changes nothing."""

EAGER_NOTE = (
    "compiled='eager': torch.compile was set aside for this block (its stance was 'force_eager'), so "
    "compiled functions and modules ran their Python code eagerly and every op is shown. The compiled "
    "program's own saved tensors and peak may differ (inductor recomputes some tensors and saves others)."
)

# NOTE [ regions compiled in an earlier block ]: what earlier blocks of this process observed
# (plain data, bounded), so that a graph compiled while an earlier step was recorded is attributed
# in later steps too; matched only after the block's own partitions.
_EARLIER: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')
_ROOT = re.compile(r"^(?:L|G)\[['\"](?P<name>[^'\"]+)['\"]\]")


@dataclass(frozen=True)
class CompiledSave:
    """One tensor a compiled region saved (``saved_tensors[index]`` of ``node``), attributed."""

    node: int
    index: int
    op: str
    kind: str  # "activation" (made in the region) or "input" (an input or parameter of the region)
    module: str | None
    file: str | None
    line: int | None
    function: str | None
    used_by: tuple[tuple[str | None, str | None, int | None], ...]
    bytes: int
    storage: int


def _module_path(stack: Any, root: str | None, orig_mod: bool) -> str | None:
    """The module path of a node's ``nn_module_stack`` (its innermost entry) in the recording's
    names: Dynamo writes ``L['self'].h[0].attn`` (``self`` the compiled module)."""
    if not isinstance(stack, Mapping) or not stack:
        stack = {"": ("L['self']", None)}  # no module entered: the compiled code's own module
    entry = list(stack.values())[-1]
    src = entry[0] if isinstance(entry, tuple | list) and entry else entry
    if not isinstance(src, str):
        src = "L['self']"
    m = _ROOT.match(src)
    local = m.group("name") if m else None
    rest = src[m.end():] if m else src
    rest = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", rest)
    rest = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", rest)
    rest = re.sub(r"getattr\(([^,]+), ['\"]([^'\"]+)['\"]\)", r"\1.\2", rest).strip(".")
    if root is not None or local is None:  # the region ran inside that module's call: the local is it
        base = root
        if base is not None and orig_mod:
            base += "._orig_mod"
    else:
        base = local
    if base is None:
        return rest or None
    return f"{base}.{rest}" if rest else base


def _frame(trace: Any) -> tuple[str | None, int | None, str | None]:
    """The innermost frame of a node's ``stack_trace`` outside torch itself."""
    if not isinstance(trace, str):
        return None, None, None
    frames = [(m.group("file"), int(m.group("line")), m.group("fn")) for m in _FRAME.finditer(trace)]
    own = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    pick = own or frames
    return pick[-1] if pick else (None, None, None)


def _dtype(v: Any) -> str | None:
    d = getattr(v, "dtype", None)
    return None if d is None else str(d).removeprefix("torch.")


def _shape(v: Any) -> tuple[int | None, ...] | None:
    s = getattr(v, "shape", None)
    if s is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in s)


def _read_partition(fw_module: Any, bw_module: Any, n_outputs: int, meta: Any) -> dict[str, Any]:
    """What one partition saves, as plain data (no graph objects are kept)."""
    outs = next(iter(fw_module.graph.find_nodes(op="output"))).args[0]
    saved = list(outs[n_outputs:])
    tensors = [n for n in saved if _dtype(getattr(n, "meta", {}).get("val")) is not None]
    sl = getattr(meta, "tensors_saved_for_backwards_with_vc_check_slice", None)
    n_vc = len(tensors)
    no_vc = getattr(meta, "num_tensors_saved_with_no_vc_check", 0) or 0
    if isinstance(sl, slice) and sl.stop is not None and sl.start is not None:
        n_vc = sl.stop - sl.start
    n_vc = min(n_vc, len(tensors) - no_vc) if no_vc else n_vc
    bw_in = {n.name: n for n in bw_module.graph.find_nodes(op="placeholder")}
    rows = []
    for node in tensors[:n_vc]:
        m = node.meta
        producer = node
        kind = "activation"
        if node.op == "placeholder":
            kind = "input"
            users = [u for u in node.users if u.op == "call_function"]
            producer = users[0] if users else node
        file, line, fn = _frame(producer.meta.get("stack_trace"))
        used = [(u.meta.get("fwd_nn_module_stack"), *_frame(u.meta.get("stack_trace"))[:2])
                for u in _backward_users(bw_in.get(node.name))]
        rows.append({
            "shape": _shape(m.get("val")), "dtype": _dtype(m.get("val")),
            "op": str(node.target) if node.op == "call_function" else node.op,
            "kind": kind, "stack": producer.meta.get("nn_module_stack"),
            "file": file, "line": line, "function": fn, "used": used,
        })
    return {"saves": rows, "no_vc": no_vc}


def _backward_users(placeholder: Any) -> list[Any]:
    """The backward ops that read a saved value, through the forward ops the partitioner chose to
    recompute in the backward graph (``partitioner_tag == "is_forward"``: a view, a GELU's
    pieces)."""
    out: list[Any] = []
    todo = list(getattr(placeholder, "users", ()))
    seen: set[Any] = set()
    while todo:
        u = todo.pop()
        if u in seen or u.op != "call_function":
            continue
        seen.add(u)
        if u.meta.get("partitioner_tag") == "is_forward":
            todo.extend(u.users)
        else:
            out.append(u)
    return out


class Observer:
    """The ``compiled=`` option of one block: what it changes while the block runs and what it
    adds to the recording."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise GradscopeError(
                f"gradscope: compiled= takes one of {', '.join(map(repr, MODES))}, got {mode!r}. "
                "'attribute' names the module and line of each tensor a compiled region saves; 'eager' "
                "records the block with torch.compile set aside."
            )
        self.mode = mode
        self.partitions: list[dict[str, Any]] = []
        self.observed = False
        self.eager_set = False
        self.limit_hits: list[str] = []  # see NOTE [ the recompile limit in a block ] in gradscope._base.compat

    def start(self) -> Callable[[], None]:
        """Begin observing (or set compilation aside); returns the undo (run also on errors)."""
        unwatch = _compat.watch_recompile_limit(self.limit_hits.append)
        try:
            undo = self._start()
        except BaseException:
            unwatch()
            raise

        def both() -> None:
            try:
                undo()
            finally:
                unwatch()

        return both

    def _start(self) -> Callable[[], None]:
        if self.mode == "eager":
            handle = _compat.force_eager_stance()
            self.eager_set = handle is not None
            return lambda: _compat.restore_compile_stance(handle)
        if self.mode == "attribute":
            undo = _compat.observe_compiled_saves(self._seen)
            self.observed = undo is not None
            if undo is not None:
                return undo
        return lambda: None

    def _seen(self, fw_module: Any, bw_module: Any, n_outputs: int, meta: Any) -> None:
        part = _read_partition(fw_module, bw_module, n_outputs, meta)
        self.partitions.append(part)
        _EARLIER.append(part)

    def attach(self, rec: Any) -> Any:
        """The recording with ``extra["compiled"]`` and its notes (unchanged when nothing is
        compiled, compilation was not set aside and no recompile limit was reached)."""
        notes = list(rec.notes)
        if self.limit_hits:
            functions = ", ".join(dict.fromkeys(self.limit_hits))
            notes.append(
                f"torch.compile reached its recompile limit {len(self.limit_hits)} time(s) in the block "
                f"({functions}): those functions ran eagerly from then on, so their operators show as "
                "eager nodes here, and PyTorch logged why. A recording can cause one of those recompiles "
                "(on torch 2.6 a compiled module compiles again for the module hooks a block installs); "
                "torch._dynamo.reset() or a higher torch._dynamo.config recompile limit before the block "
                "lets them run compiled."
            )
        if self.mode == "eager":
            notes.append(EAGER_NOTE if self.eager_set else (
                "compiled='eager' was asked for, but this torch has no torch.compiler.set_stance: "
                "compiled code ran compiled."))
        nodes = [n.id for n in rec.nodes if n.name == "CompiledFunctionBackward"]
        if not nodes:
            if self.mode == "eager":
                return replace(rec, notes=tuple(notes), extra={**rec.extra, "compiled": {"mode": self.mode}})
            return replace(rec, notes=tuple(notes)) if self.limit_hits else rec
        by_node: dict[int, dict[int, Any]] = {}
        for s in rec.saved:
            if s.attribute.startswith("saved_tensors["):
                by_node.setdefault(s.node, {})[int(s.attribute[14:-1])] = s
        names = [n.leaf for n in rec.nodes if n.leaf]
        regions, missing = [], []
        no_vc = 0
        for nid in nodes:
            rows = by_node.get(nid, {})
            part = self._match(rows) if self.mode == "attribute" else None
            if part is None:
                missing.append(nid)
                continue
            no_vc += part["no_vc"]
            root = rec.nodes[nid].module
            # a compiled module (OptimizedModule) keeps the traced module as ``_orig_mod``
            orig = root is not None and not root.endswith("_orig_mod") and any(
                "_orig_mod." in str(x) for x in names)
            saves = []
            for i, p in enumerate(part["saves"]):
                s = rows.get(i)
                if s is None:
                    continue
                used = sorted({(_module_path(st, root, orig), f, ln) for st, f, ln in p["used"]},
                              key=lambda u: tuple(str(x) for x in u))
                saves.append({
                    "index": i, "op": p["op"], "kind": p["kind"],
                    "module": _module_path(p["stack"], root, orig),
                    "file": p["file"], "line": p["line"], "function": p["function"],
                    "used_by": [list(u) for u in used], "bytes": s.bytes, "storage": s.storage,
                })
            regions.append({"node": nid, "saves": saves})
        out = {"mode": self.mode, "observed": self.observed, "regions": regions, "unattributed_nodes": missing}
        if regions:
            n = sum(len(r["saves"]) for r in regions)
            notes.append(
                f"{n} tensors saved by {len(regions)} compiled regions are attributed to the module and line "
                "of the op that made them and of the ops whose gradients read them, from AOTAutograd's "
                "forward and backward graphs (gs.compiled_saves(recording))."
            )
        if no_vc:
            notes.append(
                f"{no_vc} tensors of compiled regions were kept on the autograd context without "
                "save_for_backward (no version check): they bypass saved-tensor hooks and are not counted."
            )
        if missing:
            why = ("they were compiled before the block (a compiled graph is only seen while it is "
                   "compiled inside a recording), or recompiled without AOTAutograd"
                   if self.observed else
                   "this torch does not expose AOTAutograd's saved-tensor bookkeeping"
                   if self.mode == "attribute" else "compiled='off' was given")
            notes.append(
                f"{len(missing)} CompiledFunctionBackward nodes have saved tensors that are not attributed to "
                f"modules or lines: {why}. Record with gs.record(..., compiled='eager') to see every op "
                "(the compiled program's own peak may differ), or call torch._dynamo.reset() before the "
                "block so that the compile happens inside it."
            )
        return replace(rec, notes=tuple(notes), extra={**rec.extra, "compiled": out})

    def _match(self, rows: Mapping[int, Any]) -> dict[str, Any] | None:
        """The latest observed partition whose saves have the node's shapes and dtypes."""
        for part in [*reversed(self.partitions), *reversed(_EARLIER)]:
            saves = part["saves"]
            if len(saves) < len(rows) or (rows and max(rows) >= len(saves)):
                continue
            if all(_fits(saves[i], s) for i, s in rows.items()):
                return part
        return None


def _fits(p: Mapping[str, Any], s: Any) -> bool:
    shape = p["shape"]
    if p["dtype"] != s.dtype or shape is None or len(shape) != len(s.shape):
        return False
    return all(a is None or a == b for a, b in zip(shape, s.shape, strict=True))


def compiled_saves(rec: Any) -> list[CompiledSave]:
    """The attributed saves of a recording's compiled regions (empty when none were observed).

    Example:
        >>> import gradscope as gs
        >>> gs.compiled_saves(gs.Recording())
        []
    """
    info = rec.extra.get("compiled") if isinstance(rec.extra, Mapping) else None
    out: list[CompiledSave] = []
    for region in (info or {}).get("regions", ()):
        for s in region.get("saves", ()):
            out.append(CompiledSave(
                node=int(region["node"]), index=int(s["index"]), op=str(s["op"]), kind=str(s["kind"]),
                module=s.get("module"), file=s.get("file"), line=s.get("line"), function=s.get("function"),
                used_by=tuple((u[0], u[1], u[2]) for u in s.get("used_by", ())),
                bytes=int(s["bytes"]), storage=int(s["storage"]),
            ))
    return out


def compiled_bytes_by_module(rec: Any) -> dict[str, int]:
    """The attributed saves of compiled regions alone, by module (as :func:`saved_bytes_by_module`
    counts them), largest first: the module table of what compiled code keeps for backward."""
    per: dict[str, dict[int, int]] = {}
    for c in compiled_saves(rec):
        for m in {u[0] for u in c.used_by} or {c.module}:
            per.setdefault(m or "(no module)", {})[c.storage] = c.bytes
    out = {m: sum(v.values()) for m, v in per.items()}
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def saved_bytes_by_module(rec: Any) -> dict[str, int]:
    """Saved bytes per module with compiled regions opened up: an attributed compiled save counts
    for each module whose ops' gradients read it (see NOTE [ which module a compiled save belongs
    to ]); every other save for its own node's module. Storage-deduplicated within each module,
    largest first; saves outside any module are under ``"(no module)"``."""
    opened = {(c.node, c.index): c for c in compiled_saves(rec)}
    per: dict[str, dict[int, int]] = {}
    for s in rec.saved:
        c = None
        if s.attribute.startswith("saved_tensors["):
            c = opened.get((s.node, int(s.attribute[14:-1])))
        mods = {u[0] for u in c.used_by} if c is not None and c.used_by else {s.module}
        for m in mods:
            per.setdefault(m or "(no module)", {})[s.storage] = s.bytes
    out = {m: sum(v.values()) for m, v in per.items()}
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))
