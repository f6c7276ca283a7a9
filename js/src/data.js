// Decoding the payload that Python sends (gradscope.widget.recording_payload). Pure, no DOM.

/**
 * Turn a recording payload into arrays and lookups the views read.
 * Strings travel once in a table; columns hold indexes into it (-1 or null for "none").
 */
export function decodeRecording(p) {
  const S = p.strings || [];
  const str = (i) => (i === null || i === undefined || i < 0 ? null : S[i]);
  // the user's source lines (gradscope.Recording.lines): labels and whole stacks by line index
  const L = p.lines || { label: [], stack: [] };
  const lines = L.label.map((k, i) => ({ index: i, label: str(k), stack: str(L.stack[i]) }));
  const lineOf = (col, i) => {
    const k = col ? col[i] : -1;
    return k === null || k === undefined || k < 0 || k >= lines.length ? null : lines[k];
  };
  const n = p.nodes.name.length;
  const nodes = [];
  for (let i = 0; i < n; i++) {
    nodes.push({
      id: i,
      name: str(p.nodes.name[i]),
      order: p.nodes.order[i],
      module: str(p.nodes.module[i]),
      leaf: str(p.nodes.leaf[i]),
      leafShape: str(p.nodes.leaf_shape[i]),
      executed: p.nodes.executed[i],
      savedBytes: p.nodes.saved_bytes[i],
      savedCount: p.nodes.saved_count[i],
      actBytes: p.nodes.act_bytes ? p.nodes.act_bytes[i] : 0,
      largest: p.nodes.largest ? str(p.nodes.largest[i]) : null,
      largestKind: p.nodes.largest_kind ? str(p.nodes.largest_kind[i]) : null,
      alive: p.nodes.alive ? p.nodes.alive[i] : null,
      line: lineOf(p.nodes.line, i),
    });
  }
  const m = p.saved.node.length;
  const saved = [];
  const savedByNode = Array.from({ length: n }, () => []);
  for (let i = 0; i < m; i++) {
    const s = {
      index: i,
      node: p.saved.node[i],
      attribute: str(p.saved.attribute[i]),
      shape: str(p.saved.shape[i]),
      dtype: str(p.saved.dtype[i]),
      device: str(p.saved.device[i]),
      bytes: p.saved.bytes[i],
      storage: p.saved.storage[i],
      kind: str(p.saved.kind[i]),
      module: str(p.saved.module[i]),
      name: str(p.saved.name[i]),
      freedAt: p.saved.freed[i],
      line: lineOf(p.saved.line, i),
    };
    saved.push(s);
    if (s.node >= 0 && s.node < n) savedByNode[s.node].push(i);
  }
  const steps = [];
  for (let i = 0; i < p.steps.node.length; i++) {
    steps.push({
      index: i,
      node: p.steps.node[i],
      backward: p.steps.backward[i],
      start: p.steps.start[i],
      duration: p.steps.duration[i],
      liveBefore: p.steps.live_before[i],
      liveAfter: p.steps.live_after[i],
      freedBytes: p.steps.freed[i],
    });
  }
  const tl = p.timeline;
  const phases = p.phases || ["forward", "backward", "optimizer", "other"];
  const timeline = {
    t: tl.t,
    live: tl.live,
    phase: tl.phase.map((k) => phases[k] ?? "other"),
    label: tl.label.map(str),
    module: tl.module.map(str),
    step: tl.step,
    line: tl.t.map((_, i) => lineOf(tl.line, i)),
    reserved: tl.reserved || null,
    dropped: tl.dropped || 0,
    categories: tl.categories || [],
    // a single category is all of live, sent once (gradscope.widget.recording_payload)
    byCategory: tl.categories && tl.categories.length === 1 && !(tl.by_category || []).length ? [tl.live] : tl.by_category || [],
    categoryNote: tl.category_note || null,
  };
  const M = p.modules || { name: [], alive_at_peak: null, saved_activations: [] };
  const modules = M.name.map((k, i) => ({
    name: str(k),
    alive: M.alive_at_peak ? M.alive_at_peak[i] : null,
    act: M.saved_activations[i],
  }));
  const B = p.by_line || { line: [], alive_at_peak: null, saved: [] };
  const byLine = B.line
    .map((k, i) => ({ line: lines[k] || null, alive: B.alive_at_peak ? B.alive_at_peak[i] : null, saved: B.saved[i] }))
    .filter((r) => r.line);
  const lineDefinitions = {
    saved: B.saved_definition || "",
    alive: B.alive_definition || "",
    savedLabel: B.saved_label || "saved",
    aliveLabel: B.alive_label || "alive at peak",
  };
  const levels = p.levels || (p.graph ? [p.graph] : []);
  return {
    label: p.label || "",
    summary: p.summary,
    peak: p.peak,
    nodes,
    edges: p.edges,
    saved,
    savedByNode,
    steps,
    timeline,
    modules,
    lines,
    byLine,
    lineDefinitions,
    levels,
    level: Math.min(p.level || 0, Math.max(0, levels.length - 1)),
    figures: p.figures || {},
    categoryLabels: p.category_labels || {},
    backwardCalls: p.backward_calls || [],
  };
}

/** Figure definitions by name, with a fallback so a view never shows "undefined". */
export function figureOf(rec, name) {
  return rec.figures[name] || { label: name, definition: "" };
}

/** The text a node is drawn with: the parameter name for leaves, the node's class otherwise. */
export function nodeLabel(node) {
  if (node.leaf) return node.leaf;
  return node.name || "?";
}

/** Saved bytes (every kind) per module, each storage counted once per module, largest first (pure). */
export function modulesBySavedBytes(saved) {
  const per = new Map();
  for (const s of saved) {
    const key = s.module ?? "(no module)";
    if (!per.has(key)) per.set(key, new Map());
    per.get(key).set(s.storage, s.bytes);
  }
  const out = [];
  for (const [mod, m] of per) {
    let total = 0;
    for (const b of m.values()) total += b;
    out.push([mod, total]);
  }
  out.sort((a, b) => b[1] - a[1] || naturalCompare(a[0], b[0]));
  return out;
}

/** Compare texts with digit runs as numbers: "layers.2" before "layers.10" (pure). */
export function naturalCompare(a, b) {
  const re = /(\d+)|(\D+)/g;
  const pa = String(a).match(re) || [];
  const pb = String(b).match(re) || [];
  for (let i = 0; i < Math.min(pa.length, pb.length); i++) {
    const x = pa[i];
    const y = pb[i];
    if (x === y) continue;
    const nx = /^\d/.test(x);
    const ny = /^\d/.test(y);
    if (nx && ny && Number(x) !== Number(y)) return Number(x) - Number(y);
    return x < y ? -1 : 1;
  }
  return pa.length - pb.length;
}

/**
 * Node ids whose class, parameter name or module contains `query` (case-insensitive), biggest
 * savers first, then by id. Empty for an empty query (pure).
 */
export function findNodes(nodes, query) {
  const q = String(query).trim().toLowerCase();
  if (!q) return [];
  const out = [];
  for (const n of nodes) {
    const hay = [n.name, n.leaf, n.module].filter((x) => x).join("\u0000").toLowerCase();
    if (hay.includes(q)) out.push(n);
  }
  out.sort((a, b) => b.actBytes - a.actBytes || b.savedBytes - a.savedBytes || a.id - b.id);
  return out.map((n) => n.id);
}
