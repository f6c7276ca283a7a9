import assert from "node:assert/strict";
import { test } from "node:test";
import { escapePlotly, formatBytes, formatError, formatSeconds, truncate, truncateStart } from "../src/format.js";

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
