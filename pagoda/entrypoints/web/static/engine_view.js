// The live engine view of the selected model, fed by GET /v1/engine/stream (one JSON event
// per tick; see pagoda/entrypoints/web/engine_view.py for its shape). The stream ends every
// few seconds by design; the view reconnects at once, and after an error a little later.

import { ApiError, errorMessage, headers, readEvents } from "./api.js";
import { chartHeadline, COLORS, formatNumber, kvGrid, lineChart } from "./charts.js";
import { timeline } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const INTERVAL_S = 0.25;
const HISTORY = 240;  // points per chart: one minute at 4 ticks a second
const WINDOW = "the last minute";
const RETRY_MS = 2000;

function series() {
  return new Array(HISTORY).fill(null);
}

function push(values, value) {
  values.push(value ?? null);
  values.shift();
}

const sleep = (ms, signal) => new Promise((resolve) => {
  const timer = setTimeout(resolve, ms);
  signal.addEventListener("abort", () => {
    clearTimeout(timer);
    resolve();
  }, { once: true });
});

export function setupEngineView() {
  const section = $("engine");
  const state = $("engine-state");
  const history = {
    generation: series(), prompt: series(),
    ttft: [series(), series(), series()], tpot: [series(), series(), series()],
  };
  let controller = null;
  let last = null;

  function draw() {
    if (!last) return;
    kvGrid($("kv-grid"), last.kv);
    const chart = (id, title, unit, series) => {
      lineChart($(`${id}-chart`), series, { title, unit, window: WINDOW });
      chartHeadline($(`${id}-now`), series);
    };
    chart("throughput", "Tokens per second", "tok/s", [
      { label: "generated", color: COLORS.decode, values: history.generation },
      { label: "prompt", color: COLORS.prefill, values: history.prompt },
    ]);
    const percentileSeries = (values) => ["p50", "p90", "p99"].map((label, i) => ({
      label, color: [COLORS.stop, COLORS.prefill, COLORS.abort][i], values: values[i],
    }));
    chart("ttft", "Time to first token", "ms", percentileSeries(history.ttft));
    chart("tpot", "Time per output token", "ms", percentileSeries(history.tpot));
    timeline($("timeline"), last.requests);
  }

  function update(event) {
    last = event;
    section.dataset.ticks = String(Number(section.dataset.ticks) + 1);
    const { queue, batch, kv, prefix_cache: prefix, throughput, latency } = event;
    $("q-waiting").textContent = queue.waiting;
    $("q-running").textContent = queue.running;
    $("q-preempted").textContent = queue.preempted;
    $("prefix-hit").textContent = prefix.hit_rate === null
      ? "–" : `${(prefix.hit_rate * 100).toFixed(1)}%`;
    $("steps-rate").textContent = formatNumber(throughput.steps_per_s);
    $("generated").textContent = event.counters.num_generation_tokens.toLocaleString("en-US");
    // Idle (nothing running or waiting): no step runs, whatever the last one held.
    const idle = queue.running === 0 && queue.waiting === 0;
    const total = Math.max(batch.num_tokens, 1);
    $("batch-prefill").style.width = idle ? "0%" : `${(100 * batch.num_prefill_tokens) / total}%`;
    $("batch-decode").style.width = idle ? "0%" : `${(100 * batch.num_decode_tokens) / total}%`;
    $("batch-text").textContent = idle ? "idle: no request running"
      : `${batch.num_seqs} sequence${batch.num_seqs === 1 ? "" : "s"}: ` +
        `${batch.num_prefill_tokens} prefill + ${batch.num_decode_tokens} decode tokens`;
    $("kv-used").textContent = kv.used;
    $("kv-cached").textContent = kv.cached;
    $("kv-free").textContent = kv.free;
    $("kv-grid").setAttribute("aria-label", `KV block pool: ${kv.used} used, ${kv.cached} ` +
      `cached, ${kv.free} free of ${kv.num_blocks} blocks of ${kv.block_size} tokens`);
    const tiers = kv.tiers;  // (null without --kv-offload-memory / --kv-offload-dir)
    $("kv-tiers").hidden = !tiers;
    if (tiers) {
      const mib = (bytes) => `${(bytes / 1048576).toFixed(1)} MiB`;
      const tier = (name, t, size) => size > 0
        ? `${name} ${mib(size)}: ${t.hits} hits, ${t.misses} misses, ` +
          `${mib(t.bytes_written)} written, ${mib(t.bytes_read)} read, ${t.evictions} evicted`
        : `${name}: off`;
      $("kv-tiers").textContent = `Tiers: ${tiers.keys} blocks held, ` +
        `${tiers.hit_tokens} prompt tokens loaded, ${tiers.failed_loads} failed loads · ` +
        `${tier("host", tiers.host, tiers.host_bytes)} · ` +
        `${tier("disk", tiers.disk, tiers.disk_bytes)}` +
        (tiers.swap_bytes ? ` · swapped out ${mib(tiers.swap_bytes)}` : "") +
        (tiers.corrupt_entries ? ` · ${tiers.corrupt_entries} corrupt entries` : "");
    }
    if (event.interval > 0) {  // (the first event of a connection has no rates)
      push(history.generation, throughput.generation_tokens_per_s);
      push(history.prompt, throughput.prompt_tokens_per_s);
      ["p50", "p90", "p99"].forEach((p, i) => {
        push(history.ttft[i], latency.ttft && latency.ttft[p] * 1000);
        push(history.tpot[i], latency.tpot && latency.tpot[p] * 1000);
      });
    }
    state.textContent = `· ${event.model}`;
    draw();
  }

  async function run(model, signal) {
    const url = `/v1/engine/stream?model=${encodeURIComponent(model)}&interval=${INTERVAL_S}`;
    while (!signal.aborted) {
      try {
        const response = await fetch(url, { headers: headers(), signal });
        if (!response.ok) throw new ApiError(await errorMessage(response));
        await readEvents(response, (event) => {
          if (event.error) throw new ApiError(event.error.message);
          update(event);
        });
        continue;  // the server ends each stream after a while: reconnect at once
      } catch (e) {
        if (signal.aborted) return;
        state.textContent = `· ${e.message}`;
      }
      await sleep(RETRY_MS, signal);
    }
  }

  window.addEventListener("resize", draw);
  return {
    // (Re)connects to `model`'s stream; null disconnects.
    setModel(model) {
      if (controller) controller.abort();
      controller = null;
      if (!model) {
        state.textContent = "· no model loaded";
        return;
      }
      controller = new AbortController();
      run(model, controller.signal);
    },
  };
}
