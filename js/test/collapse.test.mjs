import assert from "node:assert/strict";
import { test } from "node:test";
import { ancestors, autoOpen, boxCount, descendants, groupBytes, visibleLayout } from "../src/collapse.js";
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

function nested() {
  // Box 0 ("enc") holds node 0 and box 1 ("enc.layer"), which holds nodes 1 and 2; box 2 is a
  // repeat box at the top holding box 3; node 3 is loose at the top, below both.
  return {
    node_w: 150,
    node_h: 30,
    x: [100, 100, 100, 200, 100],
    y: [60, 60, 140, 400, 60],
    group: [0, 1, 1, -1, 3],
    groups: {
      key: ["enc", "enc.layer", "rep.0 – rep.1", "rep.0"],
      label: ["enc", "layer", "rep.0 – rep.1 (×2)", "rep.0"],
      parent: [-1, 0, -1, 2],
      repeat: [1, 1, 2, 1],
      count: [3, 2, 1, 1],
      x: [100, 120, 400, 120],
      y: [100, 140, 100, 60],
      w: [190, 190, 190, 190],
      h: [50, 50, 50, 50],
      iw: [260, 250, 240, 240],
      ih: [220, 200, 120, 120],
    },
  };
}

test("nested boxes: an open box holds its nodes and its inner boxes, which open inside it", () => {
  const g = nested();
  const kinds = (v) => v.items.map((i) => `${i.kind}${i.id}`);
  // folded: two boxes and the loose node; opening an inner box alone shows nothing more
  assert.deepEqual(kinds(visibleLayout(g, [0, 1, 1, 2, 2, 3], new Set())), ["node3", "group0", "group2"]);
  assert.deepEqual(kinds(visibleLayout(g, [], new Set([1]))), ["node3", "group0", "group2"]);
  const one = visibleLayout(g, [0, 1, 1, 2, 2, 3], new Set([0]));
  assert.deepEqual(kinds(one), ["node3", "frame0", "node0", "group1", "group2"]);
  const f0 = one.items[1];
  // the frame starts where the box started (top 75) with the content's size
  assert.deepEqual([f0.x, f0.y - f0.h / 2, f0.w, f0.h], [100, 75, 260, 220]);
  const g1 = one.items[3];
  assert.deepEqual([g1.x, g1.y], [100 - 130 + 120, 75 + 140]);
  // nodes 1 and 2 are shown by their folded box
  assert.equal(one.itemOfNode[1], 3);
  assert.equal(one.itemOfNode[2], 3);
  const both = visibleLayout(g, [0, 1, 1, 2, 2, 3], new Set([0, 1]));
  assert.deepEqual(kinds(both), ["node3", "frame0", "node0", "frame1", "node1", "node2", "group2"]);
  const [outer, inner] = [both.items[1], both.items[3]];
  const rect = (it) => [it.x - it.w / 2, it.y - it.h / 2, it.x + it.w / 2, it.y + it.h / 2];
  const inside = (a, b) => a[0] >= b[0] && a[1] >= b[1] && a[2] <= b[2] && a[3] <= b[3];
  assert.ok(inside(rect(inner), rect(outer)), JSON.stringify([inner, outer]));
  for (const k of [4, 5]) assert.ok(inside(rect(both.items[k]), rect(inner)));
  assert.ok(inside(rect(both.items[2]), rect(outer)));
  // the opened inner box grew its parent: the loose node below moved down further
  assert.ok(both.items[0].y > one.items[0].y);
  // the edge between nodes 1 and 2 is drawn now, node 0 -> node 1 too
  const pairs = [];
  for (let k = 0; k < both.edges.length; k += 2) pairs.push([both.items[both.edges[k]].id, both.items[both.edges[k + 1]].id]);
  assert.deepEqual(pairs.slice(0, 2), [[0, 1], [1, 2]]);
});

test("the first view opens the boxes holding half the graph, never a repeat box, within a box budget", () => {
  const g = nested();
  assert.deepEqual([...autoOpen(g)], [0]); // "enc.layer" holds 2 of the 5 nodes: less than half
  assert.deepEqual([...autoOpen(g, 3)], []); // opening "enc" would show 4 boxes
  assert.deepEqual([...autoOpen(g, 4)], [0]);
  assert.deepEqual(ancestors(g, 1), [1, 0]);
  assert.deepEqual(descendants(g, 2), [2, 3]);
});
