// The widget's stylesheet, scoped under .gs-root (a notebook page holds other content).
export const CSS = `
.gs-root { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2933; background: #fff;
  border: 1px solid #d9e2ec; border-radius: 6px; padding: 10px; box-sizing: border-box; max-width: 100%;
  container-type: inline-size; container-name: gs; }
.gs-root * { box-sizing: border-box; }
.gs-root h3 { font-size: 15px; margin: 0 0 4px 0; }
.gs-root h4 { font-size: 13px; margin: 6px 0 4px 0; overflow-wrap: anywhere; }
.gs-summary { color: #52606d; margin-bottom: 6px; overflow-wrap: anywhere; }
.gs-toolbar { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; margin: 6px 0; }
.gs-root button { font: inherit; padding: 2px 9px; border: 1px solid #9aa5b1; border-radius: 4px; background: #f5f7fa; cursor: pointer; }
.gs-root button:hover { background: #e4e7eb; }
.gs-root button:disabled { opacity: 0.5; cursor: default; }
.gs-find { font: inherit; padding: 2px 6px; border: 1px solid #9aa5b1; border-radius: 4px; width: 180px; }
.gs-legend { display: flex; gap: 4px 12px; color: #52606d; font-size: 12px; flex-wrap: wrap; margin: 2px 0 6px 0; }
.gs-arrow { display: inline-block; margin-right: 3px; font-weight: 700; color: #52606d; }
.gs-level { font: inherit; padding: 1px 4px; }
.gs-swatch { display: inline-block; width: 14px; height: 10px; margin-right: 3px; vertical-align: middle; border: 1px solid #52606d; }
.gs-body { display: flex; gap: 10px; align-items: flex-start; }
.gs-graph-col { flex: 1 1 auto; min-width: 0; }
/* a 1000 px window: the details stay beside the graph, narrower (the graph then opens folded by
   module where every node would not show its name); narrower still (Lab's sidebar open): below */
@container gs (max-width: 1080px) { .gs-body > .gs-side { flex-basis: 320px; } }
@container gs (max-width: 760px) {
  .gs-body { flex-direction: column; align-items: stretch; }
  .gs-side { flex: 0 0 auto !important; max-width: 100% !important; height: auto !important; max-height: 300px; }
}
/* the step controls stick to the window's bottom edge while the graph above them is on screen */
.gs-stepbar { position: sticky; bottom: 0; z-index: 3; background: #fff; padding: 1px 0; }
.gs-graph { position: relative; min-width: 0; height: 520px; border: 1px solid #d9e2ec; border-radius: 4px; background: #fbfcfd; overflow: hidden; }
.gs-graph-note { position: absolute; left: 8px; right: 8px; bottom: 8px; background: rgba(255, 251, 235, 0.96); border: 1px solid #f0b429; border-radius: 4px; padding: 4px 8px; font-size: 12px; color: #513c06; }
.gs-tip { position: absolute; pointer-events: none; background: #1f2933; color: #fff; font-size: 12px; padding: 4px 7px;
  border-radius: 4px; max-width: 330px; white-space: pre-wrap; overflow-wrap: anywhere; z-index: 2; }
.gs-canvas { display: block; cursor: grab; touch-action: none; outline: none; }
.gs-side { flex: 0 0 360px; max-width: 40%; height: 520px; overflow: auto; border: 1px solid #d9e2ec; border-radius: 4px; padding: 6px 8px; }
/* see NOTE [ names wrap at their joints ] in format.js: names carry their break chances, so the
   panel never breaks inside a word (overflow-wrap: anywhere let a table squeeze "parameter" into
   "para|met|er") */
.gs-side .gs-kv > span, .gs-side .gs-table td { overflow-wrap: normal; word-break: normal; white-space: pre-wrap; }
.gs-side .gs-table th { overflow-wrap: normal; white-space: normal; }
.gs-side .gs-table td.gs-num { white-space: nowrap; }
.gs-side .gs-table td.gs-freed-at { white-space: pre-wrap; }
.gs-side .gs-table th, .gs-side .gs-table td { padding: 2px 3px; }
.gs-side .gs-kv { grid-template-columns: fit-content(38%) 1fr; }
.gs-kv { display: grid; grid-template-columns: auto 1fr; gap: 1px 8px; }
.gs-kv > span:nth-child(odd) { color: #52606d; }
.gs-kv > span { overflow-wrap: anywhere; white-space: pre-wrap; }
.gs-table { border-collapse: collapse; width: 100%; font-size: 12px; }
.gs-table th, .gs-table td { border-bottom: 1px solid #e4e7eb; padding: 2px 4px; text-align: left; vertical-align: top; overflow-wrap: anywhere; white-space: pre-wrap; }
.gs-table th { white-space: nowrap; overflow-wrap: normal; }
.gs-table td.gs-num, .gs-table th.gs-num { text-align: right; white-space: nowrap; }
.gs-table th.gs-num.gs-wrap { white-space: normal; }
.gs-table tr.gs-freed td { color: #9aa5b1; text-decoration: line-through; }
.gs-table tr.gs-freed-now td { background: #fef3c7; }
.gs-muted { color: #7b8794; }
.gs-stepper { display: flex; gap: 6px; align-items: center; margin: 8px 0 4px 0; flex-wrap: wrap; }
.gs-stepper input[type=range] { flex: 1 1 200px; }
.gs-steplabel { min-width: 260px; overflow-wrap: anywhere; }
.gs-timeline { width: 100%; min-height: 240px; }
.gs-status-ok { color: #15803d; font-weight: 600; }
.gs-status-wrong { color: #b91c1c; font-weight: 600; }
.gs-status-raised { color: #b45309; font-weight: 600; }
.gs-cmp-status { margin-left: 8px; color: #52606d; }
.gs-section { margin-top: 10px; }
.gs-error { color: #b91c1c; white-space: pre-wrap; overflow-wrap: anywhere; }
.gs-modtable tr.gs-module { cursor: pointer; }
.gs-modtable td.gs-module-name { overflow-wrap: normal; }
.gs-modtable tr.gs-module:hover td { background: #f0f4f8; text-decoration: underline; }
.gs-defs { font-size: 11px; margin: 4px 0; }
.gs-step-why { margin: 2px 0 6px 0; padding: 4px 8px; background: #fef9c3; border-left: 3px solid #ca8a04; border-radius: 3px; }
.gs-peak-breakdown { margin: 2px 0; color: #1f2933; overflow-wrap: anywhere; }
.gs-table td.gs-best { background: #dcfce7; font-weight: 700; }
.gs-table tr.gs-stale td { color: #7b8794; font-style: italic; }
.gs-table tr.gs-ref td.gs-cmp-name { font-weight: 600; }
.gs-table td.gs-cmp-name { white-space: nowrap; overflow-wrap: normal; }
.gs-table td.gs-warn { color: #b45309; }
.gs-cmp-notes { font-size: 12px; margin: 4px 0; }
.gs-cmp-headline { margin: 4px 0 8px 0; padding: 6px 10px; border-left: 4px solid #2563eb; background: #f5f8ff; border-radius: 3px; }
.gs-cmp-headline > div { margin: 2px 0; }
.gs-cmp-problem { font-weight: 600; }
.gs-cmp-winner { color: #14532d; }
.gs-scroll { overflow-x: auto; max-width: 100%; }
.gs-table td.gs-cmp-message { min-width: 200px; }
.gs-root button.gs-on { background: #dbeafe; border-color: #2563eb; }
.gs-toolbar h4 { margin: 0 8px 0 0; }
.gs-snap-diagnosis { margin: 8px 0; padding: 6px 10px; border: 1px solid #fecaca; border-left: 4px solid #dc2626; border-radius: 4px; background: #fff7f7; }
.gs-finding { margin: 4px 0 8px 0; overflow-wrap: anywhere; }
.gs-finding-tag { display: inline-block; font-size: 11px; font-weight: 600; padding: 0 6px; border-radius: 8px; background: #fee2e2; color: #991b1b; }
.gs-finding-fix { margin: 2px 0 0 14px; color: #1f2933; }
.gs-finding-code { display: block; margin: 2px 0 0 14px; font-size: 12px; background: #f1f5f9; padding: 2px 6px; border-radius: 3px; white-space: pre-wrap; overflow-wrap: anywhere; }
.gs-snap-fulltext pre { font-size: 11px; white-space: pre-wrap; overflow-wrap: anywhere; max-height: 240px; overflow: auto; background: #f8fafc; padding: 4px; }
.gs-snap-body { display: flex; gap: 10px; align-items: flex-start; }
.gs-snap-groups { flex: 0 0 38%; min-width: 0; }
.gs-snap-blocks { flex: 1 1 auto; min-width: 0; }
@container gs (max-width: 1080px) { .gs-snap-body { flex-direction: column; } .gs-snap-groups { flex: 0 0 auto; width: 100%; } .gs-snap-blocks { width: 100%; } }
.gs-snap-block { cursor: pointer; }
.gs-snap-block:hover td { background: #f0f4f8; }
.gs-snap-block.gs-open td { background: #eef6ff; }
.gs-snap-frames { margin: 2px 0 4px 0; padding-left: 22px; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 11.5px; }
.gs-snap-frame { overflow-wrap: anywhere; }
.gs-snap-notes { font-size: 11px; margin-top: 8px; }
.gs-job-imbalance { margin: 6px 0; font-weight: 600; overflow-wrap: anywhere; }
.gs-job-table tr.gs-job-row { cursor: pointer; }
.gs-job-table tr.gs-job-row:hover td { background: #f0f4f8; }
.gs-job-table tr.gs-job-selected td { background: #eef6ff; }
.gs-job-table tr.gs-job-heaviest td.gs-job-peak { font-weight: 700; color: #b91c1c; }
.gs-job-bad { color: #b45309; font-weight: 600; }
.gs-job-table tr.gs-job-missing td, .gs-job-table tr.gs-job-unreadable td { color: #b91c1c; }
.gs-job-table td.gs-job-rank { white-space: nowrap; }
/* a narrow notebook scrolls the table sideways rather than breaking words */
.gs-job-table td { overflow-wrap: normal; }
.gs-job-table tr.gs-job-row td:nth-child(-n+6) { white-space: nowrap; }
.gs-job-table td.gs-job-where, .gs-job-table td.gs-job-inputs { min-width: 170px; }
.gs-job-details { margin: 4px 0 8px 0; display: flex; gap: 14px; flex-wrap: wrap; align-items: flex-start; }
.gs-job-details > div { flex: 1 1 100%; }
.gs-job-details table { width: auto; }
.gs-job-notes { font-size: 12px; margin: 4px 0; }
.gs-loop { margin: 4px 0 8px 0; }
.gs-loop-title { color: #52606d; font-size: 12px; }
.gs-loop-chart { width: 100%; max-width: 640px; height: auto; display: block; }
.gs-loop-status, .gs-loop-notes { color: #52606d; font-size: 12px; }
.gs-loop-grows { color: #b42318; }
`;
