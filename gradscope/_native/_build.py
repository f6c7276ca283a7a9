"""Builds the compiled hooks with ``torch.utils.cpp_extension`` (run as a script in a child process
by :func:`gradscope._native.build`, so that a process ending mid-build can kill the whole build:
see NOTE [ first use never waits for the compiler ] in gradscope._native).

``python _build.py SETTINGS_JSON`` builds ``_hooks`` into the settings' ``out`` directory: with
ninja (``torch.utils.cpp_extension.load``, both sources compiled at once) where it is found, else
with setuptools and cpp_extension's ``BuildExtension`` (no ninja needed). Either way the module is
then imported once here, so that a file that would not load is a failed build, not a loaded one.
This file imports nothing of gradscope's (the child would import all of it for nothing).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def _with_pip_ninja() -> None:
    """Put the ``ninja`` package's binary (where pip installed it) and the interpreter's scripts on
    PATH, where cpp_extension looks for ninja (else a system ninja, else setuptools)."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        dirs.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _with_ninja(s: dict[str, Any], out: Path) -> Path:
    from torch.utils import cpp_extension

    cpp_extension.load(name="_hooks", sources=s["sources"], extra_cflags=s["cflags"],
                       extra_ldflags=s["ldflags"], build_directory=str(out), verbose=False,
                       is_python_module=False)  # (loads it with ctypes: imported again below)
    return out / "_hooks.so"


def _with_setuptools(s: dict[str, Any], out: Path) -> Path:
    from setuptools import setup
    from torch.utils import cpp_extension

    os.environ["CC"] = os.environ["CXX"] = str(s["cxx"])  # the C++ compiler compiles and links
    os.environ["LDSHARED"] = f"{s['cxx']} -shared"
    ext = cpp_extension.CppExtension("_hooks", s["sources"], extra_compile_args=s["cflags"],
                                     extra_link_args=s["ldflags"])
    setup(name="gradscope-hooks", ext_modules=[ext], script_name="setup.py",
          script_args=["-q", "build_ext", "--build-lib", str(out), "--build-temp", str(out / "obj")],
          cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)})
    (built,) = out.glob("_hooks*.so")
    return built


def main(argv: list[str]) -> int:
    s = json.loads(argv[1])
    out = Path(s["out"])
    _with_pip_ninja()
    os.environ["CXX"] = str(s["cxx"])
    from torch.utils import cpp_extension

    if s.get("ninja", True) and cpp_extension.is_ninja_available():
        built = _with_ninja(s, out)
    else:
        built = _with_setuptools(s, out)
    target = out / str(s["name"])
    shutil.move(str(built), target)
    import torch  # noqa: F401  # the module links against it

    loader = importlib.machinery.ExtensionFileLoader("gradscope._native._hooks", str(target))
    spec = importlib.util.spec_from_file_location("gradscope._native._hooks", str(target), loader=loader)
    assert spec is not None
    loader.exec_module(importlib.util.module_from_spec(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
