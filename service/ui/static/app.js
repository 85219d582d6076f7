// tidal's web page for jobs: a static shell that reads the coordinator's /v1 API.
//
// Rules this file keeps (the page shows what jobs' users wrote, so treat all
// of it as hostile text):
// * every value reaches the page through textContent, createTextNode or
//   setAttribute on a fixed attribute: never innerHTML, never a built string
//   of markup; links are built from encodeURIComponent'd ids, or checked to
//   be http(s) before they become an href;
// * the API token lives in this tab's sessionStorage and goes out only as a
//   bearer header to this page's own origin; it is never put in a URL or the
//   page, and the sign-in field is emptied once it is read;
// * environment values are never shown: the API lists only their names
//   (spec.env_names), and if a spec ever carried an env mapping, only its keys
//   would be shown.
"use strict";

(function () {
  const TOKEN_KEY = "tidal.token";
  const API = new URL("../v1/", window.location.href);
  const REFRESH_MS = 2000;
  const LOG_LINES_KEPT = 2000;
  const THROUGHPUT_WINDOW_MS = 60000;
  // Events after which the job restarts its workers at a new size (or after a
  // failure); each one's recovery lasts until the job runs again.
  const DISRUPTIONS = new Set([
    "node_lost", "node_drained", "node_joined", "scaled_by_user", "restart_charged",
    "below_min_nodes", "reclaimed", "preempted", "straggler_evicted",
  ]);
  // The reasons of the event that says the job runs again at its new size.
  const RESUMED = new Set(["restarted", "resized_live"]);
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);

  let refreshTimer = null;
  let loop = 0; // bumped on every navigation: a refresh of an older loop paints nothing
  let jobPage = null; // {jobId, parts, logs: AbortController}
  let uiConfig = null;
  const stepSamples = new Map(); // job id -> [[time ms, step], ...]

  // --- small helpers ---------------------------------------------------------------

  function $(id) { return document.getElementById(id); }

  // el("td", {class: "num"}, "text", otherNode): an element with attributes and children.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined && value !== false) {
        node.setAttribute(name, String(value));
      }
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  // Make `old` look like `fresh`, keeping the nodes that are already the same:
  // a refresh every 2 s must not pull a link from under the pointer or move the
  // selection. Nodes differ in name or attributes: replaced; text: its data set.
  function morph(old, fresh) {
    if (old.isEqualNode(fresh)) return;
    if (old.nodeType === Node.TEXT_NODE && fresh.nodeType === Node.TEXT_NODE) {
      old.data = fresh.data;
      return;
    }
    if (old.nodeType !== Node.ELEMENT_NODE || old.nodeName !== fresh.nodeName ||
        !sameAttributes(old, fresh)) {
      old.replaceWith(fresh);
      return;
    }
    morphChildren(old, Array.from(fresh.childNodes));
  }

  function morphChildren(parent, fresh) {
    const old = Array.from(parent.childNodes);
    fresh.forEach((node, i) => {
      if (i < old.length) morph(old[i], node);
      else parent.appendChild(node);
    });
    for (let i = fresh.length; i < old.length; i++) old[i].remove();
  }

  function sameAttributes(a, b) {
    if (a.attributes.length !== b.attributes.length) return false;
    for (const attr of a.attributes) {
      if (b.getAttribute(attr.name) !== attr.value) return false;
    }
    return true;
  }

  function jobLink(jobId) {
    return el("a", {href: "#/jobs/" + encodeURIComponent(jobId)}, jobId);
  }

  function safeHttpUrl(text) {
    if (typeof text !== "string") return null;
    try {
      const url = new URL(text);
      return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
    } catch (_) {
      return null;
    }
  }

  function dash(value) { return value === null || value === undefined || value === "" ? "—" : value; }

  function duration(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "—";
    if (seconds < 10) return seconds.toFixed(1) + " s";
    if (seconds < 60) return Math.round(seconds) + " s";
    const s = Math.round(seconds);
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }

  function ageOf(iso, now) { return iso ? duration((now - Date.parse(iso)) / 1000) : "—"; }

  function clock(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleString();
  }

  function queueOf(view) {
    return dash((view.spec && view.spec.queue) || view.queue);
  }

  // The environment's names only, whatever shape the spec has.
  function envNames(spec) {
    if (Array.isArray(spec.env_names)) return spec.env_names.map(String);
    if (spec.env && typeof spec.env === "object") return Object.keys(spec.env);
    return [];
  }

  // --- the token and the API ---------------------------------------------------------

  function token() { return window.sessionStorage.getItem(TOKEN_KEY); }

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && typeof body.error === "string") return body.error;
    } catch (_) { /* not JSON */ }
    return "HTTP " + response.status;
  }

  async function request(path, given, init) {
    const headers = {"Authorization": "Bearer " + given, "Accept": "application/json"};
    const response = await fetch(new URL(path, API), Object.assign(
      {headers: headers, cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer"},
      init || {}));
    if (!response.ok) throw new ApiError(response.status, await errorText(response));
    return response;
  }

  async function api(path, init) {
    const given = token();
    if (!given) throw new ApiError(401, "not signed in");
    try {
      return await (await request(path, given, init)).json();
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) {
        signOut("The coordinator no longer accepts this token; sign in again.");
      }
      throw err;
    }
  }

  async function allJobs() {
    const jobs = [];
    let cursor = null;
    for (let page = 0; page < 20; page++) {
      const query = "jobs?limit=1000" + (cursor ? "&cursor=" + encodeURIComponent(cursor) : "");
      const body = await api(query);
      jobs.push(...body.jobs);
      cursor = body.next_cursor;
      if (!cursor) break;
    }
    return jobs;
  }

  // --- signing in and out -------------------------------------------------------------

  function showLogin(message) {
    stopJobPage();
    $("view").hidden = true;
    $("view").replaceChildren();
    $("nav").hidden = true;
    $("sign-out").hidden = true;
    $("refreshed").textContent = "";
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("token").focus();
  }

  function signOut(message) {
    window.sessionStorage.removeItem(TOKEN_KEY);
    uiConfig = null;
    loop += 1;
    if (refreshTimer !== null) window.clearTimeout(refreshTimer);
    refreshTimer = null;
    showLogin(message);
  }

  async function signIn(event) {
    event.preventDefault();
    const field = $("token");
    const given = field.value.trim();
    field.value = ""; // out of the page at once, whatever the answer
    if (!given) return;
    $("login-error").textContent = "";
    try {
      await request("jobs?limit=1", given);
    } catch (err) {
      $("login-error").textContent = err instanceof ApiError && err.status === 401
        ? "The coordinator refused this token."
        : "Cannot sign in: " + err.message;
      return;
    }
    window.sessionStorage.setItem(TOKEN_KEY, given);
    $("login").hidden = true;
    route();
  }

  // --- routing and refreshing ---------------------------------------------------------

  function parseRoute() {
    const hash = window.location.hash.replace(/^#/, "");
    // Job ids as the API has them (letters, digits, '.', '_', '-'): never a path.
    const job = /^\/jobs\/([A-Za-z0-9][A-Za-z0-9._-]{0,62})$/.exec(hash);
    if (job) return {page: "job", jobId: job[1]};
    if (hash === "/nodes") return {page: "nodes"};
    return {page: "jobs"};
  }

  function route() {
    if (refreshTimer !== null) window.clearTimeout(refreshTimer);
    refreshTimer = null;
    if (!token()) {
      showLogin("");
      return;
    }
    $("login").hidden = true;
    $("nav").hidden = false;
    $("sign-out").hidden = false;
    $("view").hidden = false;
    const where = parseRoute();
    if (where.page !== "job" || !jobPage || jobPage.jobId !== where.jobId) {
      stopJobPage();
      $("view").replaceChildren();
    }
    loop += 1;
    refresh(loop);
  }

  // Each render* fetches, then returns the function that paints what it fetched.
  async function refresh(mine) {
    const where = parseRoute();
    try {
      let paint;
      if (where.page === "job") paint = await renderJob(where.jobId);
      else if (where.page === "nodes") paint = await renderNodes();
      else paint = await renderJobs();
      if (mine !== loop) return;
      paint();
      $("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
      $("refreshed").classList.remove("error");
    } catch (err) {
      if (mine !== loop || (err instanceof ApiError && err.status === 401)) return;
      $("refreshed").textContent = "cannot refresh: " + err.message;
      $("refreshed").classList.add("error");
    }
    if (mine === loop && token()) refreshTimer = window.setTimeout(() => refresh(mine), REFRESH_MS);
  }

  // --- throughput, measured by this page from the steps it sees ------------------------

  function noteStep(view, now) {
    if (view.last_step === null || view.last_step === undefined || TERMINAL.has(view.phase)) {
      stepSamples.delete(view.job_id);
      return;
    }
    let samples = stepSamples.get(view.job_id) || [];
    const last = samples[samples.length - 1];
    if (last && view.last_step < last[1]) samples = []; // restarted from a checkpoint
    if (!last || last[1] !== view.last_step || now - last[0] > REFRESH_MS) {
      samples.push([now, view.last_step]);
    }
    stepSamples.set(view.job_id, samples.filter((s) => now - s[0] <= THROUGHPUT_WINDOW_MS));
  }

  // What the workers report (samples/s), else the step rate this page saw.
  function throughput(view) {
    if (typeof view.samples_per_second === "number" && !TERMINAL.has(view.phase)) {
      return view.samples_per_second.toFixed(1) + " samples/s";
    }
    const samples = stepSamples.get(view.job_id) || [];
    if (samples.length < 2) return "—";
    const [t0, s0] = samples[0];
    const [t1, s1] = samples[samples.length - 1];
    if (t1 - t0 < 1000) return "—";
    return ((s1 - s0) / ((t1 - t0) / 1000)).toFixed(2) + " steps/s";
  }

  // --- the jobs table -----------------------------------------------------------------

  async function renderJobs() {
    const jobs = await allJobs();
    const now = Date.now();
    jobs.forEach((view) => noteStep(view, now));
    jobs.sort((a, b) => Date.parse(b.created_at) - Date.parse(a.created_at));
    const header = el("tr", {},
      ...["Job", "Name", "Phase", "Queue", "World size", "Step", "Throughput", "Restarts", "Age"]
        .map((name) => el("th", {scope: "col"}, name)));
    const rows = jobs.map((view) => el("tr", {"data-job": view.job_id},
      el("td", {}, jobLink(view.job_id)),
      el("td", {}, view.spec.name),
      el("td", {}, el("span", {class: "phase phase-" + view.phase.toLowerCase()}, view.phase)),
      el("td", {}, queueOf(view)),
      el("td", {class: "num world-size"}, view.world_size),
      el("td", {class: "num"}, dash(view.last_step)),
      el("td", {class: "num"}, throughput(view)),
      el("td", {class: "num"}, view.restart_count),
      el("td", {class: "num"}, ageOf(view.created_at, now))));
    const body = rows.length ? rows
      : [el("tr", {}, el("td", {colspan: 9, class: "muted"}, "No jobs yet. Submit one with tidal submit."))];
    return () => morphChildren($("view"), [
      el("h1", {}, "Jobs"),
      el("table", {id: "jobs"}, el("thead", {}, header), el("tbody", {}, ...body))]);
  }

  // --- the nodes table ----------------------------------------------------------------

  // Each GPU the node describes (index, model, memory, health), else its count.
  function gpusOf(node) {
    const devices = Array.isArray(node.gpu_devices) ? node.gpu_devices : [];
    if (!devices.length) return node.gpus ? String(node.gpus) : "none";
    const cell = el("ul", {class: "gpus"});
    if (typeof node.gpus_used === "number") {
      cell.appendChild(el("li", {class: "muted"}, node.gpus_used + " of " + devices.length + " in use"));
    }
    for (const gpu of devices) {
      const memory = gpu.memory_bytes ? " " + Math.round(gpu.memory_bytes / 2 ** 30) + " GiB" : "";
      const health = gpu.healthy === false ? " — failed" + (gpu.fault ? ": " + gpu.fault : "") : "";
      cell.appendChild(el("li", {class: gpu.healthy === false ? "error" : null},
                          "GPU " + gpu.index + (gpu.model ? " " + gpu.model : "") + memory + health));
    }
    return cell;
  }

  // live or draining, and the `slow` condition of a straggler cooling down.
  function stateOf(node) {
    const slow = node.slow;
    if (!slow) return node.state;
    const since = new Date(slow.since).toLocaleTimeString();
    return el("span", {}, node.state + ", ",
              el("span", {class: "error", title: "evicted from " + slow.job_id + "; no new jobs until " +
                          new Date(slow.until).toLocaleTimeString() + " (tidal undrain clears it)"},
                 "slow " + Number(slow.ratio).toFixed(2) + "x since " + since));
  }

  function nodeJobs(jobs) {
    const cell = el("td", {});
    jobs.forEach((jobId, i) => {
      if (i) cell.appendChild(document.createTextNode(", "));
      cell.appendChild(jobLink(jobId));
    });
    if (!jobs.length) cell.appendChild(document.createTextNode("—"));
    return cell;
  }

  async function renderNodes() {
    const nodes = await api("nodes");
    const header = el("tr", {}, ...["Node", "Host", "State", "Slots used", "GPUs", "Labels", "Jobs"]
      .map((name) => el("th", {scope: "col"}, name)));
    const rows = nodes.map((node) => el("tr", {"data-node": node.node_id},
      el("td", {}, node.node_id),
      el("td", {}, node.host),
      el("td", {}, stateOf(node)),
      el("td", {class: "num"}, node.slots_used + " / " + node.slots),
      el("td", {}, gpusOf(node)),
      el("td", {}, Object.entries(node.labels || {}).map(([k, v]) => k + "=" + v).join(", ") || "—"),
      nodeJobs(node.jobs || [])));
    const body = rows.length ? rows
      : [el("tr", {}, el("td", {colspan: 7, class: "muted"}, "No node is registered."))];
    return () => morphChildren($("view"), [
      el("h1", {}, "Nodes"),
      el("table", {id: "nodes"}, el("thead", {}, header), el("tbody", {}, ...body))]);
  }

  // --- a job's story: recoveries and world size over time --------------------------------

  // How long each recovery took: from a disrupting event (a node lost or
  // joined, a resize, a charged restart) until the job ran again, i.e. the
  // next event in phase RUNNING with reason "restarted" or "resized_live" (the
  // scheduler writes it once every node runs at the new size). New bounds
  // disrupt only when they release nodes (the event names them): bounds alone
  // restart nothing. Disruptions that come before the
  // job ran again are one recovery, shown on the first of them; those before
  // the job first ran (nodes joining in the pass that starts it) are its start,
  // not a recovery. Returns seq -> {seconds, ongoing}; a recovery the job's end
  // cut short is left out.
  function disrupts(event) {
    if (event.reason === "scaled_by_user") return (event.nodes || []).length > 0;
    return DISRUPTIONS.has(event.reason);
  }

  function recoveries(events, nowMs) {
    const out = new Map();
    let start = null;
    let ran = false;
    for (const event of events) {
      if (event.phase === "RUNNING" && !ran) {
        ran = true;
        continue;
      }
      if (event.phase === "RUNNING" && RESUMED.has(event.reason)) {
        if (start !== null) {
          out.set(start.seq, {seconds: (Date.parse(event.time) - Date.parse(start.time)) / 1000,
                              ongoing: false});
        }
        start = null;
      } else if (TERMINAL.has(event.phase)) {
        start = null;
      } else if (ran && start === null && disrupts(event)) {
        start = event;
      }
    }
    if (start !== null) {
      out.set(start.seq, {seconds: (nowMs - Date.parse(start.time)) / 1000, ongoing: true});
    }
    return out;
  }

  // [[time ms, world size], ...] from the events (each carries the size the
  // job had after it) and the job's size now.
  function worldSizeSeries(events, view, nowMs) {
    const points = [];
    for (const event of events) {
      const size = TERMINAL.has(event.phase) ? 0 : event.world_size;
      if (size === null || size === undefined) continue;
      points.push([Date.parse(event.time), size]);
    }
    const end = TERMINAL.has(view.phase) && view.finished_at ? Date.parse(view.finished_at) : nowMs;
    points.push([end, TERMINAL.has(view.phase) ? 0 : view.world_size]);
    return points;
  }

  function worldSizeChart(points) {
    const width = 640, height = 160, left = 36, right = 8, top = 10, bottom = 24;
    // The sizes stepped through, for people reading the markup and for the tests.
    const sizes = points.map((p) => p[1]).filter((size, i, all) => i === 0 || size !== all[i - 1]);
    const chart = svg("svg", {viewBox: "0 0 " + width + " " + height, class: "chart",
                              role: "img", "aria-label": "world size over time",
                              "data-sizes": sizes.join(",")});
    if (points.length < 2) {
      chart.appendChild(svg("text", {x: left, y: height / 2, class: "axis"}, "no resize yet"));
      return chart;
    }
    const t0 = points[0][0], t1 = Math.max(points[points.length - 1][0], t0 + 1);
    const maxSize = Math.max(1, ...points.map((p) => p[1]));
    const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
    const y = (s) => top + (1 - s / maxSize) * (height - top - bottom);
    let path = "M" + x(points[0][0]).toFixed(1) + "," + y(points[0][1]).toFixed(1);
    for (let i = 1; i < points.length; i++) {
      path += " H" + x(points[i][0]).toFixed(1) + " V" + y(points[i][1]).toFixed(1);
    }
    for (const size of new Set([0, maxSize, Math.round(maxSize / 2)])) {
      chart.appendChild(svg("line", {x1: left, x2: width - right, y1: y(size), y2: y(size),
                                     class: "grid"}));
      chart.appendChild(svg("text", {x: left - 6, y: y(size) + 4, class: "axis",
                                     "text-anchor": "end"}, size));
    }
    chart.appendChild(svg("path", {d: path, class: "line"}));
    chart.appendChild(svg("text", {x: left, y: height - 6, class: "axis"},
                          new Date(t0).toLocaleTimeString()));
    chart.appendChild(svg("text", {x: width - right, y: height - 6, class: "axis",
                                   "text-anchor": "end"}, new Date(t1).toLocaleTimeString()));
    return chart;
  }

  // --- a job's page ---------------------------------------------------------------------

  function stopJobPage() {
    if (jobPage && jobPage.logs) jobPage.logs.abort();
    jobPage = null;
  }

  function section(id, title, ...children) {
    return el("section", {id: id, class: "panel"}, el("h2", {}, title), ...children);
  }

  function buildJobPage(jobId) {
    const parts = {
      title: el("h1", {}, "Job ", el("span", {id: "job-id"}, jobId)),
      links: el("p", {id: "job-links", class: "links"}),
      summary: el("dl", {id: "job-summary", class: "summary"}),
      error: el("div", {id: "job-error", role: "alert"}),
      chart: el("div", {id: "world-size-chart"}),
      eventsHead: el("thead", {}),
      events: el("tbody", {}),
      nodes: el("tbody", {}),
      logStatus: el("p", {id: "logs-status", class: "muted"}, "Connecting…"),
      logs: el("pre", {id: "logs", tabindex: 0}),
    };

    const nodesHead = el("tr", {}, ...["Node", "State", "Ranks", "Step", "Restarts"]
      .map((name) => el("th", {scope: "col"}, name)));
    const reload = el("button", {type: "button", id: "logs-reload"}, "Reconnect");
    reload.addEventListener("click", () => startLogs(jobId));
    $("view").replaceChildren(
      el("p", {}, el("a", {href: "#/"}, "← all jobs")),
      parts.title, parts.links, parts.error, parts.summary,
      section("world-size", "World size over time", parts.chart),
      section("events", "Events",
              el("table", {id: "events-table"}, parts.eventsHead, parts.events)),
      section("job-nodes", "Nodes",
              el("table", {id: "job-nodes-table"}, el("thead", {}, nodesHead), parts.nodes)),
      section("logs-panel", "Logs", el("div", {class: "logs-bar"}, parts.logStatus, reload),
              parts.logs));
    jobPage = {jobId: jobId, parts: parts, logs: null};
    startLogs(jobId);
    return jobPage;
  }

  // "97.1% (lost 12.0 s: detection 1.0, restart 9.0, redone 2.0)", where the API has it.
  function goodputText(view) {
    if (typeof view.goodput !== "number") return "—";
    const lost = Object.entries(view.lost_seconds || {})
      .filter(([, seconds]) => typeof seconds === "number" && seconds >= 0.05).sort();
    const total = lost.reduce((sum, [, seconds]) => sum + seconds, 0);
    const causes = lost.map(([cause, seconds]) => cause.replace(/_/g, " ") + " " + seconds.toFixed(1));
    return (100 * view.goodput).toFixed(1) + "%" +
      (lost.length ? " (lost " + total.toFixed(1) + " s: " + causes.join(", ") + ")" : "");
  }

  function summaryItems(view, now) {
    const spec = view.spec;
    const names = envNames(spec);
    const bounds = spec.min_nodes + ".." + spec.max_nodes + " node(s) × " + spec.nproc_per_node;
    return [
      ["Name", spec.name],
      ["Phase", view.phase + (view.cancel_requested && !TERMINAL.has(view.phase) ? " (cancelling)" : "")],
      ["Queue", queueOf(view)],
      ["World size", view.world_size + " (" + bounds + ")"],
      ["Step", dash(view.last_step) +
        (typeof view.total_steps === "number" ? " of " + view.total_steps : "")],
      ["Throughput", throughput(view)],
      ["Loss", typeof view.loss === "number" ? view.loss.toPrecision(4) : "—"],
      ["Goodput", goodputText(view)],
      ["Last checkpoint", view.last_checkpoint_step === null || view.last_checkpoint_step === undefined
        ? "—" : "step " + view.last_checkpoint_step +
          (view.last_checkpoint_at ? " (" + ageOf(view.last_checkpoint_at, now) + " ago)" : "")],
      ["Restarts", view.restart_count +
        (Object.keys(view.restarts).length
          ? " (" + Object.entries(view.restarts).map(([k, v]) => k + " " + v).join(", ") + ")" : "") +
        "; worker-failure budget " + spec.max_restarts + " per node"],
      ["Age", ageOf(view.created_at, now)],
      ["Submitted", clock(view.created_at)],
      ["Finished", clock(view.finished_at)],
      ["Command", spec.command.join(" ")],
      ["Environment", names.length ? names.join(", ") + " (values hidden)" : "—"],
    ];
  }

  function renderSummary(parts, view, now) {
    const items = [];
    for (const [name, value] of summaryItems(view, now)) {
      items.push(el("dt", {}, name), el("dd", {}, value));
    }
    morphChildren(parts.summary, items);
    const links = [];
    const dashboard = uiConfig && safeHttpUrl(uiConfig.grafana_dashboard_url);
    if (dashboard) {
      const url = new URL(dashboard);
      url.searchParams.set("var-job_id", view.job_id);
      links.push(el("a", {href: url.href, target: "_blank", rel: "noopener noreferrer",
                                       id: "grafana-link"}, "Grafana dashboard"));
    } else {
      links.push(el("span", {class: "muted"},
        "No Grafana configured (tidal coordinator --grafana-url)."));
    }
    morphChildren(parts.links, links);
  }

  function renderError(parts, view) {
    const problems = [];
    if (view.error) {
      const err = view.error;
      const what = err.rank === -1 ? "the runner" : "rank " + err.rank;
      const head = "Failed: " + what + ", exit code " + err.exit_code +
        (err.signal ? " (" + err.signal + ")" : "") + (err.message ? ": " + err.message : "");
      problems.push(el("p", {}, head));
      if (err.traceback) problems.push(el("pre", {class: "traceback"}, err.traceback));
    }
    for (const cond of view.conditions || []) {
      if (!cond.status && cond.type !== "Finished" && !TERMINAL.has(view.phase) && cond.message) {
        problems.push(el("p", {class: "condition"}, cond.type + ": " + cond.message));
      }
    }
    parts.error.className = view.error ? "error-box" : (problems.length ? "note-box" : "");
    morphChildren(parts.error, problems);
  }

  // The steps each recovery lost show in a column of their own once events
  // carry them (steps_lost); until then the job's goodput says what was lost.
  function renderEvents(parts, events, now) {
    const recovered = recoveries(events, now);
    const withLost = events.some((event) => typeof event.steps_lost === "number");
    const names = ["Time", "Phase", "Reason", "Message", "World size", "Recovery"];
    if (withLost) names.push("Steps lost");
    morphChildren(parts.eventsHead,
                  [el("tr", {}, ...names.map((name) => el("th", {scope: "col"}, name)))]);
    const rows = events.slice().reverse().map((event) => {
      const rec = recovered.get(event.seq);
      const recovery = rec ? duration(rec.seconds) + (rec.ongoing ? " so far" : "") : "—";
      const lost = typeof event.steps_lost === "number" ? event.steps_lost : "—";
      return el("tr", {"data-seq": event.seq, "data-reason": event.reason},
        el("td", {}, clock(event.time)),
        el("td", {}, event.phase),
        el("td", {}, event.reason),
        el("td", {class: "message"}, event.message),
        el("td", {class: "num"}, dash(event.world_size)),
        el("td", {class: "num recovery"}, recovery),
        withLost ? el("td", {class: "num steps-lost"}, lost) : null);
    });
    morphChildren(parts.events, rows);
  }

  function renderJobNodes(parts, view) {
    const rows = view.nodes.map((node) => el("tr", {},
      el("td", {}, node.node_id), el("td", {}, node.state),
      el("td", {}, node.ranks.length ? node.ranks.join(", ") : "—"),
      el("td", {class: "num"}, dash(node.last_step)), el("td", {class: "num"}, node.restart_count)));
    morphChildren(parts.nodes, rows.length ? rows
      : [el("tr", {}, el("td", {colspan: 5, class: "muted"}, "No node holds this job now."))]);
  }

  async function renderJob(jobId) {
    if (uiConfig === null) {
      try {
        uiConfig = await api("ui/config");
      } catch (err) {
        // A token scoped to queues may be refused it: the page goes on without Grafana.
        if (!(err instanceof ApiError && err.status === 403)) throw err;
        uiConfig = {};
      }
    }
    const path = "jobs/" + encodeURIComponent(jobId);
    let view, events;
    try {
      [view, events] = await Promise.all([api(path), api(path + "/events")]);
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) {
        return () => {
          stopJobPage();
          $("view").replaceChildren(el("p", {}, el("a", {href: "#/"}, "← all jobs")),
                                    el("p", {class: "error"}, err.message));
        };
      }
      throw err;
    }
    return () => {
      const page = jobPage && jobPage.jobId === jobId ? jobPage : buildJobPage(jobId);
      const now = Date.now();
      noteStep(view, now);
      renderSummary(page.parts, view, now);
      renderError(page.parts, view);
      morphChildren(page.parts.chart, [worldSizeChart(worldSizeSeries(events.events, view, now))]);
      renderEvents(page.parts, events.events, now);
      renderJobNodes(page.parts, view);
    };
  }

  // --- live logs ------------------------------------------------------------------------

  function appendLogLines(box, lines) {
    const follow = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
    for (const line of lines) {
      if (line === "") continue; // a keep-alive while following; output lines have a prefix
      box.appendChild(el("div", {class: line.startsWith("[tidal] ") ? "log-line tidal" : "log-line"},
                         line));
    }
    while (box.childNodes.length > LOG_LINES_KEPT) box.removeChild(box.firstChild);
    if (follow) box.scrollTop = box.scrollHeight;
  }

  async function startLogs(jobId) {
    if (!jobPage || jobPage.jobId !== jobId) return;
    if (jobPage.logs) jobPage.logs.abort();
    const control = new AbortController();
    jobPage.logs = control;
    const {logStatus, logs} = jobPage.parts;
    logs.replaceChildren();
    logStatus.textContent = "Connecting…";
    const given = token();
    if (!given) return;
    let response;
    try {
      response = await request("jobs/" + encodeURIComponent(jobId) + "/logs?tail=200&follow=true",
                               given, {signal: control.signal,
                                       headers: {"Authorization": "Bearer " + given,
                                                 "Accept": "text/plain"}});
    } catch (err) {
      if (control.signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) {
        signOut("The coordinator no longer accepts this token; sign in again.");
        return;
      }
      logStatus.textContent = "Logs are not available right now (" + err.message + ").";
      return;
    }
    logStatus.textContent = "Following the job's logs.";
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        pending += decoder.decode(value, {stream: true});
        const lines = pending.split("\n");
        pending = lines.pop();
        appendLogLines(logs, lines);
      }
      pending += decoder.decode();
      if (pending) appendLogLines(logs, [pending]);
      if (!control.signal.aborted) logStatus.textContent = "End of the logs.";
    } catch (err) {
      if (!control.signal.aborted) {
        logStatus.textContent = "The log stream stopped (" + err.message + "); Reconnect to resume.";
      }
    }
  }

  // --- start ----------------------------------------------------------------------------

  // For tests run in the browser: the pure parts.
  window.tidalUi = Object.freeze({recoveries: recoveries, worldSizeSeries: worldSizeSeries,
                                  goodputText: goodputText});

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", () => signOut("Signed out."));
    window.addEventListener("hashchange", route);
    route();
  });
})();
