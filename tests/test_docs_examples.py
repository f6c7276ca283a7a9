"""The README and every page of docs/ are executed: their examples run and print what the pages show.

- Every ```python block runs. The blocks of one page run in order in one namespace (a page reads
  like one session), in a fresh working directory. A block may be left out only where it needs what
  this machine cannot give (a GPU, a browser or a network), said in a marker right above it,
  ``<!-- not run: needs CUDA -->``, and only a handful of blocks are; the GPT-2 diagnosis example
  (marker ``diagnosis example``) is run by tests/test_readme_diagnosis.py instead.
- A ```text block right after a python block (or after a line "prints:") is what that block
  prints: compared with doctest's rules (``...`` stands for any text, whitespace normalized) on the
  pinned torch, whose kernels and allocations the pages' numbers are.
- ```ipython blocks (notebook magics) run in an IPython shell, one per page.
- ```bash blocks are not run; every ``./dev`` subcommand, ``python -m gradscope`` command and
  file they name exists.
- docs/figures.md is what :func:`figures_page` makes from the figure registry (``python
  tests/test_docs_examples.py`` writes it again).
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gradscope import Recording

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
_PINNED = re.search(r"^TORCH_PINNED=(\S+)", (ROOT / "dev").read_text(), re.MULTILINE)
PINNED = _PINNED is not None and torch.__version__.split("+")[0] == _PINNED.group(1)

# the only reasons a python block may be left out, and how many may be
NOT_RUN_REASONS = ("needs CUDA", "needs a GPU", "needs a browser", "needs a network")
NOT_RUN_MAX = 4
RUN_ELSEWHERE = {"diagnosis example": ROOT / "tests" / "test_readme_diagnosis.py"}
README_MAX_BYTES = 8 * 1024


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int  # 1-based line of the opening fence
    marker: str | None  # the HTML comment right above the fence, if any
    output: str | None  # the ```text block right after a python block


_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!--\s*(.*?)\s*-->\s*\Z", re.DOTALL)


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = list(_FENCE.finditer(text))
    out: list[Block] = []
    for i, m in enumerate(found):
        lang = m.group(1)
        if lang == "text" and out and out[-1].lang == "python" and out[-1].output is None:
            gap = text[found[i - 1].end():m.start()]
            if re.fullmatch(r"\s*(prints[^\n]*:)?\s*", gap):
                prev = out[-1]
                out[-1] = Block(prev.lang, prev.body, prev.line, prev.marker, m.group(2))
                continue
        before = text[found[i - 1].end() if i else 0:m.start()]
        mk = _MARKER.search(before)
        out.append(Block(lang, m.group(2), text.count("\n", 0, m.start()) + 1, mk.group(1) if mk else None, None))
    return out


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _skip_reason(b: Block) -> str | None:
    """Why a python block is not run here (a marker), or None."""
    if b.marker is None:
        return None
    if b.marker.startswith("not run:"):
        return b.marker
    for key in RUN_ELSEWHERE:
        if b.marker.startswith(key):
            return b.marker
    return None


def _check_output(want: str, got: str, where: str) -> None:
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    if not checker.check_output(want, got, flags):
        raise AssertionError(f"{where}: the page shows\n{want}\nthe block printed\n{got}")


def _prepare(page: Path, cwd: Path) -> None:
    """Files a page's examples read that come from where this machine cannot run them: the CUDA
    memory snapshot of docs/snapshots.md, written here by the tests' fake caching allocator."""
    if page.name == "snapshots.md":
        sys.path.insert(0, str(ROOT / "tests"))
        try:
            from _snapshots import snapshot, write
            from test_snapshot_diagnose import _leak_until_oom
        finally:
            sys.path.remove(str(ROOT / "tests"))
        alloc, _ = _leak_until_oom()
        write(cwd / "snap.pickle", snapshot(alloc))


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python" and _skip_reason(b) is None]


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_page_id)
def test_the_python_examples_run_and_print_what_the_page_shows(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    todo = _runnable(page)
    monkeypatch.chdir(tmp_path)
    _prepare(page, tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        for b in todo:
            where = f"{_page_id(page)}:{b.line}"
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(b.body, where, "exec"), namespace)  # the page's own example
            if b.output is not None and PINNED:
                _check_output(b.output, buf.getvalue(), where)
    finally:
        # the jobs page starts a one-process group: never leave it to the tests after this one
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang == "ipython" for b in blocks(p))], ids=_page_id)
def test_the_notebook_examples_run_in_ipython(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.chdir(tmp_path)
    shell = get_ipython()
    shell.run_cell("%reset -f", store_history=False)  # the page's session starts empty
    try:
        for b in blocks(page):
            if b.lang != "ipython":
                continue
            result = shell.run_cell(b.body, store_history=False)
            assert result.error_before_exec is None, f"{_page_id(page)}:{b.line}: {result.error_before_exec}"
            err = result.error_in_exec
            # a block that demonstrates an out-of-memory error says so in a comment, and must raise it
            if "runs out of memory on purpose" in b.body:
                assert isinstance(err, torch.OutOfMemoryError), f"{_page_id(page)}:{b.line} raised {err!r}"
            else:
                assert err is None, f"{_page_id(page)}:{b.line} raised {err!r}"
            # `%%gradscope -o NAME` keeps the cell's recording as NAME, also when the cell failed
            named = re.match(r"%%gradscope\b.*?-o (\w+)", b.body)
            if named:
                kept = shell.user_ns.get(named.group(1))
                assert isinstance(kept, Recording) and kept.complete == (err is None), (b.line, kept)
    finally:
        shell.run_cell("%unload_ext gradscope", store_history=False)
        shell.run_cell("%reset -f", store_history=False)


def test_blocks_left_out_say_why_and_are_few() -> None:
    left_out = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang != "python" or b.marker is None:
                continue
            where = f"{_page_id(page)}:{b.line}"
            if b.marker.startswith("not run:"):
                reason = b.marker.removeprefix("not run:").strip()
                assert reason.startswith(NOT_RUN_REASONS), f"{where}: a block may be left out only where it " \
                    f"needs one of {NOT_RUN_REASONS}, not {reason!r}"
                left_out.append(where)
            for key, test in RUN_ELSEWHERE.items():
                if b.marker.startswith(key):
                    assert _page_id(page) in test.read_text(), f"{where}: {test.name} does not read {_page_id(page)}"
    assert len(left_out) <= NOT_RUN_MAX, left_out


def _dev_commands() -> set[str]:
    dev = (ROOT / "dev").read_text()
    case = dev[dev.index('case "$cmd" in'):]
    return set(re.findall(r"^  ([a-z][a-z-]*)\)", case, re.MULTILINE))


def _module_commands() -> set[str]:
    """The subcommands of ``python -m gradscope``, from its --help."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "gradscope", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    m = re.search(r"\{([\w,-]+)\}", out)
    assert m, out
    return set(m.group(1).split(","))


_PATH = re.compile(r"(?<![\w./-])((?:\./)?(?:[\w-]+/)*[\w-]+\.(?:py|ipynb|md|json|toml|cc|h|txt|js))\b")


BUILT = ("gradscope/static/",)  # build outputs (not in a fresh checkout)


def _existing(name: str) -> bool:
    return name.startswith(BUILT) or (ROOT / name).exists() or (DOCS / name).exists()


def test_shell_commands_name_what_exists() -> None:
    dev, module = _dev_commands(), _module_commands()
    assert {"demo", "test", "test-range", "lab", "bench", "setup"} <= dev
    for page in PAGES:
        for b in blocks(page):
            if b.lang != "bash":
                continue
            for line in b.body.splitlines():
                cmd = line.split("#", 1)[0].strip()
                if not cmd:
                    continue
                where = f"{_page_id(page)}:{b.line}: {cmd}"
                for part in re.split(r"&&|\|\||;", cmd):
                    words = shlex.split(part)
                    if words[:1] == ["./dev"]:
                        assert len(words) > 1 and words[1] in dev, where
                    if words[:3] == ["python", "-m", "gradscope"]:
                        assert len(words) > 3 and words[3] in module, where
                    for w in words:
                        if "/" in w and not w.startswith(("-", "dist/", "http")) and _PATH.fullmatch(w):
                            assert _existing(w), where


def test_files_the_pages_name_exist() -> None:
    """Paths in code spans (`benchmarks/bench_record.py`) and relative links name files that exist."""
    for page in PAGES:
        text = page.read_text()
        for span in re.findall(r"`([^`\n]+)`", text):
            for name in _PATH.findall(span):
                if "/" in name and not name.startswith(("dist/", "step", "~")):
                    assert _existing(name), f"{_page_id(page)} names {name}"
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{_page_id(page)} links {link}"


def test_the_pages_are_for_users() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= README_MAX_BYTES
    for page in [*PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md"]:
        text = page.read_text()
        for word in ("rounds ago", "this round", "last round", "tried and not kept"):
            assert word not in text, f"{_page_id(page)} says {word!r}"


# ----- the figure definitions page ------------------------------------------------------------------
FIGURES_PAGE = DOCS / "figures.md"


def _cell(text: str) -> str:
    """A table cell: a ``|`` inside it would end the cell."""
    return text.replace("|", "\\|")


def figures_page() -> str:
    """docs/figures.md from the one registry, gradscope.figures.FIGURES."""
    from gradscope import figures

    lines = [
        "# Figure definitions",
        "",
        "<!-- generated from gradscope.figures.FIGURES by `python tests/test_docs_examples.py`; "
        "tests/test_docs_examples.py fails when they differ -->",
        "",
        "Every number the summary, the widget, the HTML page, the comparison and the job view show is one of",
        "these, with its label as the column or list title and this definition beside it (in tooltips and",
        "under the tables). They live in one registry in code, `gradscope.figures.FIGURES`, with the function",
        "that computes each; this page is made from it. A label has one meaning everywhere: \"saved (total)\"",
        "counts activations only, \"saved (all kinds)\" every saved tensor, parameters and inputs included.",
        "",
        "## The figures (`gradscope.figures.FIGURES`)",
        "",
        "| figure | label | definition | computed by |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{f.name}` | {_cell(f.label)} | {_cell(f.definition)} | `{f.computed_by}` |"
              for f in figures.FIGURES.values()]
    lines += [
        "",
        "## Memory by category (`gradscope.figures.CATEGORY_LABELS`)",
        "",
        "The bands of the memory timeline, bottom to top.",
        "",
        "| category | label |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {_cell(v)} |" for k, v in figures.CATEGORY_LABELS.items()]
    return "\n".join(lines) + "\n"


def test_the_figures_page_is_the_registry() -> None:
    assert FIGURES_PAGE.read_text() == figures_page(), \
        "docs/figures.md differs from the figure registry: run python tests/test_docs_examples.py"


if __name__ == "__main__":
    FIGURES_PAGE.write_text(figures_page())
    print(f"wrote {FIGURES_PAGE.relative_to(ROOT)}")
