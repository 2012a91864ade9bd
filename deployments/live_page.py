"""The live page at `/v1/mtplx/dashboard`: the server's state at a glance, for users without Grafana.

One self-contained HTML page (no external scripts, styles or fonts: nothing is fetched from
elsewhere) that polls the snapshot route once a second and draws tokens/s, draft acceptance and
lane occupancy over the last 5 s (from snapshots and the server's clock), waiting rows (numbers
and 2-minute charts), every running lane of every replica with its route and rows (greedy and
sampled), the running lanes by route over all replicas (one lane per model is the healthy state:
more mean rows are split), and the recent lane events (a lane started, changed width, ended).
The page itself holds no data, so it is served without an API key;
its snapshot requests carry the key the user types (kept in the tab's sessionStorage; a
`#key=...` fragment, which browsers never send to the server, fills it in).
"""

PAGE_PATH = "/v1/mtplx/dashboard"

PAGE_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mtplx live</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
 header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline}
 header h1{font-size:18px;margin:0} header span{opacity:.8}
 #status.bad{color:#ff8a80}
 main{padding:14px 18px}
 .cards{display:grid;grid-template-columns:repeat(5,1fr);gap:12px}
 .card{background:#fff;border-radius:8px;padding:10px 12px;box-shadow:0 1px 2px #0002}
 .card b{display:block;font-size:26px} .card small{color:#667}
 canvas{width:100%;height:60px;display:block;margin-top:6px}
 table{border-collapse:collapse;width:100%;background:#fff;border-radius:8px;box-shadow:0 1px 2px #0002;margin-top:14px}
 th,td{padding:6px 10px;text-align:left;border-bottom:1px solid #eee} th{font-weight:600;color:#445}
 .slots{display:flex;gap:2px} .slot{width:12px;height:14px;border-radius:2px;background:#dde}
 .slot.live{background:#2e7d32} .slot.pre{background:#f9a825}
 h2{font-size:15px;margin:18px 0 4px} #events{background:#fff;border-radius:8px;padding:8px 12px;box-shadow:0 1px 2px #0002;max-height:180px;overflow:auto;font-family:monospace;font-size:12px;white-space:pre-wrap}
 #keybox{display:none;margin:10px 0} #keybox.show{display:block}
 #byroute{color:#445} #byroute .warn{color:#c62828}
</style></head><body>
<header><h1>mtplx live</h1><span id="model">-</span><span id="replicas">-</span><span id="status">connecting</span></header>
<main>
<div id="keybox">This server wants an API key: <input id="key" type="password" size="40"> <button id="setkey">use</button></div>
<div class="cards">
 <div class="card"><small>tokens/s decoded (all replicas)</small><b id="tps">-</b><canvas id="c_tps"></canvas></div>
 <div class="card"><small>draft acceptance</small><b id="acc">-</b><canvas id="c_acc"></canvas></div>
 <div class="card"><small>lane occupancy (live rows per cycle)</small><b id="occ">-</b><canvas id="c_occ"></canvas></div>
 <div class="card"><small>waiting rows (replicas + ingress)</small><b id="wait">-</b><canvas id="c_wait"></canvas></div>
 <div class="card"><small>rows in flight / finished</small><b id="rows">-</b><small id="done">-</small></div>
</div>
<h2>Running lanes</h2>
<div id="byroute">-</div>
<table><thead><tr><th>replica</th><th>lane</th><th>route</th><th>width</th><th>rows (live, prefilling, free)</th><th>waiting</th><th>cycles</th><th>mean occupancy</th><th>acceptance</th></tr></thead>
<tbody id="lanes"><tr><td colspan="9">no running lane: the server is idle</td></tr></tbody></table>
<h2>Recent lanes</h2><div id="events">-</div>
</main>
<script>
"use strict";
const HIST = 120, hist = {tps: [], acc: [], occ: [], wait: []};
let win = [], lanesSeen = new Map(), events = [];
const m = /[#&]key=([^&]+)/.exec(location.hash);
if (m) { sessionStorage.setItem("mtplx_key", decodeURIComponent(m[1])); history.replaceState(null, "", location.pathname); }
document.getElementById("setkey").onclick = () => { sessionStorage.setItem("mtplx_key", document.getElementById("key").value); tick(); };
const $ = id => document.getElementById(id);
function replicas(snap) { return Object.values(snap.replicas || {}).filter(r => r && !r.error); }
function sum(snap, k) { return replicas(snap).reduce((a, r) => a + (r[k] || 0), 0); }
function push(name, v) { hist[name].push(v); if (hist[name].length > HIST) hist[name].shift(); draw(name); }
function draw(name) {
  const c = $("c_" + name), ctx = c.getContext("2d"), w = c.width = c.clientWidth * devicePixelRatio, h = c.height = 60 * devicePixelRatio;
  const xs = hist[name].filter(v => v !== null), hi = Math.max(1e-9, ...xs, name === "acc" ? 1 : 0);
  ctx.clearRect(0, 0, w, h); ctx.strokeStyle = "#1565c0"; ctx.lineWidth = 2 * devicePixelRatio; ctx.beginPath();
  hist[name].forEach((v, i) => { if (v === null) return; const x = w * i / (HIST - 1), y = h - 2 - (h - 4) * v / hi; i ? ctx.lineTo(x, y) : ctx.moveTo(x, y); });
  ctx.stroke();
}
function event(text) { events.unshift(new Date().toLocaleTimeString() + "  " + text); events = events.slice(0, 40); $("events").textContent = events.join("\n"); }
function render(snap) {
  let dt;
  $("model").textContent = snap.model || "-";
  const reps = replicas(snap);
  $("replicas").textContent = reps.length + " replica" + (reps.length === 1 ? "" : "s");
  const ing = snap.ingress || {};
  const waiting = sum(snap, "waiting_rows") + (ing.rows_waiting || 0);
  $("wait").textContent = waiting; push("wait", waiting);
  $("rows").textContent = sum(snap, "active"); $("done").textContent = sum(snap, "requests_completed") + " finished, " + sum(snap, "requests_cancelled") + " cancelled";
  // rates over the last 5 s of server time (one snapshot pair can be too close to show anything)
  const keys = ["accepted_draft_tokens", "rejected_draft_tokens", "lane_cycles", "lane_row_cycles"];
  win.push({t: snap.time, v: Object.fromEntries(keys.map(k => [k, sum(snap, k)]))});
  while (win.length > 2 && snap.time - win[1].t >= 5) win.shift();
  const old = win[0]; dt = snap.time - old.t;
  // tokens/s: the replicas' own 5 s rates when they keep them (our window needs polls seconds
  // apart), else ours: a token per live row and cycle, plus accepted drafts
  const rates = reps.map(r => r.decode_tok_s_5s).filter(v => typeof v === "number");
  let tps = rates.length ? rates.reduce((a, v) => a + v, 0) : null;
  if (win.length > 1 && dt > 0) {
    const d = k => sum(snap, k) - old.v[k];
    const acc = d("accepted_draft_tokens"), rej = d("rejected_draft_tokens"), cyc = d("lane_cycles"), rc = d("lane_row_cycles");
    if (tps === null) tps = Math.max(0, rc + acc) / dt;
    $("acc").textContent = acc + rej > 0 ? (100 * acc / (acc + rej)).toFixed(0) + "%" : "-"; push("acc", acc + rej > 0 ? acc / (acc + rej) : null);
    $("occ").textContent = cyc > 0 ? (rc / cyc).toFixed(2) : "-"; push("occ", cyc > 0 ? rc / cyc : null);
  }
  if (tps !== null) { $("tps").textContent = tps.toFixed(1); push("tps", tps); }
  const rows = [], now = new Map();
  for (const r of reps) for (const ln of (r.lanes || [])) {
    const id = (r.replica_id || "?") + "/" + ln.serial;
    now.set(id, ln);
    const before = lanesSeen.get(id);
    if (!before) event("replica " + r.replica_id + ": lane " + ln.key + (ln.width ? " started at width " + ln.width : " has rows waiting for a width"));
    else if (before.width !== ln.width) event("replica " + r.replica_id + ": lane " + ln.key + " width " + before.width + " -> " + ln.width);
    const free = Math.max(0, ln.width - ln.live_rows - ln.prefilling_rows);
    const slots = "<span class='slot live'></span>".repeat(ln.live_rows) + "<span class='slot pre'></span>".repeat(Math.min(ln.prefilling_rows, ln.width)) + "<span class='slot'></span>".repeat(free);
    const drafted = (ln.accepted || 0) + (ln.rejected || 0);
    // the lane's route by its live rows (rows of any sampling share a lane), the drafts its cycles chain
    const route = esc(ln.route) + (typeof ln.depth === "number" ? ", depth " + ln.depth : "");
    const split = " (" + ln.greedy_rows + " greedy, " + (ln.live_rows - ln.greedy_rows) + " sampled)";
    rows.push("<tr><td>" + esc(r.replica_id) + "</td><td>" + esc(ln.key) + "</td><td>" + route + "</td><td>" + (ln.width || "-") + "</td><td><div class='slots'>" + slots + "</div>" + ln.live_rows + " live" + split + ", " + ln.prefilling_rows + " prefilling</td><td>" + ln.waiting_rows + "</td><td>" + ln.cycles + "</td><td>" + ln.mean_occupancy + "</td><td>" + (drafted ? (100 * ln.accepted / drafted).toFixed(0) + "%" : "-") + "</td></tr>");
  }
  byRoute(reps);
  for (const [id, ln] of lanesSeen) if (!now.has(id)) event("replica " + id.split("/")[0] + ": lane " + ln.key + " ended after " + ln.cycles + " cycles, " + ln.admitted + " rows, occupancy " + ln.mean_occupancy);
  lanesSeen = now;
  $("lanes").innerHTML = rows.length ? rows.join("") : "<tr><td colspan='9'>no running lane: the server is idle</td></tr>";
}
// running lanes by route over all replicas (each replica's lanes_by_route): one lane per model
// is the healthy state, a replica running more means its rows are split
function byRoute(reps) {
  const agg = {}, split = [];
  for (const r of reps) {
    let n = 0;
    for (const [route, a] of Object.entries(r.lanes_by_route || {})) { const t = agg[route] = agg[route] || {lanes: 0, live_rows: 0}; t.lanes += a.lanes || 0; t.live_rows += a.live_rows || 0; n += a.lanes || 0; }
    if (n > 1) split.push(esc(r.replica_id) + " runs " + n + " lanes");
  }
  const parts = Object.entries(agg).sort().map(([route, a]) => esc(route) + ": " + a.lanes + " lane" + (a.lanes === 1 ? "" : "s") + ", " + a.live_rows + " live rows");
  $("byroute").innerHTML = "lanes by route: " + (parts.length ? parts.join("; ") : "none") + (split.length ? " <span class='warn'>(" + split.join(", ") + ": rows split; one lane per model is the healthy state)</span>" : "");
}
function esc(s) { return String(s).replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";"); }
async function tick() {
  const key = sessionStorage.getItem("mtplx_key"), headers = key ? {Authorization: "Bearer " + key} : {};
  try {
    const r = await fetch(location.pathname.replace(/dashboard\/?$/, "snapshot"), {headers, cache: "no-store"});
    if (r.status === 401) { $("keybox").classList.add("show"); $("status").textContent = "API key needed"; $("status").className = "bad"; return; }
    const snap = await r.json();
    $("keybox").classList.remove("show"); $("status").textContent = "live, " + new Date().toLocaleTimeString(); $("status").className = "";
    render(snap);
  } catch (e) { $("status").textContent = "unreachable: " + e; $("status").className = "bad"; }
}
tick(); setInterval(tick, 1000);
</script></body></html>
"""
