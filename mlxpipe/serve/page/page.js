// The cluster's page of `mlxpipe serve`: draws GET /v1/cluster every POLL_MS, and chats through the server's own
// /v1/chat/completions. Plain DOM and SVG, no library, nothing fetched from elsewhere.
"use strict";

const POLL_MS = 1000;
const CHART_SECONDS = 300;
const KEY_STORE = "mlxpipe-api-key";

const $ = (id) => document.getElementById(id);
let modelId = null;
let imageLimits = null; // {max_bytes, max_images} where the model takes images; null: text only, no attach
let attached = [];      // images for the next message: {name, uri} (a data: URI, sent as an image_url part)
let chat = [];          // the conversation so far: {role, content}; a turn with images keeps them, as parts
let chatBusy = false;
let lastCause = null;   // the root cause the server last gave: kept when it then stops answering (it gave up)

// --- the API key: asked for when the server answers 401, kept in this tab's sessionStorage -----------------

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("main").hidden = true;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("key-input").value = "";
  poll();
});

// --- helpers -----------------------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

const fmt = (x, digits = 1) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const gb = (x) => (x === null || x === undefined ? "–" : `${Number(x).toFixed(x < 10 ? 2 : 1)} GB`);
const pct = (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`);

// --- polling -----------------------------------------------------------------------------------------------

let pollTimer = null;

async function poll() {
  clearTimeout(pollTimer);
  try {
    const response = await fetch("v1/cluster", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      const had = sessionStorage.getItem(KEY_STORE);
      sessionStorage.removeItem(KEY_STORE);
      askForKey(had ? "That key was refused." : "");
      return;  // polling resumes when a key is given
    }
    if (!response.ok) throw new Error(`GET /v1/cluster: ${response.status}`);
    const data = await response.json();
    $("key-form").hidden = true;
    $("main").hidden = false;
    render(data);
  } catch (err) {
    const why = lastCause ? `${lastCause}; ` : "";
    setStatus("unreachable", `${why}the server does not answer (${err.message}); retrying`);
  }
  pollTimer = setTimeout(poll, POLL_MS);
}

function setStatus(status, detail) {
  const pill = $("status");
  pill.textContent = status;
  pill.dataset.status = status;
  const banner = $("detail");
  banner.hidden = !detail;
  banner.textContent = detail || "";
  banner.dataset.status = status;
}

function render(data) {
  modelId = data.model_id;
  $("model").textContent = data.model_id;
  imageLimits = data.images || null;
  $("attach").hidden = !imageLimits;
  const cause = data.status === "failed" ? (data.error || data.detail) : data.status === "restarting" ? data.detail : null;
  lastCause = data.status === "failed" ? `Failed: ${cause}` : null;
  setStatus(data.status, cause ? `${data.status === "failed" ? "Failed" : "Restarting"}: ${cause}` : null);
  $("restarts").textContent = data.restarts ? `${data.restarts} restart${data.restarts > 1 ? "s" : ""}` : "";
  renderRanks(data);
  renderChart(data.history);
  renderStats(data);
  renderRequests(data.requests);
}

// --- the pipeline: one card per rank, in layer order, the hop waits between them -----------------------------

function renderRanks(data) {
  const ranks = [...data.ranks].sort((a, b) => a.layers[0] - b.layers[0]);
  const hops = new Map((data.hops || []).map((h) => [`${h.from}>${h.to}`, h]));
  const cause = data.status === "failed" || data.status === "restarting" ? (data.error || data.detail) : null;
  const nodes = [];
  ranks.forEach((rank, i) => {
    if (i > 0) {
      const hop = hops.get(`${ranks[i - 1].rank}>${rank.rank}`);
      nodes.push(el("div", { class: "hop", title: "how long the next rank waited for this hop's input, and its share of that rank's working time" },
        el("span", { class: "arrow", text: "→" }),
        hop ? el("span", { class: "muted small", text: `wait ${fmt(hop.wait_s, 1)} s` }) : null,
        hop && hop.wait_share !== undefined ? el("span", { class: "muted small", text: pct(hop.wait_share) }) : null));
    }
    nodes.push(rankCard(rank, cause));
  });
  $("ranks").replaceChildren(...nodes);
}

function rankCard(rank, cause) {
  const [start, end] = rank.layers;
  const group = tensorGroup(rank);
  const card = el("div", { class: "card rank", "data-rank": rank.rank, "data-state": rank.state },
    el("div", { class: "rank-head" },
      el("span", { class: "rank-id", text: `rank ${rank.rank}` }),
      el("span", { class: "state pill", "data-status": rank.state, text: rank.state })),
    el("div", { class: "host", text: rank.host }),
    el("div", { class: "layers", text: `layers ${start}–${end - 1}` },
      el("span", { class: "muted small", text: ` (${end - start})` })),
    group ? el("div", { class: "group", text: group }) : null,
    memoryBar(rank),
    el("div", { class: "busy" },
      el("span", { class: "muted", text: "busy " }), el("span", { text: pct(rank.busy) }),
      el("div", { class: "bar thin" }, el("div", { class: "fill busy-fill", style: `width:${Math.round((rank.busy || 0) * 100)}%` }))),
    diskTier(rank));
  if ((rank.state === "failed" || rank.state === "restarting") && cause) {
    card.append(el("div", { class: "cause small", text: cause }));
  }
  return card;
}

// The prompt cache's disk tier on this rank, when the server keeps one: what it holds, or why it has none.
function diskTier(rank) {
  const tier = rank.prompt_cache;
  if (!tier) return null;
  if (tier.error) return el("div", { class: "disk-tier small error", title: tier.error, text: "no disk cache" });
  const held = tier.entries === undefined ? "" : `${tier.entries} prefixes, ${gb(tier.gb)}`;
  return el("div", { class: "disk-tier small muted", title: tier.dir || "", text: `disk cache ${held}`.trim() });
}

// A tensor-parallel group, when /health names one (a `tp` or `stage` field); nothing otherwise.
function tensorGroup(rank) {
  const tp = rank.tp ?? rank.tp_group ?? null;
  const stage = rank.stage ?? null;
  if (tp === null && stage === null) return null;
  const parts = [];
  if (stage !== null) parts.push(`stage ${stage}`);
  if (tp !== null) parts.push(typeof tp === "object" ? `tensor-parallel ${JSON.stringify(tp)}` : `tensor-parallel ${tp}`);
  return parts.join(" · ");
}

// Memory in use (as of the last request that ended; at load before) and the peak, against the host's budget
// (the plan's: its wired limit or macOS's share of its memory; unknown when the hostfile gives no memory).
function memoryBar(rank) {
  const budget = rank.budget_gb;
  const peak = rank.peak_memory_gb;
  const now = rank.memory_gb ?? peak;
  const width = (x) => `width:${Math.min(100, Math.round(((x || 0) / budget) * 100))}%`;
  const label = `memory ${gb(now)} · peak ${gb(peak)} · ${budget ? `of ${gb(budget)}` : "budget unknown"}`;
  return el("div", { class: "memory" },
    el("div", { class: "muted small", text: label }),
    budget ? el("div", { class: "bar", title: "memory in use, and the peak, against the host's budget" },
      el("div", { class: "fill peak", style: width(peak) }),
      el("div", { class: "fill now", style: width(now) })) : null);
}

// --- the chart: tok/s (area, left scale) and requests in flight (step line, right scale) --------------------

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function niceMax(x) {
  if (x <= 1) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= x);
}

function renderChart(history) {
  const chart = $("chart");
  const W = 640, H = 170, L = 36, R = 28, T = 8, B = 20;
  const samples = history.samples;
  const now = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
  const x = (t) => L + ((t - (now - CHART_SECONDS)) / CHART_SECONDS) * (W - L - R);
  const tpsMax = niceMax(Math.max(1, ...samples.map((s) => s.tps)));
  const flyMax = Math.max(2, ...samples.map((s) => s.in_flight));
  const yT = (v) => H - B - (v / tpsMax) * (H - T - B);
  const yF = (v) => H - B - (v / flyMax) * (H - T - B);
  const nodes = [];
  for (const f of [0, 0.5, 1]) {
    const y = H - B - f * (H - T - B);
    nodes.push(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
    nodes.push(svg("text", { x: L - 4, y: y + 4, "text-anchor": "end", class: "axis tps" }));
    nodes[nodes.length - 1].textContent = fmt(f * tpsMax, tpsMax < 5 ? 1 : 0);
    nodes.push(svg("text", { x: W - R + 4, y: y + 4, class: "axis fly" }));
    nodes[nodes.length - 1].textContent = Number.isInteger(f * flyMax) ? f * flyMax : "";
  }
  for (const minutes of [5, 4, 3, 2, 1, 0]) {
    const t = svg("text", { x: x(now - minutes * 60), y: H - 4, "text-anchor": "middle", class: "axis" });
    t.textContent = minutes ? `-${minutes}m` : "now";
    nodes.push(t);
  }
  const shown = samples.filter((s) => s.t >= now - CHART_SECONDS);
  if (shown.length > 1) {
    const line = shown.map((s) => `${x(s.t).toFixed(1)},${yT(s.tps).toFixed(1)}`);
    nodes.push(svg("polygon", {
      points: `${x(shown[0].t).toFixed(1)},${H - B} ${line.join(" ")} ${x(now).toFixed(1)},${H - B}`, class: "area tps" }));
    nodes.push(svg("polyline", { points: line.join(" "), class: "line tps" }));
    const steps = [];
    shown.forEach((s, i) => {
      if (i > 0) steps.push(`${x(s.t).toFixed(1)},${yF(shown[i - 1].in_flight).toFixed(1)}`);
      steps.push(`${x(s.t).toFixed(1)},${yF(s.in_flight).toFixed(1)}`);
    });
    nodes.push(svg("polyline", { points: steps.join(" "), class: "line fly" }));
  }
  chart.replaceChildren(...nodes);
}

function renderStats(data) {
  const samples = data.history.samples;
  // The last few seconds' tokens, so that the figure does not flicker between samples.
  const last = samples.slice(-3);
  $("tps-now").textContent = fmt(last.length ? last.reduce((a, s) => a + s.tps, 0) / last.length : 0);
  $("in-flight").textContent = data.in_flight;
  $("waiting").textContent = data.waiting;
  const cache = data.cache;
  $("cache-hits").textContent = `${cache.hits} / ${cache.requests}`;
  const tiers = cache.tiers || { memory: { hits: 0 }, disk: { hits: 0 } };
  $("cache-tiers").textContent = `memory ${tiers.memory.hits}, disk ${tiers.disk.hits}`;
  $("cached-share").textContent = cache.prompt_tokens ? pct(cache.cached_tokens / cache.prompt_tokens) : "–";
}

// --- recent requests ---------------------------------------------------------------------------------------

function renderRequests(requests) {
  $("no-requests").hidden = requests.length > 0;
  const rows = [];
  for (const r of requests) {
    // A refused request has no id (nothing reached the ranks): its door, route and field say what it was.
    const refused = r.id === null;
    const attrs = { "data-id": r.id ?? "", "data-status": r.status, class: r.error ? "failed" : "" };
    // Which API, and what its body asked that was dropped or mapped, on hover.
    attrs.title = [r.door, ...(r.notes || [])].filter(Boolean).join("\n");
    rows.push(el("tr", attrs,
      el("td", { class: "id", text: refused ? r.door : r.id }),
      el("td", { class: "status", text: refused ? `refused ${r.status}` : r.status }),
      el("td", { text: refused ? "–" : r.prompt_tokens }),
      el("td", { class: "cached", "data-tier": r.cache_tier || "",
        text: refused ? "–" : r.cache_tier === "disk" ? `${r.cached_tokens} disk` : r.cached_tokens }),
      el("td", { text: refused ? "–" : r.generation_tokens }),
      el("td", { text: r.ttft === null ? "–" : `${fmt(r.ttft, 2)} s` }),
      el("td", { text: refused ? "–" : fmt(r.tps) })));
    const why = refused ? `${r.method} ${r.path}${r.param ? ` · ${r.param}` : ""}: ${r.error}` : r.error;
    if (r.error) rows.push(el("tr", { class: "error-row" }, el("td", { colSpan: 7, class: "error", text: why })));
  }
  $("requests").tBodies[0].replaceChildren(...rows);
}

// --- the chat: streamed from /v1/chat/completions ----------------------------------------------------------

function addMessage(role, text, images) {
  const node = el("div", { class: `msg ${role}` }, el("div", { class: "role", text: role }), el("div", { class: "text", text }),
    images && images.length ? el("div", { class: "images" }, ...images.map((i) => el("img", { class: "thumb", src: i.uri, alt: i.name, title: i.name }))) : null);
  $("messages").append(node);
  $("messages").scrollTop = $("messages").scrollHeight;
  return node;
}

async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const images = attached;
  clearAttached();
  // With images, OpenAI's content parts: each image a data: URI, then the text (the server checks each one).
  const parts = images.length
    ? [...images.map((i) => ({ type: "image_url", image_url: { url: i.uri } })), { type: "text", text }]
    : text;
  chat.push({ role: "user", content: parts });
  messages.push(...chat);
  addMessage("user", text, images);
  const reply = addMessage("assistant", "");
  const out = reply.querySelector(".text");
  reply.classList.add("streaming");
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: parseInt($("max-tokens").value, 10),
  };
  if (modelId) body.model = modelId;
  let content = "";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body) });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message || `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const line = event.split("\n").find((l) => l.startsWith("data: "));
        if (!line || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.id) reply.dataset.requestId = chunk.id.replace(/^chatcmpl-/, "");
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          content += delta;
          out.textContent = content;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (chunk.usage) {
          const u = chunk.usage;
          const cached = u.prompt_tokens_details?.cached_tokens || 0;
          reply.append(el("div", { class: "usage muted small",
            text: `${reply.dataset.requestId || ""} · ${u.prompt_tokens} prompt (${cached} cached) · ${u.completion_tokens} generated` }));
        }
      }
    }
    chat.push({ role: "assistant", content });
  } catch (err) {
    chat.pop();  // the turn failed: it is not part of the conversation
    reply.classList.add("failed");
    reply.append(el("div", { class: "error small", text: err.message }));
    if (String(err.message).includes("API key")) askForKey("The server refused the key.");
  } finally {
    reply.classList.remove("streaming");
    reply.dataset.done = "true";
  }
}

$("chat-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || chatBusy) return;
  chatBusy = true;
  $("send").disabled = true;
  $("chat-input").value = "";
  try {
    await send(text);
  } finally {
    chatBusy = false;
    $("send").disabled = false;
    $("chat-input").focus();
  }
});

$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});

$("chat-clear").addEventListener("click", () => {
  chat = [];
  clearAttached();
  $("messages").replaceChildren();
});

// --- images attached to the next message, where the model takes images -----------------------------------

function readAsDataUri(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function clearAttached() {
  attached = [];
  $("chat-image").value = "";
  $("attached").replaceChildren();
}

$("chat-image").addEventListener("change", async () => {
  $("chat-error").textContent = "";
  const files = [...$("chat-image").files];
  $("chat-image").value = "";  // the same file can be chosen again
  for (const file of files) {
    // The server's limits, said here before a large file is read; the server checks again (format, pixels).
    if (imageLimits && file.size > imageLimits.max_bytes) {
      $("chat-error").textContent = `${file.name} is over the server's limit of ${imageLimits.max_bytes} bytes (--max-image-mb)`;
      continue;
    }
    if (imageLimits && attached.length >= imageLimits.max_images) {
      $("chat-error").textContent = `at most ${imageLimits.max_images} images per message (--max-images)`;
      break;
    }
    attached.push({ name: file.name, uri: await readAsDataUri(file) });
  }
  $("attached").replaceChildren(...attached.map((i) => el("img", { class: "thumb", src: i.uri, alt: i.name, title: i.name })));
  $("attached").dataset.count = String(attached.length);
});

poll();
