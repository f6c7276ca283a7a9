// A CUDA memory snapshot's payload (gradscope._views.snapshot_payload.snapshot_payload), decoded, and
// the questions its view asks about one moment. Pure: no DOM, no Plotly.

/** "/home/u/proj/train.py" -> "train.py" ("pkg/__init__.py" keeps its folder), like Python's _short_file. */
export function shortFile(path) {
  const parts = String(path).replace(/\\/g, "/").replace(/\/+$/, "").split("/");
  const base = parts[parts.length - 1] || String(path);
  if ((base === "__init__.py" || base === "__main__.py") && parts.length > 1) return `${parts[parts.length - 2]}/${base}`;
  return base;
}

/** "train.py:57 train_step" for a frame. */
export function frameLabel(f) {
  return `${shortFile(f.file)}:${f.line} ${f.name}`;
}

/** Turn the payload into arrays and objects the view reads. */
export function decodeSnapshot(p) {
  const S = p.strings || [];
  const F = p.frames;
  const frames = F.line.map((line, i) => ({ file: S[F.file[i]], line, name: S[F.name[i]], folded: !!F.folded[i] }));
  const stacks = p.stacks.map((ids) => ids.map((k) => frames[k]));
  const B = p.blocks;
  const blocks = B.size.map((size, i) => ({
    row: i,
    size,
    stream: B.stream[i],
    address: B.address[i],
    allocAt: B.alloc_at[i],
    freeAt: B.free_at[i] < 0 ? null : B.free_at[i],
    frames: stacks[B.stack[i]],
    depth: B.depth[i],
    line: S[B.line[i]],
    role: B.role ? S[B.role[i]] : "",
  }));
  const groupings = {};
  for (const [g, v] of Object.entries(p.groupings)) groupings[g] = { names: v.names.map((k) => S[k]), bytes: v.bytes };
  return {
    label: p.label || "",
    summary: p.summary,
    positions: p.positions,
    t: p.t,
    total: p.total,
    reserved: p.reserved,
    groupings,
    group: p.group || "line",
    moments: p.moments,
    blocks,
    peak: p.peak,
    oom: p.oom,
    ooms: p.ooms || [],
    defaultIndex: Math.min(Math.max(p.default || 0, 0), Math.max(p.positions.length - 1, 0)),
    diagnosis: p.diagnosis,
    notes: p.notes || [],
  };
}

/** Index of the value in sorted `xs` nearest to `x` (the earlier one on a tie); -1 when empty. */
export function nearestIndex(xs, x) {
  if (!xs.length) return -1;
  let lo = 0;
  let hi = xs.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  if (lo > 0 && Math.abs(xs[lo - 1] - x) <= Math.abs(xs[lo] - x)) return lo - 1;
  return lo;
}

/** x of each sampled moment: seconds since the trace's first event, or its trace position. */
export function snapshotX(snap, mode) {
  if (mode === "time" && snap.t) return snap.t;
  return snap.positions;
}

/** Whether the trace has times (so that a time axis can be offered). */
export function hasTimes(snap) {
  return !!snap.t && snap.t.length > 0;
}

/**
 * What the view says about moment k: its position and time, allocated and reserved bytes, how
 * many blocks were live, the largest ones (decoded blocks) and what the others add up to, and
 * the bytes by group (non-zero, largest first) in the chosen grouping.
 */
export function moment(snap, k, grouping = snap.group) {
  const n = snap.positions.length;
  const i = Math.min(Math.max(k, 0), n - 1);
  const ids = snap.moments.blocks[i] || [];
  const shown = ids.map((r) => snap.blocks[r]);
  const shownBytes = shown.reduce((a, b) => a + b.size, 0);
  const count = snap.moments.counts[i] || 0;
  const g = snap.groupings[grouping] || snap.groupings.line;
  const byGroup = [];
  g.names.forEach((name, j) => {
    const b = g.bytes[j][i];
    if (b) byGroup.push([name, b]);
  });
  // largest first; "(other)", the groups beyond the top ones together, always last
  const rank = (e) => (e[0] === "(other)" ? 1 : 0);
  byGroup.sort((a, b) => rank(a) - rank(b) || b[1] - a[1] || (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  return {
    index: i,
    position: snap.positions[i],
    t: snap.t ? snap.t[i] : null,
    allocated: snap.total[i],
    reserved: snap.reserved[i],
    count,
    blocks: shown,
    restCount: Math.max(0, count - shown.length),
    restBytes: Math.max(0, snap.total[i] - shownBytes),
    byGroup,
    isOom: snap.ooms.includes(i),
    isPeak: snap.peak && snap.peak.index === i,
  };
}

/** The frames of a block to show: the user's, with those of PyTorch, the standard library, installed
 * packages and C++ folded into a count between them. */
export function visibleFrames(frames) {
  const out = [];
  let hidden = 0;
  for (const f of frames) {
    if (f.folded) {
      hidden++;
      continue;
    }
    if (hidden) out.push({ hidden });
    hidden = 0;
    out.push(f);
  }
  if (hidden) out.push({ hidden });
  return out;
}

/** "event 1234 (2.350 s)" for a moment. */
export function momentText(m) {
  const where = m.position < 0 ? "before the first trace event" : `trace event ${m.position.toLocaleString("en-US")}`;
  return m.t === null || m.t === undefined || m.position < 0 ? where : `${where} (${m.t.toFixed(3)} s)`;
}
