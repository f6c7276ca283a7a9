"""A wheel carries the built widget and installs into someone else's environment without Node.js (see
NOTE [ the wheel carries the widget ] in hatch_build.py): built offline with the build backend of
the running environment, installed with ``--no-deps`` into a fresh virtualenv on top of another
torch of the supported range where one is set up (``./dev test-range`` makes them)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "gradscope" / "static" / "widget.js"
NATIVE_SOURCES = ("gradscope/_native/hooks.cc", "gradscope/_native/walk.cc", "gradscope/_native/native.h")
RANGE_VENVS = {v: ROOT / ".venvs" / f"torch-{v}" for v in ("2.6.0", "2.15.0")}


def _source_copy(dest: Path, bundle: bool) -> Path:
    """What a checkout holds (tracked sources, the built bundle, .gitignore), without js/node_modules
    or caches: the build runs there, so it never writes into the working tree."""
    src = dest / "src"
    ignore = shutil.ignore_patterns("__pycache__", "node_modules", "*.pyc")
    shutil.copytree(ROOT / "gradscope", src / "gradscope", ignore=ignore)
    shutil.copytree(ROOT / "js", src / "js", ignore=ignore)
    for name in ("pyproject.toml", "hatch_build.py", "README.md", ".gitignore"):
        shutil.copy2(ROOT / name, src / name)
    copied = src / "gradscope" / "static" / "widget.js"
    if bundle:
        # the bundle as built, newer than its sources (the hook rebuilding it would need npm's packages)
        now = time.time() + 1
        os.utime(copied, (now, now))
    else:
        shutil.rmtree(copied.parent, ignore_errors=True)
    return src


def _pip(*args: str, path: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRADSCOPE_SKIP_JS", "PYTHONPATH", "PIP_INDEX_URL")}
    env["PIP_NO_INDEX"] = "1"  # offline: everything comes from this environment
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not BUNDLE.is_file():
        pytest.skip("gradscope/static/widget.js is not built here (./dev setup builds it)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp, bundle=True)
    out = tmp / "dist"
    # no npm on PATH: a wheel from a tree whose bundle is built needs no Node.js
    p = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src), path=str(tmp))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return whl


def test_the_wheel_carries_the_widget_and_the_compiled_hooks_sources(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "gradscope/static/widget.js" in names
        for name in NATIVE_SOURCES:
            assert name in names
            assert z.read(name) == (ROOT / name).read_bytes()
        digest = hashlib.sha256(z.read("gradscope/static/widget.js")).hexdigest()
        metadata = z.read(f"gradscope-{wheel.name.split('-')[1]}.dist-info/METADATA").decode()
    assert digest == hashlib.sha256(BUNDLE.read_bytes()).hexdigest()
    assert not any(n.startswith(("js/", "tests/")) or "__pycache__" in n for n in names)
    # the README's wheel command names the file the build makes
    readme = (ROOT / "README.md").read_text()
    assert f"pip install dist/{wheel.name}" in readme
    assert re.search(r"^Requires-Dist: torch>=2\.6$", metadata, re.M)
    assert re.search(r"^Requires-Dist: anywidget.*; extra == .notebook.$", metadata, re.M)


def test_building_from_source_without_node_says_what_to_do(tmp_path: Path) -> None:
    src = _source_copy(tmp_path, bundle=False)
    p = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src),
             path=str(tmp_path))
    assert p.returncode != 0
    out = " ".join((p.stdout + p.stderr).split())
    assert "building gradscope from source needs Node.js (18 or newer) with npm" in out
    assert "install gradscope from a wheel, which carries the widget" in out
    # the install named is one that works: the wheel's file name, never PyPI's project of that name
    assert 'pip install "dist/gradscope-0.1.0-py3-none-any.whl[notebook]"' in out
    assert "(pip install gradscope)" not in out and "pip install gradscope " not in out
    assert "GRADSCOPE_SKIP_JS=1" in out
    assert not list((tmp_path / "dist").glob("*.whl"))


_STEP = """
import sys, torch, gradscope as gs
from pathlib import Path
from gradscope import widget, _native
torch.manual_seed(0)
lin = torch.nn.Linear(8, 4)
x = torch.randn(2, 8)
with gs.record(memory="tracker") as rec:
    lin(x).sum().backward()
r = rec.recording
print("torch", torch.__version__)
print("gradscope", Path(gs.__file__).resolve().parent)
print("saved", r.saved_bytes, "complete", r.complete)
print("leaves", ",".join(sorted(n.leaf for n in r.nodes if n.leaf)))
print("grad_ok", bool(torch.allclose(lin.weight.grad, x.sum(0).expand(4, 8))))
print("bundle", widget.bundle_path().stat().st_size)
print("sources", all(p.is_file() for p in (*_native._SOURCES, _native._HEADER)))
"""


def _install_and_run(wheel: Path, base_python: Path, site_packages: Path, tmp: Path) -> dict[str, str]:
    """A fresh virtualenv that sees ``site_packages`` (torch and the rest of an existing environment;
    a virtualenv made from another one's python sees only the base interpreter's packages, so a .pth
    file adds them), gradscope installed into it from the wheel alone."""
    venv = tmp / "venv"
    subprocess.run([str(base_python), "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    p = _pip("--python", str(python), "install", "--no-deps", str(wheel))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (own,) = (venv / "lib").glob("python3*/site-packages")
    (own / "_gradscope_test_base.pth").write_text(f"{site_packages}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRADSCOPE_CACHE")}
    env["GRADSCOPE_NATIVE"] = "0"  # the Python hooks: compiling for this torch is test_native's business
    # run outside the checkout, so that `import gradscope` can only find the installed copy
    p = subprocess.run([str(python), "-c", textwrap.dedent(_STEP)], capture_output=True, text=True, env=env,
                       cwd=tmp, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert Path(out["gradscope"]) == (own / "gradscope").resolve()
    # Linear(8, 4) on a (2, 8) input: addmm saves the input (2 * 8 float32), not the weight
    assert out["saved"] == f"{2 * 8 * 4} complete True"
    assert out["leaves"] == "lin.bias,lin.weight"  # named by the variable that holds the module
    assert out["grad_ok"] == "True"
    assert int(out["bundle"]) == BUNDLE.stat().st_size
    assert out["sources"] == "True"
    return out


def _set_up(venv: Path) -> bool:
    """Whether ./dev finished setting ``venv`` up: it writes its stamp after the last install (CI sets the
    range's virtualenvs up while this suite runs, so one may exist half-installed)."""
    return (venv / "bin" / "python").exists() and (venv / ".gradscope-lock").exists()


def _site_packages(python: Path) -> Path:
    p = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True, check=True, timeout=60)
    return Path(p.stdout.strip())


@pytest.mark.parametrize("version", sorted(RANGE_VENVS))
def test_the_wheel_installs_next_to_another_torch(wheel: Path, tmp_path: Path, version: str) -> None:
    python = RANGE_VENVS[version] / "bin" / "python"
    if not _set_up(RANGE_VENVS[version]):
        pytest.skip(f"no virtualenv with torch {version} here (./dev setup-range makes .venvs/torch-{version})")
    out = _install_and_run(wheel, python, _site_packages(python), tmp_path)
    assert out["torch"].split("+")[0] == version


def test_the_wheel_installs_next_to_the_running_torch(wheel: Path, tmp_path: Path) -> None:
    """Where no other torch is set up: on top of the environment running the tests."""
    import torch

    others = [v for v, venv in sorted(RANGE_VENVS.items()) if _set_up(venv)]
    if others:
        pytest.skip(f"installed next to torch {' and '.join(others)} instead (the test above)")
    out = _install_and_run(wheel, Path(sys.executable), _site_packages(Path(sys.executable)), tmp_path)
    assert out["torch"] == torch.__version__
