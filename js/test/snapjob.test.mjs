import assert from "node:assert/strict";
import { test } from "node:test";
import { alignSpan, alignTimelines, phaseIndexRuns, statusText } from "../src/jobdata.js";
import { decodeSnapshot, frameLabel, moment, momentText, nearestIndex, shortFile, snapshotX, visibleFrames } from "../src/snapdata.js";

// shaped like gradscope._snapshot.payload.snapshot_payload's output: 4 moments, two groups and "(other)"
function snapPayload() {
  return {
    kind: "snapshot",
    label: "s",
    summary: { device: "cuda:0", events: 10, allocations: 3 },
    strings: ["/home/u/train.py", "train_step", "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "forward", "train.py:57 train_step", "model.py:20 forward", "(other)", "/home/u/pkg/__init__.py", "main", "activations", "existed before the trace"],
    positions: [-1, 3, 6, 9],
    t: [0, 0.001, 0.002, 0.003],
    total: [0, 300, 700, 500],
    reserved: [0, 2048, 2048, 4096],
    groupings: { line: { names: [4, 5, 6], bytes: [[0, 100, 100, 100], [0, 200, 400, 400], [0, 0, 200, 0]] } },
    group: "line",
    moments: { blocks: [[], [1, 0], [2, 1, 0], [1, 0]], counts: [0, 2, 4, 2], limit: 3 },
    blocks: { size: [100, 200, 200], stream: [0, 0, 7], address: [0, 512, 1024], alloc_at: [1, 2, 5], free_at: [-1, -1, 7], stack: [0, 1, 1], line: [4, 5, 5], depth: [1, 3, 3], role: [10, 9, 9] },
    stacks: [[0], [1, 2, 3]],
    frames: { file: [0, 2, 0, 7], line: [57, 125, 20, 3], name: [1, 3, 3, 8], folded: [false, true, false, false] },
    peak: { at: 6, bytes: 700, index: 2 },
    oom: { at: 9, index: 3, requested: 4096 },
    ooms: [3],
    default: 3,
    diagnosis: { findings: [] },
    notes: [],
  };
}

test("a snapshot payload decodes into blocks with their frames", () => {
  const s = decodeSnapshot(snapPayload());
  assert.equal(s.blocks.length, 3);
  assert.deepEqual(s.blocks[1].frames.map(frameLabel), ["linear.py:125 forward", "train.py:20 forward", "pkg/__init__.py:3 main"]);
  assert.equal(s.blocks[0].freeAt, null);
  assert.equal(s.blocks[2].freeAt, 7);
  assert.deepEqual(s.blocks.map((b) => b.role), ["existed before the trace", "activations", "activations"]);
  assert.equal(s.defaultIndex, 3);
  assert.equal(shortFile("/a/b/__main__.py"), "b/__main__.py");
});

test("a moment: its largest blocks, the rest, and bytes by group with (other) last", () => {
  const s = decodeSnapshot(snapPayload());
  const m = moment(s, 2);
  assert.equal(m.position, 6);
  assert.deepEqual(m.blocks.map((b) => b.row), [2, 1, 0]);
  assert.equal(m.restCount, 1);
  assert.equal(m.restBytes, 700 - 500);
  assert.deepEqual(m.byGroup, [["model.py:20 forward", 400], ["train.py:57 train_step", 100], ["(other)", 200]]);
  assert.equal(m.isPeak, true);
  assert.equal(moment(s, 3).isOom, true);
  assert.equal(momentText(m), "trace event 6 (0.002 s)");
  assert.equal(momentText(moment(s, 0)), "before the first trace event");
  assert.deepEqual(moment(s, 99).position, 9); // clamped
});

test("nearest sampled moment and x values", () => {
  assert.equal(nearestIndex([-1, 3, 6, 9], 4), 1);
  assert.equal(nearestIndex([-1, 3, 6, 9], 5), 2);
  assert.equal(nearestIndex([-1, 3, 6, 9], 4.5), 1); // a tie: the earlier
  assert.equal(nearestIndex([-1, 3, 6, 9], 100), 3);
  assert.equal(nearestIndex([], 1), -1);
  const s = decodeSnapshot(snapPayload());
  assert.deepEqual(snapshotX(s, "time"), [0, 0.001, 0.002, 0.003]);
  assert.deepEqual(snapshotX(s, "events"), [-1, 3, 6, 9]);
});

test("frames of PyTorch, libraries and C++ fold into a count between the user's", () => {
  const f = (name, folded) => ({ file: "x.py", line: 1, name, folded });
  assert.deepEqual(visibleFrames([f("a", true), f("b", true), f("c", false), f("d", true)]), [{ hidden: 2 }, f("c", false), { hidden: 1 }]);
});

test("timelines overlaid by time, by share and phase by phase", () => {
  const tls = [
    { rank: 0, t: [0, 1, 2, 3, 4], live: [1, 2, 3, 2, 1], phase: [0, 0, 1, 1, 2] },
    { rank: 1, t: [0, 2, 4, 6, 8], live: [1, 2, 3, 2, 1], phase: [0, 0, 0, 1, 2] },
  ];
  assert.deepEqual(alignTimelines(tls, "time").xs[1], [0, 2000, 4000, 6000, 8000]);
  assert.deepEqual(alignTimelines(tls, "normalized").xs[0], [0, 25, 50, 75, 100]);
  const a = alignTimelines(tls, "phase");
  // rank 0: forward [0, 2) -> [0, 1), backward [2, 4) -> [1, 2), optimizer at 2
  assert.deepEqual(a.xs[0], [0, 0.5, 1, 1.5, 2]);
  // rank 1: forward [0, 6) -> [0, 1), backward [6, 8) -> [1, 2)
  assert.deepEqual(a.xs[1].map((v) => Number(v.toFixed(6))), [0, 0.333333, 0.666667, 1, 2]);
  assert.deepEqual(a.ticks.text, ["forward", "backward", "optimizer"]);
  assert.equal(a.note, null);
  assert.deepEqual(phaseIndexRuns([0, 0, 1, 0]), [[0, 0, 1], [1, 2, 2], [0, 3, 3]]);
  const odd = alignTimelines([tls[0], { ...tls[1], phase: [1, 1, 0, 0, 2] }], "phase");
  assert.match(odd.note, /not come in the same order/);
  // a span on rank 1 from 2 s to 6 s, phase-aligned, interpolates between its points
  assert.deepEqual(alignSpan(tls[1], a.xs[1], 2, 6, "phase").map((v) => Number(v.toFixed(6))), [0.333333, 1]);
  assert.deepEqual(alignSpan(tls[1], a.xs[1], 2, 6, "normalized"), [25, 75]);
  assert.deepEqual(alignTimelines([{ rank: 0, t: [0, 1], live: [0, 1], phase: null }], "phase").xs[0], [0, 100]);
});

test("status words", () => {
  assert.deepEqual(statusText({ status: "failed" }), { text: "failed (partial recording)", bad: true });
  assert.deepEqual(statusText({ status: "complete" }), { text: "complete", bad: false });
});
