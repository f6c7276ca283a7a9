import assert from "node:assert/strict";
import { test } from "node:test";
import { fitView, hitTest, initialView, panBy, toScreen, toWorld, zoomAt } from "../src/viewport.js";

test("fitView centres the bounds", () => {
  const v = fitView({ minX: 0, minY: 0, maxX: 100, maxY: 50 }, 220, 220, 10, 10);
  assert.equal(v.scale, 2);
  assert.deepEqual(toScreen(v, 50, 25), { x: 110, y: 110 });
});

test("zoomAt keeps the point under the cursor", () => {
  const v0 = { scale: 1, tx: 10, ty: 20 };
  const before = toWorld(v0, 200, 100);
  const v1 = zoomAt(v0, 2, 200, 100);
  assert.equal(v1.scale, 2);
  const after = toWorld(v1, 200, 100);
  assert.ok(Math.abs(after.x - before.x) < 1e-9 && Math.abs(after.y - before.y) < 1e-9);
});

test("zoom is clamped", () => {
  assert.equal(zoomAt({ scale: 3, tx: 0, ty: 0 }, 100, 0, 0).scale, 4);
});

test("panBy moves the translation only", () => {
  assert.deepEqual(panBy({ scale: 2, tx: 1, ty: 1 }, 5, -3), { scale: 2, tx: 6, ty: -2 });
});

test("initialView keeps a tall graph legible and shows its top", () => {
  const b = { minX: 0, minY: 0, maxX: 200, maxY: 20000 };
  const v = initialView(b, 800, 400, 20, 0.55);
  assert.equal(v.scale, 0.55);
  assert.equal(toScreen(v, 0, 0).y, 20);
  const small = initialView({ minX: 0, minY: 0, maxX: 100, maxY: 100 }, 800, 400);
  assert.equal(small.scale, 1.2);
});

test("hitTest: nodes anywhere, frames on the header only, later items first", () => {
  const items = [
    { kind: "frame", id: 0, x: 100, y: 100, w: 200, h: 200 },
    { kind: "node", id: 7, x: 100, y: 100, w: 50, h: 20 },
  ];
  assert.equal(hitTest(items, 100, 100), 1);
  assert.equal(hitTest(items, 10, 10), 0);
  assert.equal(hitTest(items, 10, 150), -1);
  assert.equal(hitTest(items, 500, 500), -1);
});

test("initialView fits a modest graph whole when labels stay legible", () => {
  const v = initialView({ minX: 0, minY: 0, maxX: 800, maxY: 560 }, 840, 440);
  assert.ok(v.scale >= 0.6 && v.scale < 0.9);
  const top = toScreen(v, 0, 0);
  const bottom = toScreen(v, 800, 560);
  assert.ok(top.x >= 0 && top.y >= 0 && bottom.x <= 840 && bottom.y <= 440);
});
