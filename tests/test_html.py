"""Self-contained HTML pages: one file, data inline and escaped, no network references."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest
from _recordings import HOSTILE, hostile_recording, tiny_recording

from gradscope._views.html import _inline_json, _inline_script, comparison_html, recording_html
from gradscope.widget import bundle_path

pytestmark = pytest.mark.skipif(
    not bundle_path().exists(), reason="front end not built (cd js && npm run build)"
)


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="gradscope-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_recording_page_is_one_self_contained_file(tmp_path: Path):
    rec = tiny_recording()
    path = tmp_path / "run.html"
    assert rec.to_html(path) == str(path)  # the path: as a cell's last line it shows the name, not the page
    page = path.read_text(encoding="utf-8")
    assert rec.to_html() == page
    assert page.startswith("<!doctype html>")
    assert page.count("<script") == 2  # the data and the bundled module, nothing else
    assert not re.search(r"<script[^>]+src=", page)
    assert not re.search(r"<link[^>]+href=", page)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    data = _data(page)
    assert data["kind"] == "recording"
    assert data["summary"]["nodes"] == 6
    assert data["summary"]["saved_bytes"] == rec.saved_bytes == 832
    assert len(data["levels"][0]["x"]) == 6


def test_hostile_text_cannot_close_the_script():
    page = recording_html(hostile_recording())
    # the only "</script>" occurrences are the two closing tags
    assert page.lower().count("</script") == 2
    assert "<img src=x" not in page
    data = _data(page)
    assert set(HOSTILE) <= set(data["strings"])  # the texts arrive unchanged as data
    # the label (HOSTILE[1]) is the page title, escaped
    title = page.split("<title>")[1].split("</title>")[0]
    assert title == "gradscope · &lt;/script&gt;&lt;script&gt;alert(2)&lt;/script&gt;"


def test_inline_escapes():
    assert _inline_json({"a": "</script><!--&"}) == '{"a":"\\u003c/script\\u003e\\u003c!--\\u0026"}'
    assert json.loads(_inline_json({"a": "</script>\u2028"})) == {"a": "</script>\u2028"}
    assert _inline_script('x="</script>"') == 'x="<\\/script>"'


class _Row:
    def __init__(self, name, status, peak, rec):
        self.name, self.status, self.peak_bytes, self.saved_bytes = name, status, peak, peak // 2
        self.time_s, self.max_abs_error, self.message, self.recording = 0.01, 0.0, f"<b>{name}</b>", rec


class _FakeComparison:
    reference = "a"

    def __init__(self):
        self.rows = [_Row("a", "ok", 1600, tiny_recording()), _Row("b", "raised", 100, None)]

    def rerun(self, names):
        pass


def test_comparison_page():
    page = comparison_html(_FakeComparison())
    data = _data(page)
    assert data["kind"] == "comparison"
    assert [r["name"] for r in data["rows"]] == ["a", "b"]
    assert [r["status"] for r in data["rows"]] == ["ok", "raised"]
    assert data["rows"][0]["message"] == "<b>a</b>"
    assert data["recordings"][0]["summary"]["nodes"] == 6 and data["recordings"][1] is None


def test_real_comparison_page():
    import torch

    import gradscope as gs

    x = torch.randn(5, requires_grad=True)
    cmp = gs.compare({"sin": lambda: x.sin().sum(), "cos": lambda: x.cos().sum()}, memory="off", repeat=1)
    data = _data(cmp.to_html())
    assert [r["name"] for r in data["rows"]] == ["sin", "cos"]
    assert data["rows"][1]["status"] == "wrong"
    assert sys.getsizeof(data) > 0


def test_comparison_page_states_its_problem():
    """The sentence saying what the candidates solve travels as data, shown first (issue 30, point 5)."""
    import gradscope as gs

    problem = "Which is cheaper? </script><img src=x> & more"
    page = comparison_html(_FakeComparison(), problem=problem)
    assert page.lower().count("</script") == 2 and "<img src=x" not in page  # escaped as data
    assert _data(page)["problem"] == problem
    assert "problem" not in _data(comparison_html(_FakeComparison()))
    with pytest.raises(gs.GradscopeError, match="problem must be a sentence"):
        comparison_html(_FakeComparison(), problem=3)  # type: ignore[arg-type]


def test_demo_page_states_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``python -m gradscope demo`` writes its problem into its page, with its sizes, and says in the
    page and on stdout what each result means, from the comparison's own rows."""
    from gradscope.__main__ import main
    from gradscope.recording import format_bytes

    path = tmp_path / "demo.html"
    assert main(["demo", "--depth", "2", "--width", "16", "--batch", "4", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out
    data = _data(path.read_text(encoding="utf-8"))
    problem = data["problem"]
    assert problem.startswith("The problem: d/dy <1, d f(y, G(z))/dz>, a mixed second derivative through a frozen G "
                              "of 2 x (Linear 16 + Tanh), batch 4. ")
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["create_graph", "forward_ad", "split"]
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "wrong"]
    ref, fad = rows["create_graph"]["peak_bytes"], rows["forward_ad"]["peak_bytes"]
    said = out.split("What the results mean:\n")[1].split("\n\n")[0].splitlines()
    assert [ln.split(":")[0].strip() for ln in said] == ["create_graph", "forward_ad", "split"]
    assert f"peak {format_bytes(ref)}." in said[0]
    assert f"at {format_bytes(fad)}, {fad / ref:.2f}x the reference's peak" in said[1]
    assert said[2].strip().startswith("split: wrong, and that is the point: ")
    assert rows["split"]["message"] in said[2]
    assert problem.endswith(" ".join(ln.strip() for ln in said))  # the page says the same


def test_written_files_get_the_users_umask(tmp_path: Path):
    """Every file gradscope writes (pages, recordings) gets the mode ``open(path, "w")`` gives:
    0o666 less the umask for a new file, its own mode for a file written over."""
    rec = tiny_recording()
    old = os.umask(0o022)
    try:
        assert rec.to_html(tmp_path / "a.html") == str(tmp_path / "a.html")
        rec.save(tmp_path / "a.gscope.json")
        os.umask(0o077)
        rec.to_html(tmp_path / "private.html")
        os.umask(0o002)
        (tmp_path / "shared.html").write_text("old")
        os.chmod(tmp_path / "shared.html", 0o640)
        rec.to_html(tmp_path / "shared.html")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"a.html": 0o644, "a.gscope.json": 0o644, "private.html": 0o600, "shared.html": 0o640}
    assert (tmp_path / "shared.html").read_text(encoding="utf-8") == rec.to_html()
