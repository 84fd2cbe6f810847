// The studio: a client of this server's public routes (GET /v1/models, GET /v1/options,
// POST /v1/chat/completions with "stream": true and "drafts": true). Every forward's draft
// frame (an SSE comment ": draft {...}") is kept and drawn; the controls are built from
// /v1/options, so an option the server learns appears here with no change to this page.
"use strict";

const MASK = "·";
const state = { model: null, listing: null, history: [], panes: {} };
window.studio = state; // (tests and curious users read the frames here)

const $ = (selector, root = document) => root.querySelector(selector);
const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
};

// -- the controls, from the option listing

function control(option) {
  let input;
  if (option.enum || option.type === "boolean") {
    const values = option.enum || ["true", "false"];
    const label = option.default !== undefined ? `(default: ${option.default})` : "(default)";
    input = el("select", {}, el("option", { value: "", textContent: label }),
      ...values.map((v) => el("option", { value: String(v), textContent: String(v) })));
  } else if (option.type === "integer" || option.type === "number") {
    input = el("input", { type: "number", step: option.type === "integer" ? "1" : "any",
      placeholder: option.default !== undefined ? String(option.default) : "(default)" });
  } else {
    input = el("input", { type: "text", placeholder: option.type === "array" ? "comma-separated" : "" });
  }
  input.name = option.name;
  input.dataset.type = option.type;
  const family = option.family ? ` (${option.family})` : "";
  return el("label", { title: option.help + family }, option.name + family, input);
}

function settingsOf(pane) {
  const body = {};
  for (const input of pane.root.querySelectorAll(".settings [name]")) {
    const raw = input.value.trim();
    if (raw === "") continue;
    const type = input.dataset.type;
    if (type === "integer" || type === "number") body[input.name] = Number(raw);
    else if (type === "boolean") body[input.name] = raw === "true";
    else if (type === "array") body[input.name] = raw.split(",").map((v) => Number(v.trim()));
    else body[input.name] = raw;
  }
  return body;
}

function makePane(key, title) {
  const root = $("#pane-template").content.firstElementChild.cloneNode(true);
  root.id = `pane-${key}`;
  $("h2", root).textContent = title;
  for (const option of state.listing.data) $(".settings", root).append(control(option));
  $("#panes").append(root);
  const pane = { key, root, frames: [], history: emptyHistory(), answer: "", forwards: 0, seconds: 0 };
  $(".replay", root).addEventListener("input", (e) => showFrame(pane, Number(e.target.value)));
  // a tap (a touch screen shows no hover text) or a click: the cell's text under the canvas
  $(".canvas", root).addEventListener("click", (e) => {
    const cell = e.target.closest(".cell");
    const detail = $(".detail", root);
    detail.textContent = cell ? cell.title : "";
    detail.hidden = !cell;
  });
  $(".png", root).addEventListener("click", () => download(pane, "png"));
  $(".svg", root).addEventListener("click", () => download(pane, "svg"));
  $(".gif", root).addEventListener("click", () => download(pane, "gif"));
  state.panes[key] = pane;
  return pane;
}

// -- a run: one streamed request, its frames kept and drawn as they arrive

function showError(pane, message) {
  const box = pane ? $(".error", pane.root) : $("#status");
  box.textContent = message;
  box.hidden = !message;
}

function clearPane(pane) {
  // a new run starts from an empty pane: an error must not leave the previous run's
  // canvas, answer, figures and picture under it, as if they were this prompt's
  Object.assign(pane, { frames: [], history: emptyHistory(), answer: "", forwards: 0, seconds: 0, finish: null });
  showError(pane, "");
  $(".answer", pane.root).textContent = "";
  $(".canvas", pane.root).replaceChildren();
  const order = $(".order", pane.root);
  order.width = 10;
  order.height = 10;
  for (const b of pane.root.querySelectorAll(".png, .svg, .gif")) b.disabled = true;
  const slider = $(".replay", pane.root);
  Object.assign(slider, { max: "0", value: "0", disabled: true });
  $(".replay-at", pane.root).textContent = "–";
  figures(pane);
}

async function run(pane, messages) {
  clearPane(pane);
  pane.running = true;
  try {
    return await stream(pane, messages);
  } finally {
    pane.running = false;
    figures(pane);
  }
}

async function stream(pane, messages) {
  // (proposals: each frame's 5 likeliest tokens per position, shown on hovering a cell)
  const body = Object.assign({ model: state.model, messages, stream: true, drafts: true, proposals: PROPOSALS },
                             settingsOf(pane));
  const started = performance.now();
  const stopped = () => {
    showError(pane, "stopped: the request was cancelled");
    return null;
  };
  let response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: state.abort.signal });
  } catch (e) {
    if (state.abort.signal.aborted) return stopped();
    showError(pane, `the server cannot be reached: ${e}`);
    return null;
  }
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON: the status */ }
    showError(pane, message);
    return null;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) handleLine(pane, line, started);
      }
    }
  } catch (e) {
    if (!state.abort.signal.aborted) throw e;
    if (pane.frames.length) showFrame(pane, pane.frames.length - 1, true); // (what it made before the stop)
    return stopped();
  }
  pane.seconds = (performance.now() - started) / 1000;
  if (pane.frames.length) showFrame(pane, pane.frames.length - 1, true); // (the last frame, drawn now)
  figures(pane);
  return pane.answer;
}

function handleLine(pane, line, started) {
  if (line.startsWith(": draft ")) {
    const frame = JSON.parse(line.slice(8));
    frame.at = (performance.now() - started) / 1000;
    record(pane.history, frame, pane.frames[pane.frames.length - 1] || null);
    pane.frames.push(frame);
    pane.forwards = frame.forwards;
    pane.seconds = frame.at;
    drawSoon(pane);
  } else if (line.startsWith("data: ") && line !== "data: [DONE]") {
    const chunk = JSON.parse(line.slice(6));
    if (chunk.error) { showError(pane, chunk.error.message || String(chunk.error)); return; }
    const choice = (chunk.choices || [])[0];
    if (choice && choice.delta && choice.delta.content) pane.answer += choice.delta.content;
    if (choice && choice.finish_reason) pane.finish = choice.finish_reason;
    $(".answer", pane.root).textContent = pane.answer;
  }
}

function drawSoon(pane) {
  // frames can come faster than the screen redraws: draw the latest once per display frame
  if (pane.drawing) return;
  pane.drawing = requestAnimationFrame(() => {
    pane.drawing = null;
    showFrame(pane, pane.frames.length - 1, true);
  });
}

// -- what each position went through, up to frame k

function emptyHistory() {
  // commit[i]: the forward that committed position i, with its confidence; edited[i]: a
  // committed (or drafted) token that a later forward replaced, at the forwards editedAt[i]
  return { commit: [], confidence: [], edited: [], editedAt: [] };
}

function record(h, frame, previous) {
  // one more frame into the history `h` (live: once per frame, not the whole run again)
  frame.tokens.forEach((token, i) => {
    if (frame.states[i] === "c" && h.commit[i] === undefined) {
      h.commit[i] = frame.forwards;
      const j = i - frame.block[0];
      h.confidence[i] = j >= 0 && j < frame.confidence.length ? frame.confidence[j] : 1;
    }
    const before = previous ? previous.tokens[i] : undefined;
    if (previous && before !== null && before !== undefined && token !== before && previous.states[i] !== "m") {
      h.edited[i] = true;
      (h.editedAt[i] = h.editedAt[i] || []).push(frame.forwards);
    }
  });
  return h;
}

function history(pane, k) {
  // the history up to frame k: the kept one for the latest frame, rebuilt for a replay
  if (k === pane.frames.length - 1 && pane.history) return pane.history;
  const h = emptyHistory();
  for (let f = 0; f <= k; f++) record(h, pane.frames[f], f > 0 ? pane.frames[f - 1] : null);
  return h;
}

function forwardColour(forward, last, confidence) {
  // viridis by the forward's place in the decode (colour-blind safe, ordered dark to light),
  // paler where the model was less sure; white text on the dark end
  const [r, g, b] = viridisRgb(last > 1 ? (forward - 1) / (last - 1) : 1);
  const pale = 0.55 * (1 - Math.min(Math.max(confidence, 0), 1));
  const mix = (v) => Math.round(v + (255 - v) * pale);
  const dark = 0.299 * mix(r) + 0.587 * mix(g) + 0.114 * mix(b) < 140;
  return { background: `rgb(${mix(r)}, ${mix(g)}, ${mix(b)})`, color: dark ? "#fff" : "#000" };
}

const RUN_MIN = 3; // a run of this many equal end tokens (EOS, padding) is drawn as one cell

function isEndToken(text) {
  return text === "" || /^<[^<>]*>$/.test(text) || /^<\|[^|]*\|>$/.test(text);
}

function showFrame(pane, k, live = false) {
  const frames = pane.frames;
  if (!frames.length) return;
  const frame = frames[k];
  const { commit, confidence, edited } = history(pane, k);
  const canvas = $(".canvas", pane.root);
  canvas.replaceChildren();
  const shown = visibleLength(frames[frames.length - 1]);
  const lastForward = frames[frames.length - 1].forwards;
  let skip = 0;
  frame.tokens.slice(0, shown).forEach((token, i) => {
    if (skip > 0) { skip--; return; }
    let run = 1;  // (committed end tokens in a row: one cell with their count)
    while (frame.states[i] === "c" && token !== null && isEndToken(token) && i + run < shown
           && frame.tokens[i + run] === token && frame.states[i + run] === "c") run++;
    if (run >= RUN_MIN) {
      skip = run - 1;
      canvas.append(el("span", { className: "cell run", textContent: `${token || "∅"} ×${run}`,
                                 title: `positions ${i}-${i + run - 1}: ${run} × ${JSON.stringify(token)}` }));
      return;
    }
    const s = frame.states[i];
    const cell = el("span", { className: `cell ${s}`, textContent: token === null ? MASK : (token || "∅") });
    if (i >= frame.block[0] && i < frame.block[1]) cell.classList.add("block");
    if (edited[i]) cell.classList.add("edited");
    const inserted = (frame.inserted || []).includes(i);  // LLaDA2.2: a mask a SPLIT put in
    if (inserted) cell.classList.add("inserted");
    // a uniform canvas (DiffusionGemma): the draws the step's rule kept, apart from the re-noised
    const accepted = s === "d" && (frame.accepted || []).includes(i);
    if (accepted) cell.classList.add("accepted");
    if (s === "c") {
      const c = confidence[i] ?? 1;
      Object.assign(cell.style, forwardColour(commit[i], lastForward, c));
      cell.title = `position ${i}: committed at forward ${commit[i]}, confidence ${c.toFixed(3)}`;
    } else {
      const what = s === "m" ? (inserted ? "masked (inserted by a SPLIT)" : "masked")
        : accepted ? "draft, its draw accepted at this forward" : "draft";
      cell.title = `position ${i}: ${what}`;
    }
    const top = proposalsAt(frame, i);
    if (top) cell.title += `\nthe model's likeliest here at forward ${frame.forwards}:\n` +
      top.map(([text, p]) => `  ${JSON.stringify(text)} ${(100 * p).toFixed(1)}%`).join("\n");
    canvas.append(cell);
  });
  if (frame.deleted) {  // LLaDA2.2: positions a DELETE dropped this forward (the block shifted left)
    canvas.append(el("span", { className: "cell deleted", textContent: `−${frame.deleted}`,
                               title: `${frame.deleted} position(s) deleted at forward ${frame.forwards}` }));
  }
  const slider = $(".replay", pane.root);
  slider.max = String(frames.length - 1);
  slider.disabled = false;
  if (live) slider.value = String(k);
  $(".replay-at", pane.root).textContent = `${frame.forwards} / ${frames[frames.length - 1].forwards}`;
  figures(pane, frame);
  drawOrder(pane);
}

function proposalsAt(frame, i) {
  // the frame's proposals at generated position i ([[text, p], ...]), or null
  if (!frame.proposals) return null;
  if (!frame.proposalsAt) frame.proposalsAt = new Map(frame.proposals);
  return frame.proposalsAt.get(i) || null;
}

function visibleLength(frame) {
  // the positions up to the last one holding a token (a long canvas of untouched masks
  // past the answer is cut), at least the current block
  let last = frame.block[1];
  frame.states.split("").forEach((s, i) => { if (s !== "m") last = Math.max(last, i + 1); });
  return Math.min(last, frame.tokens.length);
}

function figures(pane, frame) {
  const last = frame || pane.frames[pane.frames.length - 1];
  const forwards = last ? last.forwards : 0;
  // during a run, the current block's committed positions count too (`committed` counts
  // the answer's final tokens only: 0.00 for a whole first block); once it ends, the
  // answer's tokens (not the EOS padding a decode fills without a forward)
  const decoded = last && pane.running ? [...last.states.slice(0, last.block[1])].filter((s) => s === "c").length : 0;
  const committed = last ? Math.max(last.committed, decoded) : 0;
  const seconds = last ? (frame ? last.at : pane.seconds) : 0;
  $(".forwards", pane.root).textContent = String(forwards);
  $(".frames", pane.root).textContent = String(pane.frames.length);
  $(".tpf", pane.root).textContent = forwards ? (committed / forwards).toFixed(2) : "–";
  $(".tps", pane.root).textContent = seconds > 0 ? (committed / seconds).toFixed(1) : "–";
  $(".time", pane.root).textContent = seconds > 0 ? `${seconds.toFixed(2)} s` : "–";
}

// -- the unmask-order picture: positions across, forwards down

const CELL = 12;

function orderCells(pane) {
  const frames = pane.frames, last = frames[frames.length - 1];
  const { commit, confidence, editedAt } = history(pane, frames.length - 1);
  const n = visibleLength(last), rows = last.forwards;
  return { n, rows, commit, confidence, editedAt };
}

function viridisRgb(t) {
  // a few stops of matplotlib's viridis, linearly interpolated (the CLI's picture uses it)
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2);
  const a = stops[i], b = stops[i + 1], u = x - i;
  return a.map((v, j) => Math.round(v + (b[j] - v) * u));
}

const viridis = (t) => `rgb(${viridisRgb(t).join(",")})`;

function orderRects(pane) {
  // one rectangle per position for its committed span, one for its commit, one per edit
  const { n, rows, commit, confidence, editedAt } = orderCells(pane);
  const rects = [];
  for (let i = 0; i < n; i++) {
    const f = commit[i];
    if (f !== undefined && f < rows) rects.push({ x: i * CELL, y: f * CELL, h: (rows - f) * CELL, fill: "#d9d9d9" });
    if (f !== undefined) rects.push({ x: i * CELL, y: (f - 1) * CELL, h: CELL, fill: viridis(confidence[i] ?? 1) });
    for (const e of editedAt[i] || []) rects.push({ x: i * CELL, y: (e - 1) * CELL, h: CELL, fill: "#d62728" });
  }
  return { width: Math.max(n, 1) * CELL, height: Math.max(rows, 1) * CELL, rects };
}

function drawOrder(pane) {
  const { width, height, rects } = orderRects(pane);
  const canvas = $(".order", pane.root);
  canvas.width = width;
  canvas.height = height;
  const g = canvas.getContext("2d");
  g.fillStyle = "#ffffff";
  g.fillRect(0, 0, width, height);
  for (const r of rects) { g.fillStyle = r.fill; g.fillRect(r.x, r.y, CELL, r.h); }
  for (const b of pane.root.querySelectorAll(".png, .svg, .gif")) b.disabled = false;
}

function download(pane, kind) {
  // the server draws it with the CLI's renderer (POST /v1/studio/render): the unmask order
  // with axes, colour bar and a title naming the model and the pane's settings (png, svg),
  // or the decode as an animation, the canvas after every forward (gif)
  const settings = Object.entries(settingsOf(pane)).map(([k, v]) => `${k}=${v}`).join(", ");
  const title = `${state.model} (${state.listing.family || "autoregressive"})${settings ? ": " + settings : ""}`;
  const frames = pane.frames.map(({ proposalsAt, ...frame }) => frame);
  const name = `${kind === "gif" ? "decode" : "unmask-order"}-${pane.key}.${kind}`;
  fetch("/v1/studio/render", { method: "POST", headers: { "Content-Type": "application/json" },
                               body: JSON.stringify({ format: kind, frames, title }) })
    .then(async (response) => {
      if (!response.ok) throw new Error((await response.json()).error.message);
      const url = URL.createObjectURL(await response.blob());
      const link = el("a", { href: url, download: name });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    })
    .catch((e) => showError(pane, `the picture could not be made: ${e.message}`));
}

// -- the chat

async function readImage() {
  const file = $("#image").files[0];
  if (!file) return null;
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function addTurn(role, text) {
  $("#history").append(el("div", { className: `turn ${role}`, textContent: text }));
}

const PROPOSALS = 5; // the likeliest tokens a frame carries per position (the hover)
const PANE_KEYS = ["a", "b", "c", "d"]; // 1 to 4 settings side by side (#compare)

function comparedPanes() {
  return PANE_KEYS.slice(0, Number($("#compare").value) || 1).map((key) => state.panes[key]);
}

function showPanes() {
  const shown = new Set(comparedPanes());
  for (const key of PANE_KEYS) state.panes[key].root.hidden = !shown.has(state.panes[key]);
  $("#panes").dataset.count = String(shown.size);
}

async function send() {
  const text = $("#prompt").value;
  if (!text.trim()) return;
  const image = await readImage();
  const content = image ? [{ type: "image_url", image_url: { url: image } }, { type: "text", text }] : text;
  const messages = state.history.concat([{ role: "user", content }]);
  $("#run").disabled = true;
  $("#stop").disabled = false;
  state.abort = new AbortController();
  try {
    const answer = await run(state.panes.a, messages);
    for (const pane of comparedPanes().slice(1)) {  // (the same prompt, each pane's settings, in turn)
      if (state.abort.signal.aborted) {  // (a pane's old results are not this prompt's)
        clearPane(pane);
        showError(pane, "not run: stopped");
      } else {
        await run(pane, messages);
      }
    }
    if (answer !== null) {
      state.history = messages.concat([{ role: "assistant", content: answer }]);
      addTurn("user", text);
      addTurn("assistant", answer);
      $("#prompt").value = "";
    }
  } finally {
    $("#run").disabled = false;
    $("#stop").disabled = true;
    document.body.dataset.runs = String(Number(document.body.dataset.runs || 0) + 1);
  }
}

async function start() {
  try {
    const models = await (await fetch("/v1/models")).json();
    state.model = models.data[0].id;
    state.listing = await (await fetch("/v1/options")).json();
  } catch (e) {
    showError(null, `cannot read the server's models and options: ${e}`);
    return;
  }
  $("#model").textContent = state.model;
  $("#family").textContent = state.listing.family || "autoregressive";
  $("#image-label").hidden = !state.listing.vision;
  for (const example of state.listing.examples || []) {  // (the server's: the demo's problems on the demo)
    $("#examples").append(el("button", { type: "button", textContent: example,
                                          onclick: () => { $("#prompt").value = example; $("#prompt").focus(); } }));
  }
  for (const key of PANE_KEYS) makePane(key, key.toUpperCase());
  showPanes();
  $("#compare").addEventListener("change", showPanes);
  $("#run").addEventListener("click", send);
  $("#stop").addEventListener("click", () => state.abort && state.abort.abort()); // (the server cancels the decode)
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("#new-chat").addEventListener("click", () => { state.history = []; $("#history").replaceChildren(); });
  document.body.dataset.ready = "true";
}

start();
