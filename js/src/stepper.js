// Step-through of backward: what a given step shows. Pure.

export function clampStep(i, n) {
  if (n <= 0) return -1;
  if (!Number.isFinite(i)) return 0;
  return Math.min(n - 1, Math.max(0, Math.trunc(i)));
}

/**
 * The state at backward step `i` (0-based) of a decoded recording:
 *   node: the node executing; liveBefore/liveAfter/freedBytes: from the step;
 *   freed: Set of saved-tensor indexes released at or before step i (greyed out);
 *   freedNow: indexes released exactly at step i.
 * Returns null when the recording has no backward steps.
 */
export function stepState(rec, i) {
  const n = rec.steps.length;
  const k = clampStep(i, n);
  if (k < 0) return null;
  const s = rec.steps[k];
  const freed = new Set();
  const freedNow = [];
  for (const t of rec.saved) {
    if (t.freedAt !== null && t.freedAt !== undefined && t.freedAt <= k) {
      freed.add(t.index);
      if (t.freedAt === k) freedNow.push(t.index);
    }
  }
  return {
    index: k,
    count: n,
    node: s.node,
    liveBefore: s.liveBefore,
    liveAfter: s.liveAfter,
    freedBytes: s.freedBytes,
    freed,
    freedNow,
  };
}

/**
 * For each node, the step from which all of its saved tensors are released (-1 if it saves
 * nothing or some save is never released). A node is drawn greyed from that step on.
 */
export function nodeReleaseSteps(rec) {
  const out = new Int32Array(rec.nodes.length).fill(-1);
  for (let i = 0; i < rec.nodes.length; i++) {
    const idx = rec.savedByNode[i];
    if (idx.length === 0) continue;
    let last = -1;
    let all = true;
    for (const j of idx) {
      const f = rec.saved[j].freedAt;
      if (f === null || f === undefined) {
        all = false;
        break;
      }
      last = Math.max(last, f);
    }
    out[i] = all ? last : -1;
  }
  return out;
}

/** The timeline x (seconds since the first point) at which step k starts; null if unknown. */
export function stepTime(rec, k) {
  const tl = rec.timeline;
  if (!tl.t.length) return null;
  const t0 = tl.t[0];
  for (let i = 0; i < tl.step.length; i++) if (tl.step[i] === k) return tl.t[i] - t0;
  const s = rec.steps[k];
  if (!s || s.start === null || s.start === undefined) return null;
  const x = s.start - t0;
  return x >= 0 && x <= tl.t[tl.t.length - 1] - t0 + 1 ? x : null;
}

/**
 * Why step k released nothing, as a sentence; null when it released something. Checked in this
 * order: the backward call kept its graph (create_graph / retain_graph), the node saved nothing,
 * it saved only tensors that existed before the block (parameters, inputs), its saves are shared
 * with a node that runs later, or something else still holds them.
 */
export function whyNothingFreed(rec, k) {
  const s = rec.steps[k];
  if (!s || s.freedBytes > 0) return null;
  const call = (rec.backwardCalls || [])[s.backward];
  const nth = `backward call ${s.backward + 1}`;
  if (call && call.create_graph) {
    return `Nothing freed: ${nth} ran with create_graph=True, which keeps the graph and its saved tensors alive (a later derivative goes through them).`;
  }
  if (call && call.retain_graph) {
    return `Nothing freed: ${nth} ran with retain_graph=True, which keeps the graph's saved tensors until the graph itself is dropped.`;
  }
  const mine = rec.savedByNode[s.node] || [];
  if (!mine.length) return "Nothing freed: this node saved no tensors.";
  if (mine.every((j) => rec.saved[j].kind !== "activation")) {
    return "Nothing freed: this node saved only parameters or inputs, which existed before the block and stay alive.";
  }
  const storages = new Set(mine.filter((j) => rec.saved[j].kind === "activation").map((j) => rec.saved[j].storage));
  for (const t of rec.saved) {
    if (t.node !== s.node && storages.has(t.storage) && (t.freedAt === null || t.freedAt === undefined || t.freedAt > k)) {
      return `Nothing freed: its saved activation is also saved by node #${t.node}, which still needs it.`;
    }
  }
  return "Nothing freed: its saved tensors are still referenced elsewhere (a variable, or an output).";
}
