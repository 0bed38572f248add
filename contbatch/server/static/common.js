// Shared by the playground and the dashboard: the API key and calls to this server.
// The key is kept in this browser's localStorage for this server's origin, and sent as
// "Authorization: Bearer <key>" like any OpenAI client would. Nothing here talks to any
// other host (the server's Content-Security-Policy forbids it anyway).
"use strict";

const cb = {
  KEY_STORE: "contbatch.apiKey",

  key() { return localStorage.getItem(cb.KEY_STORE) || ""; },

  headers(extra = {}) {
    const h = { ...extra };
    if (cb.key()) h.Authorization = "Bearer " + cb.key();
    return h;
  },

  // The server's error message (OpenAI's {"error": {"message": ...}} shape), or the status.
  async errorText(resp) {
    const text = await resp.text();
    try { return JSON.parse(text).error.message || text; } catch { return `${resp.status} ${resp.statusText} ${text}`.trim(); }
  },

  async getJSON(path) {
    const resp = await fetch(path, { headers: cb.headers(), cache: "no-store" });
    if (!resp.ok) {
      const err = new Error(await cb.errorText(resp));
      err.status = resp.status;
      throw err;
    }
    return resp.json();
  },

  // Wire the key bar of a page: shown when a call answers 401, hidden once a key works.
  // `onKey` runs after the user saves a key (the page retries what failed).
  setupKeyBar(onKey) {
    const bar = document.getElementById("keybar");
    const input = document.getElementById("api-key");
    input.value = cb.key();
    document.getElementById("key-save").addEventListener("click", () => {
      const k = input.value.trim();
      if (k) localStorage.setItem(cb.KEY_STORE, k); else localStorage.removeItem(cb.KEY_STORE);
      onKey();
    });
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") document.getElementById("key-save").click(); });
    document.getElementById("key-toggle").addEventListener("click", () => { bar.hidden = !bar.hidden; });
    return {
      ask(message) {
        // Focus the key field only when first asking: never pull the caret out of the
        // prompt the user is typing when a later call is refused too.
        if (!bar.classList.contains("needed")) input.focus();
        bar.hidden = false;
        bar.classList.add("needed");
        document.getElementById("key-message").textContent = message;
      },
      ok() {
        bar.classList.remove("needed");
        document.getElementById("key-message").textContent = "";
        if (cb.key()) bar.hidden = true;
      },
    };
  },

  fmt(x, digits = 2) { return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits); },
  ms(seconds) { return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0) + " ms"; },
};
