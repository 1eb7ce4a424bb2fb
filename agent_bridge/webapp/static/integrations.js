// Per client: the config `mlx-dspark integrate CLIENT` writes (GET /v1/integrations), a copy
// button, and "write it" (POST /v1/integrations/CLIENT/write: the same merge and backups).
import { $, api, copyText, el, fmt } from "./app.js";

function seenBadge(seen) {
  return seen ? el("span", { class: "badge ok", title: seen.user_agent }, `seen: ${seen.requests} requests, ${fmt.ago(seen.last_seen)}`)
    : el("span", { class: "badge" }, "not seen yet");
}

function clientCard(c, scope, transport) {
  const status = el("span", { class: "muted" });
  let armed = false;
  const write = el("button", { type: "button", class: "primary", onclick: async () => {
    if (!armed) {
      armed = true;
      write.textContent = "Write these files? Click again";
      setTimeout(() => { armed = false; write.textContent = "Write it"; }, 4000);
      return;
    }
    armed = false;
    write.textContent = "Write it";
    status.textContent = "writing…";
    try {
      const out = await api(`/v1/integrations/${c.client}/write`, { method: "POST", body: { scope, transport } });
      status.textContent = out.written.map((w) => `wrote ${w.path}${w.backup ? ` (backup ${w.backup})` : ""}`).join("; ");
    } catch (e) {
      status.textContent = `not written: ${e.message}`;
    }
  } }, "Write it");
  return el("div", { class: "client", "data-client": c.client },
    el("h3", {}, c.client, seenBadge(c.seen)),
    c.files.map((f) => el("div", {},
      el("div", { class: "file-head" }, el("span", {}, f.about), el("code", {}, f.path),
        el("button", { type: "button", onclick: (e) => copy(f.text, e.target) }, "Copy")),
      el("pre", {}, f.text))),
    el("div", { class: "file-head" }, write, status));
}

function copy(text, button) {
  const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1500); };
  copyText(text).then(done, () => { button.textContent = "Copy failed"; });
}

async function load() {
  const scope = $("#int-scope").value;
  const transport = $("#int-transport").value;
  const data = await api(`/v1/integrations?scope=${scope}&transport=${transport}`);
  const seen = Object.entries(data.seen);
  $("#int-seen tbody").replaceChildren(...(seen.length ? seen.map(([name, s]) => el("tr", {}, el("td", {}, name), el("td", {}, s.requests),
    el("td", {}, fmt.ago(s.last_seen)), el("td", {}, s.user_agent || "–"))) : [el("tr", {}, el("td", { colspan: 4, class: "muted" }, "none yet"))]));
  $("#int-clients").replaceChildren(...data.clients.map((c) => clientCard(c, scope, transport)));
  document.body.dataset.integrationsReady = "1";
}

export function init() {
  $("#int-scope").addEventListener("change", () => load().catch(() => {}));
  $("#int-transport").addEventListener("change", () => load().catch(() => {}));
}

export function show() {
  load().catch((e) => { $("#int-clients").replaceChildren(el("p", {}, `integrations: ${e.message}`)); });
}
