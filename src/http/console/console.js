// The operator's console: reads /admin/status, /admin/history and /admin/projects every two
// seconds with the admin token, and renders them. Everything from agents, upstreams or
// clients is put in the page as text (textContent), never as HTML. The token lives in this
// tab's sessionStorage only, goes out as a bearer, never in a URL; signing out forgets it.
"use strict";

const POLL_MS = 2000;
const STALE_MS = 3 * POLL_MS;
const TOKEN_KEY = "fantom-console-token";

let token = sessionStorage.getItem(TOKEN_KEY);
let lastOk = 0;
let lastError = "";
let samples = [];
let timer = null;

const $ = (id) => document.getElementById(id);

// An element with attributes and children; strings become text nodes.
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

// A table in a region that scrolls sideways in a narrow window (focusable, so a keyboard
// can scroll it too), named by `label`.
function table(headers, rows, label) {
  if (!rows.length) return el("p", { class: "muted" }, "None.");
  const name = label || headers.join(", ");
  return el("div", { class: "scroll", id: "region-" + name.toLowerCase().replace(/[^a-z0-9]+/g, "-"), tabindex: 0, role: "region", "aria-label": name }, el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, c)))))));
}

function word(ok, yes, no) {
  return el("span", { class: ok ? "good" : "bad" }, ok ? yes : no);
}

function ago(ms) {
  if (!ms) return "never";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return s + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  return Math.round(s / 3600) + " h ago";
}

function duration(s) {
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

async function api(path, options) {
  const init = Object.assign({ headers: {} }, options || {});
  init.headers = Object.assign({ Authorization: "Bearer " + token }, init.headers);
  init.cache = "no-store";
  const r = await fetch(path, init);
  let body = null;
  try { body = await r.json(); } catch (_) { body = null; }
  if (!r.ok) {
    const message = body && body.error && body.error.message ? body.error.message : "HTTP " + r.status;
    const e = new Error(message);
    e.status = r.status;
    throw e;
  }
  return body;
}

function showSignedIn(on) {
  $("sign-in-section").hidden = on;
  $("views").hidden = !on;
  $("sign-out").hidden = !on;
}

function signOut(message) {
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  if (timer) clearTimeout(timer);
  timer = null;
  samples = [];
  projectsShown = "";
  showSignedIn(false);
  $("freshness").textContent = "Not signed in";
  $("sign-in-error").textContent = message || "";
}

// ---- views

function renderHa(status) {
  const ha = status.ha || {};
  const rows = [["This hub", ha.role || "?"], ["State store", ha.store || "?"]];
  if (ha.leader) rows.push(["Leader", ha.leader]);
  if (ha.epoch !== undefined) rows.push(["Epoch", ha.epoch]);
  rows.push(["Fenced", ha.fenced ? el("span", { class: "bad" }, "yes: " + ha.fenced) : word(true, "no", "")]);
  if (ha.aside) rows.push(["Stepped aside", el("span", { class: "bad" }, JSON.stringify(ha.aside))]);
  if (ha.peers) rows.push(["Other hubs", ha.peers.join(", ") || "none"]);
  const out = [table(["", ""], rows, "This hub's HA")];
  if (status.leader_unreachable) {
    out.push(el("p", { class: "bad" }, "This hub is a standby and the leader's data is missing: " + status.leader_unreachable));
  }
  if (status.leader_ha) {
    out.push(el("p", { id: "through-standby" }, "This page is served through a standby; the data below is the leader's."));
    out.push(table(["Leader", ""], [["Role", status.leader_ha.role || "?"], ["Epoch", status.leader_ha.epoch ?? "?"]], "The leader's HA"));
  }
  $("ha").replaceChildren(...out);
}

function renderFleet(status) {
  const rows = [];
  for (const a of status.agents || []) {
    for (const p of a.providers || []) {
      const flags = [];
      if (p.stale) flags.push("stale config: " + p.stale);
      if (a.needs_key_push) flags.push("needs the key");
      if (p.benched) flags.push("benched");
      if (p.paused) flags.push("paused");
      if (a.draining) flags.push("draining");
      rows.push([
        a.id, a.hostname, duration(a.connected_s || 0), p.role, p.provider,
        p.backend + (p.device ? " on " + p.device : ""), p.dtype || "", p.model || "",
        p.latency_ewma_ms != null ? Math.round(p.latency_ewma_ms) + " ms" : "",
        p.in_flight, p.credits,
        flags.length ? el("span", { class: "bad" }, flags.join("; ")) : el("span", { class: "good" }, "serving"),
      ]);
    }
    if (!(a.providers || []).length) {
      const state = a.draining ? "draining: finishing " + a.leases + " leases" : "idle";
      rows.push([a.id, a.hostname, duration(a.connected_s || 0), "", "no providers", "", "", "", "", "", "", el("span", { class: "warn" }, state)]);
    }
  }
  $("fleet").replaceChildren(table(
    ["Agent", "Host", "Session", "Role", "Provider", "Backend", "dtype", "Model", "Latency", "In flight", "Credits", "State"], rows));
}

// "code: n, code: n", or "none".
function counts(map) {
  const parts = Object.entries(map || {}).map(([k, n]) => k + ": " + n);
  return parts.length ? parts.join(", ") : "none";
}

// Items waiting per class and project: "interactive: a 2; batch: a 4, b 3".
function waiting(w) {
  const parts = Object.entries(w || {}).map(([cls, per]) =>
    cls + ": " + Object.entries(per).map(([p, n]) => p + " " + n).join(", "));
  return parts.length ? parts.join("; ") : "nothing waiting";
}

function waits(q) {
  if (!q) return el("span", { class: "muted" }, "none leased in the last minute");
  return "p50 " + Math.round(q.p50) + " ms, p99 " + Math.round(q.p99) + " ms (" + q.count + " in " + q.window_s + " s)";
}

function renderRoles(status) {
  const head = ["Role", "Policy", "Readiness", "Queued", "Waiting by class and project", "Queue wait", "Leases", "Items in flight", "Refused", "Failed"];
  const rows = Object.entries(status.roles || {}).map(([role, r]) => el("tr", { id: "role-" + role },
    el("th", { scope: "row" }, role), el("td", {}, r.policy),
    el("td", {}, r.unservable ? el("span", { class: "bad" }, "not ready (" + r.unservable.code + "): " + r.unservable.message) : word(true, "ready", "")),
    el("td", {}, r.queue_depth), el("td", { class: "waiting" }, waiting(r.waiting)), el("td", {}, waits(r.wait_ms)),
    el("td", {}, r.leases), el("td", {}, r.items_in_flight),
    el("td", { class: "refused" }, counts(r.refused)), el("td", {}, counts(r.failed))));
  $("roles").replaceChildren(el("div", { class: "scroll", id: "region-roles", tabindex: 0, role: "region", "aria-label": "Roles and queues" }, el("table", {},
    el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows))));
}

const GATE_EVENTS = ["suspended", "refused", "verify", "migration"];
const BUDGET_EVENTS = ["cooldown", "wall", "stopped", "resumed", "override"];

// Events of `kinds`, newest first, as a table with their times.
function eventTable(status, kinds, label) {
  const rows = (status.events || []).filter((e) => kinds.includes(e.kind)).reverse().map((e) => [
    el("time", { datetime: new Date(e.t_ms).toISOString() }, new Date(e.t_ms).toLocaleTimeString() + " (" + ago(e.t_ms) + ")"),
    el("span", { class: e.kind === "resumed" || e.kind === "override" || e.kind === "verify" ? "" : "bad" }, e.kind),
    e.subject, e.detail,
  ]);
  return table(["When", "Event", "About", "What happened"], rows, label);
}

function renderSpaces(status) {
  const gate = status.gate || {};
  const spaces = (gate.spaces || []).map((s) => [
    s.id, s.generation, s.model, s.dims, s.live || "stored, not served",
    Object.entries(s.rows || {}).map(([p, n]) => p + ": " + n).join(", "),
  ]);
  const verdicts = (gate.verdicts || []).map((v) => {
    const state = v.state || "?";
    const why = v.reason || v.error || "";
    return [
      v.provider, v.space,
      el("span", { class: state === "pass" ? "good" : "bad" }, state + (why ? ": " + why : "")),
      v.evidence ? v.evidence.min_cosine.toFixed(4) : "",
      v.checks, v.checked_at_ms ? ago(v.checked_at_ms) : "", v.caught_by || "",
    ];
  });
  const scorers = (status.scorers || []).map((s) => [s.provider || "", s.scorer || s.claimed || "", s.state + (s.error ? ": " + s.error : "")]);
  $("spaces").replaceChildren(
    table(["Space", "Generation", "Model", "Dims", "State", "Rows by provider"], spaces),
    el("h3", {}, "Migrations"),
    renderMigrations(status),
    el("h3", {}, "Verdicts"),
    table(["Provider", "Space", "Verdict", "Lowest cosine", "Checks", "Judged", "Caught by"], verdicts),
    el("h3", {}, "Scorers"),
    table(["Reranker", "Scores as", "State"], scorers),
    el("h3", {}, "Suspensions, refusals and verifies"),
    el("div", { id: "gate-events" }, eventTable(status, GATE_EVENTS, "Gate events")));
}

// Each embedding role's live spaces, with the steps that apply (each asks to confirm).
function renderMigrations(status) {
  const roles = status.migrations || [];
  if (!roles.length) return el("p", { class: "muted" }, "No embedding role has a space yet.");
  return el("div", { id: "migrations" }, roles.map((m) => {
    const row = (s) => [
      s.live, s.id || "(named when its founder connects)", s.policy,
      s.passing.length ? s.passing.join(", ") : word(false, "", "none"),
      s.rows, s.tokens,
      Object.entries(s.rows_by_project || {}).map(([p, n]) => p + ": " + n).join(", "),
    ];
    const rows = [m.current, m.next, m.previous].filter(Boolean).map(row);
    const actions = el("p", {});
    if (m.next) {
      actions.append(el("button", { type: "button", "data-migration": "cutover", "data-role": m.role }, "Cut over to the next space"));
      actions.append(el("button", { type: "button", "data-migration": "abort", "data-role": m.role }, "Abort the migration"));
    }
    if (m.previous) {
      actions.append(el("button", { type: "button", "data-migration": "close", "data-role": m.role }, "Close the previous space"));
    }
    return el("div", {},
      el("h4", {}, "Role " + m.role + (m.next ? ": migrating" : "")),
      table(["Space", "Id", "Policy", "Passing providers", "Rows", "Tokens", "Rows by project"], rows, "Spaces of " + m.role),
      actions);
  }));
}

const MIGRATION_CONFIRM = {
  cutover: "Cut over? Unpinned requests are served in the next space from now on; the current space stays served to pinned requests until you close it.",
  abort: "Abort the migration? Requests pinned to the next space are refused from now on.",
  close: "Close the previous space? Requests pinned to it are refused from now on.",
};

function renderBudget(status) {
  const b = status.budget || {};
  const rows = [
    ["Ceiling", b.ceiling + " (" + b.ceiling_source + ")"],
    ["Limit now", b.limit],
    ["In flight", b.in_flight],
    ["Override", b.override_permits ?? "none"],
    ["Cooling down", b.cooldown_remaining_ms > 0 ? el("span", { class: "warn" }, "yes, " + Math.ceil(b.cooldown_remaining_ms / 1000) + " s left") : "no"],
    ["Stopped", b.stopped || b.key_rejected ? el("span", { class: "bad" }, b.stopped || b.key_rejected) : "no"],
    ["Throttles (429s) so far", b.throttles],
    ["Account", b.funded === false ? el("span", { class: "bad" }, "not funded") : (b.funded ? "funded" : "not known yet")],
  ];
  if (b.rpm != null) rows.push(["Requests per minute", b.rpm]);
  $("budget").replaceChildren(table(["", ""], rows, "Budget"));
  $("budget-events").replaceChildren(eventTable(status, BUDGET_EVENTS, "Budget events"));
  renderChart();
}

function renderChart() {
  const w = 900, h = 200, pad = 30;
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${w} ${h + 20}`, role: "img", "aria-label": "Budget over the last 15 minutes" });
  if (samples.length < 2) {
    const t = svg("text", { x: pad, y: h / 2 });
    t.textContent = samples.length ? "Collecting samples…" : "No samples yet: this hub started or took over a moment ago.";
    root.append(t);
    $("budget-chart").replaceChildren(root, legend());
    return;
  }
  const t0 = samples[0].t_ms, t1 = samples[samples.length - 1].t_ms;
  const top = Math.max(1, ...samples.map((s) => Math.max(s.ceiling, s.limit, s.in_flight)));
  const x = (t) => pad + ((t - t0) / Math.max(1, t1 - t0)) * (w - 2 * pad);
  const y = (v) => h - (v / top) * (h - pad) ;
  for (let i = 1; i < samples.length; i++) {
    const s = samples[i];
    if (s.cooling || s.stopped) {
      root.append(svg("rect", { class: s.stopped ? "stopped" : "cooling", x: x(samples[i - 1].t_ms), y: 0, width: Math.max(1, x(s.t_ms) - x(samples[i - 1].t_ms)), height: h }));
    }
  }
  root.append(svg("line", { class: "axis", x1: pad, y1: h, x2: w - pad, y2: h }));
  const line = (key, cls) => svg("polyline", { class: cls, points: samples.map((s) => x(s.t_ms).toFixed(1) + "," + y(s[key]).toFixed(1)).join(" ") });
  root.append(line("ceiling", "ceiling"), line("limit", "limit"), line("in_flight", "in-flight"));
  for (let i = 1; i < samples.length; i++) {
    if (samples[i].throttles > samples[i - 1].throttles) {
      const px = x(samples[i].t_ms);
      root.append(svg("polygon", { class: "throttle", points: `${px - 5},${h + 14} ${px + 5},${h + 14} ${px},${h + 5}` }));
    }
  }
  const label = (text, lx, ly) => { const t = svg("text", { x: lx, y: ly }); t.textContent = text; return t; };
  root.append(label(String(top), 2, pad), label("0", 2, h), label(Math.round((t1 - t0) / 60000) + " min ago", pad, h + 18), label("now", w - pad - 20, h + 18));
  $("budget-chart").replaceChildren(root, legend());
}

function legend() {
  return el("p", { class: "legend" },
    el("span", {}, "solid blue: limit"), el("span", {}, "dashed grey: ceiling"),
    el("span", {}, "solid green: in flight"), el("span", {}, "▲ throttle"));
}

const LIMITS = [
  ["max_queued_items", "Items queued at most", "1"],
  ["max_cloud_in_flight", "Cloud calls in flight at most", "1"],
  ["cloud_tokens_per_day", "Cloud tokens per UTC day", "1"],
  ["cloud_usd_per_day", "Cloud US$ per UTC day", "0.01"],
];

// A project's limits and today's use against each, in words.
function limitsText(p) {
  const limits = p.limits || {};
  const today = (p.usage && p.usage.today) || {};
  const out = [];
  if (limits.max_queued_items != null) out.push((p.usage ? p.usage.items_queued : 0) + " of " + limits.max_queued_items + " items queued");
  if (limits.max_cloud_in_flight != null) out.push((p.usage ? p.usage.cloud_in_flight : 0) + " of " + limits.max_cloud_in_flight + " cloud calls in flight");
  if (limits.cloud_tokens_per_day != null) out.push((today.cloud_tokens || 0) + " of " + limits.cloud_tokens_per_day + " cloud tokens today");
  if (limits.cloud_usd_per_day != null) out.push("$" + (today.cloud_usd || 0).toFixed(4) + " of $" + limits.cloud_usd_per_day + " today");
  if (today.over) out.push("over: " + today.over);
  return out.length ? out.join("; ") : "no limits";
}

// The edit form of a project: its weight and limits (an empty limit field means none).
function editForm(p) {
  const id = (k) => "edit-" + p.name + "-" + k;
  const limits = p.limits || {};
  const fields = [el("label", { for: id("weight") }, "Weight"),
    el("input", { id: id("weight"), name: "weight", type: "number", min: 1, max: 1000, required: true, value: p.weight ?? 1 })];
  for (const [key, label, step] of LIMITS) {
    fields.push(el("label", { for: id(key) }, label),
      el("input", { id: id(key), name: key, type: "number", min: 0, step, value: limits[key] ?? "", placeholder: "none" }));
  }
  return el("details", { "data-project": p.name },
    el("summary", {}, "Edit " + p.name),
    el("form", { "data-edit": p.name }, fields, el("button", { type: "submit" }, "Save")));
}

let projectsShown = "";

function renderProjects(list) {
  const box = $("projects");
  // An operator editing a project keeps what they typed: the table waits for them.
  if (box.contains(document.activeElement) && document.activeElement.matches("input, select")) return;
  const shown = JSON.stringify(list.projects || []);
  if (shown === projectsShown) return;
  projectsShown = shown;
  const open = new Set([...box.querySelectorAll("details[open]")].map((d) => d.getAttribute("data-project")));
  const rows = (list.projects || []).map((p) => {
    const today = (p.usage && p.usage.today) || {};
    const actions = el("span", { class: "actions" });
    if (p.has_key) {
      actions.append(el("button", { type: "button", "data-rotate": p.name }, "Rotate key"));
    }
    if (p.name !== "default") {
      actions.append(el("button", { type: "button", "data-remove": p.name }, "Remove"));
    }
    const edit = editForm(p);
    if (open.has(p.name)) edit.open = true;
    return [p.name, String(p.weight ?? 1), limitsText(p), "$" + (today.cloud_usd || 0).toFixed(4),
      (p.usage ? p.usage.requests : 0) + " requests, " + (today.cloud_tokens || 0) + " cloud tokens today",
      counts(p.usage && p.usage.refused), el("div", {}, actions, edit)];
  });
  box.replaceChildren(table(["Project", "Weight", "Limits and today's use", "Cloud spend today", "Use", "Refusals", ""], rows, "Projects"));
}

// What the edit form asks for: the weight, and each limit (null: none).
function editPatch(form) {
  const patch = { weight: Number(form.elements.weight.value), limits: {} };
  for (const [key] of LIMITS) {
    const v = form.elements[key].value.trim();
    patch.limits[key] = v === "" ? null : Number(v);
  }
  return patch;
}

function showKey(project, key) {
  $("key-project").textContent = project;
  $("key-value").value = key;
  $("copy-result").textContent = "";
  $("new-key").hidden = false;
  $("key-value").focus();
  $("key-value").select();
}

// ---- the loop

// A selector that finds the focused element again after the views are drawn anew (a
// keyboard user's place survives the refresh), or null.
function focusedSelector() {
  const e = document.activeElement;
  if (!e || e === document.body) return null;
  if (e.id) return "#" + CSS.escape(e.id);
  for (const attr of ["data-rotate", "data-remove"]) {
    if (e.hasAttribute(attr)) return "button[" + attr + '="' + CSS.escape(e.getAttribute(attr)) + '"]';
  }
  const d = e.closest("details[data-project]");
  if (d && e.tagName === "SUMMARY") return 'details[data-project="' + CSS.escape(d.getAttribute("data-project")) + '"] > summary';
  return null;
}

async function refresh() {
  timer = null;
  if (!token) return;
  try {
    const since = samples.length ? samples[samples.length - 1].t_ms : 0;
    const [status, history, projects] = await Promise.all([
      api("/admin/status"),
      api("/admin/history" + (since ? "?since_ms=" + since : "")),
      api("/admin/projects"),
    ]);
    samples = samples.concat(history.samples || []);
    const cutoff = Date.now() - (history.keep_s || 900) * 1000;
    samples = samples.filter((s) => s.t_ms >= cutoff);
    const focused = focusedSelector();
    renderHa(status); renderFleet(status); renderRoles(status); renderSpaces(status);
    renderBudget(status); renderProjects(projects);
    if (focused && (document.activeElement === document.body || !document.activeElement)) {
      const again = document.querySelector(focused);
      if (again) again.focus({ preventScroll: true });
    }
    lastOk = Date.now();
    lastError = "";
  } catch (e) {
    if (e.status === 401) { signOut(e.message); return; }
    lastError = e.message || String(e);
  }
  showFreshness();
  timer = setTimeout(refresh, POLL_MS);
}

// Reads again now (after an action), unless a read is already under way.
function refreshSoon() {
  if (!timer) return;
  clearTimeout(timer);
  refresh();
}

function showFreshness() {
  const f = $("freshness");
  if (!token) return;
  const age = Date.now() - lastOk;
  if (lastError && age > STALE_MS) {
    f.className = "stale";
    f.textContent = "The hub does not answer (" + lastError + "); the data shown is stale, from " + ago(lastOk) + ".";
  } else if (age > STALE_MS) {
    f.className = "stale";
    f.textContent = "Stale: last updated " + ago(lastOk) + ".";
  } else {
    f.className = "";
    f.textContent = "Live: updated every " + POLL_MS / 1000 + " s.";
  }
}

function start() {
  showSignedIn(true);
  lastOk = Date.now();
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  const loopback = ["localhost", "127.0.0.1", "[::1]", "::1"].includes(location.hostname);
  $("clear-text-warning").hidden = !(location.protocol === "http:" && !loopback);

  $("sign-in").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    $("token").value = "";
    try {
      await api("/admin/status");
      sessionStorage.setItem(TOKEN_KEY, token);
      $("sign-in-error").textContent = "";
      start();
    } catch (e) {
      signOut(e.message);
    }
  });
  $("sign-out").addEventListener("click", () => signOut("Signed out."));

  $("override").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      await api("/admin/budget", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ permits: Number($("permits").value) }) });
      $("override-result").textContent = "The override is set.";
      refreshSoon();
    } catch (e) { $("override-result").textContent = "Not set: " + e.message; }
  });
  $("clear-override").addEventListener("click", async () => {
    try {
      await api("/admin/budget", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ permits: null }) });
      $("override-result").textContent = "The override is cleared.";
      refreshSoon();
    } catch (e) { $("override-result").textContent = "Not cleared: " + e.message; }
  });

  $("new-project").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = $("project-name").value.trim();
    try {
      const made = await api("/admin/projects", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ name, weight: Number($("project-weight").value) }) });
      $("project-name").value = "";
      $("projects-result").textContent = "Project " + name + " created.";
      showKey(name, made.key);
      refreshSoon();
    } catch (e) { $("projects-result").textContent = "Not created: " + e.message; }
  });
  $("projects").addEventListener("click", async (ev) => {
    const target = ev.target;
    if (!(target instanceof HTMLButtonElement)) return;
    const rotate = target.getAttribute("data-rotate");
    const remove = target.getAttribute("data-remove");
    try {
      if (rotate && confirm("Rotate the key of " + rotate + "? The old key stops working at once.")) {
        const made = await api("/admin/projects/" + encodeURIComponent(rotate) + "/rotate", { method: "POST" });
        $("projects-result").textContent = "The key of " + rotate + " was rotated: the old key is refused from now on.";
        showKey(rotate, made.key);
      } else if (remove && confirm("Remove project " + remove + "? Its key stops working at once.")) {
        await api("/admin/projects/" + encodeURIComponent(remove), { method: "DELETE" });
        $("projects-result").textContent = "Project " + remove + " removed.";
        refreshSoon();
      }
    } catch (e) { $("projects-result").textContent = "Not done: " + e.message; }
  });
  $("projects").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = ev.target;
    const name = form.getAttribute("data-edit");
    try {
      await api("/admin/projects/" + encodeURIComponent(name), { method: "PATCH", headers: { "Content-Type": "application/json" }, body: JSON.stringify(editPatch(form)) });
      $("projects-result").textContent = "Project " + name + " saved.";
      document.activeElement.blur();
      projectsShown = "";
      refreshSoon();
    } catch (e) { $("projects-result").textContent = "Not saved: " + e.message; }
  });
  $("open-migration").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const backend = $("migration-backend").value;
    const founder = { backend, model: $("migration-model").value.trim() };
    const dims = $("migration-dims").value;
    if (dims) founder.dims = Number(dims);
    if (backend === "cloud") founder.provider = $("migration-provider").value.trim();
    const body = { role: $("migration-role").value, founder };
    if ($("migration-policy").value) body.policy = $("migration-policy").value;
    try {
      const done = await api("/admin/migrations", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
      $("migration-result").textContent = done.event;
      refreshSoon();
    } catch (e) { $("migration-result").textContent = "Not opened: " + e.message; }
  });
  $("spaces").addEventListener("click", async (ev) => {
    const target = ev.target;
    if (!(target instanceof HTMLButtonElement)) return;
    const step = target.getAttribute("data-migration");
    const role = target.getAttribute("data-role");
    if (!step || !role || !confirm("Role " + role + ": " + MIGRATION_CONFIRM[step])) return;
    try {
      const done = await api("/admin/migrations/" + encodeURIComponent(role) + "/" + step, { method: "POST" });
      $("migration-result").textContent = done.event;
      refreshSoon();
    } catch (e) { $("migration-result").textContent = "Not done: " + e.message; }
  });
  $("copy-key").addEventListener("click", async () => {
    const field = $("key-value");
    if (window.isSecureContext && navigator.clipboard) {
      try { await navigator.clipboard.writeText(field.value); $("copy-result").textContent = "Copied."; return; } catch (_) { /* fall back */ }
    }
    field.focus();
    field.select();
    $("copy-result").textContent = "Selected: press Ctrl+C (or ⌘C) to copy.";
  });
  $("dismiss-key").addEventListener("click", () => {
    $("key-value").value = "";
    $("new-key").hidden = true;
  });

  setInterval(showFreshness, 1000);
  if (token) start();
});
