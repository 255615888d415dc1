// inflight's live page: a chat box that streams from /v1/chat/completions, and the engines' recent steps
// from /v1/live/events drawn as requests x steps. Plain browser JavaScript, no build step, no library.
"use strict";

const MAX_STEPS = 40; // columns kept: the newest steps, across workers
const MAX_ROWS = 16; // rows kept: the requests that appear in those steps, newest last
const STAGGER = 4; // "parallel" copies start this many answer pieces apart
const $ = (id) => document.getElementById(id);

function authHeaders() {
  const key = $("apikey").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Reads a text/event-stream body, calling onData with each event's data; returns at [DONE] or the end.
async function readSSE(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data) continue; // a comment (keep-alive)
      if (data === "[DONE]") return;
      onData(data);
    }
  }
}

// ---- the engine view -------------------------------------------------------------------------------
const live = {
  steps: [], // {worker, n, ms, tokens, rows: Map(id -> {scheduled, computed, join, leave})}
  seen: new Set(), // request ids that appeared in an earlier step (a first appearance is a join)
  workers: new Map(), // worker -> {running, waiting, kv, last step}
  arrivals: [], // performance.now() of each step received, for steps/s
  mine: new Set(), // short ids of this page's own requests
};

function lastStepOf(worker) {
  for (let i = live.steps.length - 1; i >= 0; i--) if (live.steps[i].worker === worker) return live.steps[i];
  return null;
}

function onLive(message) {
  const now = performance.now();
  for (const s of message.steps) {
    const rows = new Map();
    for (const [id, scheduled, computed] of s.batch) {
      rows.set(id, { scheduled, computed, join: !live.seen.has(id), leave: false });
      live.seen.add(id);
    }
    const prev = lastStepOf(message.worker);
    if (prev) for (const [id, cell] of prev.rows) if (!rows.has(id)) cell.leave = true;
    live.steps.push({ worker: message.worker, n: s.n, ms: s.ms, tokens: s.tokens, rows });
    live.arrivals.push(now);
  }
  if (message.steps.length === 0 && message.running === 0) {
    // Idle heartbeat: whoever was in this worker's last step has left.
    const prev = lastStepOf(message.worker);
    if (prev) for (const cell of prev.rows.values()) cell.leave = true;
  }
  live.steps = live.steps.slice(-MAX_STEPS);
  if (live.seen.size > 4096) live.seen = new Set([...live.steps.flatMap((s) => [...s.rows.keys()])]);
  const newest = message.steps[message.steps.length - 1];
  live.workers.set(message.worker, {
    running: message.running, waiting: message.waiting, kv: message.kv_usage, step: newest,
  });
  live.arrivals = live.arrivals.filter((t) => now - t < 2000);
  renderGauges(newest);
  renderBatch();
}

function renderGauges(newest) {
  let running = 0, waiting = 0, kv = 0;
  for (const w of live.workers.values()) {
    running += w.running;
    waiting += w.waiting;
    kv = Math.max(kv, w.kv);
  }
  $("running").textContent = running;
  $("waiting").textContent = waiting;
  $("kv").value = kv;
  $("kvpct").textContent = `${(kv * 100).toFixed(1)}%`;
  if (newest) {
    $("step").textContent = newest.n;
    $("stepms").textContent = newest.ms.toFixed(1);
    $("steptok").textContent = newest.tokens;
  }
  $("steps-per-s").textContent = (live.arrivals.length / 2).toFixed(1);
}

function isMine(id) {
  // One completion: the engine's id is the request's; n > 1: the request's id + "#index".
  for (const short of live.mine) if (id === short || id.startsWith(`${short}#`)) return true;
  return false;
}

function renderBatch() {
  const ids = [];
  for (const s of live.steps) for (const id of s.rows.keys()) if (!ids.includes(id)) ids.push(id);
  const rows = ids.slice(-MAX_ROWS);
  const multi = live.workers.size > 1;
  const body = $("batch").tBodies[0];
  const head = document.createElement("tr");
  head.append(th("request", "rid"));
  for (const s of live.steps) head.append(th(multi ? `${s.worker.slice(-4)}:${s.n}` : String(s.n)));
  const trs = [head];
  for (const id of rows) {
    const tr = document.createElement("tr");
    tr.dataset.rid = id;
    if (isMine(id)) tr.className = "mine";
    tr.append(th(id, "rid"));
    for (const s of live.steps) {
      const td = document.createElement("td");
      const cell = s.rows.get(id);
      if (cell) {
        const prefill = cell.scheduled > 1;
        td.className = [prefill ? "prefill" : "decode", cell.join && "join", cell.leave && "leave"]
          .filter(Boolean).join(" ");
        td.textContent = prefill ? `P${cell.scheduled}` : "D";
        td.title = `${id}: ${cell.scheduled} token(s) at position ${cell.computed}, step ${s.n} (${s.ms} ms)`;
      }
      tr.append(td);
    }
    trs.push(tr);
  }
  body.replaceChildren(...trs);
  const wrap = $("batch-wrap");
  wrap.scrollLeft = wrap.scrollWidth; // the newest steps are on the right
}

function th(text, cls) {
  const cell = document.createElement("th");
  cell.textContent = text;
  if (cls) cell.className = cls;
  return cell;
}

async function followEngines() {
  for (;;) {
    try {
      const response = await fetch("/v1/live/events", { headers: authHeaders() });
      if (response.status === 401) {
        // The gateway wants an API key: wait for one rather than retry (and log a 401) every second.
        setFeed(false, "engine feed: enter the API key");
        await new Promise((resolve) => $("apikey").addEventListener("change", resolve, { once: true }));
        continue;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      setFeed(true, "engine feed: live");
      await readSSE(response, (data) => onLive(JSON.parse(data)));
      setFeed(false, "engine feed: reconnecting");
    } catch (err) {
      setFeed(false, `engine feed: ${err.message}; retrying`);
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function setFeed(on, text) {
  $("feed").className = on ? "on" : "off";
  $("feed").textContent = text;
}

// ---- the chat --------------------------------------------------------------------------------------
const chat = { model: null, messages: [], controller: null };

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("transcript").append(div);
  return div;
}

function samplingBody() {
  const body = {
    model: chat.model,
    messages: chat.messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

// Streams one chat completion, calling onText with each piece of text; resolves to the usage.
async function streamChat(body, onText, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) {
    const detail = await response.json().catch(() => ({}));
    throw new Error(detail.error?.message || `HTTP ${response.status}`);
  }
  let usage = null;
  await readSSE(response, (data) => {
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.id) live.mine.add(`${chunk.id.split("-")[0]}-${chunk.id.split("-")[1].slice(0, 8)}`);
    const text = chunk.choices?.[0]?.delta?.content;
    if (text) onText(text);
    if (chunk.usage) usage = chunk.usage;
  });
  return usage;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  $("error").textContent = "";
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  const body = samplingBody();
  const started = performance.now();
  let first = null;
  let pieces = 0;
  // Copy i of the prompt starts once the answer has STAGGER * i pieces, whatever the model's speed: the
  // batch view then shows requests joining a running batch and leaving it at different steps.
  const copies = Math.max(0, Number($("parallel").value) - 1);
  const extra = [];
  const startCopies = (upTo) => {
    while (extra.length < Math.min(copies, upTo)) extra.push(streamChat(body, () => {}, chat.controller.signal));
  };
  const onText = (piece) => {
    startCopies(Math.floor((pieces + 1) / STAGGER));
    const now = performance.now();
    if (first === null) {
      first = now;
      $("ttft").textContent = (first - started).toFixed(0);
    }
    pieces += 1;
    out.textContent += piece;
    $("ntok").textContent = pieces;
    if (pieces > 1) $("tps").textContent = ((pieces - 1) / ((now - first) / 1000)).toFixed(1);
    $("transcript").scrollTop = $("transcript").scrollHeight;
  };
  chat.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  ["ttft", "tps"].forEach((id) => ($(id).textContent = "–"));
  $("ntok").textContent = "0";
  try {
    const usage = await streamChat(body, onText, chat.controller.signal);
    startCopies(copies); // an answer shorter than the stagger: the rest start now
    if (usage) $("ntok").textContent = usage.completion_tokens;
    chat.messages.push({ role: "assistant", content: out.textContent });
  } catch (err) {
    if (err.name !== "AbortError") $("error").textContent = err.message;
    chat.messages.pop(); // the turn did not complete: do not send it as history
  } finally {
    await Promise.allSettled(extra);
    chat.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    chat.model = (await response.json()).data[0].id;
    $("model").textContent = chat.model;
  } catch (err) {
    $("model").textContent = `unknown (${err.message})`;
  }
}

$("chat-form").addEventListener("submit", send);
$("stop").addEventListener("click", () => chat.controller?.abort());
$("clear").addEventListener("click", () => {
  chat.messages = [];
  $("transcript").replaceChildren();
});
$("apikey").addEventListener("change", loadModel);
loadModel();
followEngines();
renderBatch();
