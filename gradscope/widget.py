"""The notebook widget: the autograd graph, memory timeline, backward step-through and strategy
toggles, as an anywidget whose front end is bundled from ``js/`` (no CDN).

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._views.widget import (
    LIVE_INTERVAL_S,
    MAX_ITERATION_POINTS,
    MAX_TIMELINE_POINTS,
    PAYLOAD_VERSION,
    ComparisonWidget,
    JobWidget,
    RecordingWidget,
    SnapshotWidget,
    bundle_id,
    bundle_name,
    bundle_path,
    bundle_text,
    comparison_payload,
    is_snapshot,
    iterations_columns,
    job_payload,
    loader_text,
    loop_payload,
    mimebundle,
    payload_json,
    payload_of,
    recording_payload,
    show,
    snapshot_payload,
)

__all__ = [
    "LIVE_INTERVAL_S",
    "MAX_ITERATION_POINTS",
    "MAX_TIMELINE_POINTS",
    "PAYLOAD_VERSION",
    "ComparisonWidget",
    "JobWidget",
    "RecordingWidget",
    "SnapshotWidget",
    "bundle_id",
    "bundle_name",
    "bundle_path",
    "bundle_text",
    "loader_text",
    "comparison_payload",
    "is_snapshot",
    "iterations_columns",
    "job_payload",
    "loop_payload",
    "mimebundle",
    "payload_json",
    "payload_of",
    "recording_payload",
    "show",
    "snapshot_payload",
]
