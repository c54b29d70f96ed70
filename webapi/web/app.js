// needle's page: plain JS, no build step, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";
let INFO = null;
let queryUrl = null;      // object URL of the uploaded query image, or a /thumb URL for key queries
let busy = false;
let lastSearch = null;    // the last search asked for (a function that runs it again): options re-run it
let again = false;        // options changed during a search: run the last one again when it ends

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.classList.remove("hidden");
}
function clearError() { $("error").textContent = ""; $("error").classList.add("hidden"); }
function status(message) { $("status").textContent = message || ""; }
function fmt(x, digits = 3) { return typeof x === "number" ? x.toFixed(digits) : ""; }

async function getJSON(url, options) {
  let response;
  try {
    response = await fetch(url, options);
  } catch (err) {
    throw new Error("the server cannot be reached: " + err.message);
  }
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch (err) { /* not JSON */ }
  if (!response.ok) {
    const message = body && body.error ? body.error : `${response.status} ${response.statusText}`;
    throw new Error(message);
  }
  if (body === null) throw new Error("the server answered something that is not JSON");
  return body;
}

function options() {
  const k = parseInt($("k").value, 10);
  const nprobe = $("nprobe").value === "" ? null : parseInt($("nprobe").value, 10);
  const shortlist = $("shortlist").value === "" ? null : parseInt($("shortlist").value, 10);
  if (!Number.isInteger(k) || k < 1) throw new Error("k must be a positive integer");
  if (nprobe !== null && (!Number.isInteger(nprobe) || nprobe < 1)) throw new Error("nprobe must be a positive integer");
  if (shortlist !== null && (!Number.isInteger(shortlist) || shortlist < 1)) throw new Error("shortlist must be a positive integer");
  return { k, nprobe, rerank: $("rerank").checked, shortlist };
}

async function run(label, request) {
  if (busy) return;
  clearError();
  busy = true;
  status("searching…");
  const started = performance.now();
  try {
    const out = await request();
    status(`${out.results.length} results in ${Math.round(performance.now() - started)} ms` + (out.reranked ? " (re-ranked)" : ""));
    await render(out);
  } catch (err) {
    status("");
    showError(err.message || String(err));
  } finally {
    busy = false;
    if (again) { again = false; rerun(); }
  }
}

// The re-rank box (and the shortlist) change what the results mean: the results shown are searched
// again with the new setting, never left under a box that no longer describes them.
function rerun() {
  if (!lastSearch) return;
  if (busy) { again = true; return; }
  lastSearch();
}

function setQueryView(url, label) {
  if (queryUrl && queryUrl.startsWith("blob:") && queryUrl !== url) URL.revokeObjectURL(queryUrl);
  queryUrl = url;
  $("query-view").classList.toggle("hidden", !url && !label);
  $("query-img").classList.toggle("hidden", !url);
  if (url) $("query-img").src = url;
  $("query-label").textContent = label || "";
}

async function searchFile(file) {
  if (!file) return;
  lastSearch = () => searchFile(file);
  clearError();
  if (INFO && file.size > INFO.max_upload_bytes) {
    showError(`the file is ${file.size} bytes, over the limit of ${INFO.max_upload_bytes} bytes`);
    return;
  }
  let opts;
  try { opts = options(); } catch (err) { showError(err.message); return; }
  const params = new URLSearchParams({ k: opts.k, rerank: opts.rerank ? "1" : "0" });
  if (opts.nprobe !== null) params.set("nprobe", opts.nprobe);
  if (opts.shortlist !== null) params.set("shortlist", opts.shortlist);
  setQueryView(URL.createObjectURL(file), `${file.name} (${file.size} bytes)`);
  await run(file.name, () => getJSON("/page/search/image?" + params, {
    method: "POST", body: file, headers: { "Content-Type": "application/octet-stream" },
  }));
}

async function searchKey(key = $("key").value.trim()) {
  if (!key) { showError("type a database key"); return; }
  lastSearch = () => searchKey(key);
  let opts;
  try { opts = options(); } catch (err) { showError(err.message); return; }
  setQueryView(null, "");
  await run(key, async () => {
    const out = await getJSON("/page/search", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ key, k: opts.k, nprobe: opts.nprobe, rerank: opts.rerank, shortlist: opts.shortlist }),
    });
    setQueryView("/thumb?key=" + encodeURIComponent(key), key);
    return out;
  });
}

async function searchText(text = $("text").value) {
  if (!text.trim()) { showError("the text query is empty"); return; }
  lastSearch = () => searchText(text);
  let opts;
  try { opts = options(); } catch (err) { showError(err.message); return; }
  setQueryView(null, `“${text}”`);
  await run(text, () => getJSON("/page/search", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ text, k: opts.k, nprobe: opts.nprobe }),
  }));
}

function loadImage(url) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("image failed to load: " + url));
    img.src = url;
  });
}

async function render(out) {
  const grid = $("results");
  grid.replaceChildren();
  const pending = [];
  out.results.forEach((r, i) => {
    const card = document.createElement("div");
    card.className = "card";
    card.dataset.key = r.key;
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = r.key;
    img.loading = "lazy";
    img.src = "/thumb?key=" + encodeURIComponent(r.key);
    img.onerror = () => { img.alt = "no thumbnail"; img.classList.add("missing"); };
    card.appendChild(img);
    const head = document.createElement("div");
    head.innerHTML = `<span class="rank">#${i + 1}</span><span class="score">score ${fmt(r.score)}</span>`;
    card.appendChild(head);
    const key = document.createElement("div");
    key.className = "key";
    key.textContent = r.key;
    card.appendChild(key);
    if (r.global_score !== undefined) {
      const s = document.createElement("div");
      s.className = "scores";
      // With query expansion the global score is the similarity to the expanded query (the query's
      // descriptor plus verified results'), not the plain score shown without re-ranking.
      const globalLabel = out.expanded_with > 0 ? "global (expanded query)" : "global";
      if (out.expanded_with > 0) s.title = `query expanded with ${out.expanded_with} verified results (docs/reranking.md)`;
      s.textContent = `${globalLabel} ${fmt(r.global_score)} · local ${fmt(r.local_score)}` +
        (r.inliers !== undefined ? ` · ${r.inliers} inliers` : "");
      card.appendChild(s);
    }
    grid.appendChild(card);
    const verified = r.inliers === undefined ? true : r.inliers > 0;  // below the inlier threshold: no evidence drawn
    if (verified && r.matches && r.matches.query_xy && r.matches.query_xy.length && queryUrl) {
      card.classList.add("wide");
      pending.push(drawMatches(card, queryUrl, img.src, r.matches));
    }
  });
  await Promise.allSettled(pending);
}

// Lines between matched keypoints: both images side by side at the same height; the points are in
// the local extractor's base frame (longer side = local_resolution).
async function drawMatches(card, qUrl, dbUrl, matches) {
  const base = (INFO && INFO.local_resolution) || 1;
  let q, d;
  try { [q, d] = await Promise.all([loadImage(qUrl), loadImage(dbUrl)]); } catch (err) { return; }
  const H = 200;
  const qs = H / q.naturalHeight, ds = H / d.naturalHeight;
  const qw = q.naturalWidth * qs, dw = d.naturalWidth * ds, gap = 8;
  const qf = Math.max(q.naturalWidth, q.naturalHeight) / base, df = Math.max(d.naturalWidth, d.naturalHeight) / base;
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "matches");
  svg.setAttribute("viewBox", `0 0 ${qw + gap + dw} ${H}`);
  const place = (url, x, w) => {
    const im = document.createElementNS(SVG_NS, "image");
    im.setAttribute("href", url);
    im.setAttribute("x", x); im.setAttribute("y", 0);
    im.setAttribute("width", w); im.setAttribute("height", H);
    svg.appendChild(im);
  };
  place(qUrl, 0, qw);
  place(dbUrl, qw + gap, dw);
  matches.query_xy.forEach((p, i) => {
    const o = matches.db_xy[i];
    if (!o) return;
    const line = document.createElementNS(SVG_NS, "line");
    line.setAttribute("x1", p[0] * qf * qs); line.setAttribute("y1", p[1] * qf * qs);
    line.setAttribute("x2", qw + gap + o[0] * df * ds); line.setAttribute("y2", o[1] * df * ds);
    svg.appendChild(line);
  });
  const title = document.createElementNS(SVG_NS, "title");
  title.textContent = `${matches.query_xy.length} inlier correspondences`;
  svg.appendChild(title);
  card.querySelector("img.thumb").replaceWith(svg);
}

function setMode(mode) {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t.dataset.mode === mode));
  document.querySelectorAll(".mode").forEach((m) => m.classList.toggle("hidden", m.id !== "mode-" + mode));
  clearError();
}

async function loadReport() {
  let report;
  try { report = await getJSON("/report"); } catch (err) { return; }
  $("report").classList.remove("hidden");
  const summary = $("report-summary");
  summary.replaceChildren();
  for (const [name, value] of Object.entries(report.summary || {})) {
    if (!/^(map|recall|oracle|n_|k$|database_size|index_kind|search_ms)/.test(name)) continue;
    const span = document.createElement("span");
    span.textContent = `${name}: ${typeof value === "number" ? +value.toFixed(3) : value}`;
    summary.appendChild(span);
  }
  $("report-notes").textContent = (report.notes || []).join(" ");
  if (report.scaling_plot) { $("scaling").src = "/report/scaling.png"; $("scaling").classList.remove("hidden"); }
  const body = document.querySelector("#report-table tbody");
  body.replaceChildren();
  for (const q of report.per_query || []) {
    const tr = document.createElement("tr");
    const missed = q.missed === undefined || q.missed === null ? "—"
      : q.missed.length === 0 ? "none" : q.missed.map((m) => `${m.key} (${m.rank === null || m.rank === undefined ? "not found" : "rank " + m.rank})`).join(", ");
    for (const cell of [q.key, q.kind || "", fmt(q.ap, 2), fmt(q.recall, 2), missed]) {
      const td = document.createElement("td");
      td.textContent = cell === undefined ? "" : cell;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

async function init() {
  document.querySelectorAll(".tab").forEach((t) => t.addEventListener("click", () => { if (!t.disabled) setMode(t.dataset.mode); }));
  $("file").addEventListener("change", (e) => {
    const file = e.target.files[0];
    e.target.value = "";  // choosing the same file again is a change too: it searches again
    searchFile(file);
  });
  $("rerank").addEventListener("change", rerun);
  $("shortlist").addEventListener("change", () => { if ($("rerank").checked) rerun(); });
  const drop = $("drop");
  ["dragenter", "dragover"].forEach((ev) => drop.addEventListener(ev, (e) => { e.preventDefault(); drop.classList.add("over"); }));
  ["dragleave", "drop"].forEach((ev) => drop.addEventListener(ev, (e) => { e.preventDefault(); drop.classList.remove("over"); }));
  drop.addEventListener("drop", (e) => { const f = e.dataTransfer.files[0]; if (f) searchFile(f); });
  $("key-go").addEventListener("click", () => searchKey());
  $("key").addEventListener("keydown", (e) => { if (e.key === "Enter") searchKey(); });
  $("text-go").addEventListener("click", () => searchText());
  $("text").addEventListener("keydown", (e) => { if (e.key === "Enter") searchText(); });
  try {
    INFO = await getJSON("/page/info");
  } catch (err) {
    showError("cannot read the index information: " + err.message);
    return;
  }
  $("info").textContent = `${INFO.ntotal} images · d=${INFO.d} · ${INFO.kind || "index"}` +
    (INFO.has_locals ? " · local features" : "");
  $("k").max = INFO.ntotal;
  if (parseInt($("k").value, 10) > INFO.ntotal) $("k").value = INFO.ntotal;
  $("rerank").disabled = !INFO.has_locals;
  $("rerank").checked = INFO.has_locals && INFO.rerank_default;
  $("shortlist").value = INFO.shortlist;
  $("shortlist").disabled = !INFO.has_locals;
  $("tab-text").disabled = !INFO.has_text;
  $("text").disabled = $("text-go").disabled = !INFO.has_text;
  $("text-note").textContent = INFO.has_text ? "" : "the index's model has no text tower";
  if (!INFO.has_model) { $("tab-image").disabled = true; setMode("key"); }
  document.body.dataset.ready = "1";
  loadReport();
}

window.addEventListener("unhandledrejection", (e) => showError(String(e.reason && e.reason.message || e.reason)));
init();
