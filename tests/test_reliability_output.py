"""Reliability of output: hostile module and parameter names (markup, quotes, newlines, control
characters, very long, non-ASCII, ``</script>``) registered with ``add_module`` and
``register_parameter`` come out as text everywhere: one line each in the summary, escaped data
(never markup) in the HTML page, plain strings in the widget's state, quoted labels in dot."""

from __future__ import annotations

import html.parser
import json
import re
from typing import Any

import pytest
import torch
from test_reliability import leftovers
from torch import nn

import gradscope as gs
from gradscope._views import widget as widget_impl  # the face holds public names only

HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "</script><script>alert(2)</script>",
    "<!--",
    "]]><svg onload=alert(3)>",
    "quote\"s 'and' `ticks`",
    "new\nline",
    "carriage\rreturn",
    "tab\there",
    "nul\x00byte",
    "esc\x1b[31mred",
    "line\u2028separator",
    "Ünïcödé模块🙂",
    "&amp;&lt;",
    "{{template}}${x}",
    "x" * 3000,
]


class _Hostile(nn.Module):
    """Submodules and parameters named by HOSTILE; each submodule's output is scaled by a
    parameter of that name, so every name owns nodes, leaves and saved tensors."""

    def __init__(self) -> None:
        super().__init__()
        for name in HOSTILE:
            self.add_module(name, nn.Linear(4, 4))
            self.register_parameter(name + "_p", nn.Parameter(torch.full((4,), 0.5)))
        # a whole name in <...> is what Graphviz would read as an HTML-like label
        self.register_parameter("<b>bold</b>", nn.Parameter(torch.ones(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in HOSTILE:
            x = torch.tanh(getattr(self, name)(x) * getattr(self, name + "_p"))
        return x * getattr(self, "<b>bold</b>")


@pytest.fixture(scope="module")
def recording() -> gs.Recording:
    torch.manual_seed(0)
    model = _Hostile()
    # modules= names paths relative to the model itself, so that names start the labels
    with gs.record(memory="tracker", label=HOSTILE[1] + HOSTILE[5], modules=model) as rec:
        model(torch.randn(3, 4)).pow(2).mean().backward()
    assert leftovers() == []
    return rec.recording


def test_names_reach_the_recording_unchanged(recording: gs.Recording) -> None:
    modules = {n.module for n in recording.nodes}
    leaves = {n.leaf for n in recording.nodes}
    for name in HOSTILE:
        assert name in modules
        assert f"{name}.weight" in leaves and f"{name}_p" in leaves


def _printable_line(line: str) -> bool:
    return all(ch.isprintable() for ch in line)


def test_summary_is_one_printable_line_per_item(recording: gs.Recording) -> None:
    text = recording.summary(top=100)
    lines = text.split("\n")
    assert all(_printable_line(line) for line in lines)
    assert "\r" not in text and "\x1b" not in text and "\x00" not in text and "\u2028" not in text
    # nothing a name carries starts a line of its own
    for bad in ("line", "return", "separator", "red"):
        assert not any(line.startswith(bad) for line in lines)
    assert any("new\\nline" in line for line in lines)  # shown, escaped
    assert all(len(line) < 400 for line in lines)  # a 3,000-character name is cut
    assert lines[0].startswith("gradscope recording </script><script>alert(2)</script>new\\nline")


class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, Any]]] = []
        self.data: dict[str, str] = {}
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in = dict(attrs).get("id") or "module"
            self.data.setdefault(self._in, "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            self.data[self._in] += data


def _strings(obj: Any) -> set[str]:
    out: set[str] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            out.add(o)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return out


def test_html_page_carries_names_as_data_never_markup(recording: gs.Recording) -> None:
    pytest.importorskip("gradscope.html")
    page = recording.to_html()
    parser = _Tags()
    parser.feed(page)
    tags = [t for t, _ in parser.tags]
    # exactly the page's own elements: no tag from a name (img, svg, a second data script)
    assert tags.count("script") == 2 and "img" not in tags and "svg" not in tags
    assert set(tags) <= {"html", "head", "meta", "title", "style", "body", "noscript", "script", "div"}
    for name in HOSTILE:
        if any(c in name for c in "<>&"):
            assert name not in page  # never raw in the page
    assert "<!--" not in page.split("<script type=\"application/json\"", 1)[1]
    data = json.loads(parser.data["gradscope-data"])
    strings = "\n".join(_strings(data))
    for name in HOSTILE:
        if len(name) < 200:  # long names may be shortened for display
            assert name in strings, name
    title = re.search(r"<title>(.*?)</title>", page, re.S)
    assert title is not None and "<script>" not in title.group(1) and "&lt;/script&gt;" in title.group(1)


def test_widget_state_holds_names_as_plain_strings(recording: gs.Recording) -> None:
    widget = pytest.importorskip("gradscope.widget")
    payload = json.loads(widget.payload_json(recording))
    strings = "\n".join(_strings(payload))
    for name in HOSTILE:
        if len(name) < 200:
            assert name in strings, name
    if getattr(widget_impl, "_anywidget", None) is None or not widget.bundle_path().exists():
        pytest.skip("widget stack or built bundle not present")
    w = widget.RecordingWidget(recording)
    state = w.get_state()
    assert json.loads(state["data"]) == payload
    bundle = widget.mimebundle(recording)
    assert all(_printable_line(line) for line in bundle["text/plain"].split("\n"))


def test_dot_labels_are_text(recording: gs.Recording) -> None:
    pytest.importorskip("graphviz")
    source = recording.to_dot().source
    # every label is a quoted string: a name in <...> would otherwise be an HTML-like label,
    # which Graphviz interprets (its <IMG SRC=...> reads files)
    assert not re.search(r"label=<", source)
    assert "<img src=x onerror=alert(1)>.weight" in source and '"<b>bold</b>' in source
