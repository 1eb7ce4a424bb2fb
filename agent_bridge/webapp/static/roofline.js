// Roofline (GET /machine), the verify cost curve (GET /v1/cost-curve), where recent requests
// landed (the telemetry snapshot), and re-running tune with progress (POST /v1/tune).
import { $, api, cards, el, fmt, plot, stream } from "./app.js";

let roofPlot = null;
let curvePlot = null;
const COLOURS = ["#2563eb", "#16a34a", "#f59e0b", "#dc2626", "#7c3aed", "#0891b2", "#db2777"];

function replacePlot(old, container, opts, data) {
  old?.destroy();
  container.replaceChildren();
  return plot(container, opts, data);
}

async function load() {
  $("#tune-status").textContent = "measuring the roofline…";
  const [machine, curve, snap] = await Promise.all([api("/machine"), api("/v1/cost-curve"), api("/v1/telemetry/snapshot")]);
  const r = machine.roofline;
  cards($("#roof-cards"), [
    ["memory bandwidth", `${fmt.n(r.bandwidth_gb_s, 1)} GB/s`],
    ["model weights", fmt.bytes(r.model_bytes)],
    ["plain-decode ceiling", `${fmt.n(r.plain_decode_ceiling_tok_s, 0)} tok/s`],
    ["cost curve", curve.measured ? `tuned ${(curve.measured_at || "").slice(0, 16).replace("T", " ")}` : "quick (not tuned)"],
    ["device", `${machine.device} · ${machine.blas || ""} · ${machine.cpu_count || "?"} cores`],
  ]);
  // Decode speed per depth (from the curve /machine used: the tuned one, else a quick
  // one-depth measurement): the bandwidth ceiling, measured plain decoding, a perfect
  // drafter's best, and each recent request (its decode tok/s at its prompt length).
  const rows = Object.entries(r.by_depth).map(([depth, d]) => ({ depth: Number(depth), plain_tok_s: d.plain_tok_s, ceiling_tok_s: d.ceiling_tok_s,
    best_speedup: d.best_speedup_perfect_drafter, best_width: d.best_width, cost: d.cost }));
  const recent = snap.recent.filter((j) => j.generated > 1 && j.decode_tok_s > 0);
  const xs = [...new Set([...rows.map((d) => d.depth), ...recent.map((j) => j.prompt_tokens)])].sort((a, b) => a - b);
  const at = (depth, key) => rows.find((d) => d.depth === depth)?.[key] ?? null;
  const landed = xs.map((x) => {
    const hits = recent.filter((j) => j.prompt_tokens === x);
    return hits.length ? Math.max(...hits.map((j) => j.decode_tok_s)) : null;
  });
  const dot = (colour) => ({ show: true, size: 7, fill: colour });
  const data = [xs, xs.map((x) => at(x, "ceiling_tok_s") ?? r.plain_decode_ceiling_tok_s), xs.map((x) => at(x, "plain_tok_s")),
    xs.map((x) => { const p = at(x, "plain_tok_s"); return p === null ? null : p * at(x, "best_speedup"); }), landed];
  roofPlot = replacePlot(roofPlot, $("#roof-plot"), {
    scales: { x: { time: false, distr: xs[0] > 0 ? 3 : 1 }, y: { distr: 3 } },
    series: [{ label: "depth" },
      { label: "bandwidth ceiling", stroke: "#dc2626", dash: [6, 4] },
      { label: "plain decode", stroke: "#2563eb", spanGaps: true, points: dot("#2563eb") },
      { label: "perfect drafter", stroke: "#16a34a", spanGaps: true, points: dot("#16a34a") },
      { label: "recent requests", stroke: "#7c3aed", paths: () => null, points: dot("#7c3aed") }],
    axes: [{ label: "context depth (tokens)" }, { label: "tokens/s" }],
  }, data);
  // The cost curve: the tuned one in full, else the quick measurement's widths.
  const quick = !curve.measured;
  const widths = quick ? [1, 2, 4, 8, 16, 32, 64] : curve.widths;
  const costs = quick ? rows.map((d) => ({ label: `depth ${d.depth} (quick)`, values: [1, ...widths.slice(1).map((w) => d.cost[String(w)] ?? null)] }))
    : curve.by_depth.map((d) => ({ label: `depth ${d.depth}`, values: d.relative }));
  curvePlot = replacePlot(curvePlot, $("#roof-curve"), {
    scales: { x: { time: false } },
    series: [{ label: "width" }, { label: "no gain (cost = k)", stroke: "#9ca3af", dash: [4, 4] },
      ...costs.map((c, i) => ({ label: c.label, stroke: COLOURS[i % COLOURS.length], points: quick ? dot(COLOURS[i % COLOURS.length]) : undefined }))],
    axes: [{ label: "tokens verified in one forward (k)" }, { label: "cost / cost(1)" }],
  }, [widths, widths, ...costs.map((c) => c.values)]);
  $("#tune-status").textContent = rows.map((d) => `depth ${d.depth}: best ${fmt.n(d.best_speedup, 2)}x at k=${d.best_width}`).join(" · ");
  document.body.dataset.rooflineReady = "1";
}

async function tune() {
  const depths = $("#tune-depths").value.split(",").map((d) => parseInt(d, 10)).filter((d) => !Number.isNaN(d));
  const repeats = parseInt($("#tune-repeats").value, 10) || 2;
  const bar = $("#tune-progress");
  $("#tune-run").disabled = true;
  bar.hidden = false;
  bar.value = 0;
  try {
    await stream("/v1/tune", { method: "POST", body: { depths, repeats } }, (event, data) => {
      if (event === "progress") {
        bar.value = data.done / data.total;
        $("#tune-status").textContent = `measuring ${data.what} (${data.done}/${data.total})`;
      } else if (event === "error") {
        throw new Error(data.error.message);
      }
    });
    await load();
  } catch (e) {
    $("#tune-status").textContent = `tune failed: ${e.message}`;
  } finally {
    $("#tune-run").disabled = false;
    bar.hidden = true;
  }
}

export function init() {
  $("#tune-run").addEventListener("click", tune);
}

export function show() {
  load().catch((e) => { $("#roof-cards").replaceChildren(el("div", { class: "card" }, `roofline: ${e.message}`)); });
}
