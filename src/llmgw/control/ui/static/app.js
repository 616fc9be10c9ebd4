// The fleet page: signs in, then reads the admin API every few seconds and draws it.
// Every name and message from the fleet goes in as text (textContent), never as markup.
"use strict";

const EVERY_MS = 3000;
const SOURCES = {
  nodes: "/api/v1/nodes", models: "/api/v1/models", replicas: "/api/v1/replicas",
  drift: "/api/v1/drift", traffic: "/api/v1/traffic", keys: "/api/v1/keys",
  viewers: "/api/v1/viewers",
};
let timer = null;

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function stateEl(tag, state) {
  return el(tag, state, "state state-" + String(state).replace(/[^a-z_]/g, ""));
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return Math.round(s) + "s ago";
  if (s < 3600) return Math.round(s / 60) + "m ago";
  if (s < 86400) return Math.round(s / 3600) + "h ago";
  return Math.round(s / 86400) + "d ago";
}

function gb(mb) { return (mb / 1024).toFixed(1) + " GB"; }
function num(x, digits) { return x === null || x === undefined ? "–" : x.toFixed(digits); }
function ms(s) { return s === null || s === undefined ? "–" : Math.round(s * 1000) + " ms"; }

function table(headers, rows, empty, numeric) {
  if (!rows.length) return el("p", empty, "empty");
  const t = el("table");
  const head = t.createTHead().insertRow();
  headers.forEach((h, i) => head.appendChild(el("th", h, numeric && numeric.includes(i) ? "num" : "")));
  const body = t.createTBody();
  for (const row of rows) {
    const tr = body.insertRow();
    for (const [key, value] of Object.entries(row.data || {})) tr.dataset[key] = value;
    row.cells.forEach((cell, i) => {
      const td = cell instanceof Node ? el("td") : el("td", cell);
      if (cell instanceof Node) td.appendChild(cell);
      if (numeric && numeric.includes(i)) td.className = "num";
      tr.appendChild(td);
    });
  }
  return t;
}

function gpuEl(gpu) {
  const box = el("div", null, "gpu");
  const total = gpu.memory_mb || 0;
  const free = gpu.memory_free_mb === undefined ? total : gpu.memory_free_mb;
  const used = Math.max(0, total - free);
  box.dataset.gpu = gpu.uuid || String(gpu.index);
  box.appendChild(el("div", `GPU ${gpu.index}: ${gpu.name} (${gpu["class"] || "?"})`));
  const bar = el("div", null, "bar");
  const fill = el("div");
  fill.style.width = (total ? (100 * used / total).toFixed(1) : 0) + "%";
  bar.appendChild(fill);
  bar.title = `${gb(used)} used, ${gb(free)} free of ${gb(total)}`;
  box.appendChild(bar);
  box.appendChild(el("div", `${gb(used)} used, ${gb(free)} free of ${gb(total)}`, "facts"));
  return box;
}

function drawNodes(nodes) {
  const cards = nodes.map((n) => {
    const card = el("div", null, "card");
    card.dataset.node = n.id;
    const title = el("h3", n.id + " ");
    title.appendChild(stateEl("span", n.state));
    card.appendChild(title);
    card.appendChild(el("div", `${n.addr || "?"} · ${n.cpus} CPUs · ${gb(n.memory_mb)} · seen ${ago(n.last_seen)}`, "facts"));
    const beats = el("div", `beats to control plane ${n.control_plane || "?"}`, "facts");
    beats.dataset.controlPlane = n.control_plane || "";
    card.appendChild(beats);
    if (n.gpus.length) n.gpus.forEach((g) => card.appendChild(gpuEl(g)));
    else card.appendChild(el("div", "no GPU (CPU)", "facts"));
    const warnings = n.warnings || [];
    const engines = el("ul", null, "engines");
    for (const p of n.provision) {
      const li = el("li", p.engine + ": ");
      li.dataset.engine = p.engine;
      li.appendChild(stateEl("span", p.state));
      // A detail the !! line below already says is not said twice.
      if (p.detail && !warnings.some((w) => w.includes(p.detail))) {
        li.appendChild(el("span", " — " + p.detail, "why"));
      }
      engines.appendChild(li);
    }
    card.appendChild(engines);
    for (const w of warnings) card.appendChild(el("div", `!! ${n.id}: ${w}`, "warning"));
    return card;
  });
  $("nodes").replaceChildren(...(cards.length ? cards : [el("p", "no nodes", "empty")]));
}

// Where a replica runs: its node, or a split one's main node + its workers.
function placedOn(r) {
  const workers = (r.workers || []).map((w) => w.node);
  return workers.length ? `${r.node} + ${workers.join(", ")}` : (r.node || "–");
}

// A split replica stopped for a fault stays shown this long, with why (a lost worker).
const SPLIT_DOWN_SHOWN_S = 600;

function shown(r) {
  if (r.state !== "stopped") return true;
  return (r.workers || []).length > 0 && Date.now() / 1000 - r.updated <= SPLIT_DOWN_SHOWN_S;
}

function drawModels(models, replicas) {
  const parts = models.map((m) => {
    const mine = replicas.filter((r) => r.model === m.name && shown(r));
    const box = el("div");
    box.dataset.model = m.name;
    const title = el("h3", m.name);
    if ((m.aliases || []).length) title.appendChild(el("span", " also " + m.aliases.join(", "), "why"));
    if (m.state) {
      const state = stateEl("span", m.state);
      state.dataset.modelState = m.state;
      title.append(" ", state);
    }
    box.appendChild(title);
    box.appendChild(table(["REPLICA", "NODE", "PROFILE", "STATE", "SINCE", "WHY"], mine.map((r) => ({
      data: { replica: r.id, state: r.state },
      cells: [r.id, placedOn(r), r.profile || "–", stateEl("span", r.state), ago(r.updated),
              el("span", r.err || r.held_back || "", "why")],
    })), "no replicas"));
    return box;
  });
  $("models").replaceChildren(...(parts.length ? parts : [el("p", "no models in the catalog", "empty")]));
}

function drawTraffic(traffic) {
  const rows = traffic.models.map((t) => ({
    data: { traffic: t.model },
    cells: [t.model || "(no model)", num(t.requests_per_s, 2), ms(t.p50_s), ms(t.p99_s),
            num(t.tokens_per_s, 1), t.status_4xx, t.status_5xx, t.requests],
  }));
  const empty = traffic.gateway_up ? "no request through the gateway yet" : "the gateway does not answer its metrics";
  $("traffic").replaceChildren(table(
    ["MODEL", "REQUESTS/S", "P50", "P99", "TOKENS/S", "4XX", "5XX", "REQUESTS"], rows, empty,
    [1, 2, 3, 4, 5, 6, 7]));
}

function drawDrift(drift) {
  const rows = [];
  for (const host of drift) {
    if (!host.failing.length) {
      rows.push({ data: { host: host.host }, cells: [host.host, ago(host.checked),
        el("span", `all ${host.promises} hold`, "state state-holds"), "", ""] });
    }
    for (const f of host.failing) {
      rows.push({ data: { host: host.host, promise: f.promise }, cells: [host.host, ago(host.checked),
        el("span", f.promise, "state state-fails"), ago(f.since), el("span", f.message, "why")] });
    }
  }
  $("drift").replaceChildren(rows.length
    ? table(["HOST", "CHECKED", "PROMISE", "FAILING SINCE", "WHY"], rows)
    : howToCheck());
}

// Said when no host reports: how the checks are turned on (docs/operations.md, "Checks
// that keep running").
function howToCheck() {
  const box = el("div");
  box.id = "drift-none";
  box.appendChild(el("p", "No host reports its checks.", "empty"));
  const how = el("p", null, "note");
  for (const [text, code] of [
    ["pytest provision/", true], [" runs them on every host it provisions, as the service ", false],
    ["llmgw-check", true], [" (", false],
    ["--check-serve HOST:PORT", true], [" says where it answers, on loopback by default); a host provisioned with ", false],
    ["--no-check-serve", true], [" runs none: provision it again without that option, or run ", false],
    ["llmgw check --serve HOST:PORT", true], [" there.", false],
  ]) how.appendChild(el(code ? "code" : "span", text));
  box.appendChild(how);
  return box;
}

function drawKeys(keys, viewers) {
  $("keys").replaceChildren(table(
    ["NAME", "PREFIX", "MODELS", "LIMITS", "LAST USED", "REQUESTS", "TOKENS IN/OUT"],
    keys.map((k) => ({
      data: { key: k.name },
      cells: [k.name, k.prefix, k.models.join(", ") || "all",
              [k.rpm ? k.rpm + " rpm" : "", k.tpm ? k.tpm + " tpm" : ""].filter(Boolean).join(", ") || "no limits",
              ago(k.last_used), k.requests, `${k.prompt_tokens}/${k.completion_tokens}`],
    })), "no keys", [5]));
  $("viewers").replaceChildren(table(["NAME", "PREFIX", "MADE"],
    viewers.map((v) => ({ data: { viewer: v.name }, cells: [v.name, v.prefix, ago(v.created)] })),
    "no viewer keys"));
}

async function getJSON(path) {
  const r = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (r.status === 401) throw new SignedOut((await r.json().catch(() => ({}))).detail || "");
  if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.json().catch(() => ({}))).detail || ""}`);
  return r.json();
}

class SignedOut extends Error {}

async function refresh() {
  try {
    const names = Object.keys(SOURCES);
    const got = await Promise.all(names.map((n) => getJSON(SOURCES[n])));
    const d = Object.fromEntries(names.map((n, i) => [n, got[i]]));
    drawNodes(d.nodes);
    drawModels(d.models, d.replicas);
    drawTraffic(d.traffic);
    drawDrift(d.drift);
    drawKeys(d.keys, d.viewers);
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (e instanceof SignedOut) {
      // The server's own words: why the session ended (signed out elsewhere, a new admin
      // token, the viewer key revoked or expired), cut before its curl example.
      return showSignIn(e.message.split(". Send ")[0] || "The session has ended; sign in again.");
    }
    $("status").textContent = "could not update: " + e.message;
  }
}

function showSignIn(message) {
  clearInterval(timer);
  timer = null;
  $("fleet").hidden = true;
  $("who").hidden = $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  $("sign-in-error").textContent = message || "";
  $("status").textContent = "";
}

function showFleet(who) {
  $("sign-in").hidden = true;
  $("fleet").hidden = false;
  $("who").textContent = `${who.role}: ${who.name}`;
  $("who").hidden = $("sign-out").hidden = false;
  refresh();
  clearInterval(timer);
  timer = setInterval(refresh, EVERY_MS);
}

async function signIn(event) {
  event.preventDefault();
  const r = await fetch("/ui/session", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ credential: $("credential").value }),
  });
  $("credential").value = "";
  const body = await r.json().catch(() => ({}));
  if (r.ok) showFleet(body);
  else showSignIn(typeof body.detail === "string" ? body.detail : "signing in failed: " + r.status);
}

async function signOut() {
  await fetch("/ui/session", { method: "DELETE", credentials: "same-origin" });
  showSignIn("Signed out.");
}

async function start() {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  const r = await fetch("/ui/session", { credentials: "same-origin" });
  if (r.ok) showFleet(await r.json());
  else showSignIn();
}

start();
