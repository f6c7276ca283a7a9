// A job's payload (gradscope.job.job_payload) and the overlay of its ranks' timelines. Pure.

export const RANK_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

export function rankColor(rank) {
  return RANK_COLORS[rank % RANK_COLORS.length];
}

/** Runs of one phase in a timeline: [[phase, firstIndex, lastIndex], ...]. */
export function phaseIndexRuns(phases) {
  const runs = [];
  for (let i = 0; i < phases.length; i++) {
    const last = runs[runs.length - 1];
    if (last && last[0] === phases[i]) last[2] = i;
    else runs.push([phases[i], i, i]);
  }
  return runs;
}

/**
 * x of every point of every rank's timeline, overlaid three ways:
 * - "time": milliseconds since the rank's block began;
 * - "normalized": the share of the rank's own time (0-100 %), so ranks of different speed line up;
 * - "phase": run j of phases (forward, backward, optimizer, ...) spans [j, j + 1) on every rank, a
 *   point placed by its time inside its run, so each phase starts at the same x on every rank.
 * Ranks whose phase runs differ in order are still aligned run by run, and `note` says so.
 * Returns { xs: [[...] per timeline], title, ticks: {vals, text} | null, note }.
 */
export function alignTimelines(timelines, mode, phaseNames = ["forward", "backward", "optimizer", "other"]) {
  if (mode === "time") {
    return { xs: timelines.map((tl) => tl.t.map((t) => t * 1e3)), title: "ms since each rank's block began", ticks: null, note: null };
  }
  if (mode === "phase" && timelines.every((tl) => tl.phase && tl.phase.length === tl.t.length)) {
    const runsOf = timelines.map((tl) => phaseIndexRuns(tl.phase));
    const names = (runs) => runs.map((r) => r[0]).join(",");
    const longest = runsOf.reduce((a, b) => (b.length > a.length ? b : a), []);
    const same = runsOf.every((r) => names(r) === names(runsOf[0]));
    const xs = timelines.map((tl, k) => {
      const runs = runsOf[k];
      const x = new Array(tl.t.length);
      runs.forEach(([, a, b], j) => {
        const t0 = tl.t[a];
        const t1 = j + 1 < runs.length ? tl.t[runs[j + 1][1]] : tl.t[b];
        for (let i = a; i <= b; i++) x[i] = j + (t1 > t0 ? (tl.t[i] - t0) / (t1 - t0) : 0);
      });
      return x;
    });
    const ticks = { vals: longest.map((_, j) => j + 0.5), text: longest.map((r) => phaseNames[r[0]] ?? "other") };
    const note = same ? null : "the ranks' phases do not come in the same order: aligned run by run";
    return { xs, title: "phase (each run of a phase spans the same width on every rank)", ticks, note };
  }
  return {
    xs: timelines.map((tl) => {
      const end = tl.t.length ? tl.t[tl.t.length - 1] : 0;
      return tl.t.map((t) => (end > 0 ? (100 * t) / end : 0));
    }),
    title: "share of each rank's time (%)",
    ticks: null,
    note: mode === "phase" ? "these timelines carry no phases: aligned by each rank's share of its time" : null,
  };
}

/** x of a span [t0, t1] (seconds) on one rank's axis, in the same mode as alignTimelines. */
export function alignSpan(tl, x, t0, t1, mode) {
  if (mode === "time") return [t0 * 1e3, t1 * 1e3];
  if (mode === "normalized" || !tl.phase) {
    const end = tl.t.length ? tl.t[tl.t.length - 1] : 0;
    return end > 0 ? [(100 * t0) / end, (100 * t1) / end] : [0, 0];
  }
  // phase: interpolate between the timeline's own points
  const at = (t) => {
    const ts = tl.t;
    if (!ts.length) return 0;
    if (t <= ts[0]) return x[0];
    for (let i = 1; i < ts.length; i++) {
      if (ts[i] >= t) {
        const f = ts[i] > ts[i - 1] ? (t - ts[i - 1]) / (ts[i] - ts[i - 1]) : 0;
        return x[i - 1] + f * (x[i] - x[i - 1]);
      }
    }
    return x[x.length - 1];
  };
  return [at(t0), at(t1)];
}

/** The word for a rank's status in the table, and whether it is a problem. */
export function statusText(row) {
  if (row.status === "complete") return { text: "complete", bad: false };
  if (row.status === "failed") return { text: "failed (partial recording)", bad: true };
  return { text: row.status, bad: true };
}
