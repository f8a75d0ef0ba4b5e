// Polymorph's operator dashboard: polls the admin API every 2 s and draws everything itself (inline SVG,
// no library). Holds only the latest answer of each endpoint, so its memory stays flat however long it runs.
"use strict";

const POLL_MS = 2000;
const SLO_WINDOW_BUCKETS = 30; // attainment fallback: the last 5 min of 10 s buckets
const MAX_DECISIONS_SHOWN = 200;
const MIN_VIEW_S = 120; // charts start at the first traffic of the hour, but span at least 2 minutes
const SVG_NS = "http://www.w3.org/2000/svg";
const SHAPE_COLORS = ["#6ea8fe", "#f5b942", "#3ecf8e", "#c084fc", "#f2555a", "#2dd4bf", "#fb923c", "#a3e635", "#f472b6", "#94a3b8"];
const TIER_COLORS = { interactive: "#6ea8fe", standard: "#3ecf8e", batch: "#f5b942" };
const EXTRA_TIER_COLORS = ["#c084fc", "#2dd4bf", "#fb923c", "#f472b6"];
const KIND_COLORS = { drift: "#f5b942", plan: "#6ea8fe", step: "#c084fc", verify: "#3ecf8e", rollback: "#f2555a", recompile: "#2dd4bf" };

const latest = { state: null, series: null, decisions: [] };
const openDecisions = new Set();
let decisionsSignature = "";

// ---------- small helpers ----------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function fmtNum(x, digits = 3) {
  if (x == null || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (x === 0) return "0";
  const abs = Math.abs(x);
  if (abs >= 1000) return x.toFixed(0);
  if (abs >= 1) return Number(x.toPrecision(digits + 1)).toString();
  return Number(x.toPrecision(digits)).toString();
}

function fmtSeconds(s) {
  if (s == null) return "–";
  if (s < 1) return `${fmtNum(s * 1000, 3)} ms`;
  return `${fmtNum(s, 3)} s`;
}

function fmtPct(x) {
  return x == null ? "–" : `${(x * 100).toFixed(1)}%`;
}

function fmtClock(unixS, withSeconds = true) {
  const d = new Date(unixS * 1000);
  const hh = String(d.getHours()).padStart(2, "0");
  const mm = String(d.getMinutes()).padStart(2, "0");
  return withSeconds ? `${hh}:${mm}:${String(d.getSeconds()).padStart(2, "0")}` : `${hh}:${mm}`;
}

function fmtAgo(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function fmtDuration(s) {
  if (s == null) return "–";
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h}h ${String(m).padStart(2, "0")}m` : `${m}m ${String(Math.floor(s % 60)).padStart(2, "0")}s`;
}

function shapeOrder() {
  const fromConfig = (latest.state && latest.state.shapes) || [];
  const fromSeries = Object.keys((latest.series && latest.series.mix) || {});
  return [...new Set([...fromConfig, ...fromSeries.sort()])];
}

function shapeColor(name) {
  const index = shapeOrder().indexOf(name);
  return SHAPE_COLORS[(index < 0 ? 0 : index) % SHAPE_COLORS.length];
}

function tierColor(name, index) {
  return TIER_COLORS[name] || EXTRA_TIER_COLORS[index % EXTRA_TIER_COLORS.length];
}

function tierObjectives() {
  const state = latest.state || {};
  return state.tiers || (state.config && state.config.tiers) || {};
}

// ---------- polling ----------

async function getJson(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401 || response.status === 403) throw Object.assign(new Error("auth"), { auth: true });
  if (response.status === 404) return null;
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function poll() {
  if (document.hidden) return;
  const [state, series, decisions] = await Promise.allSettled([
    getJson("/admin/state"),
    getJson("/admin/series?window_s=3600"),
    getJson("/admin/decisions"),
  ]);
  const failures = [state, series, decisions].filter((r) => r.status === "rejected");
  document.getElementById("auth-banner").classList.toggle("hidden", !failures.some((r) => r.reason.auth));
  if (state.status === "fulfilled" && state.value) latest.state = state.value;
  if (series.status === "fulfilled" && series.value) latest.series = fromFirstTraffic(series.value);
  if (decisions.status === "fulfilled") {
    const body = decisions.value; // null: the gateway has no decision log (404)
    latest.decisions = (Array.isArray(body) ? body : (body && body.decisions) || []).slice(-MAX_DECISIONS_SHOWN);
  }
  const dot = document.getElementById("live-dot");
  dot.className = `live-dot ${failures.length ? "bad" : "ok"}`;
  document.getElementById("updated").textContent = failures.length ? "update failed" : `updated ${fmtClock(Date.now() / 1000)}`;
  render();
}

function mapValues(object, fn) {
  return Object.fromEntries(Object.entries(object || {}).map(([key, value]) => [key, fn(value)]));
}

// A young deployment has minutes of traffic in an hour-long series: drop the idle buckets before it
// (keeping one, and at least MIN_VIEW_S), so that a fresh drift fills the charts instead of their last pixels.
function fromFirstTraffic(series) {
  const t = series.t || [];
  const firsts = Object.values(series.mix || {}).map((values) => values.findIndex((v) => v > 0)).filter((i) => i >= 0);
  const first = firsts.length ? Math.min(...firsts) : t.length;
  const start = Math.max(0, Math.min(first - 1, t.length - Math.ceil(MIN_VIEW_S / (series.step_s || 10))));
  if (start === 0) return series;
  const cut = (values) => values.slice(start);
  return { ...series, t: cut(t), mix: mapValues(series.mix, cut), tiers: mapValues(series.tiers, (tier) => mapValues(tier, cut)), pools: mapValues(series.pools, (pool) => mapValues(pool, cut)) };
}

async function loop() {
  try {
    await poll();
  } catch (err) {
    console.error(err);
  }
  setTimeout(loop, POLL_MS);
}

function render() {
  renderHeader();
  renderPools();
  renderMix();
  renderTiers();
  renderDecisions();
}

// ---------- header and fleet ----------

function renderHeader() {
  const state = latest.state;
  if (!state) return;
  document.getElementById("config-version").textContent = state.config ? `v${state.config.version}` : "–";
  document.getElementById("uptime").textContent = fmtDuration(state.uptime_s);
  const mix = (latest.series && latest.series.mix) || {};
  const lastRate = Object.values(mix).reduce((sum, values) => sum + (values[values.length - 1] || 0), 0);
  document.getElementById("traffic-now").textContent = `${fmtNum(lastRate)} req/s`;
}

function replicaState(replica) {
  if (replica.draining) return "draining";
  if (replica.starting || replica.health === "starting") return "starting";
  if (replica.available) return "healthy";
  return "ejected";
}

function poolAttainment(pool) {
  if (typeof pool.slo_attainment === "number") return pool.slo_attainment;
  const series = latest.series && latest.series.pools && latest.series.pools[pool.name];
  if (!series) return null;
  const requests = series.requests_rps.slice(-SLO_WINDOW_BUCKETS).reduce((a, b) => a + b, 0);
  const goodput = series.goodput_rps.slice(-SLO_WINDOW_BUCKETS).reduce((a, b) => a + b, 0);
  return requests > 0 ? goodput / requests : null;
}

function engineSummary(engine) {
  const box = el("div", { class: "engine" });
  if (engine == null || (typeof engine === "object" && !Object.keys(engine).length)) {
    box.textContent = "engine: defaults";
    return box;
  }
  if (typeof engine !== "object") {
    box.textContent = String(engine);
    return box;
  }
  const entries = Object.entries(engine).filter(([, v]) => v != null && typeof v !== "object").slice(0, 10);
  entries.forEach(([key, value], i) => {
    box.append(el("span", { class: "k", text: `${key}=` }), `${value}${i < entries.length - 1 ? "  " : ""}`);
  });
  return box;
}

function metricRow(label, fraction, text, barClass) {
  const fill = el("span");
  fill.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  return el("div", { class: "metric-row" }, el("span", { text: label }), el("div", { class: `bar ${barClass || ""}` }, fill), el("span", { class: "value", text }));
}

// what the replica's engine reports at its /metrics, or why it is routed by the gateway's own counts
function engineText(replica) {
  const e = replica.engine;
  if (!e) return replica.engine_error ? `; engine figures unknown (${replica.engine_error})` : "";
  const kv = e.kv_usage_fraction == null ? "" : `, KV ${Math.round(e.kv_usage_fraction * 100)}%`;
  return `; engine: ${e.num_running} running, ${e.num_waiting} waiting (${e.foreign_requests} not ours)${kv}`;
}

function poolCard(pool) {
  const counts = { healthy: 0, draining: 0, starting: 0, ejected: 0 };
  const dots = el("div", { class: "replica-dots" });
  for (const replica of pool.replicas || []) {
    const kind = replicaState(replica);
    counts[kind] += 1;
    dots.append(el("span", { class: `replica-dot ${kind}`, title: `${replica.name}: ${kind}, ${replica.in_flight} in flight${engineText(replica)}` }));
  }
  const shapes = el("div", { class: "chips" });
  for (const shape of pool.shapes || []) {
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = shapeColor(shape);
    shapes.append(el("span", { class: "chip" }, swatch, shape));
  }
  const countText = [`${counts.healthy} healthy`, `${counts.draining} draining`, `${counts.starting} starting`];
  if (counts.ejected) countText.push(`${counts.ejected} ejected`);
  const attainment = poolAttainment(pool);
  const sloClass = attainment == null ? "" : attainment >= 0.99 ? "" : attainment >= 0.95 ? "warn" : "bad";
  return el(
    "div",
    { class: "pool", "data-pool": pool.name },
    el("div", { class: "head" }, el("span", { class: "name", text: pool.name }), el("span", { class: "gpu", text: pool.gpu || "GPU ?" })),
    el("div", { class: "models", text: (pool.models || ["any model"]).join(", ") }),
    shapes,
    engineSummary(pool.engine),
    el("div", { class: "replicas" }, dots, el("span", { text: countText.join(" · ") })),
    // the admin API caps a pool without a routable replica at 1e9
    metricRow("load", pool.load_fraction, (pool.load_fraction || 0) >= 1e6 ? "no capacity" : `${Math.round((pool.load_fraction || 0) * 100)}%`),
    metricRow("in flight", Math.min(1, (pool.in_flight || 0) / 256), String(pool.in_flight || 0)),
    metricRow("SLO met", attainment, fmtPct(attainment), `slo ${sloClass}`),
  );
}

function renderPools() {
  const state = latest.state;
  if (!state) return;
  const box = document.getElementById("pools");
  const pools = state.pools || [];
  box.replaceChildren(...(pools.length ? pools.map(poolCard) : [el("div", { class: "empty", text: "No pools configured." })]));
  const replicas = pools.reduce((n, p) => n + (p.replicas || []).length, 0);
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
  document.getElementById("fleet-hint").textContent = `${plural(pools.length, "pool")} · ${plural(replicas, "replica")}`;
}

// ---------- charts ----------

function niceStep(span, targetTicks) {
  const raw = span / Math.max(1, targetTicks);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const fraction = raw / power;
  return (fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10) * power;
}

function linearScale(maxValue, height) {
  const top = maxValue > 0 ? maxValue * 1.08 : 1;
  const step = niceStep(top, 4);
  const ceiling = Math.ceil(top / step) * step;
  const ticks = [];
  for (let v = 0; v <= ceiling + step / 2; v += step) ticks.push(v);
  return { y: (v) => height - (v / ceiling) * height, ticks, label: (v) => fmtNum(v, 2) };
}

function logScale(minValue, maxValue, height) {
  const lo = Math.pow(10, Math.floor(Math.log10(Math.max(minValue, 1e-4))));
  const hi = Math.pow(10, Math.ceil(Math.log10(Math.max(maxValue * 1.05, lo * 10))));
  const span = Math.log10(hi) - Math.log10(lo);
  const ticks = [];
  for (let v = lo; v <= hi * 1.001; v *= 10) ticks.push(v);
  return { y: (v) => height - ((Math.log10(Math.max(v, lo)) - Math.log10(lo)) / span) * height, ticks, label: (v) => fmtSeconds(v).replace(" ", "") };
}

// Lays out a chart: margins, grid, axes; returns the plot frame for the series drawn on it.
function frame(svgNode, t, scale, height) {
  const width = Math.max(320, svgNode.clientWidth || svgNode.parentNode.clientWidth || 800);
  const margin = { left: 52, right: 12, top: 14, bottom: 22 };
  const plotW = width - margin.left - margin.right;
  const plotH = height - margin.top - margin.bottom;
  svgNode.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svgNode.replaceChildren();
  const t0 = t[0], t1 = t[t.length - 1] + (latest.series ? latest.series.step_s : 10);
  const x = (unixS) => margin.left + ((unixS - t0) / Math.max(1, t1 - t0)) * plotW;
  const yScale = scale(plotH);
  const y = (v) => margin.top + yScale.y(v);
  const grid = svg("g", { class: "grid" });
  for (const tick of yScale.ticks) {
    grid.append(svg("line", { x1: margin.left, x2: width - margin.right, y1: y(tick), y2: y(tick) }));
    const label = svg("text", { x: margin.left - 6, y: y(tick) + 4, "text-anchor": "end" });
    label.textContent = yScale.label(tick);
    grid.append(label);
  }
  const minuteStep = niceStep((t1 - t0) / 60, 6) * 60;
  for (let tick = Math.ceil(t0 / minuteStep) * minuteStep; tick <= t1; tick += minuteStep) {
    const label = svg("text", { x: x(tick), y: height - 5, "text-anchor": "middle" });
    label.textContent = fmtClock(tick, false);
    grid.append(label);
  }
  svgNode.append(grid);
  svgNode.append(svg("line", { class: "axis-line", x1: margin.left, x2: width - margin.right, y1: margin.top + plotH, y2: margin.top + plotH }));
  return { svgNode, x, y, t0, t1, margin, plotW, plotH, width, height };
}

function pathThrough(points) {
  let d = "";
  let pen = false;
  for (const p of points) {
    if (p == null) {
      pen = false;
      continue;
    }
    d += `${pen ? "L" : "M"}${p[0].toFixed(1)},${p[1].toFixed(1)}`;
    pen = true;
  }
  return d;
}

function drawEvents(f) {
  const group = svg("g", { class: "events" });
  const laneEnds = []; // markers closer than their width stack downwards in lanes
  const sorted = [...latest.decisions].sort((a, b) => a.at_unix_s - b.at_unix_s);
  for (const decision of sorted) {
    const at = decision.at_unix_s;
    if (typeof at !== "number" || at < f.t0 || at > f.t1) continue;
    const color = KIND_COLORS[decision.kind] || "#c5cbe0";
    const x = f.x(at);
    let lane = laneEnds.findIndex((end) => end <= x - 15);
    if (lane < 0) lane = laneEnds.length < 4 ? laneEnds.length : laneEnds.indexOf(Math.min(...laneEnds));
    laneEnds[lane] = x;
    const cy = f.margin.top - 2 + lane * 15;
    const g = svg("g", { class: "event", "data-kind": decision.kind || "" });
    g.append(svg("line", { x1: x, x2: x, y1: cy, y2: f.margin.top + f.plotH, stroke: color }));
    g.append(svg("circle", { cx: x, cy, r: 7, fill: color }));
    const letter = svg("text", { x, y: cy + 3.5 });
    letter.textContent = (decision.kind || "?")[0].toUpperCase();
    g.append(letter);
    const title = svg("title");
    title.textContent = `${fmtClock(at)} ${decision.kind}: ${decisionSummary(decision)}`;
    g.append(title);
    group.append(g);
  }
  f.svgNode.append(group);
}

// Hover: a vertical cursor and a tooltip listing the values of the nearest bucket.
function attachHover(f, t, rows) {
  const tooltip = document.getElementById("tooltip");
  const cursor = svg("line", { class: "cursor hidden", y1: f.margin.top, y2: f.margin.top + f.plotH });
  f.svgNode.append(cursor);
  f.svgNode.onmousemove = (event) => {
    const box = f.svgNode.getBoundingClientRect();
    const px = ((event.clientX - box.left) / box.width) * f.width;
    const step = latest.series ? latest.series.step_s : 10;
    const index = Math.round((((px - f.margin.left) / f.plotW) * (f.t1 - f.t0)) / step - 0.5);
    if (index < 0 || index >= t.length) {
      f.svgNode.onmouseleave();
      return;
    }
    const cx = f.x(t[index] + step / 2);
    cursor.setAttribute("x1", cx);
    cursor.setAttribute("x2", cx);
    cursor.classList.remove("hidden");
    tooltip.replaceChildren(el("div", { class: "t", text: `${fmtClock(t[index])}–${fmtClock(t[index] + step)}` }));
    for (const row of rows) {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = row.color;
      tooltip.append(el("div", { class: "row" }, el("span", { class: "legend" }, el("span", { class: "item" }, swatch, row.name)), el("span", { class: "v", text: row.format(row.values[index]) })));
    }
    tooltip.classList.remove("hidden");
    const left = Math.min(window.innerWidth - tooltip.offsetWidth - 12, event.pageX + 14);
    tooltip.style.left = `${left}px`;
    tooltip.style.top = `${event.pageY + 12}px`;
  };
  f.svgNode.onmouseleave = () => {
    cursor.classList.add("hidden");
    tooltip.classList.add("hidden");
  };
}

function legend(boxId, items) {
  const box = document.getElementById(boxId);
  box.replaceChildren(
    ...items.map((item) => {
      const swatch = el("span", { class: `swatch ${item.style || ""}` });
      if (item.style === "dash") swatch.style.borderColor = item.color;
      else swatch.style.background = item.color;
      return el("span", { class: "item" }, swatch, item.name);
    }),
  );
}

function emptyChart(svgNode, message) {
  svgNode.replaceChildren();
  const text = svg("text", { x: 60, y: 40 });
  text.textContent = message;
  svgNode.append(text);
}

function renderMix() {
  const series = latest.series;
  const node = document.getElementById("mix-chart");
  const shapes = shapeOrder().filter((name) => series && series.mix && series.mix[name]);
  const kinds = [...new Set(latest.decisions.map((d) => d.kind))].filter(Boolean);
  legend("event-legend", kinds.map((kind) => ({ name: `${kind}`, color: KIND_COLORS[kind] || "#c5cbe0", style: "round" })));
  if (!series || !series.t || !series.t.length || !shapes.length) {
    legend("mix-legend", []);
    emptyChart(node, "No traffic in the last hour yet.");
    return;
  }
  legend("mix-legend", shapes.map((name) => ({ name, color: shapeColor(name) })));
  const t = series.t;
  const totals = t.map((_, i) => shapes.reduce((sum, name) => sum + series.mix[name][i], 0));
  const f = frame(node, t, (h) => linearScale(Math.max(...totals), h), Number(node.getAttribute("height")));
  const step = series.step_s;
  const xs = t.map((ts) => f.x(ts + step / 2));
  const base = t.map(() => 0);
  for (const name of shapes) {
    const values = series.mix[name];
    const top = base.map((b, i) => b + values[i]);
    let d = `M${xs[0].toFixed(1)},${f.y(top[0]).toFixed(1)}`;
    for (let i = 1; i < t.length; i++) d += `L${xs[i].toFixed(1)},${f.y(top[i]).toFixed(1)}`;
    for (let i = t.length - 1; i >= 0; i--) d += `L${xs[i].toFixed(1)},${f.y(base[i]).toFixed(1)}`;
    node.insertBefore(svg("path", { class: "area", d: `${d}Z`, fill: shapeColor(name), "fill-opacity": "0.85", "data-shape": name }), node.lastChild);
    top.forEach((v, i) => (base[i] = v));
  }
  drawEvents(f);
  const rows = shapes.map((name) => ({ name, color: shapeColor(name), values: series.mix[name], format: (v) => `${fmtNum(v)}/s` }));
  rows.push({ name: "total", color: "#c5cbe0", values: totals, format: (v) => `${fmtNum(v)}/s` });
  attachHover(f, t, rows);
}

function lineChart(nodeId, lines, scaleOf, thresholds, format) {
  const node = document.getElementById(nodeId);
  const series = latest.series;
  const values = lines.flatMap((line) => line.values).filter((v) => v != null && v > 0);
  if (!series || !series.t || !series.t.length || !values.length) {
    emptyChart(node, "No samples yet.");
    return;
  }
  const limits = thresholds.map((th) => th.value).filter((v) => v != null);
  const f = frame(node, series.t, (h) => scaleOf(Math.min(...values, ...limits), Math.max(...values, ...limits), h), Number(node.getAttribute("height")));
  const step = series.step_s;
  for (const th of thresholds) {
    if (th.value == null) continue;
    node.append(svg("line", { class: "threshold", x1: f.margin.left, x2: f.width - f.margin.right, y1: f.y(th.value), y2: f.y(th.value), stroke: th.color }));
  }
  for (const line of lines) {
    const points = line.values.map((v, i) => (v == null ? null : [f.x(series.t[i] + step / 2), f.y(v)]));
    node.append(svg("path", { class: `line ${line.dashed ? "dashed" : ""}`, d: pathThrough(points), stroke: line.color, "data-tier": line.tier }));
  }
  drawEvents(f);
  attachHover(f, series.t, lines.map((l) => ({ name: l.name, color: l.color, values: l.values, format })));
}

function renderTiers() {
  const tiers = (latest.series && latest.series.tiers) || {};
  const names = Object.keys(tiers).sort((a, b) => (a in TIER_COLORS ? Object.keys(TIER_COLORS).indexOf(a) : 9) - (b in TIER_COLORS ? Object.keys(TIER_COLORS).indexOf(b) : 9));
  const colors = Object.fromEntries(names.map((name, i) => [name, tierColor(name, i)]));
  legend("tier-legend", names.map((name) => ({ name, color: colors[name] })));
  const objectives = tierObjectives();
  const goodput = names.flatMap((name) => [
    { name: `${name} goodput`, tier: name, color: colors[name], values: tiers[name].goodput_rps },
    { name: `${name} requests`, tier: name, color: colors[name], values: tiers[name].requests_rps, dashed: true },
  ]);
  lineChart("goodput-chart", goodput, (lo, hi, h) => linearScale(hi, h), [], (v) => `${fmtNum(v)}/s`);
  for (const [key, nodeId, objective] of [["ttft_p99_s", "ttft-chart", "ttft_p99_s"], ["tpot_p99_s", "tpot-chart", "tpot_p99_s"]]) {
    const lines = names.map((name) => ({ name, tier: name, color: colors[name], values: tiers[name][key] }));
    const thresholds = names.map((name) => ({ value: objectives[name] ? objectives[name][objective] : null, color: colors[name] }));
    lineChart(nodeId, lines, (lo, hi, h) => logScale(lo, hi, h), thresholds, fmtSeconds);
  }
}

// ---------- decision log ----------

// Per kind, the evidence fields (fleet/README.md, "Decision log") that say what was decided, for the
// one-line summary when the gateway sent none; a kind not listed shows its first plain fields.
const SUMMARY_FIELDS = {
  drift: ["reason", "score"],
  capacity: ["reason"],
  plan: ["outcome", "num_moves", "predicted_goodput_after_rps"],
  recompile: ["reason"],
  step: ["source", "reason", "num_steps_left"],
  verify: ["source", "ok", "observed_goodput_rps", "predicted_goodput_rps"],
  rollback: ["source", "outcome", "reason"],
  compile: ["pool", "reason"],
  compiled: ["pool", "predicted_gain"],
};

function decisionSummary(decision) {
  if (decision.summary) return decision.summary;
  const evidence = decision.evidence || {};
  const keys = SUMMARY_FIELDS[decision.kind] || Object.keys(evidence);
  const parts = keys
    .filter((k) => k in evidence && (evidence[k] == null || typeof evidence[k] !== "object"))
    .slice(0, 3)
    .map((k) => `${k.replace(/_/g, " ")} ${typeof evidence[k] === "number" ? fmtNum(evidence[k]) : evidence[k]}`);
  return parts.join(" · ") || decision.kind;
}

// A mix as shape -> req/s: a flat map already, or the controller's window ({shapes: {name: {rate_rps, ...}}}).
function mixRates(value) {
  if (isNumberMap(value)) return value;
  const shapes = value && typeof value === "object" ? value.shapes : null;
  if (!shapes || typeof shapes !== "object" || Array.isArray(shapes)) return null;
  const rates = mapValues(shapes, (shape) => (shape && typeof shape.rate_rps === "number" ? shape.rate_rps : NaN));
  return Object.values(rates).every((v) => !Number.isNaN(v)) ? rates : null;
}

function isNumberMap(value) {
  return value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length > 0 && Object.values(value).every((v) => typeof v === "number");
}

function mixComparison(before, after) {
  const names = [...new Set([...Object.keys(before), ...Object.keys(after)])];
  const top = Math.max(...names.map((n) => Math.max(before[n] || 0, after[n] || 0)), 1e-9);
  const table = el("table", {}, el("tr", {}, el("th", { text: "shape" }), el("th", { text: "before" }), el("th", { text: "after" }), el("th", { text: "change" })));
  for (const name of names) {
    const b = before[name] || 0, a = after[name] || 0;
    const bar = (v) => {
      const span = el("span", { class: "minibar" });
      span.style.width = `${Math.round((v / top) * 90)}px`;
      span.style.background = shapeColor(name);
      return el("td", { class: "num" }, span, fmtNum(v));
    };
    const delta = a - b;
    table.append(el("tr", {}, el("th", { text: name }), bar(b), bar(a), el("td", { class: `num ${delta > 0 ? "up" : delta < 0 ? "down" : ""}`, text: `${delta > 0 ? "+" : ""}${fmtNum(delta)}` })));
  }
  return table;
}

function evidenceValue(value) {
  if (value == null) return el("span", { text: "–" });
  if (typeof value === "number") return el("span", { text: fmtNum(value, 4) });
  if (typeof value !== "object") return el("span", { text: String(value) });
  if (Array.isArray(value) && value.every((item) => Array.isArray(item) && item.length === 3)) {
    // moves: [slot, from_pool, to_pool]
    return el("pre", { text: value.map(([slot, from, to]) => `${slot}: ${from} → ${to}`).join("\n") });
  }
  if (!Array.isArray(value) && Object.keys(value).length <= 16) return evidenceTable(value);
  return el("pre", { text: JSON.stringify(value, null, 2) });
}

function evidenceTable(evidence) {
  const table = el("table");
  const entries = Object.entries(evidence);
  const keys = new Set(entries.map(([k]) => k));
  const pairs = [["mix_before", "mix_after"], ["before", "after"]];
  const shown = new Set();
  for (const [b, a] of pairs) {
    const before = keys.has(b) ? mixRates(evidence[b]) : null;
    const after = keys.has(a) ? mixRates(evidence[a]) : null;
    if (before && after && (Object.keys(before).length || Object.keys(after).length)) {
      const unit = isNumberMap(evidence[b]) ? "" : " (req/s)";
      table.append(el("tr", {}, el("th", { text: `${b.replace(/_before$/, "").replace(/_/g, " ") || "value"} before → after${unit}` }), el("td", {}, mixComparison(before, after))));
      shown.add(b).add(a);
    }
  }
  for (const [key, value] of entries) {
    if (shown.has(key)) continue;
    table.append(el("tr", {}, el("th", { text: key.replace(/_/g, " ") }), el("td", {}, evidenceValue(value))));
  }
  return table;
}

function decisionKey(decision) {
  return `${decision.at_unix_s}|${decision.kind}|${decision.summary || ""}`;
}

function renderDecisions() {
  const decisions = latest.decisions;
  const signature = `${decisions.length}|${decisions.length ? decisionKey(decisions[decisions.length - 1]) : ""}|${Math.floor(Date.now() / 30000)}`;
  if (signature === decisionsSignature) return; // unchanged: keep what the reader has opened and scrolled
  decisionsSignature = signature;
  const box = document.getElementById("decisions");
  if (!decisions.length) {
    box.replaceChildren(el("div", { class: "empty", text: "No decision yet: the controller has not acted in the retained window." }));
    return;
  }
  const now = Date.now() / 1000;
  const present = new Set(decisions.map(decisionKey));
  for (const key of openDecisions) if (!present.has(key)) openDecisions.delete(key);
  const items = [...decisions].reverse().map((decision) => {
    const key = decisionKey(decision);
    const color = KIND_COLORS[decision.kind] || "#c5cbe0";
    const kind = el("span", { class: "kind", text: decision.kind || "?" });
    kind.style.background = color;
    const details = el(
      "details",
      { class: "decision", "data-kind": decision.kind || "" },
      el("summary", {}, el("span", { class: "when", text: fmtClock(decision.at_unix_s) }), kind, el("span", { class: "summary", text: decisionSummary(decision) }), el("span", { class: "ago", text: fmtAgo(now - decision.at_unix_s) })),
      el("div", { class: "evidence" }, evidenceTable(decision.evidence || {})),
    );
    details.style.borderLeftColor = color;
    details.open = openDecisions.has(key);
    details.addEventListener("toggle", () => (details.open ? openDecisions.add(key) : openDecisions.delete(key)));
    return details;
  });
  box.replaceChildren(...items);
}

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => {
    renderMix();
    renderTiers();
  }, 150);
});
document.addEventListener("visibilitychange", () => {
  if (!document.hidden) poll().catch(console.error);
});
loop();
