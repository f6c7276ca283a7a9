import assert from "node:assert/strict";
import { test } from "node:test";
import { chooseLevel, fitPath, fitText, FULL, labelMode, NAMES, topView, zoomAnchor } from "../src/lod.js";
import { toScreen, toWorld } from "../src/viewport.js";

const box = (w, h) => ({ minX: 0, minY: 0, maxX: w, maxY: h });

test("chooseLevel: a graph that fits whole with full labels opens whole, at most 1:1", () => {
  const pick = chooseLevel([box(600, 300)], 1000, 500);
  assert.equal(pick.level, 0);
  assert.equal(pick.labels, "full");
  assert.equal(pick.view.scale, 1);
});

test("chooseLevel: too wide for names at this width, so the folded level opens", () => {
  // every node is 1100 px wide; in a 560 px canvas that is scale 0.47: not even names;
  // the folded level (600 px wide) fits at 0.87 with full labels: it wins
  const pick = chooseLevel([box(1100, 4300), box(600, 4600)], 560, 520);
  assert.equal(pick.level, 1);
  assert.equal(pick.labels, "full");
  assert.ok(Math.abs(pick.view.scale - 520 / 600) < 1e-9);
  // its top is shown
  assert.equal(toScreen(pick.view, 0, 0).y, 20);
});

test("chooseLevel: wide enough for every node, which opens from its top", () => {
  const pick = chooseLevel([box(1100, 4300), box(600, 4600)], 1000, 520);
  assert.equal(pick.level, 0);
  assert.ok(pick.view.scale >= FULL && pick.view.scale <= 1);
});

test("chooseLevel: a level chosen by its width opens whole where names can still be read", () => {
  // a folded model 600 x 962 in a 624 x 581 canvas: its top at full size would hide the loss at the
  // bottom; whole, it is at 0.56, above NAMES: whole it opens (NOTE [ names at first paint ])
  const pick = chooseLevel([box(600, 962)], 624, 581);
  assert.equal(pick.level, 0);
  assert.equal(pick.labels, "names");
  assert.ok(pick.view.scale >= NAMES && pick.view.scale < FULL);
  assert.ok(toScreen(pick.view, 0, 962).y <= 581 - 20 + 1e-9); // the bottom in the canvas
  // twice as tall, whole would be below NAMES: its top, at a scale with names
  const tall = chooseLevel([box(600, 2000)], 624, 581);
  assert.equal(toScreen(tall.view, 0, 0).y, 20);
  assert.ok(tall.view.scale >= NAMES);
});

test("chooseLevel: a very tall every-node level gives way to a folded one of a few screens", () => {
  const pick = chooseLevel([box(1000, 7600), box(1000, 980)], 1100, 520);
  assert.equal(pick.level, 1);
});

test("chooseLevel: nothing fits: the coarsest level, names-size, from the top left", () => {
  const pick = chooseLevel([box(9000, 400), box(5000, 400)], 800, 500);
  assert.equal(pick.level, 1);
  assert.equal(pick.view.scale, NAMES);
  assert.deepEqual(toScreen(pick.view, 0, 0), { x: 20, y: 20 });
});

test("labelMode: two lines, one line or none by the box's size on screen", () => {
  assert.equal(labelMode(150, 40, 1).mode, "full");
  assert.equal(labelMode(150, 40, 0.5).mode, "name");
  assert.equal(labelMode(150, 40, 0.1).mode, "none");
  assert.ok(labelMode(150, 40, 1).chars >= 20);
});

test("zoomAnchor: the selected node when visible, else the drawing nearest the centre", () => {
  const view = { scale: 1, tx: 0, ty: 0 };
  // a narrow graph at the left of an 800 px screen: the centre (400, 300) is empty space
  const a = zoomAnchor(view, { minX: 0, minY: 0, maxX: 200, maxY: 1000 }, 800, 600);
  assert.deepEqual(a, { x: 200, y: 300 });
  const w = toWorld(view, a.x, a.y);
  assert.ok(w.x <= 200);
  assert.deepEqual(zoomAnchor(view, box(200, 1000), 800, 600, { x: 50, y: 70 }), { x: 50, y: 70 });
  // a focus off screen is ignored
  assert.deepEqual(zoomAnchor(view, box(200, 1000), 800, 600, { x: 50, y: 5000 }), { x: 200, y: 300 });
});

test("topView centres a narrow drawing and starts a wide one at the left", () => {
  assert.equal(toScreen(topView(box(100, 1000), 500, 300, 1), 0, 0).x, 200);
  assert.equal(toScreen(topView(box(1000, 1000), 500, 300, 1), 0, 0).x, 20);
});

test("fitText keeps the start, or the end for parameter names", () => {
  assert.equal(fitText("TanhBackwardBackward0", 10), "TanhBackw…");
  assert.equal(fitText("layers.0.self_attn.in_proj_weight", 10), "layers.0.…");
  assert.equal(fitText("layers.0.self_attn.in_proj_weight", 10, true), "…oj_weight");
  assert.equal(fitText("short", 10), "short");
});

test("a drawing wider than the screen opens on its topmost box, not on empty space", async () => {
  const { boundsWithTop } = await import("../src/lod.js");
  const items = [
    { x: 5000, y: 20, w: 160, h: 40 },
    { x: 100, y: 900, w: 160, h: 40 },
    { x: 9900, y: 900, w: 160, h: 40 },
  ];
  const b = boundsWithTop({ minX: 20, minY: 0, maxX: 9980, maxY: 920 }, items);
  assert.equal(b.topX, 5000);
  const v = topView(b, 800, 500, 0.5);
  assert.equal(toScreen(v, 5000, 0).x, 400); // the top box in the middle of the screen
  // near an edge the view stays within the drawing
  const left = topView({ ...b, topX: 30 }, 800, 500, 0.5);
  assert.equal(toScreen(left, 20, 0).x, 20);
});

test("a path too long for its box loses whole leading components, not letters", () => {
  const fits = (n) => (s) => s.length <= n;
  assert.equal(fitPath("transformer.h.1.ln_2.weight", fits(12)), "ln_2.weight");
  assert.equal(fitPath("transformer.h.1.ln_2.weight", fits(40)), "transformer.h.1.ln_2.weight");
  assert.equal(fitPath("▸ transformer.h.1.mlp.c_proj", fits(14)), "▸ mlp.c_proj");
  assert.equal(fitPath("weight", fits(3)), "weight"); // one word: left to the end cut
  assert.equal(fitPath("h.0 – h.11 (×12)", fits(5)), "h.0 – h.11 (×12)"); // not a path
});
