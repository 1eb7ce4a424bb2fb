// The prefix cache: counters (GET /v1/cache), RAM/disk bytes over time while the page is
// open, the radix tree's biggest branches, evict (RAM -> disk) and clear.
import { $, api, cards, el, fmt, plot } from "./app.js";

let history = [[], [], []]; // seconds, RAM bytes, disk bytes
let bytesPlot = null;
let timer = null;
let armed = false; // clear asks twice

function tree(branches) {
  const box = $("#cache-tree");
  if (!branches.length) {
    box.replaceChildren(el("p", { class: "muted" }, "Nothing cached yet: send a request."));
    return;
  }
  const depth = Math.max(...branches.map((b) => b.end));
  const level = {};
  for (const b of branches) level[b.id] = b.parent === null ? 0 : (level[b.parent] ?? 0) + 1;
  box.replaceChildren(...branches.map((b) => el("div", { class: "row", title: `${b.start}–${b.end} tokens, ${b.leaves} leaves, ${fmt.bytes(b.ram_bytes)} in RAM${b.on_disk ? ", on disk" : ""}` },
    el("div", { class: "text", style: `padding-left:${level[b.id] * 0.8}rem` }, `${fmt.n(b.tokens)} tok · ${JSON.stringify(b.head).slice(1, 60)}`),
    el("div", { class: "span" }, el("span", { class: b.ram_bytes ? "" : "disk", style: `left:${(100 * b.start) / depth}%;width:${Math.max(0.5, (100 * b.tokens) / depth)}%` })))));
}

async function refresh() {
  const view = await api("/v1/cache");
  const s = view.stats;
  if (!s) {
    cards($("#cache-cards"), [["prefix cache", "off"]]);
    return;
  }
  const lookups = s.hits + s.misses;
  cards($("#cache-cards"), [
    ["entries", fmt.n(s.entries)],
    ["cached tokens", fmt.n(s.cached_tokens)],
    ["RAM", `${fmt.bytes(s.ram_bytes)} / ${fmt.bytes(s.max_ram_bytes)}`],
    ["disk", `${fmt.bytes(s.disk_bytes)} (${fmt.n(s.disk_files)} files)`],
    ["hit rate", lookups ? `${fmt.pct(s.hits / lookups)} of ${lookups}` : "–"],
    ["tokens served", fmt.n(s.tokens_served)],
    ["evictions", fmt.n(s.evictions)],
    ["kind", s.kind],
  ]);
  history[0].push(Date.now() / 1000); history[1].push(s.ram_bytes); history[2].push(s.disk_bytes);
  if (history[0].length > 300) history.forEach((a) => a.shift());
  bytesPlot ??= plot($("#cache-plot"), {
    scales: { x: { range: (u, min, max) => [max - 300, max + 5] } }, // the last 5 minutes
    series: [{}, { label: "RAM", stroke: "#2563eb", fill: "rgba(37,99,235,.1)", value: (u, v) => fmt.bytes(v) },
      { label: "disk", stroke: "#64748b", value: (u, v) => fmt.bytes(v) }],
    axes: [{}, { values: (u, vals) => vals.map(fmt.bytes), size: 70 }],
  }, history);
  bytesPlot.setData(history);
  tree(view.branches);
  document.body.dataset.cacheReady = "1";
}

async function drop(path, what) {
  $("#cache-status").textContent = `${what}…`;
  try {
    await api(path, { method: "POST" });
    $("#cache-status").textContent = `${what}: done`;
  } catch (e) {
    $("#cache-status").textContent = `${what} failed: ${e.message}`;
  }
  await refresh();
}

function guarded(fn) {
  return () => fn().catch((e) => { $("#cache-status").textContent = e.message; });
}

export function init() {
  $("#cache-refresh").addEventListener("click", guarded(refresh));
  $("#cache-evict").addEventListener("click", guarded(() => drop("/v1/cache/evict", "evict")));
  $("#cache-clear").addEventListener("click", guarded(async () => {
    if (!armed) {
      armed = true;
      $("#cache-clear").textContent = "Really clear? (RAM and disk)";
      setTimeout(() => { armed = false; $("#cache-clear").textContent = "Clear"; }, 4000);
      return;
    }
    armed = false;
    $("#cache-clear").textContent = "Clear";
    await drop("/v1/cache/clear", "clear");
  }));
}

export function show() {
  guarded(refresh)();
  timer = setInterval(guarded(refresh), 3000);
}

export function hide() {
  clearInterval(timer);
}
