// Time-series charts on uPlot (static/vendor/uplot, the global `uPlot`), shared by the cluster
// page and the job page. drawChart(id, spec) draws into <div class="chart" id=id> and updates
// the same plot on the next call while its lines stay the same (else it draws a new one).
// After every draw the container says what is on it: data-points (the fewest points of any of
// its lines) and data-painted (canvas pixels in the lines' colours), which the browser test reads.
"use strict";

const PALETTE = ["#2f6fd6", "#e08a1e", "#2c8a45", "#7a4fcf", "#d64545", "#1a9aa0", "#b5489b", "#8a6d1f",
  "#4a5ea8", "#5f7d2a"];
const IDLE_COLOR = "#9aa4b2";
const silodCharts = {};  // id -> {plot, key}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i && Math.abs(n) < 10 ? 1 : 0)} ${units[i]}`;
}
const FORMATS = {
  count: (v) => (v === null || v === undefined ? "–" : String(Math.round(v * 100) / 100)),
  ratio: (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(0)}%`),
  rate: (v) => (v === null || v === undefined ? "–" : `${fmtBytes(v)}/s`),
  seconds: (v) => (v === null || v === undefined ? "–" : `${v.toFixed(3)} s`),
};

const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
// Whole seconds and up on the time axis (uPlot's defaults would label half-seconds on a short window).
const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];
// The legend shows the value under the cursor, else the newest one.
const at = (u, si, idx) => (idx === null || idx === undefined ? u.data[si].length - 1 : idx);

function hexRgb(hex) {
  return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
}

// Pixels of the plot's canvas drawn in one of its lines' colours (opaque, within a small tolerance).
function paintedPixels(plot, colors) {
  const canvas = plot.ctx.canvas;
  if (!canvas.width || !canvas.height) return 0;
  const px = plot.ctx.getImageData(0, 0, canvas.width, canvas.height).data;
  const rgbs = colors.map(hexRgb);
  let count = 0;
  for (let i = 0; i < px.length; i += 4) {
    if (px[i + 3] < 200) continue;
    for (const [r, g, b] of rgbs) {
      if (Math.abs(px[i] - r) < 24 && Math.abs(px[i + 1] - g) < 24 && Math.abs(px[i + 2] - b) < 24) { count++; break; }
    }
  }
  return count;
}

function note(box, text) {
  let p = box.querySelector(".chart-note");
  if (!text) { if (p) p.remove(); return; }
  if (!p) { p = document.createElement("p"); p.className = "chart-note"; box.appendChild(p); }
  p.textContent = text;
}

// spec: {times: [unix s], lines: [{label, values, color?}], stacked?, format?: key of FORMATS,
//        yRange?: [min, max], stepped?, empty?: text shown instead of a plot without data}
function drawChart(id, spec) {
  const box = document.getElementById(id);
  const fmt = FORMATS[spec.format || "count"];
  const lines = spec.lines.map((l, i) => ({ ...l, color: l.color || PALETTE[i % PALETTE.length] }));
  const hasData = spec.times.length > 0 && lines.length > 0 &&
    lines.some((l) => l.values.some((v) => v !== null && v !== undefined));
  const old = silodCharts[id];
  if (!hasData) {
    if (old) { old.plot.destroy(); delete silodCharts[id]; }
    box.dataset.points = "0";
    box.dataset.painted = "0";
    note(box, spec.empty || "no data yet");
    return;
  }
  note(box, spec.note || "");
  // Stacked: each line is drawn at the running sum of the ones below it, the top one first so
  // the lower fills paint over it; the legend shows each line's own value.
  let drawn = lines;
  if (spec.stacked) {
    const sums = spec.times.map(() => 0);
    const stackedLines = lines.map((l) => {
      const values = l.values.map((v, i) => (sums[i] += v || 0));
      return { ...l, raw: l.values, values };
    });
    drawn = stackedLines.reverse();
  }
  const data = [spec.times, ...drawn.map((l) => l.values)];
  const key = JSON.stringify([drawn.map((l) => [l.label, l.color]), !!spec.stacked, spec.format]);
  box.dataset.points = String(Math.min(...drawn.map((l) => l.values.filter((v) => v !== null && v !== undefined).length)));
  const raw = drawn.map((l) => l.raw);  // a stacked chart's own values, for its legend
  if (old && old.key === key) {
    old.raw = raw;
    old.plot.setData(data);
    return;
  }
  if (old) old.plot.destroy();
  const entry = { key, raw, plot: null };
  silodCharts[id] = entry;
  const width = Math.max(300, box.clientWidth - 8);
  const stepped = uPlot.paths.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;
  entry.plot = new uPlot({
    width, height: 200,
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true }, y: spec.yRange ? { range: spec.yRange } : { range: (u, lo, hi) => [Math.min(0, lo), hi > 0 ? hi * 1.15 : 1] } },
    axes: [{ incrs: TIME_INCRS, space: 70, values: (u, ticks) => ticks.map(clock) },
      { values: (u, ticks) => ticks.map(fmt), size: 70 }],
    series: [{ label: "time", value: (u, v, si, idx) => (u.data[0].length ? clock(u.data[0][at(u, 0, idx)]) : "–") },
      ...drawn.map((l) => ({
      label: l.label, stroke: l.color, width: 2,
      fill: spec.stacked ? l.color + "cc" : undefined,
      paths: spec.stepped || spec.stacked ? stepped : undefined,
      points: { show: spec.stepped ? true : false },
      value: (u, v, si, idx) => fmt((entry.raw[si - 1] || u.data[si])[at(u, si, idx)]),
    }))],
    hooks: {
      draw: [(u) => { box.dataset.painted = String(paintedPixels(u, drawn.map((l) => l.color))); }],
    },
  }, data, box);
}

window.silodCharts = silodCharts;
window.drawChart = drawChart;
window.CHART_IDLE_COLOR = IDLE_COLOR;

// Fetch a JSON document of the dashboard's API; its error message when the answer is not OK.
async function fetchJson(url) {
  const reply = await fetch(url, { credentials: "same-origin" });
  const data = await reply.json();
  if (!reply.ok) throw new Error(data.error || reply.statusText);
  return data;
}

// Run `load` (which returns the refresh interval in seconds it was told, or nothing), show its
// outcome in #status, and run it again after that interval (2 s when it failed), for ever.
async function pollEvery(load) {
  const status = document.getElementById("status");
  let delay = 2000;
  try {
    delay = 1000 * ((await load()) || 2);
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    status.className = "status ok";
    document.body.dataset.loaded = "true";
  } catch (err) {
    status.textContent = `cannot load: ${err.message}`;
    status.className = "status bad";
  }
  setTimeout(() => pollEvery(load), delay);
}
