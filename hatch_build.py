"""Build hook: bundle the widget's front end (js/) into gradscope/static/widget.js with esbuild, and
have a wheel install a copy where the Jupyter server serves it.

NOTE [ the wheel carries the widget ]: a wheel (``pip wheel .``, ``python -m build``) contains
gradscope/static/widget.js, so installing gradscope from a wheel needs no Node.js. Building from
source does: the bundle is not committed, and this hook makes it with npm (esbuild and plotly come
from the npm registry or npm's cache). Where the bundle is already there and newer than every file
it is made from (js/src, js/package.json, js/package-lock.json; what ``./dev`` builds), it is used
as it is and npm is not needed. A wheel is never built without the widget unless asked:
GRADSCOPE_SKIP_JS=1 skips the front end (recording, text and JSON still work; the widget and the
HTML pages need the bundle).

NOTE [ the wheel installs the script for the Jupyter server ]: a widget's own module is a small
loader (js/src/loader.js; see NOTE [ the script once per environment ] in gradscope._views.widget) that imports the
bundle from the Jupyter server. So a wheel also installs the bundle, as shared data, at
share/jupyter/labextensions/gradscope/static/widget-<id>.js under the environment's prefix, where
JupyterLab and Notebook 7 serve extensions' files; <id> is the first 16 hex digits of the bundle's
SHA-256, as gradscope.widget.bundle_id() computes it, so a page never imports another version than
its kernel's (a server that lacks that file makes the loader ask the kernel instead).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

BUNDLE = Path("gradscope") / "static" / "widget.js"
LOADER = Path("gradscope") / "static" / "loader.js"
SERVED = "share/jupyter/labextensions/gradscope/static"  # under the prefix: see NOTE [ the wheel installs ... ]
NEEDS_NODE = (
    "gradscope: building gradscope from source needs Node.js (18 or newer) with npm, to bundle the "
    "notebook widget (js/ into gradscope/static/widget.js)"
)


def bundle_is_current(root: Path) -> bool:
    """Whether the bundle and the loader exist and are newer than every file they are made from."""
    outputs = [root / BUNDLE, root / LOADER]
    if not all(p.is_file() for p in outputs):
        return False
    js = root / "js"
    sources = [js / "package.json", js / "package-lock.json", *(js / "src").rglob("*")]
    made = min(p.stat().st_mtime for p in outputs)
    return all(p.stat().st_mtime <= made for p in sources if p.is_file())


def served_name(bundle: Path) -> str:
    """Where a wheel installs the bundle for the Jupyter server (NOTE [ the wheel installs the
    script for the Jupyter server ])."""
    return f"{SERVED}/widget-{hashlib.sha256(bundle.read_bytes()).hexdigest()[:16]}.js"


class JSBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if os.environ.get("GRADSCOPE_SKIP_JS") == "1":
            return
        self._bundle(version)
        bundle = Path(self.root) / BUNDLE
        if self.target_name == "wheel" and bundle.is_file():
            build_data.setdefault("shared_data", {})[str(bundle)] = served_name(bundle)

    def _bundle(self, version: str) -> None:
        """Make the bundle (and the loader) unless they are current."""
        root = Path(self.root)
        js = root / "js"
        if not (js / "package.json").exists():
            if self.target_name == "wheel" and version == "standard" and not (root / BUNDLE).is_file():
                raise RuntimeError(
                    f"gradscope: this source tree has neither js/ nor {BUNDLE}: a wheel built from it "
                    "would have no widget. Build from a full checkout or sdist, or set GRADSCOPE_SKIP_JS=1 "
                    "to build without the widget."
                )
            return
        if bundle_is_current(root):
            return
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError(
                f"{NEEDS_NODE}, and npm is not on PATH. Install Node.js and npm (Debian: apt-get install "
                "nodejs npm; elsewhere: https://nodejs.org), or install gradscope from a wheel, which "
                "carries the widget: build it once where npm is (pip wheel --no-deps -w dist .), then "
                f"pip install \"dist/gradscope-{self.metadata.version}-py3-none-any.whl[notebook]\" here "
                "(gradscope is not on PyPI: the project of that name there is another one); or set "
                "GRADSCOPE_SKIP_JS=1 to build without the widget (recording, text and JSON work; the "
                "widget and HTML pages do not)."
            )
        try:
            if not (js / "node_modules").exists():
                cmd = "ci" if (js / "package-lock.json").exists() else "install"
                subprocess.run([npm, cmd, "--no-audit", "--no-fund"], cwd=js, check=True)
            subprocess.run([npm, "run", "build"], cwd=js, check=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(
                f"{NEEDS_NODE}, and `{' '.join(str(a) for a in e.cmd[1:])}` in js/ failed (exit status "
                f"{e.returncode}; its output is above). npm fetches esbuild and plotly from the npm registry "
                "the first time: check the network, or set GRADSCOPE_SKIP_JS=1 to build without the widget."
            ) from None
