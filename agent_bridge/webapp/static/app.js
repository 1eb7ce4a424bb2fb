// The web app's shell: API calls (with the --api-key, asked for once per tab), an SSE
// reader over fetch (EventSource can't send the key), small helpers, and the page router.
import * as chat from "./chat.js";
import * as telemetry from "./telemetry.js";
import * as roofline from "./roofline.js";
import * as cache from "./cache.js";
import * as integrations from "./integrations.js";

const KEY = "mlx-dspark.api-key";
const PAGES = { chat, telemetry, roofline, cache, integrations };

export const $ = (sel, root = document) => root.querySelector(sel);

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}

export const fmt = {
  n: (x, d = 0) => (x === undefined || x === null || Number.isNaN(x) ? "–" : Number(x).toLocaleString(undefined, { maximumFractionDigits: d, minimumFractionDigits: d })),
  pct: (x) => (x === undefined || x === null ? "–" : `${(100 * x).toFixed(0)}%`),
  bytes: (b) => {
    if (!b) return "0 B";
    const u = ["B", "KB", "MB", "GB", "TB"];
    const i = Math.min(u.length - 1, Math.floor(Math.log(b) / Math.log(1024)));
    return `${(b / 1024 ** i).toFixed(i ? 1 : 0)} ${u[i]}`;
  },
  s: (x) => (x === undefined || x === null ? "–" : x < 1 ? `${(x * 1000).toFixed(0)} ms` : `${x.toFixed(2)} s`),
  ago: (t) => {
    if (!t) return "–";
    const s = Date.now() / 1000 - t;
    return s < 60 ? `${s.toFixed(0)} s ago` : s < 3600 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
  },
};

// The clipboard API needs a secure context (localhost is one; a LAN address is not).
export async function copyText(text) {
  if (navigator.clipboard?.writeText && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = el("textarea", { style: "position:fixed;opacity:0" });
  area.value = text;
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("copy refused");
}

export function cards(container, items) {
  container.replaceChildren(...items.map(([k, v]) => el("div", { class: "card" }, el("div", { class: "v" }, v), el("div", { class: "k" }, k))));
}

// -- the API ------------------------------------------------------------------------------

function headers(extra = {}) {
  const h = { "X-Client-Name": "mlx-dspark-webapp", ...extra };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

let asking = null;
function askKey() {
  asking ??= new Promise((resolve) => {
    const dlg = $("#key-dialog");
    dlg.addEventListener("close", () => {
      sessionStorage.setItem(KEY, $("#key-input").value.trim());
      asking = null;
      resolve();
    }, { once: true });
    dlg.showModal();
  });
  return asking;
}

export class ApiError extends Error {}

async function errorOf(resp) {
  try {
    const body = await resp.json();
    return new ApiError(body?.error?.message || `HTTP ${resp.status}`);
  } catch {
    return new ApiError(`HTTP ${resp.status}`);
  }
}

// fetch with the key; a 401 asks for the key once and tries again.
export async function request(path, { method = "GET", body, signal } = {}) {
  for (let attempt = 0; ; attempt++) {
    const init = { method, signal, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
    if (body !== undefined) init.body = JSON.stringify(body);
    const resp = await fetch(path, init);
    if (resp.status === 401 && attempt === 0) {
      await askKey();
      continue;
    }
    if (!resp.ok) throw await errorOf(resp);
    return resp;
  }
}

export async function api(path, options) {
  return (await request(path, options)).json();
}

// Read a text/event-stream response: onEvent(eventName, parsedData) per event.
export async function stream(path, options, onEvent) {
  const resp = await request(path, options);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (!data.length) continue; // a comment (keep-alive)
      const text = data.join("\n");
      if (text === "[DONE]") return;
      onEvent(event, JSON.parse(text));
    }
  }
}

// uPlot sized to its container, re-sized with it.
export function plot(container, opts, data) {
  const width = () => Math.max(280, container.clientWidth || 400);
  const u = new uPlot({ width: width(), height: 240, ...opts }, data, container);
  new ResizeObserver(() => u.setSize({ width: width(), height: 240 })).observe(container);
  return u;
}

// -- the router ---------------------------------------------------------------------------

export let server = {};
let current = null;

function route() {
  const name = (location.hash.slice(1) || "chat").split("?")[0];
  const page = PAGES[name] ? name : "chat";
  for (const [n, mod] of Object.entries(PAGES)) {
    const active = n === page;
    $(`#page-${n}`).classList.toggle("active", active);
    $(`nav a[data-page=${n}]`).classList.toggle("active", active);
    if (!active && current === n) mod.hide?.();
  }
  if (current !== page) {
    current = page;
    PAGES[page].show?.();
  }
}

async function start() {
  try {
    // Ask for the key before the first call that needs it (a 401 would be a console error).
    const health = await (await fetch("/health")).json();
    if (health.api_key_required && !sessionStorage.getItem(KEY)) await askKey();
    server = await api("/v1/server");
    $("#server-model").textContent = `${server.model} · context ${fmt.n(server.context_window)}`;
  } catch (e) {
    $("#server-model").textContent = `server: ${e.message}`;
  }
  for (const mod of Object.values(PAGES)) mod.init?.();
  addEventListener("hashchange", route);
  route();
  document.body.dataset.ready = "1";
}

start();
