// The dashboard's pages: data arrives as JSON (first in the page, then from /api/) and is
// put into the page with textContent only, so no text a user wrote is ever read as HTML.
"use strict";

const TOKEN_KEY = "rlfleet-web-token";
// How often each page asks for fresh data: the fleet's page is the heaviest to build, and
// its GPUs change only at each poll.
const REFRESH_MS = { queue: 2000, job: 2000, fleet: 5000 };
const REQUEST_TIMEOUT_MS = 15000;
const initial = JSON.parse(document.getElementById("initial").textContent);

function el(name, attrs, ...children) {
  const e = document.createElement(name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c === null || c === undefined ? "" : c);
  return e;
}

function fmtTime(iso) {
  if (!iso) return "-";
  const d = new Date(iso);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

function token() {
  return document.getElementById("token").value.trim();
}

// A request to the JSON API; an error says why in a line a user can read: the server
// cannot be reached, or its status and `{"error": …}` (401/403: the token).
async function api(path, options) {
  let response;
  try {
    response = await fetch(path, Object.assign(
      { headers: { accept: "application/json" }, signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS) },
      options || {},
    ));
  } catch (e) {
    throw new Error(e.name === "TimeoutError" ? "the server did not answer in time" : "the server cannot be reached");
  }
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(`${body.error || response.statusText} (HTTP ${response.status})`);
  return body;
}

// --- refreshing ----------------------------------------------------------------------

// Calls `load` every `ms` (counted from the end of the last call, so never two at once)
// while the tab is visible: a hidden tab asks the server nothing, and catches up as soon
// as it is shown again. `load` returning false stops it. Returns a function that calls
// `load` now (or right after the call under way).
function every(ms, load) {
  let timer = null;
  let running = false;
  let again = false;
  let stopped = false;
  const run = async () => {
    clearTimeout(timer);
    timer = null;
    if (stopped) return;
    if (running) { again = true; return; }
    if (document.visibilityState === "hidden") return;
    running = true;
    let more = true;
    try { more = (await load()) !== false; } catch (e) { /* load shows its own failures */ }
    running = false;
    if (!more) { stopped = true; return; }
    if (again) { again = false; run(); } else timer = setTimeout(run, ms);
  };
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && timer === null && !running) run();
  });
  timer = setTimeout(run, ms);
  return run;
}

// Refreshes the page's data every `ms` with `load`, saying in #refreshed when it
// last arrived, or that the last try failed and why; on a failure the page keeps showing
// what it had (dimmed), and the next try goes on as usual.
function autoRefresh(ms, load) {
  const out = document.getElementById("refreshed");
  let last = new Date();
  let tries = 0;
  const clock = (d) => fmtTime(d.toISOString()).slice(11);
  const ok = () => {
    out.dataset.state = "ok";
    out.textContent = `updated ${clock(last)}`;
    delete document.body.dataset.stale;
  };
  ok();
  return every(ms, async () => {
    out.dataset.tries = String(++tries);
    try {
      await load();
      last = new Date();
      ok();
    } catch (e) {
      out.dataset.state = "failed";
      out.textContent = `refresh failed at ${clock(new Date())}: ${e.message}; showing data of ${clock(last)}`;
      document.body.dataset.stale = "1";
    }
  });
}

// The entries of `counts` in the order of `order` (the rest after them): the data in the
// page comes with its keys sorted (tojson), the API's in the server's order, and counts
// that changed places at each refresh would be hard to follow.
function inOrder(counts, order) {
  const rank = (k) => (order.includes(k) ? order.indexOf(k) : order.length);
  return Object.entries(counts).sort(([a], [b]) => rank(a) - rank(b));
}

function setupToken() {
  const input = document.getElementById("token");
  input.value = sessionStorage.getItem(TOKEN_KEY) || "";
  input.addEventListener("change", () => sessionStorage.setItem(TOKEN_KEY, input.value.trim()));
}

// --- queue ---------------------------------------------------------------------------

// A job's GPUs: `gpus` (every GPU of an attempt) on one VM, else each VM's
// (`gpus_per_node`, one per rank), as `job list` shows them (jobstore.gpus_text).
function gpusText(j) {
  const each = j.gpus_per_node || [];
  if (each.length <= 1) return String(j.gpus);
  return each.every((g) => g === each[0]) ? `${each[0]} × ${each.length}` : each.join("+");
}

function jobRow(j) {
  return el(
    "tr", { "data-job": String(j.id), "data-status": j.status },
    el("td", {}, el("a", { href: `/jobs/${j.id}` }, String(j.id))),
    el("td", { class: "name" }, j.name || ""),
    el("td", { class: "status" }, j.status),
    // A job over several VMs: the GPUs of each (`4 × 2`, or `2+1` when they differ), and
    // rank 0's VM with how many more.
    el("td", { class: "gpus" }, gpusText(j)),
    el("td", { class: "vm" }, j.vm && j.nodes > 1 ? `${j.vm} +${j.nodes - 1}` : j.vm || ""),
    el("td", {}, (j.gpu_indices || []).join(",")),
    el("td", {}, `${j.retry_count}/${j.max_retries}`),
    el("td", {}, fmtTime(j.submitted_at)),
    el("td", { class: "reason" }, j.failure_reason || j.status_reason || ""),
  );
}

function renderQueue(data) {
  for (const [section, jobs] of Object.entries(data.sections)) {
    const body = document.getElementById(`section-${section}`);
    if (!body) continue;
    body.replaceChildren(...(jobs.length ? jobs.map(jobRow) : [el("tr", {}, el("td", { colspan: "9", class: "muted" }, "none"))]));
  }
  // The states in the order of the status filter's options, which is the server's.
  const order = [...document.querySelectorAll("#status option")].map((o) => o.value);
  const counts = inOrder(data.counts, order).filter(([, n]) => n > 0).map(([s, n]) => `${s} ${n}`);
  document.getElementById("counts").textContent = counts.join(" · ");
}

function queuePage() {
  renderQueue(initial);
  const query = new URLSearchParams(location.search);
  const params = new URLSearchParams();
  for (const k of ["status", "name"]) if (query.get(k)) params.set(k, query.get(k));
  autoRefresh(REFRESH_MS.queue, async () => renderQueue(await api(`/api/queue?${params}`)));
}

// --- job -----------------------------------------------------------------------------

const SHOWN_ELSEWHERE = new Set(["events", "events_older", "ranks", "id", "name", "status", "status_reason", "failure_reason", "store_status"]);

// Older events the user asked for (the API sends the newest 100; "more" fetches the 100
// before the oldest one shown), and how many are still older than those.
const olderEvents = { events: [], left: null };

// An event's reason, with how often a waiting move repeated: "… (×40, last at T)".
function eventReason(e) {
  const reason = e.reason || "";
  return e.count > 1 ? `${reason} (×${e.count}, last at ${fmtTime(e.last_at)})` : reason;
}

function renderEvents(job) {
  const newest = job.events;
  const first = newest.length ? newest[0].id : Infinity;
  const shown = olderEvents.events.filter((e) => e.id < first).concat(newest);
  document.getElementById("events").replaceChildren(...shown.map((e) => el(
    "tr", {},
    el("td", {}, fmtTime(e.at)), el("td", {}, e.from || ""), el("td", {}, e.to),
    el("td", {}, String(e.attempt)), el("td", {}, e.actor), el("td", {}, eventReason(e)),
  )));
  const left = olderEvents.left === null ? job.events_older : olderEvents.left;
  const more = document.getElementById("older-events");
  more.hidden = !left;
  more.textContent = `${left} older event${left === 1 ? "" : "s"}: show more`;
  more.dataset.before = shown.length ? String(shown[0].id) : "";
}

async function showOlderEvents(jobId) {
  const more = document.getElementById("older-events");
  const page = await api(`/api/jobs/${jobId}?events=100&before=${more.dataset.before}`);
  olderEvents.events = page.events.concat(olderEvents.events);
  olderEvents.left = page.events_older;
}

// One row per node of the attempt (`ranks` of `job show --json`), rank 0 first.
function renderNodes(ranks) {
  const nodes = ranks || [];
  document.getElementById("nodes-section").hidden = nodes.length === 0;
  document.getElementById("nodes").replaceChildren(...nodes.map((r) => el(
    "tr", { "data-rank": String(r.rank) },
    el("td", {}, String(r.rank)),
    el("td", { class: "vm" }, r.vm ? el("a", { href: `/fleet?name=${encodeURIComponent(r.vm)}` }, r.vm) : "-"),
    el("td", {}, (r.gpu_indices || []).join(", ")),
    el("td", {}, r.pid === null || r.pid === undefined ? "-" : String(r.pid)),
    el("td", {}, String(r.attempt)),
    el("td", { class: "status" }, r.state),
    el("td", {}, r.exit_code === null || r.exit_code === undefined ? "" : String(r.exit_code)),
    el("td", { class: "path" }, r.attempt_dir || ""),
  )));
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

// The job's store: its URL, the checkpoints in it (step, size, time), the last upload error.
function renderStore(job) {
  document.getElementById("store-section").hidden = !job.store;
  if (!job.store) return;
  const status = job.store_status || {};
  document.getElementById("store-url").textContent = job.store;
  document.getElementById("store-final").textContent = status.final ? "final outputs in the store" : "";
  const error = document.getElementById("store-error");
  error.hidden = !status.last_error;
  error.textContent = status.last_error ? `last upload error: ${status.last_error} (${fmtTime(status.error_at)})` : "";
  const rows = (status.checkpoints || []).slice().reverse();
  document.getElementById("store-checkpoints").replaceChildren(...rows.map((c) => el(
    "tr", { "data-step": String(c.step) },
    el("td", {}, String(c.step)), el("td", {}, fmtBytes(c.bytes)), el("td", {}, c.at ? fmtTime(c.at) : "-"),
  )));
}

function renderJob(job) {
  document.getElementById("job-status").textContent = job.status;
  document.getElementById("job-status").dataset.status = job.status;
  document.getElementById("job-reason").textContent = job.failure_reason ? `${job.failure_reason}: ${job.status_reason || ""}` : job.status_reason || "";
  // Every other field of `job show --json`, whatever it holds (placement of every node…).
  const rows = [];
  for (const [k, v] of Object.entries(job)) {
    if (SHOWN_ELSEWHERE.has(k) || v === null || (Array.isArray(v) && v.length === 0)) continue;
    const text = typeof v === "object" ? JSON.stringify(v) : k.endsWith("_at") ? fmtTime(v) : String(v);
    rows.push(el("dt", {}, k), el("dd", { "data-key": k }, text));
  }
  document.getElementById("placement").replaceChildren(...rows);
  renderNodes(job.ranks);
  renderStore(job);
  renderEvents(job);
  document.getElementById("cancel").disabled = ["completed", "failed", "cancelled"].includes(job.status);
  document.getElementById("retry").disabled = job.status !== "failed";
}

function renderCurve(curve) {
  const attempts = [...new Set(curve.map((p) => p.attempt))];
  for (const key of ["reward", "loss"]) {
    const series = attempts.map((a) => ({
      name: `attempt ${a} ${key}`,
      cls: `${key} attempt-${a}`,
      dots: true,
      points: curve.filter((p) => p.attempt === a && p[key] !== null).map((p) => [p.step, p[key]]),
    }));
    lineChart(document.getElementById(`chart-${key}`), series, { xFormat: (x) => `step ${Math.round(x)}` });
  }
}

function followLog(jobId) {
  const pre = document.getElementById("log");
  const state = document.getElementById("log-state");
  let offset = 0;
  let attempt = null;
  // A finished job's log is read to its end, then left alone.
  every(1000, async () => {
    let more = true;
    try {
      const chunk = await api(`/api/jobs/${jobId}/log?offset=${offset}${attempt ? `&attempt=${attempt}` : ""}`);
      if (attempt === null) attempt = chunk.attempt;
      if (chunk.text) {
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.append(chunk.text);
        if (atEnd) pre.scrollTop = pre.scrollHeight;
      }
      offset = chunk.offset;
      state.textContent = `attempt ${chunk.attempt}${chunk.live ? ", following" : ""}`;
      more = chunk.live || chunk.text.length > 0;
    } catch (e) {
      state.textContent = e.message;
    }
    return more;
  })();
}

async function act(jobId, what, refresh) {
  const out = document.getElementById("action-result");
  out.textContent = `${what}…`;
  try {
    const body = await api(`/api/jobs/${jobId}/${what}`, {
      method: "POST",
      headers: { accept: "application/json", "x-rlfleet-token": token() },
    });
    out.textContent = what === "cancel" ? `cancelled (was ${body.previous})` : "queued again";
  } catch (e) {
    out.textContent = `${what} refused: ${e.message}`;
  }
  refresh();
}

async function refreshJob(jobId) {
  const [job, curve] = await Promise.all([api(`/api/jobs/${jobId}`), api(`/api/jobs/${jobId}/curve`)]);
  renderJob(job);
  renderCurve(curve);
}

function jobPage() {
  const jobId = initial.job.id;
  renderJob(initial.job);
  renderCurve(initial.curve);
  followLog(jobId);
  const refresh = autoRefresh(REFRESH_MS.job, () => refreshJob(jobId));
  document.getElementById("cancel").addEventListener("click", () => act(jobId, "cancel", refresh));
  document.getElementById("retry").addEventListener("click", () => act(jobId, "retry", refresh));
  document.getElementById("older-events").addEventListener("click", async () => {
    await showOlderEvents(jobId);
    refresh();
  });
}

// --- fleet ---------------------------------------------------------------------------

// How much time the timelines cover: the last N hours, or since the first sample (its
// time of day, with the date when that is more than a day back).
function spanText(data) {
  const start = data.timeline_start;
  const end = data.timeline_end;
  if (end - start >= data.hours * 3600 - 1) return `last ${data.hours} h`;
  const since = fmtTime(new Date(start * 1000).toISOString());
  return `since ${end - start < 20 * 3600 ? since.slice(11) : since}`;
}

const GPU_STATES = ["free", "allocated", "drained", "foreign", "unhealthy"];
const known = (v, unit) => (v === null || v === undefined ? "?" : `${v}${unit || ""}`);

function gpuBadge(g) {
  const title = `GPU ${g.index} ${g.name || ""}: ${g.state}, ${known(g.utilization_pct, "%")}, `
    + `${known(g.memory_used_mb)}/${known(g.memory_total_mb)} MiB`
    + (g.health_reason ? ` (${g.health_reason})` : "") + (g.drained ? ", drained by hand" : "");
  return el(
    "span", { class: `gpu ${g.state}`, title, "data-gpu": String(g.index) },
    String(g.index),
    ...(g.job_id ? [":", el("a", { href: `/jobs/${g.job_id}` }, String(g.job_id))] : []),
    ...(g.health_reason ? [" ", el("small", { class: "gpu-reason" }, g.health_reason)] : []),
  );
}

function vmRow(vm, data) {
  const flag = vm.removing ? "+removing" : vm.draining ? "+draining" : "";
  const spark = el("div", { class: "spark", "data-vm": vm.name });
  const points = vm.timeline || [];
  lineChart(spark, [
    { name: "utilisation", cls: "util", points: points.map((p) => [p.t, p.util]) },
    { name: "memory", cls: "mem", points: points.map((p) => [p.t, p.mem]) },
  ], { width: 240, height: 40, xMin: data.timeline_start, xMax: data.timeline_end, yMin: 0, yMax: 100, axes: false });
  return el(
    "tr", { "data-vm": vm.name },
    el("td", { class: "name" }, vm.name),
    el("td", { class: "status" }, `${vm.status}${flag}`,
      ...(vm.last_error ? [el("br"), el("span", { class: "muted" }, vm.last_error)] : [])),
    el("td", {}, `${vm.host}:${vm.port}`),
    el("td", { class: "free" }, `${vm.available_gpus}/${vm.gpus.length}`),
    el("td", { class: "gpus" }, ...vm.gpus.map(gpuBadge)),
    el("td", {}, spark),
  );
}

// The previous and next pages' links keep the page's other parameters (name, hours).
function pageLink(page, text) {
  const params = new URLSearchParams(location.search);
  params.set("page", String(page));
  return el("a", { href: `?${params}` }, text);
}

function renderFleet(data) {
  document.getElementById("timeline-span").textContent = spanText(data);
  document.getElementById("vms").replaceChildren(...(data.vms.length
    ? data.vms.map((vm) => vmRow(vm, data))
    : [el("tr", {}, el("td", { colspan: "6", class: "muted" }, "no VM"))]));
  const states = inOrder(data.gpu_states, GPU_STATES).map(([s, n]) => [el("span", { class: `gpu ${s}`, "data-state": s }, `${s} ${n}`), " "]);
  document.getElementById("counts").replaceChildren(`${data.total} VMs · GPUs: `, ...states.flat());
  document.getElementById("pages").replaceChildren(
    ...(data.page > 1 ? [pageLink(data.page - 1, "previous"), " "] : []),
    `page ${data.page} of ${data.pages}`,
    ...(data.page < data.pages ? [" ", pageLink(data.page + 1, "next")] : []),
  );
}

function fleetPage() {
  renderFleet(initial);
  const query = new URLSearchParams(location.search);
  const params = new URLSearchParams();
  for (const k of ["name", "page", "hours"]) if (query.get(k)) params.set(k, query.get(k));
  autoRefresh(REFRESH_MS.fleet, async () => renderFleet(await api(`/api/fleet?${params}`)));
}

setupToken();
({ queue: queuePage, job: jobPage, fleet: fleetPage })[document.body.dataset.page]();
document.body.dataset.ready = "1";
