// The graph's legend: only what the drawing shows. Pure: returns items; app.js draws them.

import { COLORS } from "./color.js";

/**
 * Legend items for a decoded recording drawn at layout `level` (an entry of rec.levels):
 * [{ key, text, style }] where style is the swatch's CSS.
 */
export function legendItems(rec, level) {
  const items = [];
  const nodes = rec.nodes;
  const groups = level && level.groups ? level.groups.key.length : 0;
  const anyAct = nodes.some((n) => n.actBytes > 0);
  if (anyAct) {
    items.push({
      key: "heat",
      text: "saved activations: few → many bytes (memory allocated in the block)",
      style: "background: linear-gradient(90deg, rgb(255,247,214), rgb(240,120,60), rgb(190,30,45))",
    });
  }
  if (nodes.some((n) => !n.leaf && n.actBytes === 0)) {
    items.push({ key: "none", text: "no new memory saved", style: `background: ${COLORS.empty}` });
  }
  if (nodes.some((n) => n.leaf)) {
    items.push({ key: "leaf", text: "parameter or input (existed before the block)", style: `background: ${COLORS.leaf}` });
  }
  if (nodes.some((n) => n.order === 1)) {
    items.push({ key: "order1", text: "made by create_graph (order 1)", style: `border: 2px dashed ${COLORS.order1}` });
  }
  if (nodes.some((n) => n.order >= 2)) {
    items.push({ key: "order2", text: "made by a second create_graph (order 2)", style: `border: 2px dotted ${COLORS.order2}` });
  }
  if (groups) {
    items.push({ key: "module", text: "module, folded (click to open)", style: "border: 3px double #52606d; background:#fff" });
  }
  if (rec.edges.length) {
    const up = nodes.some((n) => n.order % 2 === 1);
    items.push({
      key: "arrows",
      text: up
        ? "arrows: data flows along them (forward runs down; create_graph nodes run up beside what they differentiate); gradients flow against them"
        : "arrows: data flows along them, forward runs down; gradients flow against them",
      style: "border: 0; background: none",
      arrow: true,
    });
  }
  return items;
}
