"""Reliability of recording files: ``gs.load`` turns every bad file (truncated, another version,
deeply nested, over the size limit, not JSON, not a recording, damaged fields, a pickle that
would run code) into a GradscopeError and never runs anything from it; ``save`` (and
``to_html``) are atomic: a failure at any point of a save leaves the previous file byte for byte
and no temporary file behind."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradscope as gs
import gradscope._model.files as grecording
from gradscope._base import registry as _views
from gradscope.recording import Recording


@pytest.fixture(scope="module")
def recording() -> Recording:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with gs.record(memory="tracker", label="files") as rec:
        model(torch.randn(4, 8)).pow(2).mean().backward()
    r = rec.recording
    assert r.nodes and r.saved and r.steps and r.timeline
    return r


@pytest.fixture(scope="module")
def good_text(recording: Recording) -> str:
    return recording.to_json()


class _Boom:
    """Unpickling this would create a file: the proof that nothing from a file is executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _bad_files(good: str, tmp: Path) -> dict[str, bytes]:
    d = json.loads(good)
    bad: dict[str, bytes] = {
        "empty": b"",
        "whitespace": b"   \n\t ",
        "binary": bytes(range(256)) * 4,
        "utf16": good.encode("utf-16"),
        "latin1_garbage": b"\xff\xfe\xfa not utf-8",
        "pickle_that_would_run_code": pickle.dumps(_Boom(str(tmp / "EXECUTED"))),
        "python_literal": repr(d).encode(),
        "nan_literal": good.replace('"peak_bytes":', '"peak_bytes":NaN,"x":', 1).encode(),
        "top_level_list": b"[1, 2, 3]",
        "top_level_null": b"null",
        "top_level_number": b"42",
        "top_level_string": b'"gradscope.recording"',
        "nested_lists_100k": b"[" * 100_000 + b"]" * 100_000,
        "nested_objects_100k": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "nested_unclosed_100k": b"[" * 100_000,
        "nested_inside_recording": good[:-1].encode() + b',"deep":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "html_page": b"<!doctype html><html><body>not a recording</body></html>",
        "other_json_object": json.dumps({"nodes": [], "edges": []}).encode(),
        "no_format": json.dumps({k: v for k, v in d.items() if k != "format"}).encode(),
        "wrong_format": json.dumps({**d, "format": "torchviz"}).encode(),
        "duplicate_key_last_wins_wrong": good[:-1].encode() + b',"format":"other"}',
    }
    for schema in (0, 3, 99, -1, "1", 2.0, None, True, [1]):
        if schema == 2 and type(schema) is float:  # 2.0 == 2 in Python and JSON: a valid version
            continue
        bad[f"schema_{schema!r}"] = json.dumps({**d, "schema": schema}).encode()
    for cut in (1, 2, 10, 100, len(good) // 3, len(good) // 2, len(good) - 100, len(good) - 2,
                len(good) - 1):
        bad[f"truncated_at_{cut}"] = good[:cut].encode()
    for key in ("nodes", "edges", "saved", "steps", "timeline", "peak_bytes", "baseline_bytes",
                "where", "complete"):
        bad[f"missing_{key}"] = json.dumps({k: v for k, v in d.items() if k != key}).encode()
    for key, value in (("nodes", []), ("nodes", "x"), ("nodes", {"id": [0, 1], "name": ["a"]}),
                       ("saved", {"kind": ["not-a-kind"]}), ("timeline", {"phase": ["sideways"]}),
                       ("peak_bytes", "12"), ("peak_bytes", 1.5), ("peak_bytes", True),
                       ("where", []), ("peak", {"bytes": 1, "phase": "up"}), ("peak", 7),
                       ("backward_passes", None), ("timeline_dropped", "0"), ("extra", [1, 2])):
        bad[f"bad_{key}_{value!r}"[:60]] = json.dumps({**d, key: value}).encode()
    return bad


def test_every_bad_file_is_a_gradscope_error(good_text: str, tmp_path: Path) -> None:
    bad = _bad_files(good_text, tmp_path)
    assert len(bad) >= 60
    for name, content in bad.items():
        path = tmp_path / "bad.gscope.json"
        path.write_bytes(content)
        with pytest.raises(gs.GradscopeError) as info:
            gs.load(path)
        assert str(info.value).startswith("gradscope:"), name
    assert not (tmp_path / "EXECUTED").exists()
    # the good text itself loads, so each failure above is the damage's doing
    path = tmp_path / "good.gscope.json"
    path.write_text(good_text, encoding="utf-8")
    assert gs.load(path).to_json() == good_text


def test_bad_file_count(good_text: str, tmp_path: Path) -> None:
    """The report quotes this number (plus the paths and fuzzed files below)."""
    assert len(_bad_files(good_text, tmp_path)) == 61


def test_paths_that_are_not_files(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.gscope.json", tmp_path, tmp_path / "missing_dir" / "x.json"):
        with pytest.raises(gs.GradscopeError, match="cannot read"):
            gs.load(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(gs.GradscopeError, match="not a regular file"):
        gs.load(fifo)  # reading a FIFO would block forever


def test_huge_file_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.gscope.json"
    with open(path, "wb") as f:  # sparse: no disk blocks are written
        f.truncate(grecording._MAX_FILE_BYTES + 1)
    assert os.stat(path).st_blocks == 0
    with pytest.raises(gs.GradscopeError, match="limit"):
        gs.load(path)


def _mutations(d: Any, rng: random.Random) -> Any:
    """One random damage to a random place of a recording's JSON data."""
    values = [None, "x", -1, 0, 1.5, [], {}, True, 2**70, "nan", [None], {"a": 1}, "a" * 10_000,
              "<script>alert(1)</script>", -(2**63)]
    d = json.loads(json.dumps(d))
    holder: Any = d
    for _ in range(rng.randint(0, 3)):  # descend into a random column or object
        keys = sorted(holder) if isinstance(holder, dict) else list(range(len(holder)))
        inner = [k for k in keys if isinstance(holder[k], dict | list) and holder[k]]
        if not inner:
            break
        holder = holder[rng.choice(inner)]
    keys = sorted(holder) if isinstance(holder, dict) else list(range(len(holder)))
    if not keys:
        return d
    key = rng.choice(keys)
    if rng.random() < 0.1 and isinstance(holder, dict):
        del holder[key]
    else:
        holder[key] = rng.choice(values)
    return d


def test_fuzzed_recordings_load_or_fail_cleanly_and_then_render(good_text: str, tmp_path: Path) -> None:
    """400 randomly damaged recordings: each either loads, and then its summary, JSON and HTML
    page render, or fails with a GradscopeError; no other exception escapes."""
    rng = random.Random(1234)
    base = json.loads(good_text)
    loaded = failed = 0
    path = tmp_path / "fuzz.gscope.json"
    for _ in range(400):
        path.write_text(json.dumps(_mutations(base, rng)), encoding="utf-8")
        try:
            r = gs.load(path)
        except gs.GradscopeError:
            failed += 1
            continue
        loaded += 1
        try:
            r.summary()
            Recording.from_dict(json.loads(r.to_json()))
            r.to_html()
        except gs.GradscopeError:
            pass
    assert loaded > 100 and failed > 100, (loaded, failed)


# ------------------------------------------------------------------ atomic save
def _old(tmp_path: Path, recording: Recording) -> tuple[Path, bytes]:
    path = tmp_path / "run.gscope.json"
    recording.save(path)
    return path, path.read_bytes()


def _other(recording: Recording) -> Recording:
    return Recording(nodes=recording.nodes[:2], label="newer")


def _fail(exc: type[BaseException]) -> Any:
    def f(*args: Any, **kwargs: Any) -> Any:
        raise exc("injected fault during save")

    return f


SAVE_FAULTS = {
    "encoding": ("encode", None, RuntimeError),  # JSON for save, the page for to_html
    "encoding_interrupted": ("encode", None, KeyboardInterrupt),
    "fsync": (os, "fsync", OSError),
    "rename": (os, "replace", OSError),
    "rename_interrupted": (os, "replace", KeyboardInterrupt),
    "disk_full_on_write": ("write", None, OSError),
}


class _HalfWriter:
    """A file whose write puts half the text on disk, then fails as a full disk does."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> _HalfWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()

    def write(self, s: str) -> int:
        self.f.write(s[: len(s) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


@pytest.mark.parametrize("fault", list(SAVE_FAULTS))
@pytest.mark.parametrize("what", ["save", "to_html"])
def test_failed_save_leaves_previous_file_and_no_temporary(fault: str, what: str, tmp_path: Path,
                                                           recording: Recording,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path, before = _old(tmp_path, recording)
    target, attr, exc = SAVE_FAULTS[fault]
    if target == "write":
        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda *a, **k: _HalfWriter(real_fdopen(*a, **k)))
    elif target == "encode":
        if what == "save":
            monkeypatch.setattr(Recording, "to_json", _fail(exc))
        else:  # the recording's page: its HTML view
            monkeypatch.setitem(_views._VIEWS, (_views.ViewKind.HTML, Recording), _fail(exc))
    else:
        monkeypatch.setattr(target, attr, _fail(exc))
    newer = _other(recording)
    with pytest.raises(exc):
        if what == "save":
            newer.save(path)
        else:
            newer.to_html(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert gs.load(path).to_json() == recording.to_json()


def test_save_replaces_atomically_when_it_succeeds(tmp_path: Path, recording: Recording) -> None:
    path, _ = _old(tmp_path, recording)
    _other(recording).save(path)
    assert gs.load(path).label == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
