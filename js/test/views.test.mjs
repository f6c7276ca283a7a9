import assert from "node:assert/strict";
import { test } from "node:test";
import { decodeRecording } from "../src/data.js";
import { binaryTicks, formatBytesShort, formatRatio, formatSecondsRange, stepNumber, stepText } from "../src/format.js";
import { compactShape, edgeEnds, nodeDetail } from "../src/graph.js";
import { legendItems } from "../src/legend.js";
import { breakdownAt, labelledRuns, phaseRuns, xValues } from "../src/series.js";
import { whyNothingFreed } from "../src/stepper.js";
import { tinyPayload } from "./fixtures.mjs";

test("binary ticks: one binary unit, never SI", () => {
  assert.deepEqual(binaryTicks(9961480).text, ["0", "2 MiB", "4 MiB", "6 MiB", "8 MiB", "10 MiB"]);
  assert.deepEqual(binaryTicks(9961480).vals, [0, 2, 4, 6, 8, 10].map((v) => v * 1048576));
  // 1.25 MiB at most: every tick in MiB, none in KiB
  const t = binaryTicks(1.25 * 1048576);
  assert.ok(t.text.every((s) => s === "0" || s.endsWith(" MiB")), t.text);
  assert.ok(t.vals[t.vals.length - 1] >= 1.25 * 1048576);
  assert.deepEqual(binaryTicks(54784).text, ["0", "20 KiB", "40 KiB", "60 KiB"]);
  assert.deepEqual(binaryTicks(0).text, ["0 B"]);
  assert.equal(formatBytesShort(2.5 * 1048576), "2.5 MiB");
});

test("one step numbering: from 1, as the slider", () => {
  assert.equal(stepNumber(52), 53);
  assert.equal(stepText(52), "step 53");
});

test("ratios and time ranges", () => {
  assert.equal(formatRatio(0.1712), "0.17×");
  assert.equal(formatRatio(null), "n/a");
  assert.equal(formatSecondsRange(0.2956, 0.5396), "295.6–539.6 ms");
  assert.equal(formatSecondsRange(0.0005, 0.002), "500.0 µs–2.0 ms");
});

test("phase labels only where they fit, never overlapping", () => {
  const runs = phaseRuns([0, 10, 11, 12, 50], ["forward", "backward", "forward", "optimizer", "optimizer"]);
  assert.deepEqual(runs, [["forward", 0, 10], ["backward", 10, 11], ["forward", 11, 12], ["optimizer", 12, 50]]);
  // 10 px per unit: "forward" needs ~53 px: the 100 px run gets it, the 10 px runs do not
  assert.deepEqual(labelledRuns(runs, 10), [0, 3]);
  assert.deepEqual(labelledRuns(runs, 0.1), []);
});

test("x values: milliseconds or each run's share", () => {
  assert.deepEqual(xValues([1, 1.5, 3], "ms"), [0, 500, 2000]);
  assert.deepEqual(xValues([1, 1.5, 3], "normalized"), [0, 25, 100]);
});

test("the breakdown at a point lists the categories present", () => {
  const rec = decodeRecording(tinyPayload());
  assert.deepEqual(breakdownAt(rec.timeline, 3), [["activation", 768], ["other", 832]]);
  assert.deepEqual(breakdownAt(rec.timeline, 0), [["activation", 256]]);
});

test("why a step frees nothing", () => {
  const rec = decodeRecording(tinyPayload());
  // step 0 runs SumBackward0, which saved nothing
  assert.equal(whyNothingFreed(rec, 0), "Nothing freed: this node saved no tensors.");
  assert.equal(whyNothingFreed(rec, 1), null); // step 1 freed 512 bytes
  rec.backwardCalls = [{ create_graph: true, retain_graph: true }];
  assert.match(whyNothingFreed(rec, 0), /create_graph=True, which keeps the graph/);
  rec.backwardCalls = [{ create_graph: false, retain_graph: true }];
  assert.match(whyNothingFreed(rec, 0), /retain_graph=True/);
  rec.backwardCalls = [{ create_graph: false, retain_graph: false }];
  // step 2 (ReluBackward0) frees nothing while its storage is shared with node 1's, freed later
  rec.steps[2].freedBytes = 0;
  rec.saved[0].freedAt = 5;
  assert.equal(whyNothingFreed(rec, 2), "Nothing freed: its saved activation is also saved by node #1, which still needs it.");
  rec.saved[1].kind = "parameter";
  assert.match(whyNothingFreed(rec, 2), /saved only parameters or inputs/);
});

test("the legend lists only what is drawn", () => {
  const rec = decodeRecording(tinyPayload());
  const keys = legendItems(rec, rec.levels[0]).map((i) => i.key);
  assert.deepEqual(keys, ["heat", "none", "leaf", "order1", "module", "arrows"]);
  rec.nodes[1].order = 0;
  const flat = { ...rec.levels[0], groups: { ...rec.levels[0].groups, key: [] } };
  assert.deepEqual(legendItems(rec, flat).map((i) => i.key), ["heat", "none", "leaf", "arrows"]);
  assert.match(legendItems(rec, flat).at(-1).text, /forward runs down/);
});

test("node boxes say what they hold; edges meet the facing borders", () => {
  const rec = decodeRecording(tinyPayload());
  assert.equal(nodeDetail(rec.nodes[1]), "512 B · 16×8");
  assert.equal(nodeDetail(rec.nodes[4]), "parameter · 4×8");
  assert.equal(nodeDetail(rec.nodes[0]), "saves nothing");
  assert.equal(compactShape("64 × 512"), "64×512");
  const a = { x: 0, y: 0, w: 100, h: 40 };
  assert.deepEqual(edgeEnds(a, { x: 0, y: 100, w: 100, h: 40 }), [0, 20, 0, 80]); // down
  assert.deepEqual(edgeEnds(a, { x: 50, y: -100, w: 100, h: 40 }), [0, -20, 50, -80]); // up
  assert.deepEqual(edgeEnds(a, { x: 300, y: 5, w: 100, h: 40 }), [50, 0, 250, 5]); // beside
});
