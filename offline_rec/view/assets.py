"""The viewer page's style sheet and script, inlined into every page (no network at view time).

The script reads its data from <script type="application/json"> blocks and page files, and builds
the DOM with createElement / textContent only: no text of the data ever goes through an HTML parser.
"""

STYLE = r"""
:root { font-family: system-ui, "Noto Sans", "Noto Sans CJK SC", "Noto Color Emoji", sans-serif; font-size: 14px; }
body { margin: 0 1.5em 2em; color: #1d1d1f; background: #fafafa; }
header h1 { font-size: 1.3em; margin: .8em 0 .2em; }
.facts { color: #444; margin: .2em 0; }
.facts span { margin-right: 1.2em; }
.warning { color: #9a3412; }
form.filters { display: flex; flex-wrap: wrap; gap: .4em 1.2em; align-items: end; background: #fff;
  border: 1px solid #ddd; padding: .6em .8em; border-radius: 6px; margin: .6em 0; }
form.filters label { display: flex; flex-direction: column; font-size: .85em; color: #555; }
form.filters input { width: 6em; }
nav.pager { display: flex; gap: .8em; align-items: center; margin: .6em 0; }
#status { color: #444; }
.legend { display: flex; flex-wrap: wrap; gap: .6em; font-size: .85em; margin: .3em 0; align-items: center; }
section.group { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: .8em 0; padding: .4em .8em; }
section.group h2 { font-size: 1em; margin: .3em 0; font-weight: 600; }
.row { border-top: 1px solid #eee; padding: .4em 0; }
.row.dropped-row { opacity: .55; }
.row-head { font-size: .85em; color: #333; margin-bottom: .2em; }
.row-head span { margin-right: 1em; }
details.text .plain { white-space: pre-wrap; padding: .3em; }
details.prompt summary, details.text summary { cursor: pointer; color: #555; font-size: .85em; }
details.prompt pre, pre.meta { white-space: pre-wrap; background: #f4f4f4; padding: .4em; margin: .2em 0;
  font-family: ui-monospace, "Noto Sans Mono", "Noto Sans CJK SC", monospace; font-size: .85em; }
.completion { white-space: pre-wrap; line-height: 1.9; font-family: ui-monospace, "Noto Sans Mono",
  "Noto Sans CJK SC", "Noto Color Emoji", monospace; word-break: break-word; }
.tok { border-radius: 2px; padding: 1px 0; }
.tok.env { background: #e5e7eb; color: #4b5563; font-style: italic; outline: 1px dashed #9ca3af; }
.tok.drop { text-decoration: line-through 2px #111; outline: 2px solid #111; }
.tok.nl::before { content: "\21B5"; color: #999; }
.hex { unicode-bidi: isolate; font-size: .8em; color: #7c2d12; background: #ffedd5; border-radius: 2px; }
.special { unicode-bidi: isolate; font-size: .8em; color: #1e3a8a; background: #dbeafe; border-radius: 2px; }
.unknown { unicode-bidi: isolate; font-size: .8em; color: #555; }
.swatch { display: inline-block; padding: 0 .4em; border-radius: 2px; }
.error { color: #b91c1c; }
"""

SCRIPT = r"""
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const meta = JSON.parse($("view-meta").textContent);
  const index = JSON.parse($("view-index").textContent);
  const KINDS = ["text", "hex", "special", "unknown"];
  const HEX = 1;
  const pages = new Map();
  const waiting = new Map();

  // Page files (written next to the HTML by --out) call this when a script element loads them.
  window.offlineRecViewPage = function (number, payload) {
    const pending = waiting.get(number);
    if (pending) { waiting.delete(number); pending.resolve(payload); }
  };

  function loadPage(number) {
    if (pages.has(number)) return pages.get(number);
    let promise;
    const inline = $("view-page-" + number);
    if (inline) {
      promise = Promise.resolve(JSON.parse(inline.textContent));
    } else if (meta.serve) {
      promise = fetch("pages/" + number).then((response) => {
        if (response.ok) return response.json();
        return response.text().then((text) => {
          throw new Error("page " + number + ": HTTP " + response.status + " " + text);
        });
      });
    } else {
      promise = new Promise((resolve, reject) => {
        const script = document.createElement("script");
        script.src = encodeURIComponent(meta.pageDir) + "/page-" + String(number).padStart(5, "0") + ".js";
        waiting.set(number, { resolve: resolve });
        script.onerror = () => { waiting.delete(number); reject(new Error("cannot load " + script.src)); };
        document.head.appendChild(script);
      });
    }
    promise.catch(() => pages.delete(number));
    pages.set(number, promise);
    return promise;
  }

  function pageOfGroup(group) {  // the last page starting at or before `group`
    const starts = index.pageStarts;
    let low = 0, high = starts.length - 1;
    while (low < high) {
      const middle = (low + high + 1) >> 1;
      if (starts[middle] <= group) low = middle; else high = middle - 1;
    }
    return low;
  }

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function number(value, digits) {
    return value === null || value === undefined ? "none" : Number(value).toFixed(digits);
  }

  // -- filters, kept in the address's #fragment so that a view can be linked and reloaded
  const form = $("filters");
  const finishSelect = $("f-finish");
  index.reasons.forEach((reason, bit) => {
    const option = element("option", null, reason);
    option.value = String(bit);
    finishSelect.appendChild(option);
  });
  const FIELDS = ["rmin", "rmax", "lmin", "lmax", "finish", "signal", "page"];

  function readHash() {
    const params = new URLSearchParams(location.hash.slice(1));
    for (const name of FIELDS.slice(0, 6)) $("f-" + name).value = params.get(name) || "";
    return Math.max(0, parseInt(params.get("page") || "0", 10) || 0);
  }

  function filters() {
    const value = (name) => { const v = $("f-" + name).value.trim(); return v === "" ? null : Number(v); };
    return { rmin: value("rmin"), rmax: value("rmax"), lmin: value("lmin"), lmax: value("lmax"),
             finish: $("f-finish").value === "" ? -1 : Number($("f-finish").value), signal: $("f-signal").value };
  }

  function matches(g, f) {
    if (f.signal !== "" && String(index.signal[g]) !== f.signal) return false;
    const mean = index.rewardMean[g];
    if (f.rmin !== null && (mean === null || mean < f.rmin)) return false;
    if (f.rmax !== null && (mean === null || mean > f.rmax)) return false;
    if (f.lmin !== null && index.lengthMax[g] < f.lmin) return false;
    if (f.lmax !== null && index.lengthMax[g] > f.lmax) return false;
    if (f.finish >= 0 && Math.floor(index.finish[g] / Math.pow(2, f.finish)) % 2 !== 1) return false;
    return true;
  }

  let selected = [];
  let current = 0;

  function applyFilters() {
    const f = filters();
    selected = [];
    for (let g = 0; g < index.size.length; g++) if (matches(g, f)) selected.push(g);
  }

  function writeHash() {
    const params = new URLSearchParams();
    for (const name of FIELDS.slice(0, 6)) { const v = $("f-" + name).value.trim(); if (v !== "") params.set(name, v); }
    if (current) params.set("page", String(current));
    const hash = params.toString();
    if (location.hash.slice(1) !== hash) history.replaceState(null, "", hash ? "#" + hash : location.pathname);
  }

  // -- drawing
  const colourBy = $("colour-by");
  if (!meta.model) colourBy.querySelector('option[value="ratio"]').disabled = true;
  colourBy.value = meta.model ? "ratio" : "behavior";

  function colour(logp, policyLogp) {
    if (colourBy.value === "ratio" && policyLogp !== undefined && policyLogp !== null && logp !== null) {
      const logRatio = policyLogp - logp;
      const strength = Math.min(1, Math.abs(logRatio));
      return logRatio >= 0 ? "rgba(220, 38, 38, " + (0.08 + 0.6 * strength).toFixed(3) + ")"
                           : "rgba(37, 99, 235, " + (0.08 + 0.6 * strength).toFixed(3) + ")";
    }
    if (logp === null) return "";
    const p = Math.exp(logp);
    return "hsl(" + Math.round(120 * p) + ", 75%, " + (88 - 8 * (1 - p)).toFixed(1) + "%)";
  }

  function drawToken(row, position, text, droppedSet) {
    const id = row.ids[position];
    const span = element("span", "tok");
    const shown = text[String(id)];
    if (typeof shown === "string") {
      span.appendChild(document.createTextNode(shown));
      if (shown.indexOf("\n") >= 0) span.classList.add("nl");
    } else {
      for (const [kind, value] of shown) {
        span.appendChild(element("span", KINDS[kind], kind === HEX ? "\u27E8" + value + "\u27E9" : value));
      }
    }
    const logp = row.logp[position];
    const policyLogp = row.policyLogp ? row.policyLogp[position] : undefined;
    const environment = row.lossMask && row.lossMask[position] === 0;
    let title = "token " + id + " \u00b7 behavior log-prob " + number(logp, 3);
    if (environment) {
      span.classList.add("env");
      title += " \u00b7 environment token (loss_mask 0): not trained";
    } else {
      span.style.backgroundColor = colour(logp, policyLogp);
    }
    if (policyLogp !== undefined && policyLogp !== null && logp !== null) {
      title += " \u00b7 policy log-prob " + number(policyLogp, 3)
        + " \u00b7 rho " + Math.exp(policyLogp - logp).toFixed(3);
    }
    if (droppedSet.has(position)) {
      span.classList.add("drop");
      title += " \u00b7 dropped by the " + meta.algorithm.name + " clip mask";
    }
    span.title = title;
    return span;
  }

  function drawRow(row, text, groupPrompt) {
    const box = element("div", "row" + (row.droppedRow ? " dropped-row" : ""));
    box.dataset.sample = String(row.sample);
    const head = element("div", "row-head");
    const environment = row.lossMask ? row.lossMask.filter((m) => m === 0).length : 0;
    const dropped = row.dropped || [];
    const facts = [
      "#" + row.sample, "reward " + number(row.reward, 3), "advantage " + number(row.advantage, 3),
      "finish " + row.finish, "behavior " + row.behavior, "policy_version " + row.policyVersion,
      row.ids.length + " tokens" + (environment ? " (" + environment + " environment)" : ""),
    ];
    if (row.dropped) facts.push(dropped.length + " clipped");
    if (row.droppedRow) facts.push("left out by RED-Drop");
    for (const fact of facts) head.appendChild(element("span", null, fact));
    box.appendChild(head);
    const prompt = element("details", "prompt");
    prompt.appendChild(element("summary", null, "prompt (" + row.promptTokens + " tokens), task " + row.task));
    const promptText = element("pre", null, row.prompt === null ? groupPrompt : row.prompt);
    promptText.dir = "auto";
    prompt.appendChild(promptText);
    if (row.meta && row.meta !== "{}") prompt.appendChild(element("pre", "meta", "meta " + row.meta));
    box.appendChild(prompt);
    const completion = element("div", "completion");
    completion.dir = "auto";
    const droppedSet = new Set(dropped);
    for (let position = 0; position < row.ids.length; position++) {
      completion.appendChild(drawToken(row, position, text, droppedSet));
    }
    box.appendChild(completion);
    const whole = element("details", "text");
    whole.appendChild(element("summary", null, "text (the completion column)"));
    const plain = element("div", "plain", row.completion);
    plain.dir = "auto";
    whole.appendChild(plain);
    box.appendChild(whole);
    return box;
  }

  function drawGroup(group, text, number_) {
    const section = element("section", "group");
    section.dataset.group = group.id;
    const signal = { "1": "signal", "0": "no signal", "-1": "unrewarded" }[String(index.signal[number_])];
    section.appendChild(element("h2", null, "group " + group.id + " \u00b7 " + group.rows.length
      + " responses \u00b7 mean reward " + number(index.rewardMean[number_], 3) + " \u00b7 " + signal));
    for (const row of group.rows) section.appendChild(drawRow(row, text, group.prompt));
    return section;
  }

  let drawing = 0;
  function draw() {
    const ticket = ++drawing;
    const per = meta.groupsPerPage;
    const pageCount = Math.max(1, Math.ceil(selected.length / per));
    current = Math.min(current, pageCount - 1);
    writeHash();
    const chosen = selected.slice(current * per, (current + 1) * per);
    $("page-label").textContent = "page " + (current + 1) + " of " + pageCount;
    $("status").textContent = selected.length + " of " + index.size.length + " groups match";
    $("prev").disabled = current === 0;
    $("next").disabled = current >= pageCount - 1;
    const needed = [...new Set(chosen.map(pageOfGroup))];
    Promise.all(needed.map(loadPage)).then((payloads) => {
      if (ticket !== drawing) return;
      const main = $("groups");
      main.replaceChildren();
      const byPage = new Map(needed.map((page, i) => [page, payloads[i]]));
      for (const g of chosen) {
        const page = pageOfGroup(g);
        const payload = byPage.get(page);
        main.appendChild(drawGroup(payload.groups[g - index.pageStarts[page]], payload.text, g));
      }
      if (!document.body.dataset.firstPaintMs) {
        requestAnimationFrame(() => { document.body.dataset.firstPaintMs = performance.now().toFixed(0); });
      }
      document.body.dataset.rendered = String(chosen.length);
    }).catch((error) => {
      if (ticket !== drawing) return;
      $("groups").replaceChildren(element("p", "error", String(error.message || error)));
      document.body.dataset.rendered = "error";
    });
  }

  form.addEventListener("submit", (event) => { event.preventDefault(); current = 0; applyFilters(); draw(); });
  form.addEventListener("reset", () => setTimeout(() => { current = 0; applyFilters(); draw(); }, 0));
  $("prev").addEventListener("click", () => { current -= 1; draw(); });
  $("next").addEventListener("click", () => { current += 1; draw(); });
  colourBy.addEventListener("change", draw);
  window.addEventListener("hashchange", () => { current = readHash(); applyFilters(); draw(); });

  current = readHash();
  applyFilters();
  draw();
})();
"""
