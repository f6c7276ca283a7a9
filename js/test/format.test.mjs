import assert from "node:assert/strict";
import { test } from "node:test";
import { comparisonHeadline, escapePlotly, formatBytes, formatError, formatSeconds, naturalCompare, truncate, truncateStart, wrapPieces } from "../src/format.js";
import { axisText, hoverTexts } from "../src/series.js";

test("formatBytes matches gradscope.recording.format_bytes", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1023), "1023 B");
  assert.equal(formatBytes(1024), "1.0 KiB");
  assert.equal(formatBytes(1536), "1.5 KiB");
  assert.equal(formatBytes(9 * 1024 * 1024), "9.0 MiB");
  assert.equal(formatBytes(-2048), "-2.0 KiB");
  assert.equal(formatBytes(3 * 1024 ** 5), "3072.0 TiB");
  assert.equal(formatBytes(null), "n/a");
});

test("formatSeconds picks the unit", () => {
  assert.equal(formatSeconds(0.0000123), "12.3 µs");
  assert.equal(formatSeconds(0.0123), "12.3 ms");
  assert.equal(formatSeconds(2.5), "2.50 s");
  assert.equal(formatSeconds(null), "n/a");
});

test("formatError keeps exact zero", () => {
  assert.equal(formatError(0), "0");
  assert.equal(formatError(0.000123), "1.23e-4");
  assert.equal(formatError(null), "n/a");
});

test("escapePlotly turns markup into entities", () => {
  assert.equal(escapePlotly("<img src=x onerror=alert(1)>"), "&lt;img src=x onerror=alert(1)&gt;");
  assert.equal(escapePlotly("a & b"), "a &amp; b");
});

test("truncate adds an ellipsis only when needed", () => {
  assert.equal(truncate("abcdef", 4), "abc…");
  assert.equal(truncate("abc", 4), "abc");
  assert.equal(truncate("abc", 1), "…");
});

test("truncateStart keeps the end of a parameter name", () => {
  assert.equal(truncateStart("layers.0.self_attn.in_proj_weight", 15), "…in_proj_weight");
  assert.equal(truncateStart("w", 15), "w");
});

test("naturalCompare counts like people: G.2 before G.10", () => {
  const names = ["G.11", "G.1", "G.2", "G.10", "(no module)", "G.13", "G.0", "G.1.weight", "H.0"];
  assert.deepEqual(names.sort(naturalCompare), ["(no module)", "G.0", "G.1", "G.1.weight", "G.2", "G.10", "G.11", "G.13", "H.0"]);
  assert.equal(naturalCompare("layer.01", "layer.1"), 1);
  assert.equal(naturalCompare("a", "a"), 0);
});

test("wrapPieces: names break at their joints, never inside a word", () => {
  assert.deepEqual(wrapPieces("parameter (G.0.weight)"), ["parameter ", "(G.", "0.", "weight)"]);
  assert.deepEqual(wrapPieces("_saved_mat2"), ["_saved_", "mat2"]);
  assert.deepEqual(wrapPieces("TanhBackwardBackward0"), ["TanhBackwardBackward0"]);
  assert.deepEqual(wrapPieces("Ünïcödé.模块.🙂"), ["Ünïcödé.", "模块.", "🙂"]);
  // no joint at all: cut into pieces of `max` characters (emoji kept whole), nothing lost
  const long = "x".repeat(50);
  assert.deepEqual(wrapPieces(long, 24), ["x".repeat(24), "x".repeat(24), "xx"]);
  assert.deepEqual(wrapPieces("🙂".repeat(3), 2), ["🙂🙂", "🙂"]);
  for (const s of ["a.b_c d", "", "...", long]) assert.equal(wrapPieces(s).join(""), s);
});

const M = 1048576;
function cmpPayload(rows, recPeak) {
  return {
    reference: "create_graph",
    rows,
    recordings: rows.map((r, i) => (i === 0 && recPeak ? { peak: recPeak, summary: { baseline_bytes: 24 * M }, category_labels: { create_graph: "saved by create_graph nodes", activation: "saved activations" } } : null)),
  };
}

test("comparisonHeadline: the winner against the reference, the unusable, what holds memory", () => {
  const rows = [
    { name: "create_graph", status: "ok", peak_bytes: 9.5 * M, peak_ratio: 1, time_ratio: 1, max_abs_error: 0, stale: false },
    { name: "forward_ad", status: "ok", peak_bytes: 1.1 * M, peak_ratio: 1.1 / 9.5, time_ratio: 0.69, max_abs_error: 0, stale: false },
    { name: "split", status: "wrong", peak_bytes: 0.5 * M, peak_ratio: 0.5 / 9.5, max_abs_error: null, message: "output is None", stale: false },
  ];
  const h = comparisonHeadline(cmpPayload(rows, { bytes: 9.5 * M, breakdown: { activation: 3.5 * M, create_graph: 6 * M } }));
  assert.equal(
    h.winner,
    "Lowest peak: forward_ad, 1.1 MiB at once instead of create_graph's 9.5 MiB (0.12×), same result (max abs error 0), time 0.69×. Not usable: split is wrong (output is None).",
  );
  assert.equal(
    h.holder,
    "What holds memory at create_graph's peak (9.5 MiB in the block, on top of 24.0 MiB of parameters and inputs from before): saved by create_graph nodes 6.0 MiB · saved activations 3.5 MiB.",
  );
  // a stale row never wins; the reference itself can
  rows[1].stale = true;
  assert.equal(comparisonHeadline(cmpPayload(rows.slice(0, 2), null)).winner, "Lowest peak: create_graph (the reference), 9.5 MiB at once.");
  assert.deepEqual(comparisonHeadline({ rows: [], recordings: [] }), { winner: null, holder: null });
});

test("hover on a timeline drawn on its baseline names the value on the axis", () => {
  const tl = { t: [0, 1], live: [M, 2 * M], label: ["a", "b"], module: [null, null], phase: ["forward", "backward"], step: [null, 0], categories: [] };
  assert.equal(hoverTexts(tl, {}, 0)[1], "b<br>2.0 MiB live · backward · step 1");
  assert.equal(hoverTexts(tl, {}, 24 * M)[1], "b<br>26.0 MiB on the axis: 2.0 MiB live in the block + 24.0 MiB from before it<br>backward · step 1");
  assert.equal(axisText(M, 0), "1.0 MiB on the axis: 1.0 MiB live in the block + 0 B from before it");
});
