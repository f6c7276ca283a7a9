"""The data model: exact JSON round trip, clear errors for bad files, byte formatting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import encoder, mlp

import gradscope as gs
from gradscope.recording import SCHEMA_VERSION, Kind, Recording, format_bytes


def _recorded(model_fn=mlp, memory: str = "cpu") -> Recording:
    model, x = model_fn()
    with gs.record(memory=memory, label="round trip") as rec:
        model(x).pow(2).mean().backward()
    assert rec.recording is not None
    return rec.recording


@pytest.mark.parametrize("memory", ["cpu", "off"])
def test_save_load_exact_round_trip(tmp_path: Path, memory: str) -> None:
    r = _recorded(encoder, memory)
    path = tmp_path / "run.gscope.json"
    r.save(path)
    back = gs.load(path)
    assert back == r
    assert back.summary() == r.summary()
    assert back.saved_bytes == r.saved_bytes and back.peak_bytes == r.peak_bytes
    assert isinstance(back.saved[0].kind, Kind)
    # the file is plain JSON with a format tag and schema version
    data = json.loads(path.read_text())
    assert data["format"] == "gradscope.recording" and data["schema"] == SCHEMA_VERSION


def test_load_truncated(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    text = _recorded().to_json()
    p.write_text(text[: len(text) // 2])
    with pytest.raises(gs.GradscopeError, match="truncated"):
        gs.load(p)


def test_load_other_schema(tmp_path: Path) -> None:
    d = _recorded().to_dict()
    d["schema"] = SCHEMA_VERSION + 1
    p = tmp_path / "v.json"
    p.write_text(json.dumps(d))
    with pytest.raises(gs.GradscopeError, match=f"schema version {SCHEMA_VERSION + 1}"):
        gs.load(p)


def test_load_not_gradscope(tmp_path: Path) -> None:
    p = tmp_path / "other.json"
    p.write_text(json.dumps({"nodes": [], "hello": 1}))
    with pytest.raises(gs.GradscopeError, match="not a gradscope recording"):
        gs.load(p)
    p.write_bytes(b"\x80\x04\x95 not json at all")
    with pytest.raises(gs.GradscopeError, match="not UTF-8 JSON"):
        gs.load(p)
    p.write_text("print('hi')")
    with pytest.raises(gs.GradscopeError, match="not valid JSON"):
        gs.load(p)
    with pytest.raises(gs.GradscopeError, match="cannot read"):
        gs.load(tmp_path / "missing.json")


def test_load_damaged_columns(tmp_path: Path) -> None:
    d = _recorded().to_dict()
    d["nodes"]["name"] = d["nodes"]["name"][:-1]
    p = tmp_path / "d.json"
    p.write_text(json.dumps(d))
    with pytest.raises(gs.GradscopeError, match="damaged"):
        gs.load(p)


def test_recording_holds_no_tensors() -> None:
    r = _recorded()
    stack = [r.to_dict()]
    while stack:
        v = stack.pop()
        assert not isinstance(v, torch.Tensor)
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def test_derived_figures() -> None:
    r = _recorded()
    by_kind = r.saved_bytes_by_kind()
    assert set(by_kind) == {"activation", "input", "parameter"}
    storages = {}
    for s in r.saved:
        storages[s.storage] = s.bytes
    assert sum(storages.values()) == r.saved_bytes
    assert sum(r.order_counts().values()) == len(r.nodes)
    with pytest.raises(gs.GradscopeError, match="no node"):
        r.node(len(r.nodes))


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(9 * 1024**2) == "9.0 MiB"
    assert format_bytes(-2048) == "-2.0 KiB"
    assert format_bytes(None) == "n/a"
