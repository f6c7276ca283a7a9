import assert from "node:assert/strict";
import { test } from "node:test";
import { bytesColor, COLORS, orderStroke } from "../src/color.js";
import { decodeRecording, modulesBySavedBytes, nodeLabel } from "../src/data.js";
import { argmax, hoverTexts, phaseRuns } from "../src/series.js";
import { tinyPayload } from "./fixtures.mjs";

test("decodeRecording resolves the string table", () => {
  const rec = decodeRecording(tinyPayload());
  assert.equal(rec.nodes.length, 5);
  assert.equal(rec.nodes[4].leaf, "a.weight");
  assert.equal(rec.nodes[4].leafShape, "4 × 8");
  assert.equal(rec.nodes[0].module, null);
  assert.equal(nodeLabel(rec.nodes[4]), "a.weight");
  assert.equal(nodeLabel(rec.nodes[1]), "MmBackward0");
  assert.deepEqual(rec.savedByNode, [[], [0], [1], [2], []]);
  assert.equal(rec.saved[1].attribute, "result");
  assert.equal(rec.saved[2].freedAt, null);
  assert.deepEqual(rec.timeline.phase, ["forward", "forward", "backward", "backward", "backward"]);
});

test("modulesBySavedBytes counts each storage once per module", () => {
  const rec = decodeRecording(tinyPayload());
  assert.deepEqual(modulesBySavedBytes(rec.saved), [["a", 768], ["b", 512]]);
});

test("phaseRuns and argmax", () => {
  assert.deepEqual(phaseRuns([0, 1, 2, 3], ["forward", "forward", "backward", "backward"]), [["forward", 0, 2], ["backward", 2, 3]]);
  assert.deepEqual(phaseRuns([], []), []);
  assert.equal(argmax([1, 5, 5, 2]), 1);
  assert.equal(argmax([]), -1);
});

test("hover text names the op and escapes markup", () => {
  const rec = decodeRecording(tinyPayload());
  rec.timeline.label[0] = "<b>x</b>";
  const t = hoverTexts(rec.timeline);
  assert.equal(t[0], "&lt;b&gt;x&lt;/b&gt; · a<br>256 B live · forward<br>  activation: 256 B");
  // steps are numbered from 1 everywhere: the data's step 1 is "step 2", as on the slider
  assert.equal(t[3], "MmBackward0 · b<br>1.6 KiB live · backward · step 2<br>  activation: 768 B<br>  other: 832 B");
});

test("colours: zero bytes is the empty colour, more bytes is darker", () => {
  assert.equal(bytesColor(0, 100), COLORS.empty);
  assert.equal(bytesColor(100, 100), "rgb(190,30,45)");
  assert.notEqual(bytesColor(10, 100), bytesColor(100, 100));
  assert.equal(orderStroke(1).color, COLORS.order1);
  assert.equal(orderStroke(2).color, COLORS.order2);
  assert.equal(orderStroke(0).width, 1);
});

test("naturalCompare orders layer numbers as numbers", async () => {
  const { naturalCompare } = await import("../src/data.js");
  assert.deepEqual(["layers.10", "layers.2", "layers.1", "a"].sort(naturalCompare), ["a", "layers.1", "layers.2", "layers.10"]);
  assert.equal(naturalCompare("x", "x"), 0);
});

test("textOn picks white on dark fills", async () => {
  const { textOn } = await import("../src/color.js");
  assert.equal(textOn("rgb(190,30,45)"), "#ffffff");
  assert.equal(textOn("rgb(255,247,214)"), COLORS.text);
  assert.equal(textOn("#dbeafe"), COLORS.text);
});

test("findNodes matches class, parameter and module, biggest savers first", async () => {
  const { findNodes } = await import("../src/data.js");
  const rec = decodeRecording(tinyPayload());
  assert.deepEqual(findNodes(rec.nodes, "mm"), [1, 3]);
  assert.deepEqual(findNodes(rec.nodes, "A.WEIGHT"), [4]);
  assert.deepEqual(findNodes(rec.nodes, "relu"), [2]);
  assert.deepEqual(findNodes(rec.nodes, "backward").length, 4); // every class but AccumulateGrad
  assert.deepEqual(findNodes(rec.nodes, "  "), []);
});

test("decodeRecording reads the figures, modules, levels and categories", () => {
  const rec = decodeRecording(tinyPayload());
  assert.equal(rec.nodes[1].actBytes, 512);
  assert.equal(rec.nodes[1].largest, "16 × 8");
  assert.equal(rec.nodes[1].alive, null);
  assert.deepEqual(rec.modules, [
    { name: "a", alive: null, act: 768 },
    { name: "b", alive: null, act: 512 },
  ]);
  assert.equal(rec.levels.length, 1);
  assert.equal(rec.level, 0);
  assert.deepEqual(rec.timeline.categories, ["activation", "other"]);
  // the categories add up to the live bytes at every point
  rec.timeline.live.forEach((v, i) => assert.equal(rec.timeline.byCategory[0][i] + rec.timeline.byCategory[1][i], v));
  assert.equal(rec.backwardCalls.length, 1);
});

test("a payload with four phases names them all", () => {
  const p = tinyPayload();
  p.timeline.phase = [0, 1, 2, 3, 3];
  assert.deepEqual(decodeRecording(p).timeline.phase, ["forward", "backward", "optimizer", "other", "other"]);
});

test("a single category is the live bytes, sent once", () => {
  const p = tinyPayload();
  p.timeline.categories = ["other"];
  p.timeline.by_category = [];
  assert.deepEqual(decodeRecording(p).timeline.byCategory, [p.timeline.live]);
});
