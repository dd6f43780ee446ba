// kvroute dashboard: renders the frames /dashboard/events sends (one a second). No build step, no libraries.
"use strict";

const PAGE_SIZE = 50;                 // worker rows per model group and page: 1000 workers stay quick
const ui = { frame: null, pages: {}, closed: {}, filter: "", problems: false, token: null, scale: {} };
const $ = (id) => document.getElementById(id);

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
const num = (v, digits = 1) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits));
const pct = (v) => (v === null || v === undefined ? "-" : `${Math.round(v * 100)}%`);
function secs(v) {
  if (v === null || v === undefined) return "-";
  return v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
}
function uptime(s) {
  if (s === null || s === undefined) return "-";
  s = Math.floor(s);
  if (s >= 86400) return `${Math.floor(s / 86400)}d${Math.floor((s % 86400) / 3600)}h`;
  if (s >= 3600) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
}
function spark(series) {
  if (!series || series.length < 2) return '<svg class="spark"></svg>';
  const max = Math.max(...series, 1e-9);
  const pts = series.map((v, i) => `${(i / (series.length - 1)) * 120},${19 - (v / max) * 18}`).join(" ");
  return `<svg class="spark" viewBox="0 0 120 20" preserveAspectRatio="none"><polyline points="${pts}"/></svg>`;
}
function kvBar(w) {
  if (w.kv === null || w.kv === undefined) return '<span class="muted">no reading</span>';
  const used = Math.min(Math.max(w.kv, 0), 1);
  const proj = Math.min(Math.max(w.kv_projected ?? w.kv, 0), 1);
  return `<span class="kvbar" data-kv="${used}" title="reported ${pct(w.kv)}, with what the proxy sent since: ${pct(w.kv_projected)}">` +
    `<span class="fill${used >= 0.9 ? " hi" : ""}" style="width:${used * 100}%"></span>` +
    `<span class="proj" style="left:calc(${proj * 100}% - 1px)"></span></span> <span class="kvtext">${pct(w.kv)}</span>`;
}
function engineCell(w) {
  const role = w.role && w.role !== "both" ? ` <span class="muted" title="its role in a disaggregated model">· ${esc(w.role)}</span>` : "";
  return engineName(w) + role;
}
function engineName(w) {
  if (w.effective_engine && w.engine && w.effective_engine !== w.engine && w.effective_engine !== "unknown") {
    return `${esc(w.engine)} <span class="muted" title="the engine that actually runs">→ ${esc(w.effective_engine)}</span>`;
  }
  return esc(w.effective_engine || w.engine || "-");
}

function renderModels(f) {
  const rows = f.models.map((m) => `<tr data-model="${esc(m.name)}">
    <td>${esc(m.name)}</td>
    <td class="num">${m.ready}/${m.desired ?? m.workers}</td>
    <td class="num">${num(m.req_per_s)}</td>
    <td>${spark(m.series)}</td>
    <td class="num">${secs(m.ttft_p50_s)}</td>
    <td class="num">${secs(m.ttft_p99_s)}</td>
    <td class="num${m.errors ? " err" : ""}">${m.errors}</td>
    <td class="num${m.rejected ? " err" : ""}">${m.rejected}</td>
    <td class="num">${m.queued}</td>
    <td class="admin-only">${f.managed && m.pooled ? '<span class="muted">per pool: kvroute scale --role</span>' : f.managed ? `<input type="number" min="0" value="${ui.scale[m.name] ?? m.desired ?? m.workers}" size="3" data-scale-input="${esc(m.name)}"> <button data-scale="${esc(m.name)}">scale</button>` : '<span class="muted">needs kvroute up</span>'}</td>
  </tr>`);
  $("models").tBodies[0].innerHTML = rows.join("") || '<tr><td colspan="10" class="muted">no models yet</td></tr>';
  const w = f.windows;
  $("windows").textContent = `req/s over the last ${w.rate_s} s; TTFT (time to first byte) over the last ${w.ttft_s} s; ` +
    `errors and rejections over the last ${Math.round(w.errors_s / 60)} min.`;
}

function matches(w) {
  if (ui.problems && w.state === "ready") return false;
  if (!ui.filter) return true;
  const hay = `${w.id} ${w.host} ${w.state} ${w.reason} ${w.engine} ${w.effective_engine} ${w.role || ""}`.toLowerCase();
  return hay.includes(ui.filter);
}

function workerRow(w) {
  return `<tr data-worker-id="${esc(w.id)}" data-state="${esc(w.state)}">
    <td>${esc(w.id)}</td>
    <td><span class="state st-${esc(w.state)}">${esc(w.state)}</span> <span class="reason" title="${esc(w.reason)}">${esc(w.reason)}</span></td>
    <td>${engineCell(w)}</td>
    <td>${esc(w.host)}</td>
    <td>${esc((w.gpus || []).join(",") || "-")}</td>
    <td>${kvBar(w)}</td>
    <td class="num">${w.running ?? "-"}</td>
    <td class="num">${w.waiting ?? "-"}</td>
    <td class="num">${pct(w.prefix_hit_rate)}</td>
    <td class="num">${num(w.req_per_s)}</td>
    <td class="num">${uptime(w.uptime_s)}</td>
    <td class="admin-only">${w.state === "draining" || w.kv_projected === null ? "" : `<button data-drain="${esc(w.id)}">drain</button>`}</td>
  </tr>`;
}

function renderWorkers(f) {
  const byModel = new Map();
  for (const w of f.workers) {
    if (!byModel.has(w.model)) byModel.set(w.model, []);
    byModel.get(w.model).push(w);
  }
  const shown = [];
  let total = 0;
  for (const [model, all] of byModel) {
    const list = all.filter(matches);
    total += list.length;
    const pages = Math.max(1, Math.ceil(list.length / PAGE_SIZE));
    const page = Math.min(ui.pages[model] || 0, pages - 1);
    ui.pages[model] = page;
    const ready = all.filter((w) => w.state === "ready").length;
    const slice = list.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE);
    const pager = pages > 1 ? `<div class="pager"><button data-page="${esc(model)}" data-step="-1">‹ prev</button>
      page ${page + 1} of ${pages} (${list.length} workers) <button data-page="${esc(model)}" data-step="1">next ›</button></div>` : "";
    shown.push(`<details class="group" data-group="${esc(model)}"${ui.closed[model] ? "" : " open"}>
      <summary>${esc(model)} <span class="muted">${ready}/${all.length} ready</span></summary>${pager}
      <table class="grid"><thead><tr><th>worker</th><th>state</th><th>engine</th><th>host</th><th>GPUs</th><th>KV cache</th>
      <th class="num">running</th><th class="num">waiting</th><th class="num">prefix hit</th><th class="num">req/s</th>
      <th class="num">uptime</th><th class="admin-only"></th></tr></thead>
      <tbody>${slice.map(workerRow).join("")}</tbody></table></details>`);
  }
  $("groups").innerHTML = shown.join("") || '<p class="muted">no workers registered</p>';
  $("worker-count").textContent = `(${total} shown of ${f.workers.length})`;
}

function render() {
  const f = ui.frame;
  if (!f) return;
  renderModels(f);
  renderWorkers(f);
  $("updated").textContent = `updated ${new Date(f.at * 1000).toLocaleTimeString()}`;
}

// --- live updates ------------------------------------------------------------------------------
function connect() {
  const source = new EventSource("/dashboard/events");
  source.onmessage = (ev) => {
    ui.frame = JSON.parse(ev.data);
    $("conn").className = "conn conn-live";
    $("conn").textContent = "live";
    render();
  };
  source.onerror = () => {  // EventSource reconnects by itself (retry: 2000 from the server)
    $("conn").className = "conn conn-wait";
    $("conn").textContent = "reconnecting…";
  };
}

// --- admin actions (only with a token that the control plane accepts) --------------------------------
async function admin(method, path, body) {
  const resp = await fetch(path, {
    method, headers: { Authorization: `Bearer ${ui.token}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  if (!resp.ok) {
    let message = text;
    try { message = JSON.parse(text).error.message; } catch (_) { /* not OpenAI's error body */ }
    throw new Error(`${resp.status}: ${message}`);
  }
  return text;
}

async function useToken(token) {
  ui.token = token;
  try {
    await admin("GET", "/workers");
    document.body.classList.add("admin");
    sessionStorage.setItem("kvroute-admin-token", token);
    $("admin-state").textContent = "admin";
    $("admin-msg").textContent = "Token accepted: drain and scale are available.";
    $("admin-form").hidden = true;
  } catch (e) {
    ui.token = null;
    document.body.classList.remove("admin");
    sessionStorage.removeItem("kvroute-admin-token");
    $("admin-state").textContent = "read-only";
    $("admin-msg").textContent = `The control plane refused this token (${e.message}).`;
  }
}

function flash(message) {
  $("admin-msg").textContent = message;
  $("admin-form").hidden = false;
}

document.addEventListener("click", async (ev) => {
  const t = ev.target;
  if (!(t instanceof HTMLElement)) return;
  if (t.dataset.page) {
    ui.pages[t.dataset.page] = Math.max(0, (ui.pages[t.dataset.page] || 0) + Number(t.dataset.step));
    render();
  } else if (t.dataset.drain && ui.token) {
    if (!confirm(`Drain ${t.dataset.drain}? It finishes its requests and takes no new ones.`)) return;
    try { await admin("POST", `/workers/${encodeURIComponent(t.dataset.drain)}/drain`); } catch (e) { flash(`drain failed: ${e.message}`); }
  } else if (t.dataset.scale && ui.token) {
    const input = document.querySelector(`input[data-scale-input="${CSS.escape(t.dataset.scale)}"]`);
    try {
      await admin("POST", "/fleet/scale", { model: t.dataset.scale, replicas: Number(input.value) });
      delete ui.scale[t.dataset.scale];
    } catch (e) { flash(`scale failed: ${e.message}`); }
  }
});
document.addEventListener("toggle", (ev) => {
  const d = ev.target;
  if (d instanceof HTMLDetailsElement && d.dataset.group) ui.closed[d.dataset.group] = !d.open;
}, true);
document.addEventListener("input", (ev) => {  // a half-typed replica count survives the next frame
  const t = ev.target;
  if (t instanceof HTMLInputElement && t.dataset.scaleInput) ui.scale[t.dataset.scaleInput] = t.value;
});
$("filter").addEventListener("input", (ev) => { ui.filter = ev.target.value.trim().toLowerCase(); render(); });
$("problems").addEventListener("change", (ev) => { ui.problems = ev.target.checked; render(); });
$("admin-btn").addEventListener("click", () => { $("admin-form").hidden = !$("admin-form").hidden; $("admin-token").focus(); });
$("admin-form").addEventListener("submit", (ev) => { ev.preventDefault(); useToken($("admin-token").value); });
$("admin-clear").addEventListener("click", () => {
  ui.token = null;
  sessionStorage.removeItem("kvroute-admin-token");
  document.body.classList.remove("admin");
  $("admin-state").textContent = "read-only";
});

const saved = sessionStorage.getItem("kvroute-admin-token");
if (saved) useToken(saved);
connect();
