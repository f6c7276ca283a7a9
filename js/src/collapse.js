// Collapse by module: which boxes are drawn and where, given the set of expanded modules.
// Pure functions over the layout Python computed (gradscope.layout); no DOM.
//
// A collapsed module is one box. Expanding it replaces the box by a frame holding the module's
// own layout (computed in Python, relative to the frame's top-left corner) and pushes the rest
// of the drawing aside: everything below the box moves down by the extra height, and boxes in
// the same row move sideways by half the extra width. Expansions apply top to bottom.

const GAP = 20;

/**
 * Visible boxes for a graph payload and a set of expanded group indexes.
 *
 * Returns { items, edges, itemOfNode, bounds }:
 *   items: [{ kind: "node" | "group" | "frame", id, x, y, w, h }] (centres, pixels);
 *     id is a node id for "node", a group index for "group" and "frame".
 *     Frames come before their nodes, so hit-testing in reverse finds a node first.
 *   edges: flat [a0, b0, a1, b1, ...] item indexes, deduplicated, without self-loops.
 *   itemOfNode: for each node, the item that shows it (its group's box when collapsed).
 */
export function visibleLayout(graph, edges, expanded) {
  const n = graph.x.length;
  const G = graph.groups;
  const nGroups = G.key.length;
  const nodeW = graph.node_w;
  const nodeH = graph.node_h;
  const members = Array.from({ length: nGroups }, () => []);
  // Units move as a whole: a loose node, a collapsed group, or an expanded group's frame + nodes.
  const units = [];
  const unitOfGroup = new Array(nGroups).fill(-1);
  for (let i = 0; i < n; i++) {
    const g = graph.group[i];
    if (g < 0) {
      units.push({ kind: "node", id: i, x: graph.x[i], y: graph.y[i], w: nodeW, h: nodeH, inner: null });
    } else {
      members[g].push(i);
    }
  }
  for (let g = 0; g < nGroups; g++) {
    unitOfGroup[g] = units.length;
    units.push({ kind: "group", id: g, x: G.x[g], y: G.y[g], w: G.w[g], h: G.h[g], inner: null });
  }
  const order = [...expanded]
    .filter((g) => g >= 0 && g < nGroups)
    .sort((a, b) => G.y[a] - G.y[b] || G.x[a] - G.x[b] || a - b);
  for (const g of order) {
    const u = units[unitOfGroup[g]];
    const iw = Math.max(G.iw[g], u.w);
    const ih = Math.max(G.ih[g], u.h);
    const top = u.y - u.h / 2;
    const bottom = u.y + u.h / 2;
    const dy = ih - u.h + GAP;
    const dx = (iw - u.w) / 2 + GAP;
    for (const other of units) {
      if (other === u) continue;
      const oTop = other.y - other.h / 2;
      const oBottom = other.y + other.h / 2;
      let mx = 0;
      let my = 0;
      if (oTop >= bottom - 1e-6) my = dy;
      else if (oBottom > top) mx = other.x >= u.x ? dx : -dx;
      if (mx || my) shiftUnit(other, mx, my);
    }
    // The group becomes a frame with its nodes placed inside.
    const left = u.x - iw / 2;
    u.kind = "frame";
    u.y = top + ih / 2;
    u.w = iw;
    u.h = ih;
    u.inner = members[g].map((i) => ({
      kind: "node",
      id: i,
      x: left + graph.x[i],
      y: top + graph.y[i],
      w: nodeW,
      h: nodeH,
    }));
  }
  const items = [];
  const itemOfNode = new Int32Array(n).fill(-1);
  for (const u of units) {
    const idx = items.length;
    items.push({ kind: u.kind, id: u.id, x: u.x, y: u.y, w: u.w, h: u.h });
    if (u.kind === "node") itemOfNode[u.id] = idx;
    else if (u.kind === "group") for (const i of members[u.id]) itemOfNode[i] = idx;
    else {
      for (const it of u.inner) {
        itemOfNode[it.id] = items.length;
        items.push(it);
      }
    }
  }
  const seen = new Set();
  const out = [];
  for (let k = 0; k + 1 < edges.length; k += 2) {
    const a = itemOfNode[edges[k]];
    const b = itemOfNode[edges[k + 1]];
    if (a < 0 || b < 0 || a === b) continue;
    const key = a * items.length + b;
    if (seen.has(key)) continue;
    seen.add(key);
    out.push(a, b);
  }
  return { items, edges: out, itemOfNode, bounds: boundsOf(items) };
}

function shiftUnit(u, dx, dy) {
  u.x += dx;
  u.y += dy;
  if (u.inner) {
    for (const it of u.inner) {
      it.x += dx;
      it.y += dy;
    }
  }
}

/** Bounding box {minX, minY, maxX, maxY} of items (centres and sizes). */
export function boundsOf(items) {
  if (items.length === 0) return { minX: 0, minY: 0, maxX: 1, maxY: 1 };
  let minX = Infinity;
  let minY = Infinity;
  let maxX = -Infinity;
  let maxY = -Infinity;
  for (const it of items) {
    minX = Math.min(minX, it.x - it.w / 2);
    minY = Math.min(minY, it.y - it.h / 2);
    maxX = Math.max(maxX, it.x + it.w / 2);
    maxY = Math.max(maxY, it.y + it.h / 2);
  }
  return { minX, minY, maxX, maxY };
}

/** Count of drawn boxes that are nodes or collapsed groups (frames are outlines, not boxes). */
export function boxCount(items) {
  let c = 0;
  for (const it of items) if (it.kind !== "frame") c++;
  return c;
}

/** Saved bytes per group (sum of its nodes' saved bytes) for colouring collapsed boxes. */
export function groupBytes(graph, nodeBytes) {
  const out = new Array(graph.groups.key.length).fill(0);
  for (let i = 0; i < graph.group.length; i++) {
    const g = graph.group[i];
    if (g >= 0) out[g] += nodeBytes[i] || 0;
  }
  return out;
}
