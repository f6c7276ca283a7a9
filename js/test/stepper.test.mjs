import assert from "node:assert/strict";
import { test } from "node:test";
import { decodeRecording } from "../src/data.js";
import { clampStep, nodeReleaseSteps, stepState, stepTime } from "../src/stepper.js";
import { tinyPayload } from "./fixtures.mjs";

test("clampStep", () => {
  assert.equal(clampStep(-3, 5), 0);
  assert.equal(clampStep(9, 5), 4);
  assert.equal(clampStep(2.7, 5), 2);
  assert.equal(clampStep(0, 0), -1);
});

test("stepState names the node, live bytes and released saves", () => {
  const rec = decodeRecording(tinyPayload());
  const s0 = stepState(rec, 0);
  assert.equal(s0.node, 0);
  assert.equal(s0.liveAfter, 1000);
  assert.deepEqual([...s0.freed], [0]);
  assert.deepEqual(s0.freedNow, [0]);
  const s1 = stepState(rec, 1);
  assert.equal(s1.node, 1);
  assert.equal(s1.liveAfter, 1600);
  assert.equal(s1.freedBytes, 512);
  assert.deepEqual([...s1.freed].sort(), [0, 1]);
  assert.deepEqual(s1.freedNow, [1]);
  assert.equal(stepState(rec, 99).index, 2);
});

test("nodeReleaseSteps: -1 unless every save of the node is released", () => {
  const rec = decodeRecording(tinyPayload());
  assert.deepEqual([...nodeReleaseSteps(rec)], [-1, 0, 1, -1, -1]);
});

test("stepTime finds the step's first timeline point", () => {
  const rec = decodeRecording(tinyPayload());
  assert.equal(stepTime(rec, 1), 0.011);
  assert.equal(stepTime(rec, 0), 0.01);
});

test("no steps: no state", () => {
  const p = tinyPayload();
  p.steps = { node: [], backward: [], start: [], duration: [], live_before: [], live_after: [], freed: [] };
  assert.equal(stepState(decodeRecording(p), 0), null);
});
