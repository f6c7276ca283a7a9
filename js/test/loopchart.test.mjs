import assert from "node:assert/strict";
import { test } from "node:test";
import { IterationRows, MAX_POINTS } from "../src/loopchart.js";

function cols(from, n, peak) {
  const index = Array.from({ length: n }, (_, k) => from + k);
  return { index, duration: index.map(() => 0.01), peak: index.map(peak), start: index.map(() => 0), end: index.map(() => 5), saved: index.map(() => 1) };
}

test("rows arrive in pieces and keep their order", () => {
  const rows = new IterationRows(cols(0, 3, (i) => 10 * i));
  rows.append(cols(3, 2, (i) => 10 * i));
  assert.deepEqual(rows.cols.index, [0, 1, 2, 3, 4]);
  assert.deepEqual(rows.range(), [0, 40]);
});

test("past MAX_POINTS rows are thinned, the highest peak of each pair kept", () => {
  const n = MAX_POINTS + 10;
  const spike = 1234;
  const rows = new IterationRows(cols(0, n, (i) => (i === spike ? 1e9 : i % 7)));
  assert.ok(rows.length <= MAX_POINTS);
  assert.equal(Math.max(...rows.cols.peak), 1e9); // the envelope's top stays
  assert.ok(rows.cols.index.includes(spike));
  assert.equal(rows.cols.index[rows.length - 1], n - 1); // the last row stays
});

test("memory not measured yet (-1) gives no range", () => {
  const rows = new IterationRows(cols(0, 4, () => -1));
  rows.cols.end = rows.cols.end.map(() => -1);
  assert.equal(rows.range(), null);
});
