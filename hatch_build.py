"""Build hook: bundle the widget's front end (js/) into gradscope/static/ with esbuild.

Runs on `pip install .` and `pip install -e .`. The bundle is not committed; it needs Node.js and
npm (packages come from the npm registry or the local npm cache). Set GRADSCOPE_SKIP_JS=1 to
install without the front end (recording, text and JSON still work).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class JSBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if os.environ.get("GRADSCOPE_SKIP_JS") == "1":
            return
        root = Path(self.root)
        js = root / "js"
        if not (js / "package.json").exists():
            return
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError(
                "gradscope: building the widget needs Node.js and npm (install them, or set "
                "GRADSCOPE_SKIP_JS=1 to install without the widget)."
            )
        if not (js / "node_modules").exists():
            cmd = "ci" if (js / "package-lock.json").exists() else "install"
            subprocess.run([npm, cmd, "--no-audit", "--no-fund"], cwd=js, check=True)
        subprocess.run([npm, "run", "build"], cwd=js, check=True)
