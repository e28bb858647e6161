"""``GET /admin/ui``: one self-contained page showing the cluster live.

The page is static: no data and no secret are in it, so it can be served
without the admin token (a browser navigating to a URL cannot send an
``Authorization`` header). Its script fetches ``/admin/ui/data`` every two
seconds. When the router has an admin token, that endpoint answers 401 and
the page asks for the token, keeps it in ``sessionStorage`` (this tab only,
gone when the tab closes; never in the URL, a cookie or the page) and sends
it as ``Authorization: Bearer``. A cookie would be sent by the browser on
any request to the router, including forged cross-site ones; a header is
sent only by this page's own script.

No CDN, no external file: the CSS and the script are inline, and the
Content-Security-Policy allows exactly those two (by hash), fetches to this
origin and nothing else. Every value from the cluster is written with
``textContent`` (user ids are attacker-chosen strings), never as HTML.
"""

from __future__ import annotations

import base64
import hashlib

STYLE = """
:root { color-scheme: light dark; --ok: #2e7d32; --bad: #c62828; --warn: #ef6c00; --mute: #888; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; }
h1 { font-size: 1.3rem; margin: 0 0 .2rem; }
h2 { font-size: 1.05rem; margin: 1.4rem 0 .4rem; }
#status { color: var(--mute); }
#status.error { color: var(--bad); }
.grid { display: flex; flex-wrap: wrap; gap: 2rem; align-items: flex-start; }
table { border-collapse: collapse; }
th, td { padding: .25rem .7rem; text-align: right; border-bottom: 1px solid #8884; }
th:first-child, td:first-child, td.key { text-align: left; }
td.key { font-family: ui-monospace, monospace; }
.state-active { color: var(--ok); } .state-joining, .state-leaving { color: var(--warn); }
.unreachable { color: var(--bad); }
#login { display: none; margin: 1rem 0; }
#login.shown { display: block; }
#ring svg { width: 220px; height: 220px; }
.swatch { display: inline-block; width: .8em; height: .8em; margin-right: .4em; }
small { color: var(--mute); }
"""

SCRIPT = r"""
"use strict";
const TOKEN_KEY = "ringlimit-admin-token";
const COLORS = ["#1e88e5", "#43a047", "#fb8c00", "#8e24aa", "#00acc1", "#e53935",
                "#6d4c41", "#3949ab", "#7cb342", "#d81b60"];
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "\u2013";
  return Number(value).toFixed(digits === undefined ? 0 : digits);
}

function status(text, error) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function drawRing(nodes) {
  const svg = $("ring-svg");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const ns = "http://www.w3.org/2000/svg";
  let angle = -Math.PI / 2;
  nodes.forEach((node, i) => {
    const share = node.share || 0;
    if (share <= 0) return;
    const end = angle + share * 2 * Math.PI;
    const large = share > 0.5 ? 1 : 0;
    const r = 90, c = 100;
    const path = document.createElementNS(ns, "path");
    const x1 = c + r * Math.cos(angle), y1 = c + r * Math.sin(angle);
    const x2 = c + r * Math.cos(end - 1e-6), y2 = c + r * Math.sin(end - 1e-6);
    path.setAttribute("d", `M ${x1} ${y1} A ${r} ${r} 0 ${large} 1 ${x2} ${y2}`);
    path.setAttribute("fill", "none");
    path.setAttribute("stroke", COLORS[i % COLORS.length]);
    path.setAttribute("stroke-width", "22");
    const title = document.createElementNS(ns, "title");
    title.textContent = `${node.id}: ${(share * 100).toFixed(1)} %`;
    path.appendChild(title);
    svg.appendChild(path);
    angle = end;
  });
}

function renderNodes(data) {
  const body = $("nodes").tBodies[0];
  body.replaceChildren();
  data.nodes.forEach((node, i) => {
    const row = el("tr", null, "node");
    row.dataset.node = node.id;
    const name = el("td");
    const swatch = el("span", null, "swatch");
    swatch.style.background = COLORS[i % COLORS.length];
    name.append(swatch, el("span", node.id));
    // A joining or leaving node may not answer yet: its state says more.
    const state = node.reachable || node.state !== "active" ? node.state : "unreachable";
    row.append(
      name,
      el("td", state, state === "unreachable" ? "unreachable" : "state-" + state),
      el("td", node.share === null ? "\u2013" : fmt(node.share * 100, 1) + " %"),
      el("td", fmt(node.rate, 1), "rate"),
      el("td", fmt(node.denied_rate, 1), "denied-rate"),
      el("td", fmt(node.allowed), "allowed"),
      el("td", fmt(node.denied), "denied"),
      el("td", fmt(node.keys), "keys"),
    );
    body.appendChild(row);
  });
  $("total-rate").textContent = fmt(data.totals.rate, 1);
  $("total-denied-rate").textContent = fmt(data.totals.denied_rate, 1);
  $("epoch").textContent = data.epoch;
}

function renderTop(data) {
  const box = $("top");
  box.replaceChildren();
  const rules = Object.keys(data.top);
  if (!rules.length) box.appendChild(el("p", "Nobody has been limited recently.", "mute"));
  rules.forEach((rule) => {
    ["denied", "near_limit"].forEach((kind) => {
      const entries = data.top[rule][kind] || [];
      if (!entries.length) return;
      const table = el("table");
      table.dataset.rule = rule;
      table.dataset.kind = kind;
      const what = kind === "denied" ? "denied" : "near the limit";
      const caption = el("caption", `${rule} \u2014 ${what}`);
      const head = el("tr");
      ["key", "events", "\u00b1 error", "node"].forEach((h) => head.appendChild(el("th", h)));
      table.append(caption, head);
      entries.forEach((e) => {
        const row = el("tr", null, "top-key");
        // Decided by this router from the owner's lease: the owner never saw them.
        const by = e.leased ? [...e.nodes, `router lease (${e.leased})`] : e.nodes;
        row.append(el("td", e.key, "key"), el("td", e.count), el("td", e.error),
                   el("td", by.join(", ")));
        table.appendChild(row);
      });
      box.appendChild(table);
    });
  });
  $("keys-mode").textContent = data.keys === "hashed" ? "(keys hashed)" : "";
}

function renderEvents(data) {
  const list = $("events");
  list.replaceChildren();
  if (!data.events.length) list.appendChild(el("li", "none yet"));
  data.events.forEach((e) => {
    const when = new Date(e.at * 1000).toLocaleTimeString();
    list.appendChild(el("li", `${when}  epoch ${e.epoch}: ${e.node} ${e.kind}`, "event"));
  });
}

function showLogin(message) {
  $("login").className = "shown";
  $("login-message").textContent = message;
  $("main").hidden = true;
}

// Why the sign-in form shows, kept until the next sign-in or sign-out: the
// refused token is forgotten, so the next update would otherwise say only that
// a token is needed, two seconds after saying it was refused.
let loginMessage = null;

async function refresh() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { "Authorization": "Bearer " + token } : {};
  $("sign-out").hidden = !token;
  try {
    const url = location.pathname.replace(/\/?$/, "/data");
    const response = await fetch(url, { headers, cache: "no-store", credentials: "omit" });
    if (response.status === 401) {
      if (token) {
        sessionStorage.removeItem(TOKEN_KEY);
        loginMessage = "That token was refused.";
      }
      showLogin(loginMessage || "This router needs its admin token.");
      status("not signed in", true);
      return;
    }
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      status(`${response.status}: ${body.detail || response.statusText}`, true);
      return;
    }
    const data = await response.json();
    loginMessage = null;
    $("login").className = "";
    $("main").hidden = false;
    renderNodes(data);
    drawRing(data.nodes);
    renderTop(data);
    renderEvents(data);
    document.body.dataset.loaded = "1";
    status("updated " + new Date(data.generated_at * 1000).toLocaleTimeString(), false);
  } catch (err) {
    status("cannot reach the router: " + err, true);
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, 2000);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const value = $("token").value.trim();
  $("token").value = "";
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  loginMessage = null;
  refresh();
});
$("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  loginMessage = null;
  refresh();
});
loop();
"""

BODY = """
<h1>ringlimit</h1>
<div><span id="status">loading\u2026</span>
  <button id="sign-out" type="button" hidden>forget token</button></div>
<form id="login">
  <p id="login-message"></p>
  <label>Admin token <input id="token" type="password" autocomplete="off"></label>
  <button type="submit">Sign in</button>
  <small>Kept in this tab only (sessionStorage), sent as an Authorization header.</small>
</form>
<div id="main" hidden>
  <div class="grid">
    <section id="ring">
      <h2>Ring <small>epoch <span id="epoch"></span></small></h2>
      <svg id="ring-svg" viewBox="0 0 200 200" role="img" aria-label="share of keys"></svg>
    </section>
    <section>
      <h2>Nodes <small><span id="total-rate"></span> decisions/s,
        <span id="total-denied-rate"></span> denied/s</small></h2>
      <table id="nodes">
        <thead><tr><th>node</th><th>state</th><th>share of keys</th><th>req/s</th>
          <th>denied/s</th><th>allowed</th><th>denied</th><th>keys held</th></tr></thead>
        <tbody></tbody>
      </table>
    </section>
  </div>
  <h2>Top limited users <small id="keys-mode"></small></h2>
  <small>Denied, and near the limit (at most 10 % of the limit left), over the last
    one to two minutes.</small>
  <div id="top" class="grid"></div>
  <h2>Membership events</h2>
  <ul id="events"></ul>
</div>
"""


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE = (
    "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
    '<meta name=viewport content="width=device-width, initial-scale=1">'
    f"<title>ringlimit</title><style>{STYLE}</style></head>"
    f"<body>{BODY}<script>{SCRIPT}</script></body></html>\n"
).encode()

HEADERS = {
    "content-security-policy": (
        f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
}
