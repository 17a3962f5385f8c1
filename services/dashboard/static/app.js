// Polls /api/overview and fills the tables, and /api/history for the charts (charts.js). Text
// goes in through textContent only, so job names and messages can never inject markup.
"use strict";

const bytes = (n) => {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
};
const rate = (n) => (n ? `${bytes(n)}/s` : "–");
const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const when = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");

function cell(row, content, className) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content); else td.textContent = String(content);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function fill(tableId, items, render) {
  const body = document.querySelector(`#${tableId} tbody`);
  const rows = items.map((item) => { const tr = document.createElement("tr"); render(tr, item); return tr; });
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = cell(tr, "none yet", "empty");
    td.colSpan = document.querySelectorAll(`#${tableId} thead th`).length;
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function gpuStrip(node) {
  const strip = document.createElement("span");
  strip.className = "gpus";
  for (const g of node.gpus) {
    const box = document.createElement("span");
    box.className = `gpu ${g.use}`;
    const figures = [];
    if (g.utilization_ratio !== undefined) figures.push(`${pct(g.utilization_ratio)} busy`);
    if (g.memory_total_bytes !== undefined) figures.push(`${bytes(g.memory_used_bytes)} / ${bytes(g.memory_total_bytes)}`);
    if (g.temperature_celsius !== undefined) figures.push(`${g.temperature_celsius.toFixed(0)} °C`);
    if (g.ecc_uncorrectable_errors) figures.push(`${g.ecc_uncorrectable_errors} uncorrectable ECC errors`);
    box.title = `GPU ${g.index}: ${g.use}${g.fault ? " (" + g.fault + ")" : ""}` +
      `${g.holder ? " — " + (g.job_name || g.holder) : ""}${figures.length ? "\n" + figures.join(", ") : ""}`;
    box.textContent = g.index;
    strip.appendChild(box);
  }
  return strip;
}

function render(data) {
  const t = data.gpu_totals;
  document.getElementById("gpu-totals").textContent =
    `${t.training} training · ${t.lent} lent to training · ${t.inference} inference · ${t.idle} idle` +
    (t.faulted ? ` · ${t.faulted} faulted` : "") +
    ` — plan version ${data.latest_plan_version}`;
  fill("nodes", data.nodes, (tr, n) => {
    cell(tr, n.name);
    cell(tr, n.pool);
    cell(tr, n.gpu_type || "–");
    cell(tr, n.alive ? "up" : "down", n.alive ? "ok" : "bad");
    cell(tr, gpuStrip(n));
    cell(tr, n.gpu_memory_total_bytes === null ? "–" :
      `${pct(n.gpu_utilization_ratio)} · ${bytes(n.gpu_memory_used_bytes)} / ${bytes(n.gpu_memory_total_bytes)}`);
    cell(tr, n.applied_plan_version);
    cell(tr, n.cache.reachable ? pct(n.cache.hit_ratio) : (n.cache.error || "unreachable"));
    const used = n.cache.reachable ? n.cache.tiers.reduce((s, x) => s + x.used_bytes, 0) : null;
    const cap = n.cache.reachable ? n.cache.tiers.reduce((s, x) => s + x.capacity_bytes, 0) : null;
    cell(tr, used === null ? "–" : `${bytes(used)} / ${bytes(cap)}`);
    cell(tr, n.cache.reachable ? rate(n.cache.remote_rate_bytes_per_s) : "–");
  });
  fill("jobs", data.jobs.slice().reverse(), (tr, j) => {
    const link = document.createElement("a");
    link.href = `/job/${encodeURIComponent(j.id)}`;
    link.textContent = j.id;
    cell(tr, link);
    cell(tr, j.name);
    cell(tr, j.state, `state-${j.state}`);
    cell(tr, j.min_gpus === j.max_gpus ? `${j.gpus} (${j.max_gpus})` : `${j.gpus} (${j.min_gpus}–${j.max_gpus})`);
    const bar = document.createElement("progress");
    bar.max = 1; bar.value = j.fraction_done;
    const progress = document.createElement("span");
    progress.append(bar, ` ${pct(j.fraction_done)}`);
    cell(tr, progress);
    cell(tr, j.throughput_samples_per_s ? j.throughput_samples_per_s.toFixed(1) : "–");
    cell(tr, j.cache_hit_ratio ? pct(j.cache_hit_ratio) : "–");
    cell(tr, j.dataset || "–");
  });
  const cacheJobs = data.nodes.flatMap((n) => (n.cache.reachable ? n.cache.jobs.map((j) => ({ node: n.name, ...j })) : []));
  fill("cache-jobs", cacheJobs, (tr, j) => {
    cell(tr, j.node);
    cell(tr, j.job_id);
    cell(tr, j.dataset);
    cell(tr, j.quota_bytes ? bytes(j.quota_bytes) : "best effort");
    cell(tr, bytes(j.cached_bytes));
    cell(tr, pct(j.hit_ratio));
    cell(tr, rate(j.remote_io_rate_bytes_per_s));
    cell(tr, j.remote_io_limit_bytes_per_s ? rate(j.remote_io_limit_bytes_per_s) : "unlimited");
  });
  fill("plans", data.plans, (tr, p) => {
    cell(tr, p.version);
    cell(tr, when(p.created_at));
    cell(tr, p.policy);
    cell(tr, p.cache_mode);
    cell(tr, p.reason);
    cell(tr, p.jobs_placed);
    cell(tr, p.gpus_used);
    cell(tr, p.loans);
  });
}

const jobLabel = (j) => (j.name ? `${j.name} (${j.id})` : j.id);

function renderCharts(h) {
  const minutes = (h.times.length ? (h.times[h.times.length - 1] - h.times[0]) / 60 : 0);
  document.getElementById("history-span").textContent =
    `last ${minutes.toFixed(1)} min, a sample every ${h.interval_s} s, kept for ${(h.window_s / 60).toFixed(0)} min`;
  drawChart("chart-gpus", {
    times: h.times, stacked: true,
    lines: [...h.gpus_by_job.map((j) => ({ label: jobLabel(j), values: j.values })),
      { label: "idle", values: h.idle_gpus, color: window.CHART_IDLE_COLOR }],
  });
  drawChart("chart-tenants", {
    times: h.times, stacked: true, empty: "no job holds GPUs in this window",
    lines: h.gpus_by_tenant.map((t) => ({ label: t.tenant, values: t.values })),
  });
  drawChart("chart-pending", { times: h.times, lines: [{ label: "pending jobs", values: h.pending_jobs }] });
  drawChart("chart-hits", {
    times: h.times, format: "ratio", yRange: [0, 1.05], empty: "no job reads through a cache server in this window",
    lines: h.cache_hit_ratio_by_job.map((j) => ({ label: jobLabel(j), values: j.values })),
  });
  drawChart("chart-io", {
    times: h.times, format: "rate", empty: "no job reads through a cache server in this window",
    lines: h.remote_io_bytes_per_s_by_job.map((j) => ({ label: jobLabel(j), values: j.values })),
  });
  const without = h.nodes_without_gpu_figures;
  const noNvml = without.length ? `no NVML figures from ${without.join(", ")} (emulated GPUs or no NVML on the node)` : "";
  drawChart("chart-util", {
    times: h.times, format: "ratio", yRange: [0, 1.05], note: noNvml,
    empty: noNvml || "no samples yet",
    lines: h.gpu_utilization_by_node.map((n) => ({ label: n.node, values: n.values })),
  });
}

// Who the page is for: a user sees their tenants' jobs only (the server filters; this only says so).
fetchJson("/api/whoami").then((me) => {
  if (!me.auth) return;
  document.getElementById("viewer").textContent = me.admin ? `admin ${me.name} · all tenants`
    : `user ${me.name} · tenants: ${me.tenants.join(", ") || "none"}`;
  document.getElementById("logout").hidden = false;
}).catch(() => {});

pollEvery(async () => {
  const data = await fetchJson("/api/overview");
  render(data);
  renderCharts(await fetchJson("/api/history"));
  return data.refresh_s;
});
