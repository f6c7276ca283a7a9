"""A real JupyterLab on 127.0.0.1 and headless Chromium for the browser tests (tests/test_browser.py,
tests/test_browser_live.py): started by the test, stopped with its kernels afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def notebook(cells: list[str]) -> dict[str, Any]:
    """A notebook of code cells."""
    return {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
            for i, src in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _settings(dirpath: Path) -> None:
    """User settings for a quiet, unvirtualised Lab: no news toast, every cell in the DOM."""
    (dirpath / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (dirpath / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    (dirpath / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (dirpath / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"})
    )


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, root: Path, *, python: str = sys.executable, env: dict[str, str] | None = None,
               save_widget_state: bool = False) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on 127.0.0.1 serving ``root``, run by ``python``: (base URL, token);
    stopped (with its kernels) afterwards. ``env``: the server's environment (default: this
    process's, with this checkout first on PYTHONPATH); its own settings, workspaces and runtime
    directories go under ``tmp_path``. ``save_widget_state``: saving a notebook stores its widgets'
    state (Lab's setting)."""
    settings = tmp_path / "settings"
    _settings(settings)
    if save_widget_state:
        manager = settings / "@jupyter-widgets" / "jupyterlab-manager"
        manager.mkdir(parents=True)
        (manager / "plugin.jupyterlab-settings").write_text(json.dumps({"saveState": True}))
    port = free_port()
    token = secrets.token_hex(16)
    if env is None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    else:
        env = dict(env)
    env["JUPYTERLAB_SETTINGS_DIR"] = str(settings)
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "workspaces")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(
        [
            python,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False",
            "--LabApp.expose_app_in_browser=True",
            f"--ServerApp.root_dir={root}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.3)
        yield base, token
    finally:
        # the server's process group holds the server and its kernels: stop all of it
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        log.close()


def open_notebook(page: Any, base: str, token: str, name: str) -> None:
    """Open ``name`` in Lab and wait for its kernel."""
    page.goto(f"{base}/lab/tree/{name}?token={token}")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
        "window.jupyterapp.shell.currentWidget.sessionContext && "
        "window.jupyterapp.shell.currentWidget.sessionContext.session && "
        "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
        timeout=60_000,
    )
