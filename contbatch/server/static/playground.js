// The chat playground: streams replies from this server's /v1/chat/completions (SSE) and
// shows, under each reply, what it cost: time to first token, decode tokens per second, and
// how many prompt tokens the engine found in its prefix cache.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = []; // the conversation sent with every request (system prompt excluded)
let controller = null; // aborts the reply being streamed
let model = null;

const keyBar = cb.setupKeyBar(() => probe());

async function probe() {
  try {
    const models = await cb.getJSON("/v1/models");
    model = models.data[0].id;
    $("model").textContent = model;
    keyBar.ok();
    health();
  } catch (err) {
    if (err.status === 401) keyBar.ask("This server needs an API key: " + err.message);
    $("status").textContent = err.status === 401 ? "API key needed" : err.message;
    if (err.status === 503) setTimeout(probe, 2000); // warming up or draining: try again
  }
}

async function health() {
  const resp = await fetch("/health", { cache: "no-store" });
  $("status").textContent = resp.ok ? "ready" : await cb.errorText(resp);
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="role"></div><div class="text"></div>';
  div.querySelector(".role").textContent = role;
  div.querySelector(".text").textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function number(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

// The request body: only the settings the user filled in; the server applies its defaults.
function requestBody(messages) {
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (model) body.model = model;
  const fields = { temperature: parseFloat, top_p: parseFloat, top_k: (s) => parseInt(s, 10),
                   max_tokens: (s) => parseInt(s, 10), seed: (s) => parseInt(s, 10) };
  for (const [name, parse] of Object.entries(fields)) {
    const v = number(name, parse);
    if (v !== undefined) body[name] = v;
  }
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  return body;
}

function showError(div, message) {
  div.classList.add("error");
  div.querySelector(".role").textContent = "error";
  div.querySelector(".text").textContent = message;
}

async function send(text) {
  const system = $("system").value.trim();
  const turn = { role: "user", content: text };
  const messages = (system ? [{ role: "system", content: system }] : []).concat(conversation, [turn]);
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const out = reply.querySelector(".text");
  setBusy(true);
  controller = new AbortController();
  const t0 = performance.now();
  let tFirst = null, usage = null, finish = null, failed = false;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: cb.headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody(messages)), signal: controller.signal,
    });
    if (!resp.ok) {
      const message = await cb.errorText(resp);
      if (resp.status === 401) keyBar.ask("This server needs an API key: " + message);
      showError(reply, message);
      return;
    }
    keyBar.ok();
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) { showError(reply, chunk.error.message); failed = true; continue; }
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            if (tFirst === null) tFirst = performance.now();
            out.textContent += delta;
            reply.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    if (!failed) {
      conversation.push(turn, { role: "assistant", content: out.textContent });
      figures(reply, t0, tFirst, performance.now(), usage, finish);
    }
  } catch (err) {
    if (err.name === "AbortError") figures(reply, t0, tFirst, performance.now(), usage, "stopped");
    else showError(reply, "request failed: " + err.message);
  } finally {
    setBusy(false);
    controller = null;
  }
}

function figures(reply, t0, tFirst, tEnd, usage, finish) {
  const div = document.createElement("div");
  div.className = "figures";
  const ttft = tFirst === null ? null : (tFirst - t0) / 1000;
  const tokens = usage ? usage.completion_tokens : null;
  const decode = tFirst === null ? 0 : (tEnd - tFirst) / 1000;
  const tps = tokens > 1 && decode > 0 ? (tokens - 1) / decode : null;
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  Object.assign(div.dataset, { ttft: ttft ?? "", tokS: tps ?? "", tokens: tokens ?? "", cached: cached ?? "" });
  const parts = [`time to first token ${cb.ms(ttft)}`, `${cb.fmt(tps, 1)} tok/s`, `${tokens ?? "–"} tokens`];
  if (usage) parts.push(`${cached ?? 0} of ${usage.prompt_tokens} prompt tokens cached`);
  if (finish) parts.push(`finish: ${finish}`);
  div.textContent = parts.join(" · ");
  reply.appendChild(div);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-gen").disabled = !busy;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop-gen").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { conversation.length = 0; $("messages").textContent = ""; });

probe();
