// Live telemetry: one SSE stream (GET /v1/telemetry) of snapshots; charts update in place.
import { $, cards, el, fmt, plot, stream } from "./app.js";

let controller = null;
let charts = null;
const queueHistory = [[], [], []]; // seconds, queue depth, in flight

function phaseCell(job) {
  if (job.phase === "prefill") {
    const total = job.prompt_tokens || 1;
    const done = job.prefill_done || 0;
    return el("td", {}, el("div", { title: `${done}/${total} tokens` }, `prefill ${fmt.pct(done / total)}`,
      el("div", { class: "bar" }, el("span", { style: `width:${(100 * done) / total}%` }))));
  }
  return el("td", {}, job.phase);
}

function rows(tbody, list, cells) {
  tbody.replaceChildren(...(list.length ? list.map((j) => el("tr", { "data-client": j.client }, cells(j)))
    : [el("tr", {}, el("td", { colspan: 11, class: "muted" }, "none"))]));
}

function makeCharts() {
  const bars = uPlot.paths.bars({ size: [0.7, 40] });
  return {
    throughput: plot($("#tel-throughput"), {
      series: [{}, { label: "tokens/s", stroke: "#2563eb", fill: "rgba(37,99,235,.1)" }, { label: "forwards/s", stroke: "#f59e0b" }],
      axes: [{}, { label: "per second" }],
    }, [[], [], []]),
    position: plot($("#tel-position"), {
      scales: { x: { time: false }, y: { range: [0, 1] } },
      series: [{ label: "position" }, { label: "accepted / drafted", stroke: "#16a34a", fill: "rgba(22,163,74,.3)", paths: bars, points: { show: false } }],
      axes: [{ label: "draft position" }, { label: "acceptance" }],
    }, [[], []]),
    tpf: plot($("#tel-tpf"), {
      scales: { x: { time: false } },
      series: [{ label: "tokens" }, { label: "rounds", stroke: "#7c3aed", fill: "rgba(124,58,237,.3)", paths: bars, points: { show: false } }],
      axes: [{ label: "tokens committed per forward" }, { label: "rounds" }],
    }, [[], []]),
    queue: plot($("#tel-queue"), {
      scales: { x: { range: (u, min, max) => [max - 120, max + 1] }, y: { range: (u, min, max) => [0, Math.max(2, max + 1)] } },
      series: [{}, { label: "queued", stroke: "#dc2626" }, { label: "in flight", stroke: "#2563eb" }],
      axes: [{}, { label: "jobs" }],
    }, [[], [], []]),
  };
}

function update(snap) {
  cards($("#tel-cards"), [
    ["queue depth", snap.queue_depth],
    ["in flight", snap.in_flight.length],
    ["requests", fmt.n(snap.totals.requests || 0)],
    ["tokens generated", fmt.n(snap.totals.generated_tokens || 0)],
    ["clients seen", Object.keys(snap.clients).length],
    ["uptime", fmt.s(snap.uptime_s)],
  ]);
  rows($("#tel-inflight tbody"), snap.in_flight, (j) => [el("td", {}, j.id), el("td", {}, j.client), phaseCell(j),
    el("td", {}, fmt.n(j.prompt_tokens)), el("td", {}, fmt.n(j.cached_tokens)), el("td", {}, fmt.n(j.generated)),
    el("td", {}, fmt.n(j.tokens_per_forward, 2)), el("td", {}, fmt.pct(j.acceptance)), el("td", {}, j.mode || "–"),
    el("td", {}, fmt.s(snap.now - j.submitted))]);
  rows($("#tel-recent tbody"), snap.recent.slice(0, 12), (j) => [el("td", {}, j.id), el("td", {}, j.client), el("td", {}, j.finish),
    el("td", {}, fmt.n(j.prompt_tokens)), el("td", {}, fmt.n(j.cached_tokens)), el("td", {}, fmt.n(j.generated)),
    el("td", {}, fmt.n(j.tokens_per_forward, 2)), el("td", {}, fmt.pct(j.acceptance)), el("td", {}, fmt.n(j.decode_tok_s, 1)),
    el("td", {}, fmt.s(j.ttft_s)), el("td", {}, j.mode || "–")]);
  const t = snap.throughput;
  charts.throughput.setData([t.map((r) => r[0]), t.map((r) => r[1]), t.map((r) => r[2])]);
  const drafted = snap.drafted_by_position;
  const positions = drafted.map((_, i) => i + 1);
  charts.position.setData([positions, drafted.map((d, i) => (d ? snap.accepted_by_position[i] / d : 0))]);
  charts.tpf.setData([snap.tokens_per_forward.map((_, i) => i + 1), snap.tokens_per_forward]);
  const now = Math.floor(snap.now);
  if (queueHistory[0].at(-1) !== now) {
    queueHistory[0].push(now); queueHistory[1].push(snap.queue_depth); queueHistory[2].push(snap.in_flight.length);
    if (queueHistory[0].length > 300) queueHistory.forEach((a) => a.shift());
  } else {
    queueHistory[1][queueHistory[1].length - 1] = snap.queue_depth; queueHistory[2][queueHistory[2].length - 1] = snap.in_flight.length;
  }
  charts.queue.setData(queueHistory);
  document.body.dataset.telemetryVersion = snap.version;
}

export function show() {
  charts ??= makeCharts();
  controller?.abort();
  controller = new AbortController();
  const mine = controller;
  stream("/v1/telemetry", { signal: mine.signal }, (event, data) => { if (event === "snapshot") update(data); })
    .catch((e) => { if (e.name !== "AbortError") $("#tel-cards").replaceChildren(el("div", { class: "card" }, `telemetry: ${e.message}`)); })
    .finally(() => { if (controller === mine && !mine.signal.aborted) setTimeout(() => controller === mine && show(), 2000); });
}

export function hide() {
  controller?.abort();
  controller = null;
}
