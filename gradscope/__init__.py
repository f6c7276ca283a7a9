"""gradscope: see PyTorch autograd graphs, saved tensors and memory, and compare strategies.

Example:
    >>> import torch, gradscope as gs
    >>> w = torch.ones(4, requires_grad=True)
    >>> with gs.record(memory="off") as rec:
    ...     (w.exp() * 2).sum().backward()
    >>> rec.recording.saved_bytes
    16
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradscope import _views
from gradscope.errors import GradscopeError, MemoryBudgetExceeded
from gradscope.recording import Recording, load

__all__ = [
    "Comparison",
    "GradscopeError",
    "Job",
    "MemoryBudgetExceeded",
    "Recording",
    "compare",
    "compiled_saves",
    "diagnose",
    "gather",
    "graph",
    "load",
    "load_ranks",
    "load_ipython_extension",
    "load_snapshot",
    "predict",
    "predict_job",
    "record",
    "release",
    "show",
    "unload_ipython_extension",
]

__version__ = "0.1.0"

# The views of each result, loaded on first use (see NOTE [ results ask the registry ] in _views)
for _kind, _cls, _fn in (
    ("text", "gradscope.recording.Recording", "gradscope.report:summary_text"),
    ("html", "gradscope.recording.Recording", "gradscope.html:recording_html"),
    ("html", "gradscope.compare.Comparison", "gradscope.html:comparison_html"),
    ("text", "gradscope.jobs.data.Job", "gradscope.jobs.text:summary_text"),
    ("html", "gradscope.jobs.data.Job", "gradscope.html:job_page_html"),
    ("fragment", "gradscope.jobs.data.Job", "gradscope.jobs.page:fragment_html"),
    ("payload", "gradscope.jobs.data.Job", "gradscope.jobs.payload:job_payload"),
    # a job asks for its analysis the same way (NOTE [ a job asks for its analysis ] in gradscope.jobs.data)
    ("view", "gradscope.jobs.data.Job", "gradscope.jobs.analysis:job_view"),
    ("diagnosis", "gradscope.jobs.data.Job", "gradscope.jobs.analysis:diagnose_job"),
    ("dot", "gradscope.recording.Recording", "gradscope.graph:to_dot"),
    ("mimebundle", "gradscope.recording.Recording", "gradscope.widget:mimebundle"),
    ("mimebundle", "gradscope.compare.Comparison", "gradscope.widget:mimebundle"),
    ("mimebundle", "gradscope.jobs.data.Job", "gradscope.widget:mimebundle"),
    ("text", "gradscope._snapshot.data.SnapshotRecording", "gradscope.report:snapshot_summary_text"),
    ("html", "gradscope._snapshot.data.SnapshotRecording", "gradscope.html:snapshot_html"),
):
    _views.declare(_kind, _cls, _fn)
_views.declare_saved("cuda_snapshot", "gradscope._snapshot.data:from_saved")  # NOTE [ saved types ]

# Functions whose submodule has the same name are imported here, eagerly, so that the package
# attribute is always the function (``gs.record(...)``) and never the module, whatever imports
# ``gradscope.record`` later. Their modules import only torch. The rest load on first use, so that
# `import gradscope` needs no IPython or widget stack.
from gradscope.graph import graph  # noqa: E402
from gradscope.record import compiled_saves, record, release  # noqa: E402

for _name, _module in (("compare", "gradscope.compare"), ("diagnose", "gradscope.diagnose"),
                       ("predict", "gradscope.predict")):
    try:
        globals()[_name] = getattr(importlib.import_module(_module), _name)
    except ModuleNotFoundError as _e:  # a part not built yet
        if _e.name != _module:
            raise

_LAZY = {
    "Comparison": "gradscope.compare",
    "Job": "gradscope.jobs.data",
    "gather": "gradscope.distributed",
    "job": "gradscope.job",  # the module: every public name of a job, its views included
    "load_ranks": "gradscope.jobs.data",
    "predict_job": "gradscope.distributed",
    "load_snapshot": "gradscope.snapshot",
    "show": "gradscope.widget",
    "strategies": "gradscope.strategies",
}

if TYPE_CHECKING:
    from gradscope.compare import Comparison, compare
    from gradscope.diagnose import diagnose
    from gradscope.distributed import gather, predict_job
    from gradscope.jobs.data import Job, load_ranks
    from gradscope.predict import predict
    from gradscope.snapshot import load_snapshot
    from gradscope.widget import show


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'gradscope' has no attribute {name!r}")
    module = importlib.import_module(mod)
    value = module if name in ("job", "strategies") else getattr(module, name)
    globals()[name] = value
    return value


def load_ipython_extension(ipython: Any) -> None:
    """Entry point of ``%load_ext gradscope``."""
    from gradscope.ipython import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Entry point of ``%unload_ext gradscope``."""
    from gradscope.ipython import unload_ipython_extension as _unload

    _unload(ipython)
