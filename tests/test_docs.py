"""Every ``Example:`` in gradscope's docstrings runs and gives the output it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradscope

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(gradscope.__path__, "gradscope.") if m.name != "gradscope.__main__"
) + ["gradscope", "gradscope.__main__"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_examples_exist_for_the_public_api() -> None:
    attempted = 0
    for name in ("gradscope._capture.record", "gradscope._analyses.graph", "gradscope._model.recording", "gradscope"):
        attempted += doctest.testmod(importlib.import_module(name)).attempted
    assert attempted >= 6
