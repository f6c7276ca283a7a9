import assert from "node:assert/strict";
import { test } from "node:test";
import { boxCount, groupBytes, visibleLayout } from "../src/collapse.js";
import { tinyPayload } from "./fixtures.mjs";

function twoGroups() {
  // Two modules side by side in one row (y=100), a loose node below (y=300) and one above (y=20).
  return {
    node_w: 150,
    node_h: 30,
    x: [50, 60, 70, 80, 300, 150],
    y: [40, 100, 40, 100, 300, 20],
    group: [0, 0, 1, 1, -1, -1],
    groups: { key: ["left", "right"], count: [2, 2], x: [100, 400], y: [100, 100], w: [190, 190], h: [44, 44], iw: [400, 300], ih: [300, 200] },
  };
}

test("collapsed: one box per module plus loose nodes", () => {
  const g = twoGroups();
  const v = visibleLayout(g, [0, 1, 1, 4, 2, 3, 3, 4, 5, 0, 5, 2], new Set());
  assert.equal(boxCount(v.items), 4);
  assert.deepEqual(v.items.map((i) => i.kind), ["node", "node", "group", "group"]);
  // Edges inside a module vanish; edges between the same two boxes are merged.
  const pairs = [];
  for (let k = 0; k < v.edges.length; k += 2) pairs.push([v.items[v.edges[k]].kind + v.items[v.edges[k]].id, v.items[v.edges[k + 1]].kind + v.items[v.edges[k + 1]].id]);
  assert.deepEqual(pairs.sort(), [["group0", "node4"], ["group1", "node4"], ["node5", "group0"], ["node5", "group1"]].sort());
  assert.equal(v.itemOfNode[0], v.itemOfNode[1]);
});

test("expanding a module places its nodes and pushes the rest aside", () => {
  const g = twoGroups();
  const v = visibleLayout(g, [0, 1], new Set([0]));
  assert.equal(boxCount(v.items), 5); // 2 nodes of "left", group "right", 2 loose nodes
  const frame = v.items.find((i) => i.kind === "frame");
  assert.deepEqual([frame.x, frame.y, frame.w, frame.h], [100, 78 + 150, 400, 300]);
  const n0 = v.items[v.itemOfNode[0]];
  assert.deepEqual([n0.kind, n0.x, n0.y], ["node", 100 - 200 + 50, 78 + 40]);
  // The other module (same row, to the right) moved right by half the extra width plus a gap.
  const right = v.items.find((i) => i.kind === "group");
  assert.equal(right.x, 400 + (400 - 190) / 2 + 20);
  // The node below moved down by the extra height plus a gap; the node above did not move.
  assert.equal(v.items[v.itemOfNode[4]].y, 300 + (300 - 44) + 20);
  assert.equal(v.items[v.itemOfNode[5]].y, 20);
  // The edge between the module's nodes is now drawn.
  assert.deepEqual(v.edges, [v.itemOfNode[0], v.itemOfNode[1]]);
});

test("expanding both modules keeps them apart", () => {
  const g = twoGroups();
  const v = visibleLayout(g, [], new Set([0, 1]));
  const frames = v.items.filter((i) => i.kind === "frame");
  assert.equal(frames.length, 2);
  const [a, b] = frames;
  assert.ok(a.x + a.w / 2 <= b.x - b.w / 2, `frames overlap: ${JSON.stringify(frames)}`);
  assert.equal(boxCount(v.items), 6);
});

test("payload graph: collapsed and expanded counts", () => {
  const p = tinyPayload();
  assert.equal(boxCount(visibleLayout(p.levels[0], p.edges, new Set()).items), 3);
  assert.equal(boxCount(visibleLayout(p.levels[0], p.edges, new Set([0])).items), 5);
  assert.deepEqual(groupBytes(p.levels[0], p.nodes.saved_bytes), [768]);
});

test("unknown group indexes are ignored", () => {
  const p = tinyPayload();
  assert.equal(boxCount(visibleLayout(p.levels[0], p.edges, new Set([7, -1])).items), 3);
});
