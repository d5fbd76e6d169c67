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

function table(headers, rows) {
  if (!rows.length) return el("p", { class: "muted" }, "None.");
  return el("div", { class: "scroll" }, el("table", {},
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
  const out = [table(["", ""], rows)];
  if (status.leader_ha) {
    out.push(el("p", {}, "This page is served through a standby; the data below is the leader's."));
    out.push(table(["Leader", ""], [["Role", status.leader_ha.role || "?"], ["Epoch", status.leader_ha.epoch ?? "?"]]));
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
      if (p.draining) flags.push("draining");
      rows.push([
        a.id, a.hostname, duration(a.connected_s || 0), p.role, p.provider,
        p.backend + (p.device ? " on " + p.device : ""), p.dtype || "", p.model || "",
        p.latency_ewma_ms != null ? Math.round(p.latency_ewma_ms) + " ms" : "",
        p.in_flight, p.credits,
        flags.length ? el("span", { class: "bad" }, flags.join("; ")) : el("span", { class: "good" }, "serving"),
      ]);
    }
    if (!(a.providers || []).length) rows.push([a.id, a.hostname, duration(a.connected_s || 0), "", "no providers", "", "", "", "", "", "", el("span", { class: "warn" }, "idle")]);
  }
  $("fleet").replaceChildren(table(
    ["Agent", "Host", "Session", "Role", "Provider", "Backend", "dtype", "Model", "Latency", "In flight", "Credits", "State"], rows));
}

function renderRoles(status) {
  const head = ["Role", "Policy", "Readiness", "Queued", "Leases", "Items in flight"];
  const rows = Object.entries(status.roles || {}).map(([role, r]) => el("tr", { id: "role-" + role },
    el("th", { scope: "row" }, role), el("td", {}, r.policy),
    el("td", {}, r.unservable ? el("span", { class: "bad" }, "not ready (" + r.unservable.code + "): " + r.unservable.message) : word(true, "ready", "")),
    el("td", {}, r.queue_depth), el("td", {}, r.leases), el("td", {}, r.items_in_flight)));
  $("roles").replaceChildren(el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows))));
}

function renderSpaces(status) {
  const gate = status.gate || {};
  const spaces = (gate.spaces || []).map((s) => [
    s.id, s.generation, s.model, s.dims, s.current ? "current" : "retired",
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
    el("h3", {}, "Verdicts"),
    table(["Provider", "Space", "Verdict", "Lowest cosine", "Checks", "Judged", "Caught by"], verdicts),
    el("h3", {}, "Scorers"),
    table(["Reranker", "Scores as", "State"], scorers));
}

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
  $("budget").replaceChildren(table(["", ""], rows));
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

function renderProjects(list) {
  const rows = (list.projects || []).map((p) => {
    const today = (p.usage && p.usage.today) || {};
    const limits = p.limits || {};
    const actions = el("span", {});
    if (p.has_key) {
      actions.append(el("button", { type: "button", "data-rotate": p.name }, "Rotate key"));
    }
    if (p.name !== "default") {
      actions.append(el("button", { type: "button", "data-remove": p.name }, "Remove"));
    }
    const weight = el("form", { "data-weight": p.name },
      el("label", { for: "weight-" + p.name }, "Weight"),
      el("input", { id: "weight-" + p.name, type: "number", min: 1, max: 1000, value: p.weight ?? 1 }),
      el("button", { type: "submit" }, "Set"));
    const allowance = [];
    if (limits.cloud_tokens_per_day != null) allowance.push((today.cloud_tokens || 0) + " / " + limits.cloud_tokens_per_day + " tokens");
    if (limits.cloud_usd_per_day != null) allowance.push("$" + (today.cloud_usd || 0).toFixed(4) + " / $" + limits.cloud_usd_per_day);
    const refused = Object.entries((p.usage && p.usage.refused) || {}).map(([k, n]) => k + ": " + n).join(", ");
    return [p.name, weight, allowance.join("; ") || "no daily allowance", "$" + (today.cloud_usd || 0).toFixed(4),
      (today.cloud_tokens || 0) + " cloud tokens", refused || "none", actions];
  });
  $("projects").replaceChildren(table(["Project", "Weight", "Today against its allowance", "Cloud spend today", "Use today", "Refusals", ""], rows));
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
    renderHa(status); renderFleet(status); renderRoles(status); renderSpaces(status);
    renderBudget(status); renderProjects(projects);
    lastOk = Date.now();
    lastError = "";
  } catch (e) {
    if (e.status === 401) { signOut(e.message); return; }
    lastError = e.message || String(e);
  }
  showFreshness();
  timer = setTimeout(refresh, POLL_MS);
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
    } catch (e) { $("override-result").textContent = "Not set: " + e.message; }
  });
  $("clear-override").addEventListener("click", async () => {
    try {
      await api("/admin/budget", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ permits: null }) });
      $("override-result").textContent = "The override is cleared.";
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
    } catch (e) { $("projects-result").textContent = "Not created: " + e.message; }
  });
  $("projects").addEventListener("click", async (ev) => {
    const target = ev.target;
    if (!(target instanceof HTMLButtonElement)) return;
    const rotate = target.getAttribute("data-rotate");
    const remove = target.getAttribute("data-remove");
    try {
      if (rotate) {
        const made = await api("/admin/projects/" + encodeURIComponent(rotate) + "/rotate", { method: "POST" });
        $("projects-result").textContent = "The key of " + rotate + " was rotated: the old key is refused from now on.";
        showKey(rotate, made.key);
      } else if (remove && confirm("Remove project " + remove + "? Its key stops working at once.")) {
        await api("/admin/projects/" + encodeURIComponent(remove), { method: "DELETE" });
        $("projects-result").textContent = "Project " + remove + " removed.";
      }
    } catch (e) { $("projects-result").textContent = "Not done: " + e.message; }
  });
  $("projects").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = ev.target;
    const name = form.getAttribute("data-weight");
    const input = form.querySelector("input");
    try {
      await api("/admin/projects/" + encodeURIComponent(name), { method: "PATCH", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ weight: Number(input.value) }) });
      $("projects-result").textContent = "The weight of " + name + " is " + input.value + ".";
    } catch (e) { $("projects-result").textContent = "Not changed: " + e.message; }
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
