"""A snapshot is its own type (NOTE [ a snapshot is its own type ] in gradscope._analyses.snapshot.data): its
data travels with the object, and nothing decides by the ``memory_source`` string."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from _snapshots import training_snapshot

import gradscope as gs
from gradscope.diagnose import Diagnosis
from gradscope.recording import Recording, Where
from gradscope.snapshot import (
    SnapshotDiagnosis,
    SnapshotRecording,
    bytes_by_line,
    snapshot_data,
    timeline_positions,
)
from gradscope.widget import is_snapshot, payload_of


@pytest.fixture(scope="module")
def rec() -> SnapshotRecording:
    r = gs.load_snapshot(training_snapshot(steps=4, oom_step=3).snap)
    assert isinstance(r, SnapshotRecording) and isinstance(r, Recording)
    return r


def test_the_data_survives_copy_and_replace(rec: SnapshotRecording) -> None:
    d = snapshot_data(rec)
    assert rec.data is d
    for other in (copy.copy(rec), copy.deepcopy(rec), dataclasses.replace(rec, label="renamed")):
        assert type(other) is SnapshotRecording
        assert snapshot_data(other) is d  # the object carries it: no table keyed by id() to miss
        assert timeline_positions(other) == timeline_positions(rec)
        assert is_snapshot(other)
        assert isinstance(gs.diagnose(other), SnapshotDiagnosis)
    renamed = dataclasses.replace(rec, label="renamed")
    assert renamed.summary().splitlines()[0] == "gradscope recording renamed (INCOMPLETE: CUDA out of memory)"
    assert renamed.summary().splitlines()[1:] == rec.summary().splitlines()[1:]
    assert copy.deepcopy(rec) == rec and renamed != rec
    assert "snapshot" in payload_of(renamed)["kind"]


def test_a_memory_source_string_does_not_make_a_snapshot() -> None:
    plain = Recording(where=Where(device="cuda:0", memory_source="cuda snapshot"), label="plain")
    assert not is_snapshot(plain)
    text = plain.summary()
    assert text.splitlines()[:2] == ["gradscope recording plain", "  device cuda:0, memory source: cuda snapshot"]
    assert "CUDA memory snapshot" not in text
    d = gs.diagnose(plain)
    assert isinstance(d, Diagnosis) and not isinstance(d, SnapshotDiagnosis)
    assert payload_of(plain)["kind"] == payload_of(Recording())["kind"]
    assert plain.to_html().startswith("<!doctype html>")
    with pytest.raises(gs.GradscopeError, match="not made from a CUDA memory snapshot"):
        snapshot_data(plain)


def test_a_saved_snapshot_loads_as_its_type(rec: SnapshotRecording, tmp_path: Path) -> None:
    path = tmp_path / "snap.gscope.json"
    rec.save(path)
    back = gs.load(path)
    assert type(back) is SnapshotRecording and back == rec
    assert back.data is not rec.data and back.data.to_json() == rec.data.to_json()
    assert bytes_by_line(back.data) == bytes_by_line(rec.data)
    assert "cuda_snapshot" not in back.extra  # the data is a field, not a copy of its JSON kept in extra
    again = Recording.from_dict(json.loads(path.read_text()))
    assert type(again) is SnapshotRecording and again == rec
    assert SnapshotRecording.from_dict(rec.to_dict()) == rec
    with pytest.raises(gs.GradscopeError, match="not made from a CUDA memory snapshot"):
        SnapshotRecording.from_dict(Recording().to_dict())


def test_a_plain_recording_carrying_saved_data_says_how_to_rebuild_it(rec: SnapshotRecording) -> None:
    fields = {f.name: getattr(rec, f.name) for f in dataclasses.fields(Recording)}
    plain = Recording(**{**fields, "extra": rec.to_dict()["extra"]})
    assert not is_snapshot(plain)
    with pytest.raises(gs.GradscopeError, match=r"gs\.load\(path\) or Recording\.from_dict"):
        snapshot_data(plain)


def test_a_snapshot_recording_checks_its_fields(rec: SnapshotRecording) -> None:
    with pytest.raises(gs.GradscopeError, match="one position per point"):
        dataclasses.replace(rec, timeline_at=rec.timeline_at[:-1])
    not_data: Any = {"format": "gradscope.cuda_snapshot"}
    with pytest.raises(gs.GradscopeError, match="must be a SnapshotData"):
        dataclasses.replace(rec, data=not_data)
