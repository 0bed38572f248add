// The live dashboard: polls /stats once a second and redraws the cards, four SVG charts
// (the server keeps the last minutes of samples) and the table of recent requests.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const W = 600, H = 150; // the charts' viewBox; the browser stretches it to the card
const COLORS = { running: "#2f6fed", waiting: "#f29d38", kv_used: "#2f6fed", kv_cached: "#34a853",
                 kv_free: "#d5d9e2", tok_s: "#7b4fd6", hit_rate: "#34a853" };
let timer = null;

const keyBar = cb.setupKeyBar(() => { clearTimeout(timer); poll(); });

// One chart: `series` is [{name, values}], x is time over the server's whole history window.
// Stacked charts fill each series on top of the previous ones; lines break where a value is null.
function draw(svgId, legendId, times, span, series, max, stacked = false) {
  const now = times.length ? times[times.length - 1] : 0;
  const x = (t) => (W * (t - (now - span)) / span).toFixed(1);
  const y = (v) => (H - (H * Math.min(v, max)) / max).toFixed(1);
  const below = times.map(() => 0);
  let svg = `<line x1="0" y1="${H}" x2="${W}" y2="${H}" stroke="#dde1ea"/>`;
  for (const { name, values } of series) {
    const last = values.length ? values[values.length - 1] : null;
    let d = "";
    if (stacked) {
      const top = values.map((v, i) => below[i] + (v || 0));
      if (times.length) {
        d = "M" + times.map((t, i) => `${x(t)},${y(top[i])}`).join("L") + "L"
          + times.map((t, i) => `${x(t)},${y(below[i])}`).reverse().join("L") + "Z";
      }
      top.forEach((v, i) => { below[i] = v; });
      svg += `<path data-series="${name}" data-last="${last ?? ""}" d="${d}" fill="${COLORS[name]}" stroke="none"/>`;
    } else {
      let pen = "M";
      values.forEach((v, i) => {
        if (v === null || v === undefined) { pen = "M"; return; }
        d += `${pen}${x(times[i])},${y(v)}`;
        pen = "L";
      });
      svg += `<path data-series="${name}" data-last="${last ?? ""}" d="${d}" fill="none" stroke="${COLORS[name]}"`
        + ` stroke-width="2" vector-effect="non-scaling-stroke"/>`;
    }
  }
  $(svgId).innerHTML = svg;
  $(legendId).innerHTML = series.map((s) => `<span><svg width="10" height="10"><rect width="10" height="10" rx="2" fill="${COLORS[s.name]}"/></svg> ${s.label}</span>`).join("")
    + `<span>max ${Number.isInteger(max) ? max : max.toPrecision(2)} · last ${span < 90 ? Math.round(span) + " s" : Math.round(span / 60) + " min"}</span>`;
}

function render(s) {
  const c = s.current, series = s.series, times = series.t;
  // The x axis spans what the server holds, at least a minute: a fresh server's first
  // seconds are not a sliver at the right of a five-minute axis.
  const span = Math.max(60, times.length ? times[times.length - 1] - times[0] : 0);
  $("model").textContent = s.model;
  $("card-running").textContent = c.running;
  $("card-waiting").textContent = c.waiting;
  $("card-kv").textContent = `${c.kv_used} / ${s.num_blocks}`;
  $("card-kv-sub").textContent = `${c.kv_cached} cached · ${c.kv_free} free · ${s.block_size} tokens each`;
  $("card-hit").textContent = s.prefix_hit_rate === null ? "–" : (100 * s.prefix_hit_rate).toFixed(1) + " %";
  $("card-hit-sub").textContent = `since start · ${s.prefix_hit_rate_window === null ? "–" : (100 * s.prefix_hit_rate_window).toFixed(1) + " %"} over the window`;
  $("card-toks").textContent = cb.fmt(s.output_tok_s, 1);
  $("card-ttft").textContent = cb.ms(s.ttft_s.p50);
  $("card-ttft-sub").textContent = `p50 · p90 ${cb.ms(s.ttft_s.p90)} · p99 ${cb.ms(s.ttft_s.p99)} (last ${s.ttft_s.count} requests)`;
  $("card-itl").textContent = cb.ms(s.itl_s.p50);
  $("card-itl-sub").textContent = `p50 · p90 ${cb.ms(s.itl_s.p90)} · p99 ${cb.ms(s.itl_s.p99)} (last ${s.itl_s.count} tokens)`;
  $("card-preempt").textContent = c.soft_resets + c.offloads;
  $("card-preempt-sub").textContent = `${c.soft_resets} soft resets · ${c.offloads} offloads`;
  $("card-finished").textContent = s.finished_requests;

  const reqMax = Math.max(4, ...series.running.map((v, i) => v + series.waiting[i]));
  draw("chart-requests", "legend-requests", times, span, [
    { name: "running", label: "running", values: series.running },
    { name: "waiting", label: "waiting", values: series.waiting }], reqMax, true);
  draw("chart-kv", "legend-kv", times, span, [
    { name: "kv_used", label: "used", values: series.kv_used },
    { name: "kv_cached", label: "cached prefix", values: series.kv_cached },
    { name: "kv_free", label: "free", values: series.kv_free }], s.num_blocks, true);
  draw("chart-toks", "legend-toks", times, span, [{ name: "tok_s", label: "tokens/s", values: series.tok_s }],
    Math.ceil(Math.max(10, ...series.tok_s) * 1.1));
  draw("chart-hit", "legend-hit", times, span, [{ name: "hit_rate", label: "hits per interval", values: series.hit_rate }], 1);

  const body = document.querySelector("#recent tbody");
  body.innerHTML = "";
  for (const r of s.recent) {
    const tr = document.createElement("tr");
    const cells = [r.id, r.state, r.prompt_tokens, r.cached_tokens, r.generated, cb.ms(r.ttft_s),
                   cb.fmt(r.duration_s, 2) + " s", cb.fmt(r.tok_s, 1)];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      td.textContent = v;
      if (i === 0) { td.className = "id"; td.title = r.error || r.id; }
      if (r.error && i === 1) td.className = "error";
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
}

async function poll() {
  try {
    render(await cb.getJSON("/stats"));
    keyBar.ok();
    $("status").textContent = "live · " + new Date().toLocaleTimeString();
  } catch (err) {
    $("status").textContent = err.message;
    if (err.status === 401) { keyBar.ask("This server needs an API key: " + err.message); return; }
  }
  timer = setTimeout(poll, POLL_MS);
}

poll();
