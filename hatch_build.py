"""Build hook: bundle the widget's front end (js/) into gradscope/static/widget.js with esbuild.

NOTE [ the wheel carries the widget ]: a wheel (``pip wheel .``, ``python -m build``) contains
gradscope/static/widget.js, so installing gradscope from a wheel needs no Node.js. Building from
source does: the bundle is not committed, and this hook makes it with npm (esbuild and plotly come
from the npm registry or npm's cache). Where the bundle is already there and newer than every file
it is made from (js/src, js/package.json, js/package-lock.json; what ``./dev`` builds), it is used
as it is and npm is not needed. A wheel is never built without the widget unless asked:
GRADSCOPE_SKIP_JS=1 skips the front end (recording, text and JSON still work; the widget and the
HTML pages need the bundle).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

BUNDLE = Path("gradscope") / "static" / "widget.js"
NEEDS_NODE = (
    "gradscope: building gradscope from source needs Node.js (18 or newer) with npm, to bundle the "
    "notebook widget (js/ into gradscope/static/widget.js)"
)


def bundle_is_current(root: Path) -> bool:
    """Whether the bundle exists and is newer than every file it is made from."""
    bundle = root / BUNDLE
    if not bundle.is_file():
        return False
    js = root / "js"
    sources = [js / "package.json", js / "package-lock.json", *(js / "src").rglob("*")]
    made = bundle.stat().st_mtime
    return all(p.stat().st_mtime <= made for p in sources if p.is_file())


class JSBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if os.environ.get("GRADSCOPE_SKIP_JS") == "1":
            return
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
