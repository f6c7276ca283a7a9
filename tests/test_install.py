"""A wheel carries the built widget and installs into someone else's environment without Node.js (see
NOTE [ the wheel carries the widget ] in hatch_build.py): built offline with the build backend of
the running environment, installed with ``--no-deps`` into a fresh virtualenv on top of another
torch of the supported range where one is set up (``./dev test-range`` makes them)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "gradscope" / "static" / "widget.js"
NATIVE_SOURCES = ("gradscope/_capture/native/hooks.cc", "gradscope/_capture/native/walk.cc", "gradscope/_capture/native/native.h")
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
        # the bundle and loader as built, newer than their sources (the hook rebuilding them would need npm's packages)
        now = time.time() + 1
        os.utime(copied, (now, now))
        os.utime(copied.with_name("loader.js"), (now, now))
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
    # the widget's loader, and the bundle again for the Jupyter server, named by its content (NOTE [ the
    # wheel installs the script for the Jupyter server ] in hatch_build.py)
    assert "gradscope/static/loader.js" in names
    version = wheel.name.split("-")[1]
    served = [n for n in names if n.startswith(f"gradscope-{version}.data/")]
    assert served == [f"gradscope-{version}.data/data/share/jupyter/labextensions/gradscope/static/widget-{digest[:16]}.js"]
    with zipfile.ZipFile(wheel) as z:
        assert z.read(served[0]) == BUNDLE.read_bytes()
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
from gradscope import widget
from gradscope._capture import native as _native
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


def _venv_with(wheel: Path, base_python: Path, site_packages: Path, tmp: Path) -> tuple[Path, Path]:
    """A fresh virtualenv that sees ``site_packages`` (torch and the rest of an existing environment;
    a virtualenv made from another one's python sees only the base interpreter's packages, so a .pth
    file adds them), gradscope installed into it from the wheel alone. Returns its python and its own
    site-packages."""
    venv = tmp / "venv"
    subprocess.run([str(base_python), "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    p = _pip("--python", str(python), "install", "--no-deps", str(wheel))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (own,) = (venv / "lib").glob("python3*/site-packages")
    (own / "_gradscope_test_base.pth").write_text(f"{site_packages}\n")
    return python, own


def _install_and_run(wheel: Path, base_python: Path, site_packages: Path, tmp: Path) -> dict[str, str]:
    """gradscope from the wheel alone in a fresh virtualenv (:func:`_venv_with`), one step recorded."""
    python, own = _venv_with(wheel, base_python, site_packages, tmp)
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


# ----------------------------------------------------------------------------- a saved notebook
_CELLS = [
    "import torch, gradscope as gs\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))\n"
    "x = torch.randn(8, 6)\n"
    "with gs.record(label='first') as r1:\n"
    "    model(x).pow(2).mean().backward()\n"
    "with gs.record(label='second', memory='off') as r2:\n"
    "    model(x * 2).sum().backward()\n"
    "cmp = gs.compare({'a': lambda: model(x).sum(), 'b': lambda: model(x).exp().sum()}, reference='a', repeat=1)\n"
    "print('READY')",
    "r1.recording",
    "gs.show(r2.recording)",
    "cmp",
]


def _open_notebook(browser: Any, base: str, token: str, name: str, run: bool) -> tuple[Any, Any, list[str]]:
    ctx = browser.new_context(viewport={"width": 1000, "height": 900})
    page = ctx.new_page()
    served: list[str] = []
    page.on("response", lambda r: served.append(f"{r.status} {r.url.split('?')[0]}") if "/gradscope/" in r.url else None)
    page.route("**/*", lambda rt: rt.continue_() if rt.request.url.startswith(base) else rt.abort())
    page.goto(f"{base}/lab/tree/{name}?token={token}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
                           "window.jupyterapp.shell.currentWidget.sessionContext", timeout=120_000)
    if run:
        page.evaluate("""async () => { const p = window.jupyterapp.shell.currentWidget;
            await p.sessionContext.ready; await window.jupyterapp.commands.execute('notebook:run-all-cells'); }""")
    return ctx, page, served


@pytest.mark.browser
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium")
def test_a_saved_notebook_grows_by_its_data_and_opens_anywhere(wheel: Path, tmp_path: Path) -> None:
    """NOTE [ the script once per environment ] in gradscope._views.widget, with a real JupyterLab and
    Chromium, as pip alone leaves things: gradscope from the wheel in a fresh virtualenv, JupyterLab
    serving the bundle the wheel installed. A notebook with three widget outputs, saved with their
    state, holds their data and a loader of a few kilobytes each, not the 1.2 MB script each; opened
    in a fresh JupyterLab it draws every widget from that state (the script from the server); with
    gradscope uninstalled, each output shows what it holds instead."""
    playwright_sync = pytest.importorskip("playwright.sync_api")
    from _lab import CHROMIUM_ARGS
    from _lab import jupyterlab as running_lab
    from _lab import shot as _shot
    from test_browser import _notebook

    bundle = BUNDLE.read_bytes()
    name = f"widget-{hashlib.sha256(bundle).hexdigest()[:16]}.js"
    python, _ = _venv_with(wheel, Path(sys.executable), _site_packages(Path(sys.executable)), tmp_path)
    prefix = python.parent.parent
    served_file = prefix / "share" / "jupyter" / "labextensions" / "gradscope" / "static" / name
    assert served_file.read_bytes() == bundle  # where pip put it, under the environment's prefix
    # JupyterLab's own files and its widget extensions (ipywidgets', anywidget's) from this environment;
    # gradscope's only from the one pip installed it into
    share = tmp_path / "share"
    (share / "labextensions").mkdir(parents=True)
    for ext in ("@jupyter-widgets", "anywidget"):
        (share / "labextensions" / ext).symlink_to(Path(sys.prefix) / "share" / "jupyter" / "labextensions" / ext)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRADSCOPE_CACHE", "JUPYTER_PATH")}
    env.update(GRADSCOPE_NATIVE="0", JUPYTER_PATH=str(share),
               JUPYTERLAB_DIR=str(Path(sys.prefix) / "share" / "jupyter" / "lab"))
    root = tmp_path / "root"
    root.mkdir()
    nb = _notebook()
    nb["cells"] = [{**nb["cells"][0], "id": f"s{i}", "source": src} for i, src in enumerate(_CELLS)]
    (root / "saved.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    widgets = len(_CELLS) - 1
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            # 1. run the notebook; each widget imports the script from the server; save it with its widgets' state
            with running_lab(tmp_path / "lab1", root, python=str(python), env=env, save_widget_state=True) as (base, token):
                ctx, page, served = _open_notebook(browser, base, token, "saved.ipynb", run=True)
                page.wait_for_function(f"() => document.querySelectorAll('.gs-root[data-ready=\"1\"]').length >= {widgets}",
                                       timeout=180_000)
                loaded = page.evaluate("() => [...document.querySelectorAll('.gs-root')].map(r => r.parentElement.dataset.gsLoaded)")
                assert loaded == ["server"] * widgets, loaded
                assert f"200 {base}/lab/extensions/gradscope/static/{name}" in served, served
                before = (root / "saved.ipynb").stat().st_mtime_ns
                page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
                page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
                assert (root / "saved.ipynb").stat().st_mtime_ns != before
                ctx.close()
            text = (root / "saved.ipynb").read_text(encoding="utf-8")
            saved = json.loads(text)
            state = saved["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
            ours = [m["state"] for m in state.values() if "gradscope-bundle" in str(m["state"].get("_esm", ""))]
            assert len(ours) == widgets
            data = sum(len(m["data"].encode()) for m in ours)
            per_widget = [len(json.dumps(m).encode()) - len(json.dumps(m["data"]).encode()) for m in ours]
            assert all(len(m["_esm"].encode()) < 8_000 for m in ours)
            assert max(per_widget) < 12_000, per_widget  # beside its data, a widget keeps a few kilobytes
            # the file: the outputs' data and text, not a 1.2 MB script per widget (that was 5.65 MB for 11 cells)
            assert len(text.encode()) < data + 200_000, (len(text.encode()), data)
            assert bundle.decode()[:2000] not in text
            print(f"saved notebook: {len(text.encode())} bytes for {widgets} widgets, their data {data} bytes, "
                  f"each widget's state beside its data {per_widget} bytes; the script is {len(bundle)} bytes")

            # 2. a fresh JupyterLab (no kernel has these widgets) draws each from the saved state
            with running_lab(tmp_path / "lab2", root, python=str(python), env=env) as (base, token):
                ctx, page, served = _open_notebook(browser, base, token, "saved.ipynb", run=False)
                page.wait_for_function(f"() => document.querySelectorAll('.gs-root[data-ready=\"1\"]').length >= {widgets}",
                                       timeout=120_000)
                page.locator(".gs-graph").first.scroll_into_view_if_needed()
                assert int(page.locator(".gs-graph").first.get_attribute("data-node-count")) > 0
                loaded = page.evaluate("() => [...document.querySelectorAll('.gs-root')].map(r => r.parentElement.dataset.gsLoaded)")
                assert loaded == ["server"] * widgets, loaded
                _shot(page, "saved_notebook_fresh_lab")
                ctx.close()

                # 3. gradscope uninstalled from where JupyterLab runs: each output says what it needs and what
                # it holds (a new browser, nothing cached; the notebook's kernel never imported gradscope)
                p = _pip("--python", str(python), "uninstall", "-y", "gradscope")
                assert p.returncode == 0 and not served_file.exists(), p.stdout + p.stderr
                ctx, page, served = _open_notebook(browser, base, token, "saved.ipynb", run=False)
                page.wait_for_function(f"() => document.querySelectorAll('.gs-fallback').length >= {widgets}",
                                       timeout=120_000)
                assert page.locator(".gs-root").count() == 0
                texts = page.locator(".gs-fallback").all_inner_texts()
                assert all(t.startswith("gradscope: this view") for t in texts), texts
                figures = page.locator(".gs-fallback-figures").all_inner_texts()
                assert figures[0].startswith("first: ") and " nodes · peak " in figures[0], figures
                assert figures[2].splitlines()[0].startswith("a: ok, peak "), figures
                assert f"404 {base}/lab/extensions/gradscope/static/{name}" in served, served
                page.locator(".gs-fallback").first.scroll_into_view_if_needed()
                _shot(page, "saved_notebook_without_gradscope")
                ctx.close()
        finally:
            browser.close()
