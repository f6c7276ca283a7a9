// The widget's own module (anywidget's `_esm`): a few kilobytes that load the front end (the 1.2 MB
// bundle, widget.js) once per page, so that a saved notebook keeps each widget's data, not the script:
// from the Jupyter server, else from a live widget's own state, else from the kernel, else a notice and
// the figures the widget's data holds.
// See NOTE [ the script once per environment ] in gradscope/_views/widget.py.

const BUNDLE = "__GRADSCOPE_BUNDLE__"; // widget-<id>.js, set by gradscope.widget
const KERNEL_WAIT_MS = 20000; // a kernel answers once idle: after this, the notice says none did
const NOTICE_AFTER_MS = 400; // no script by then: a notice and the figures meanwhile

const loaded = (globalThis.__gradscopeBundles ??= new Map());

function serverUrls() {
  const out = [];
  try {
    const cfg = document.getElementById("jupyter-config-data");
    if (cfg) {
      const c = JSON.parse(cfg.textContent || "{}");
      const base = c.fullLabextensionsUrl || `${(c.baseUrl || "/").replace(/\/$/, "")}/lab/extensions`;
      out.push(new URL(`${base.replace(/\/$/, "")}/gradscope/static/${BUNDLE}`, window.location.href).href);
    }
  } catch {
    // not a Jupyter page: no server to ask
  }
  return out;
}

async function fromServer() {
  for (const url of serverUrls()) {
    try {
      return { module: await import(/* webpackIgnore: true */ url), via: "server" };
    } catch {
      // not installed where this server looks (or another version): try the next way
    }
  }
  return null;
}

async function importText(text, via) {
  const url = URL.createObjectURL(new Blob([text], { type: "text/javascript" }));
  try {
    return { module: await import(/* webpackIgnore: true */ url), via };
  } finally {
    URL.revokeObjectURL(url);
  }
}

// A widget shown as its cell starts carries the bundle while the cell runs (the kernel, busy, would
// not answer a request): see NOTE [ a live loop's script ] in gradscope/_views/widget.py.
async function fromState(model) {
  const text = model.get("_gs_inline");
  return text ? importText(text, "state") : null;
}

function fromKernel(model) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("no kernel sent it")), KERNEL_WAIT_MS);
    const onMessage = async (msg) => {
      if (!msg || msg.type !== "gradscope-bundle" || msg.bundle !== BUNDLE) return;
      clearTimeout(timer);
      model.off("msg:custom", onMessage);
      try {
        resolve(await importText(msg.text, "kernel"));
      } catch (e) {
        reject(e);
      }
    };
    model.on("msg:custom", onMessage);
    model.send({ type: "gradscope-bundle", bundle: BUNDLE });
  });
}

function load(model) {
  let p = loaded.get(BUNDLE);
  if (!p) {
    p = (async () => (await fromServer()) ?? (await fromState(model)) ?? (await fromKernel(model)))();
    loaded.set(BUNDLE, p);
    p.catch(() => loaded.delete(BUNDLE)); // the next widget asks again (a kernel may have started)
  }
  return p;
}

const units = ["B", "KiB", "MiB", "GiB", "TiB"];
function bytes(n) {
  if (typeof n !== "number" || !isFinite(n)) return "?";
  let v = n;
  let u = 0;
  while (Math.abs(v) >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return u ? `${v.toFixed(1)} ${units[u]}` : `${v} B`;
}

/** What the widget's data says without the front end: one line per recording or candidate. */
function figures(data) {
  const lines = [];
  const rec = (p, name) => {
    const s = p && p.summary;
    if (!s) return;
    const parts = [`${s.nodes} nodes`];
    if (s.memory !== false && typeof s.peak_bytes === "number") parts.push(`peak ${bytes(s.peak_bytes)}`);
    parts.push(`saved activations ${bytes(s.saved_activations ?? s.saved_bytes)}`, `${s.steps} backward steps`);
    lines.push(`${name || p.label || "recording"}: ${parts.join(" · ")}`);
  };
  try {
    const p = JSON.parse(data || "{}");
    if (p.kind === "recording") rec(p);
    else if (p.kind === "comparison") {
      for (const r of p.rows || []) lines.push(`${r.name}: ${r.status}, peak ${bytes(r.peak_bytes)}${r.message ? ` (${r.message})` : ""}`);
    } else if (p.kind === "job") {
      for (const r of p.rows || []) lines.push(`rank ${r.rank}: ${r.status}, peak ${bytes(r.peak_bytes)}, ${r.nodes} nodes`);
    } else if (p.kind === "snapshot") lines.push(`CUDA memory snapshot${p.label ? ` ${p.label}` : ""}`);
  } catch {
    // data that cannot be read: the notice alone
  }
  return lines;
}

function notice(el, model, text) {
  let box = el.querySelector(".gs-fallback");
  if (!box) {
    box = document.createElement("div");
    box.className = "gs-fallback";
    box.style.cssText = "font: 13px system-ui, sans-serif; border: 1px solid #d9e2ec; border-radius: 4px; padding: 8px 10px; background: #f8fafc; color: #1f2933;";
    const head = document.createElement("div");
    head.className = "gs-fallback-text";
    box.appendChild(head);
    const list = document.createElement("pre");
    list.className = "gs-fallback-figures";
    list.style.cssText = "margin: 6px 0 0; white-space: pre-wrap;";
    list.textContent = figures(model.get("data")).join("\n");
    box.appendChild(list);
    el.appendChild(box);
  }
  box.querySelector(".gs-fallback-text").textContent = text;
}

export default {
  async render({ model, el }) {
    const p = load(model);
    let settled = false;
    p.then(
      () => (settled = true),
      () => (settled = true),
    );
    // the server answers at once where it has the script: otherwise say what is awaited meanwhile
    const waiting = setTimeout(() => {
      if (!settled) notice(el, model, "gradscope: this view's script is not installed where Jupyter runs; asking the kernel for it…");
    }, NOTICE_AFTER_MS);
    let got;
    try {
      got = await p;
    } catch (e) {
      notice(
        el,
        model,
        "gradscope: this view needs gradscope's script, which neither the Jupyter server nor a kernel provided " +
          `(${e && e.message ? e.message : e}). Install gradscope where Jupyter runs (pip install "gradscope[notebook]" ` +
          "from its wheel), or run the notebook with a kernel that has gradscope. What the view holds:",
      );
      return;
    } finally {
      clearTimeout(waiting);
    }
    el.querySelector(".gs-fallback")?.remove();
    el.dataset.gsLoaded = got.via;
    return got.module.default.render({ model, el });
  },
};
