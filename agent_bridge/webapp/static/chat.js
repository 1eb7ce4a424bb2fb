// Chat with the loaded model over the OpenAI chat API (streaming), kept in localStorage.
// Each reply keeps its statistics (the final chunk's `mlx_dspark`) and, per token, how it
// was produced (`mlx_dspark.tokens` chunks, asked for with mlx_dspark.provenance).
import { $, copyText, el, fmt, server, stream } from "./app.js";

const STORE = "mlx-dspark.chats";
const SETTINGS = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "mode", "max_draft"];
let state = { chats: [], current: null, settings: {}, colour: false };
let running = null; // {controller, reply}

function load() {
  try {
    state = { ...state, ...JSON.parse(localStorage.getItem(STORE) || "{}") };
  } catch { /* a damaged store starts afresh */ }
  if (!state.chats.length) newChat();
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function chat() {
  return state.chats.find((c) => c.id === state.current) || state.chats[0];
}

function newChat() {
  const c = { id: `c${Date.now()}${Math.random().toString(36).slice(2, 6)}`, title: "New chat", messages: [] };
  state.chats.unshift(c);
  state.current = c.id;
  save();
  return c;
}

// -- settings -----------------------------------------------------------------------------

function readSettings() {
  const s = {};
  for (const k of SETTINGS) s[k] = $(`#set-${k}`).value;
  state.settings = s;
  save();
  $("#chat-settings-summary").textContent =
    `mode ${s.mode || "default"}, max draft ${s.max_draft || "auto"}, temperature ${s.temperature || 0}`;
  return s;
}

function requestBody(messages, s) {
  const body = { model: server.model || "local", messages, stream: true, stream_options: { include_usage: true },
    max_tokens: parseInt(s.max_tokens, 10) || 512, temperature: parseFloat(s.temperature) || 0,
    top_p: parseFloat(s.top_p) || 1, top_k: parseInt(s.top_k, 10) || 0, mlx_dspark: { provenance: true } };
  if (s.seed !== "") body.seed = parseInt(s.seed, 10);
  if (s.mode) body.mlx_dspark.mode = s.mode;
  const draft = (s.max_draft || "").trim();
  if (draft) body.mlx_dspark.max_draft = draft === "auto" ? "auto" : parseInt(draft, 10);
  return body;
}

// -- rendering ----------------------------------------------------------------------------

function sourceClass(source) {
  return ["target", "lookup", "dspark", "dflash"].includes(source) ? `tok-${source}` : "tok-other";
}

function renderBody(node, msg) {
  if (state.colour && msg.tokens?.length) {
    node.className = "body tokens";
    node.replaceChildren(...msg.tokens.map(([text, source]) => el("span", { class: sourceClass(source), title: source }, text)));
    return;
  }
  node.className = "body";
  node.innerHTML = DOMPurify.sanitize(marked.parse(msg.content || ""));
  for (const pre of node.querySelectorAll("pre")) {
    pre.append(el("button", { class: "copy", type: "button", onclick: () => copyText(pre.querySelector("code")?.textContent ?? pre.textContent).catch(() => {}) }, "copy"));
  }
}

function statsLine(msg) {
  const s = msg.stats;
  if (!s) return msg.finish ? el("div", { class: "stats", "data-role": "stats" }, el("span", {}, "finish ", el("b", {}, msg.finish))) : null;
  const items = [
    ["tokens/forward", fmt.n(s.mean_accepted, 2)],
    ["acceptance", fmt.pct(s.acceptance_rate)],
    ["decode", `${fmt.n(s.decode_tok_s, 1)} tok/s`],
    ["TTFT", fmt.s(s.ttft_s)],
    ["cached", fmt.n(s.cached_tokens)],
    ["prefilled", fmt.n(s.prefilled_tokens)],
    ["generated", fmt.n(s.generated_tokens)],
    ["mode", s.mode],
  ];
  if (msg.finish) items.push(["finish", msg.finish]);
  return el("div", { class: "stats", "data-role": "stats" }, items.map(([k, v]) => el("span", {}, `${k} `, el("b", {}, v))));
}

function legend(msg) {
  if (!state.colour || !msg.tokens?.length) return null;
  const sources = [...new Set(msg.tokens.map(([, s]) => s))];
  return el("div", { class: "legend" }, sources.map((s) => el("span", { class: sourceClass(s) }, s === "target" ? "target's own" : `accepted ${s} draft`)));
}

function messageNode(msg) {
  if (msg.role === "user") return el("div", { class: "msg user" }, msg.content);
  const body = el("div", { class: "body" });
  renderBody(body, msg);
  const node = el("div", { class: `msg assistant${msg.error ? " error" : ""}` }, body, legend(msg), statsLine(msg));
  if (msg.error) node.append(el("div", { class: "stats" }, msg.error));
  return node;
}

function renderAll() {
  const list = $("#chat-conversations");
  list.replaceChildren(...state.chats.map((c) => el("li", { class: c.id === state.current ? "active" : "", onclick: () => select(c.id) },
    el("span", {}, c.title),
    el("button", { type: "button", title: "Delete", onclick: (e) => { e.stopPropagation(); remove(c.id); } }, "×"))));
  const box = $("#chat-messages");
  box.replaceChildren(...chat().messages.map(messageNode));
  box.scrollTop = box.scrollHeight;
  $("#chat-regenerate").disabled = !!running || !chat().messages.some((m) => m.role === "user");
}

function select(id) {
  if (running) return;
  state.current = id;
  save();
  renderAll();
}

function remove(id) {
  if (running) return;
  state.chats = state.chats.filter((c) => c.id !== id);
  if (!state.chats.length) newChat();
  if (!state.chats.some((c) => c.id === state.current)) state.current = state.chats[0].id;
  save();
  renderAll();
}

// -- sending ------------------------------------------------------------------------------

async function generate() {
  const c = chat();
  const s = readSettings();
  const history = c.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const messages = s.system.trim() ? [{ role: "system", content: s.system }, ...history] : history;
  const reply = { role: "assistant", content: "", tokens: [], settings: { mode: s.mode, max_draft: s.max_draft } };
  c.messages.push(reply);
  const controller = new AbortController();
  running = { controller, reply };
  setBusy(true);
  renderAll();
  const node = $("#chat-messages").lastElementChild;
  const body = node.querySelector(".body");
  let pending = false;
  const paint = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; renderBody(body, reply); $("#chat-messages").scrollTop = 1e9; });
  };
  try {
    await stream("/v1/chat/completions", { method: "POST", body: requestBody(messages, s), signal: controller.signal }, (_, chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) reply.content += choice.delta.content;
      if (choice?.finish_reason) reply.finish = choice.finish_reason;
      if (chunk.mlx_dspark?.tokens) reply.tokens.push(...chunk.mlx_dspark.tokens);
      else if (chunk.mlx_dspark) reply.stats = chunk.mlx_dspark;
      paint();
    });
  } catch (e) {
    if (e.name === "AbortError") reply.finish = "stopped";
    else reply.error = e.message;
  } finally {
    running = null;
    setBusy(false);
    save();
    renderAll();
  }
}

function setBusy(busy) {
  $("#chat-send").disabled = busy;
  $("#chat-stop").disabled = !busy;
  $("#chat-regenerate").disabled = busy;
}

function send() {
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || running) return;
  const c = chat();
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.slice(0, 40);
  input.value = "";
  generate();
}

function stop() {
  running?.controller.abort();
}

function regenerate() {
  if (running) return;
  const c = chat();
  while (c.messages.length && c.messages.at(-1).role !== "user") c.messages.pop();
  if (c.messages.length) generate();
}

export function init() {
  load();
  const mode = $("#set-mode");
  mode.replaceChildren(el("option", { value: "" }, `server default (${server.default_mode ?? "auto"})`),
    ...(server.modes || []).map((m) => el("option", { value: m }, m)));
  for (const k of SETTINGS) {
    if (state.settings[k] !== undefined) $(`#set-${k}`).value = state.settings[k];
    $(`#set-${k}`).addEventListener("change", readSettings);
  }
  readSettings();
  $("#chat-colour").checked = state.colour;
  $("#chat-colour").addEventListener("change", (e) => { state.colour = e.target.checked; save(); renderAll(); });
  $("#chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("#chat-stop").addEventListener("click", stop);
  $("#chat-regenerate").addEventListener("click", regenerate);
  $("#chat-new").addEventListener("click", () => { if (!running) { newChat(); renderAll(); $("#chat-input").focus(); } });
  $("#chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && running) { e.preventDefault(); stop(); } });
  renderAll();
}

export function show() {
  $("#chat-input").focus();
}
