// Colours: nodes by saved bytes (log scale), orders and states. Pure.

const STOPS = [
  [255, 247, 214],
  [253, 203, 110],
  [240, 120, 60],
  [190, 30, 45],
];

export const COLORS = {
  empty: "#eef2f7",
  leaf: "#dbeafe",
  edge: "#9aa5b1",
  text: "#1f2933",
  order1: "#7c3aed",
  order2: "#ea580c",
  border: "#52606d",
  selected: "#2563eb",
  current: "#16a34a",
  group: "#f5f7fa",
};

/** Fill colour for `bytes` saved out of the largest node's `max` (log scale). */
export function bytesColor(bytes, max) {
  if (!bytes || bytes <= 0 || !max || max <= 0) return COLORS.empty;
  const f = max <= 1 ? 1 : Math.min(1, Math.max(0, Math.log1p(bytes) / Math.log1p(max)));
  const pos = f * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(pos));
  const t = pos - i;
  const c = STOPS[i].map((v, k) => Math.round(v + (STOPS[i + 1][k] - v) * t));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

/** Outline of a node by its order: forward (0), created by create_graph (1), the level after (2+). */
export function orderStroke(order) {
  if (order >= 2) return { color: COLORS.order2, width: 3, dash: [2, 2] };
  if (order === 1) return { color: COLORS.order1, width: 3, dash: [6, 3] };
  return { color: COLORS.border, width: 1, dash: [] };
}

/** Black or white, whichever reads better on the fill colour `rgb` ("rgb(r,g,b)" or "#rrggbb"). */
export function textOn(fill) {
  let r;
  let g;
  let b;
  const m = /^rgb\((\d+),(\d+),(\d+)\)$/.exec(fill);
  if (m) [r, g, b] = [Number(m[1]), Number(m[2]), Number(m[3])];
  else if (/^#[0-9a-f]{6}$/i.test(fill)) [r, g, b] = [1, 3, 5].map((i) => parseInt(fill.slice(i, i + 2), 16));
  else return COLORS.text;
  const lum = (0.299 * r + 0.587 * g + 0.114 * b) / 255;
  return lum < 0.55 ? "#ffffff" : COLORS.text;
}
