// One job's page (/job/<id>): polls /api/job/<id>. Text goes in through textContent only.
"use strict";

const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop());
const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");

function cell(row, content, className) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content); else td.textContent = String(content);
  if (className) td.className = className;
  row.appendChild(td);
}

function fill(tableId, items, render) {
  const body = document.querySelector(`#${tableId} tbody`);
  const rows = items.map((item) => { const tr = document.createElement("tr"); render(tr, item); return tr; });
  if (!rows.length) {
    const tr = document.createElement("tr");
    cell(tr, "none yet", "empty");
    tr.firstChild.colSpan = document.querySelectorAll(`#${tableId} thead th`).length;
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function summary(data) {
  const j = data.job;
  const code = document.createElement("code");
  code.textContent = data.logs_command;
  const state = document.createElement("span");
  state.className = `state-${j.state}`;
  state.textContent = j.state + (j.message ? ` — ${j.message}` : "");
  const items = [
    ["id", j.id], ["name", j.name || "–"], ["tenant", j.tenant], ["state", state],
    ["GPUs", j.min_gpus === j.max_gpus ? `${j.gpus} (${j.max_gpus})` : `${j.gpus} (${j.min_gpus}–${j.max_gpus})`],
    ["progress", `${pct(j.fraction_done)} · ${j.samples_done} samples`],
    ["throughput", j.throughput_samples_per_s ? `${j.throughput_samples_per_s.toFixed(1)} samples/s` : "–"],
    ["cache hits", j.dataset ? pct(j.cache_hit_ratio) : "–"], ["dataset", j.dataset || "–"],
    ["application", j.application || "–"],
    ["submitted", when(j.created_at)], ["started", when(j.started_at)], ["finished", when(j.finished_at)],
    ["logs", code],
  ];
  const dl = document.getElementById("summary");
  dl.replaceChildren(...items.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd");
    if (v instanceof Node) dd.appendChild(v); else dd.textContent = String(v);
    return [dt, dd];
  }));
  document.getElementById("title").textContent = `${j.name || j.id} (${j.id})`;
  document.title = `silod: ${j.name || j.id}`;
}

function render(data) {
  summary(data);
  // The job's GPUs from plan to plan, held until now (or its end).
  const plans = data.plans.filter((p) => p.created_at);
  const times = plans.map((p) => p.created_at);
  const gpus = plans.map((p) => p.gpus);
  if (plans.length) {
    const end = data.job.finished_at || Date.now() / 1000;
    if (end > times[times.length - 1]) { times.push(end); gpus.push(gpus[gpus.length - 1]); }
  }
  drawChart("chart-plan-gpus", {
    times, stepped: true, empty: "no plan since the job's submission names it",
    lines: [{ label: "GPUs", values: gpus }],
  });
  const m = data.metrics;
  drawChart("chart-throughput", {
    times: m.samples_per_s.times, empty: "no throughput reported yet",
    lines: [{ label: "samples/s", values: m.samples_per_s.values }],
  });
  drawChart("chart-step", {
    times: m.step_time_s.times, format: "seconds", empty: "no step time reported yet",
    lines: [{ label: "step time", values: m.step_time_s.values }],
  });
  fill("events", data.events.slice().reverse(), (tr, e) => {
    cell(tr, e.sequence);
    cell(tr, when(e.time));
    cell(tr, e.type);
    cell(tr, e.type === "state" ? `${e.from_state || "submitted"} → ${e.to_state}` : "", e.to_state ? `state-${e.to_state}` : "");
    cell(tr, e.message);
  });
  document.getElementById("plans-note").textContent =
    `the plans where the job's GPUs or generation changed, of the ${data.plans_scanned} since its submission`;
  fill("plans", data.plans.slice().reverse(), (tr, p) => {
    cell(tr, p.version);
    cell(tr, when(p.created_at));
    cell(tr, p.gpus);
    cell(tr, p.generation);
    cell(tr, p.nodes.join(", ") || "–");
    cell(tr, p.reason);
  });
}

pollEvery(async () => {
  const data = await fetchJson(`/api/job/${encodeURIComponent(jobId)}`);
  render(data);
  return data.refresh_s;
});
