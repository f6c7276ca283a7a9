"""Which Python frames are the user's: the one folding rule for snapshots' stacks and recorded lines.

NOTE [ folded frames ]: a stack names the user's code by its innermost frame that is not
PyTorch's own (:func:`is_pytorch_file`: an installed torch / functorch / triton, generated code,
C++ frames). A recorded line (:attr:`gradscope.Recording.lines`) folds more (:func:`is_folded_file`):
gradscope's own files, the standard library and installed libraries (``site-packages``), so that a
line inside ``nn.Linear.forward`` or a library's model names the user's line that called it. A
module defined in the user's own files (a test, a script, a notebook cell) is the user's code. A
snapshot's frames come from another machine: its standard library is recognised by its path
(``.../lib/python3.11/...``, ``...\\Lib\\...``) as well as by this machine's. Both rules are
decided once per file name.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sysconfig

__all__ = ["is_folded_file", "is_python_file", "is_pytorch_file"]


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec is not None else None
    return os.path.dirname(os.path.abspath(origin)) if origin else os.sep + "torch"


_TORCH_DIR = _torch_dir()
_OWN_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:torch|functorch|triton)[/\\]|torchinductor_")
_PYTORCH_CACHE: dict[str, bool] = {}
_GRADSCOPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package, above _base
_LIBRARY_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
# another machine's standard library: lib/python3.X/ (conda, pyenv, uv, /usr/lib) or Windows' Lib\
_OTHER_STDLIB = re.compile(r"[/\\]lib(?:64)?[/\\]python\d+(?:\.\d+)?[/\\]|^[A-Za-z]:\\.*\\Lib\\")
_STDLIB_DIRS = tuple(
    {os.path.abspath(p) + os.sep for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"))
     if p}
)
_FOLDED_CACHE: dict[str, bool] = {}


def is_python_file(fn: str) -> bool:
    """Whether a frame's file is Python source (``.py``, or ``<...>`` code such as a notebook
    cell or generated code), not a C++ frame of the interpreter or a library."""
    return fn.endswith(".py") or (fn.startswith("<") and fn.endswith(">"))


def is_pytorch_file(fn: str) -> bool:
    """Whether a frame's file is PyTorch's own code (or not Python at all: C++ frames).

    PyTorch's own: files of an installed torch / functorch / triton, generated code
    (``<eval_with_key>``, inductor's output), and a ``.../torch/...`` path whose part after
    ``torch/`` exists in this machine's torch install (a snapshot from a source checkout or
    another machine).
    """
    own = _PYTORCH_CACHE.get(fn)
    if own is None:
        own = (not is_python_file(fn) or fn.startswith("<eval_with_key") or bool(_OWN_PATH.search(fn))
               or _under_torch(fn))
        if len(_PYTORCH_CACHE) < 100_000:
            _PYTORCH_CACHE[fn] = own
    return own


def _under_torch(fn: str) -> bool:
    norm = fn.replace("\\", "/")
    if norm.startswith(_TORCH_DIR.replace("\\", "/") + "/"):
        return True
    cut = norm.rfind("/torch/")
    return cut >= 0 and os.path.isfile(os.path.join(_TORCH_DIR, norm[cut + len("/torch/"):]))


def is_folded_file(fn: str) -> bool:
    """Whether a recorded line skips a frame of this file (see NOTE [ folded frames ]): PyTorch's
    own, gradscope's, the standard library's (``<frozen ...>`` modules too, and another machine's
    ``lib/python3.X``) or an installed library's (``site-packages`` / ``dist-packages``)."""
    folded = _FOLDED_CACHE.get(fn)
    if folded is None:
        folded = (fn.startswith(_GRADSCOPE_DIR) or fn.startswith("<frozen ") or bool(_LIBRARY_PATH.search(fn))
                  or fn.startswith(_STDLIB_DIRS) or bool(_OTHER_STDLIB.search(fn)) or is_pytorch_file(fn))
        if len(_FOLDED_CACHE) < 100_000:
            _FOLDED_CACHE[fn] = folded
    return folded
