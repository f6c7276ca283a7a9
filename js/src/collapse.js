// Collapse by module: which boxes are drawn and where, given the set of expanded modules.
// Pure functions over the layout Python computed (gradscope.layout); no DOM.
//
// Boxes nest (see NOTE [ nested folding ] in gradscope/_views/layout.py): a box's content holds its own
// nodes and its child boxes, laid out in Python relative to the content's top-left corner. A
// collapsed module is one box. Expanding it replaces the box by a frame holding its content and
// pushes the rest of its parent's content aside: everything below the box moves down by the
// extra height, and boxes in the same row move sideways by half the extra width. Expansions apply
// top to bottom, innermost contents first, so an open box inside an open box grows its parent.

const GAP = 20;
const PAD = 24; // room between a frame's border and its content (gradscope._views.layout._INNER_PAD)
export const AUTO_OPEN_MAX = 14; // the first view opens modules while it shows at most this many boxes

function structure(graph) {
  const G = graph.groups;
  const nGroups = G.key.length;
  const parent = G.parent || new Array(nGroups).fill(-1);
  const own = Array.from({ length: nGroups + 1 }, () => []);
  const kids = Array.from({ length: nGroups + 1 }, () => []);
  for (let i = 0; i < graph.x.length; i++) own[graph.group[i] + 1].push(i);
  for (let g = 0; g < nGroups; g++) kids[parent[g] + 1].push(g);
  return { parent, own, kids };
}

/** Groups `g` and its ancestors (innermost first). */
export function ancestors(graph, g) {
  const parent = graph.groups.parent;
  const out = [];
  for (let k = g; k >= 0; k = parent ? parent[k] : -1) out.push(k);
  return out;
}

/** Group `g` and every group inside it. */
export function descendants(graph, g) {
  const parent = graph.groups.parent;
  const out = [];
  for (let k = 0; k < graph.groups.key.length; k++) {
    for (let a = k; a >= 0; a = parent ? parent[a] : -1) {
      if (a === g) {
        out.push(k);
        break;
      }
    }
  }
  return out;
}

/**
 * The modules the first view opens: a box holding at least half of the graph (the model's body,
 * not its embeddings; never a box of repeated blocks: one of its blocks is what a reader opens),
 * biggest first, while the drawing shows at most `max` boxes.
 */
export function autoOpen(graph, max = AUTO_OPEN_MAX) {
  const G = graph.groups;
  const { own, kids } = structure(graph);
  const open = new Set();
  let shown = own[0].length + kids[0].length;
  const repeat = G.repeat || [];
  for (;;) {
    let best = -1;
    for (let g = 0; g < G.key.length; g++) {
      if (open.has(g) || (repeat[g] || 1) > 1 || 2 * G.count[g] < graph.x.length) continue;
      const p = G.parent ? G.parent[g] : -1;
      if (p >= 0 && !open.has(p)) continue;
      const more = own[g + 1].length + kids[g + 1].length - 1;
      if (shown + more > max) continue;
      if (best < 0 || G.count[g] > G.count[best]) best = g;
    }
    if (best < 0) return open;
    open.add(best);
    shown += own[best + 1].length + kids[best + 1].length - 1;
  }
}

/**
 * Visible boxes for a graph payload and a set of expanded group indexes.
 *
 * Returns { items, edges, itemOfNode, bounds }:
 *   items: [{ kind: "node" | "group" | "frame", id, x, y, w, h }] (centres, pixels);
 *     id is a node id for "node", a group index for "group" and "frame".
 *     Frames come before what they hold, so hit-testing in reverse finds the innermost first.
 *   edges: flat [a0, b0, a1, b1, ...] item indexes, deduplicated, without self-loops.
 *   itemOfNode: for each node, the item that shows it (the folded box holding it, if any).
 */
export function visibleLayout(graph, edges, expanded) {
  const n = graph.x.length;
  const G = graph.groups;
  const nGroups = G.key.length;
  const nodeW = graph.node_w;
  const nodeH = graph.node_h;
  const { parent, own, kids } = structure(graph);

  // Units of one content move as a whole: a node, a folded box, or an open box's frame + items.
  const build = (c) => {
    const units = [];
    for (const i of own[c]) units.push({ kind: "node", id: i, x: graph.x[i], y: graph.y[i], w: nodeW, h: nodeH, inner: null });
    const unitOf = new Map();
    for (const g of kids[c]) {
      unitOf.set(g, units.length);
      units.push({ kind: "group", id: g, x: G.x[g], y: G.y[g], w: G.w[g], h: G.h[g], inner: null });
    }
    const order = kids[c].filter((g) => expanded.has(g)).sort((a, b) => G.y[a] - G.y[b] || G.x[a] - G.x[b] || a - b);
    for (const g of order) {
      const u = units[unitOf.get(g)];
      const inner = flatten(build(g + 1));
      let iw = Math.max(G.iw[g], u.w);
      let ih = Math.max(G.ih[g], u.h);
      if (kids[g + 1].some((k) => expanded.has(k))) {
        // inner boxes opened: the content grew; keep PAD around it
        const b = boundsOf(inner);
        const sx = b.minX < PAD ? PAD - b.minX : 0;
        if (sx) for (const it of inner) it.x += sx;
        iw = Math.max(iw, b.maxX + sx + PAD);
        ih = Math.max(ih, b.maxY + PAD);
      }
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
      // The group becomes a frame with its content placed inside.
      const left = u.x - iw / 2;
      u.kind = "frame";
      u.y = top + ih / 2;
      u.w = iw;
      u.h = ih;
      for (const it of inner) {
        it.x += left;
        it.y += top;
      }
      u.inner = inner;
    }
    return units;
  };

  const items = flatten(build(0));
  const itemOfNode = new Int32Array(n).fill(-1);
  const itemOfGroup = new Int32Array(nGroups).fill(-1);
  items.forEach((it, idx) => {
    if (it.kind === "node") itemOfNode[it.id] = idx;
    else if (it.kind === "group") itemOfGroup[it.id] = idx;
  });
  for (let i = 0; i < n; i++) {
    if (itemOfNode[i] >= 0) continue;
    for (let g = graph.group[i]; g >= 0; g = parent[g]) if (itemOfGroup[g] >= 0) itemOfNode[i] = itemOfGroup[g];
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

/** Items of units in drawing order: each frame before what it holds. */
function flatten(units) {
  const out = [];
  for (const u of units) {
    out.push({ kind: u.kind, id: u.id, x: u.x, y: u.y, w: u.w, h: u.h });
    if (u.inner) for (const it of u.inner) out.push(it);
  }
  return out;
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
