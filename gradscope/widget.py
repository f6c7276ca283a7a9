"""The notebook widget: the autograd graph, memory timeline, backward step-through and strategy
toggles, as an anywidget whose front end is bundled from ``js/`` (no CDN).

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._views.payloads import (
    LIVE_INTERVAL_S,
    MAX_ITERATION_POINTS,
    MAX_TIMELINE_POINTS,
    PAYLOAD_VERSION,
    comparison_payload,
    is_snapshot,
    iterations_columns,
    job_payload,
    loop_payload,
    payload_json,
    payload_of,
    recording_payload,
    snapshot_payload,
)
from gradscope._views.widget import (
    ComparisonWidget,
    JobWidget,
    RecordingWidget,
    SnapshotWidget,
    bundle_id,
    bundle_name,
    bundle_path,
    bundle_text,
    loader_text,
    mimebundle,
    show,
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
