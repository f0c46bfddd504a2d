// The chat page pp_node --serve answers GET / with: one self-contained HTML document (inline CSS and JS, no
// external resource), so the CSP below can forbid everything but this document's own code.
//
// It streams replies from POST /v1/chat/completions (stream: true, read with fetch + ReadableStream; Stop
// aborts the fetch, which cancels the generation on every stage) and shows the pipeline from GET /v1/status
// every 2 s. Model output is untrusted: it only ever reaches the page through textContent.
#pragma once

#include <string_view>

namespace pp::node {

// No inline event handlers (onclick=...) and no eval: the script attaches its listeners itself.
inline constexpr std::string_view kWebPageCsp =
    "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src 'none'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

inline constexpr std::string_view kWebPage = R"PPHTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pp</title>
<style>
  :root { --fg: #1d232a; --muted: #687380; --line: #d8dde3; --bg: #f6f7f9; --accent: #2563eb; --bad: #b42318; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 15px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg);
         display: grid; grid-template-columns: minmax(0, 1fr) 30rem; height: 100vh; }
  main { display: flex; flex-direction: column; min-height: 0; border-right: 1px solid var(--line); background: #fff; }
  header { padding: .6rem 1rem; border-bottom: 1px solid var(--line); display: flex; gap: .8rem; align-items: baseline; }
  header h1 { font-size: 1.1rem; margin: 0; }
  #model { color: var(--muted); }
  #log { flex: 1; overflow-y: auto; padding: 1rem; display: flex; flex-direction: column; gap: .6rem; }
  .msg { max-width: 48rem; padding: .5rem .8rem; border-radius: .6rem; white-space: pre-wrap; overflow-wrap: anywhere; }
  .user { align-self: flex-end; background: #e7efff; }
  .assistant { align-self: flex-start; background: var(--bg); border: 1px solid var(--line); }
  .assistant.busy::after { content: "\2026"; color: var(--muted); }
  .error { color: var(--bad); font-size: .9rem; }
  form { display: flex; gap: .5rem; padding: .8rem 1rem; border-top: 1px solid var(--line); }
  textarea { flex: 1; resize: vertical; font: inherit; padding: .4rem .6rem; border: 1px solid var(--line); border-radius: .4rem; }
  button { font: inherit; padding: .35rem .9rem; border: 1px solid var(--line); border-radius: .4rem; background: #fff; cursor: pointer; }
  button.primary { background: var(--accent); border-color: var(--accent); color: #fff; }
  button:disabled { opacity: .45; cursor: default; }
  aside { padding: .8rem 1rem; overflow-y: auto; font-size: .9rem; }
  aside h2 { font-size: .95rem; margin: .2rem 0 .5rem; }
  fieldset { border: 1px solid var(--line); border-radius: .4rem; display: grid; grid-template-columns: auto 1fr; gap: .3rem .6rem; margin: 0 0 1rem; }
  fieldset input { width: 100%; font: inherit; }
  #summary { color: var(--muted); margin-bottom: .4rem; }
  table { border-collapse: collapse; width: 100%; font-size: .85rem; font-variant-numeric: tabular-nums; }
  th, td { text-align: left; padding: .2rem .3rem; border-bottom: 1px solid var(--line); vertical-align: top; }
  th { white-space: nowrap; }
  td { white-space: nowrap; }
  .scroll { overflow-x: auto; }
  td.down { color: var(--bad); }
  @media (max-width: 800px) { body { grid-template-columns: 1fr; height: auto; } main { height: 80vh; } }
</style>
</head>
<body>
<main>
  <header><h1>pp</h1><span id="model"></span></header>
  <div id="log" aria-live="polite"></div>
  <form id="form">
    <textarea id="input" rows="2" placeholder="Message (Enter sends, Shift+Enter a new line)" autofocus></textarea>
    <button id="send" class="primary" type="submit">Send</button>
    <button id="stop" type="button" disabled>Stop</button>
    <button id="new" type="button">New chat</button>
  </form>
</main>
<aside>
  <h2>Sampling</h2>
  <fieldset>
    <label for="temperature">temperature</label><input id="temperature" type="number" min="0" max="2" step="0.05" value="0.7">
    <label for="top_p">top_p</label><input id="top_p" type="number" min="0" max="1" step="0.05" value="0.95">
    <label for="max_tokens">max_tokens</label><input id="max_tokens" type="number" min="1" step="1" value="256">
    <label for="seed">seed</label><input id="seed" type="number" step="1" placeholder="random">
  </fieldset>
  <h2>Pipeline</h2>
  <div id="summary">&hellip;</div>
  <div class="scroll"><table>
    <thead><tr><th>stage</th><th>host</th><th>layers</th><th>kernels</th><th>ms/batch</th><th>rows/s</th><th>sessions</th></tr></thead>
    <tbody id="stages"></tbody>
  </table></div>
</aside>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let messages = [];   // the conversation sent with every request: {role, content}
let ctrl = null;    // the running request's AbortController

function add(cls, text) {
  const d = document.createElement("div");
  d.className = cls;
  d.textContent = text;
  $("log").append(d);
  d.scrollIntoView({block: "end"});
  return d;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// A number field's value, or undefined (the server's default) when empty.
function num(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

// Yields each server-sent event's data from a fetch Response.
async function* events(res) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += dec.decode(value, {stream: true}).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of block.split("\n"))
        if (line.startsWith("data:")) yield line.slice(5).trim();
    }
  }
}

async function sendMessage(ev) {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || ctrl) return;
  $("input").value = "";
  messages.push({role: "user", content: text});
  add("msg user", text);
  const out = add("msg assistant busy", "");
  const mine = messages;
  let reply = "";
  ctrl = new AbortController();
  busy(true);
  try {
    const body = {messages, stream: true, temperature: num("temperature"), top_p: num("top_p"),
                  max_tokens: num("max_tokens"), seed: num("seed")};
    const res = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                                     body: JSON.stringify(body), signal: ctrl.signal});
    if (!res.ok) {
      const e = await res.json().catch(() => null);
      throw new Error(e && e.error ? e.error.message : "HTTP " + res.status);
    }
    for await (const data of events(res)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        reply += delta.content;
        out.textContent = reply;   // text, never HTML: the model's output is untrusted
        out.scrollIntoView({block: "end"});
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") add("error", e.message);
  } finally {
    out.classList.remove("busy");
    if (mine === messages) messages.push({role: "assistant", content: reply});  // a stopped reply stays as far as it got
    ctrl = null;
    busy(false);
  }
}

function stopReply() {
  if (ctrl) ctrl.abort();
}

function newChat() {
  stopReply();
  messages = [];
  $("log").replaceChildren();
  $("input").focus();
}

// ---- the pipeline view: GET /v1/status every 2 s; rows/s and ms/batch over the last interval ----

let last = null;  // {t, stages} of the previous refresh

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fixed(v, digits) {
  return v === null || v === undefined || !isFinite(v) ? "\u2013" : v.toFixed(digits);
}

function render(s, t) {
  $("model").textContent = s.model;
  const req = s.requests;
  $("summary").textContent = (s.pipeline_up ? "up" : "down" + (s.link_error ? ": " + s.link_error : "")) +
      " \u00b7 " + fixed(s.tokens_per_second, 1) + " tok/s \u00b7 " + s.sessions_active + " sessions \u00b7 queue " +
      s.queue_depth + " \u00b7 " + req.ok + " ok, " + req.error + " failed, " + req.cancelled + " stopped";
  const rows = s.stages.map((st, i) => {
    const prev = last && last.stages[i];
    const dt = last ? (t - last.t) / 1000 : 0;
    let ms = st.compute_ms_per_batch, rate = null;
    if (prev && dt > 0 && st.batches !== null && prev.batches !== null) {
      const batches = st.batches - prev.batches;
      if (batches > 0) ms = 1000 * (st.compute_seconds - prev.compute_seconds) / batches;
      rate = (st.batch_rows - prev.batch_rows) / dt;
    }
    const tr = document.createElement("tr");
    tr.append(cell(String(st.stage)), cell(st.host + (st.up ? "" : " (down)"), st.up ? "" : "down"),
              cell("[" + st.layers[0] + ", " + st.layers[1] + ")"),
              cell((st.arch || "?") + (st.threads ? " \u00d7" + st.threads : "")),
              cell(fixed(ms, 2)), cell(fixed(rate, 1)),
              cell(st.sessions_active === null ? "\u2013" : String(st.sessions_active)));
    return tr;
  });
  $("stages").replaceChildren(...rows);
  last = {t, stages: s.stages};
}

async function refresh() {
  try {
    const res = await fetch("/v1/status", {cache: "no-store"});
    if (!res.ok) throw new Error("HTTP " + res.status);
    render(await res.json(), performance.now());
  } catch (e) {
    $("summary").textContent = "status unavailable: " + e.message;
  }
  setTimeout(refresh, 2000);
}

$("form").addEventListener("submit", sendMessage);
$("stop").addEventListener("click", stopReply);
$("new").addEventListener("click", newChat);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("form").requestSubmit();
  }
});
refresh();
</script>
</body>
</html>
)PPHTML";

}  // namespace pp::node
