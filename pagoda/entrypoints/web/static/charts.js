// Hand-drawn canvas charts for the live engine view (no libraries): moving line charts,
// the KV block pool as a grid, and the per-request timeline. Each function redraws its
// canvas from scratch at the canvas's CSS size times devicePixelRatio.

export const COLORS = {
  used: "#d9480f",
  cached: "#1c7ed6",
  free: "#dee2e6",
  queued: "#adb5bd",
  prefill: "#f08c00",
  decode: "#1c7ed6",
  stop: "#2b8a3e",
  length: "#5f3dc4",
  abort: "#c92a2a",
  text: "#495057",
  grid: "#e9ecef",
};

// Sizes the backing store to the element; returns [context in CSS pixels, width, height].
function fit(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 150;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return [ctx, width, height];
}

export function formatNumber(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return value.toFixed(digits);
}

// series: [{label, color, values: [number|null, ...]}], oldest first, all the same length
// (the chart's capacity); the y axis starts at 0 and ends at the largest value shown.
export function lineChart(canvas, series, unit) {
  const [ctx, width, height] = fit(canvas);
  const top = 16, bottom = height - 4, left = 4, right = width - 4;
  let peak = 0;
  for (const s of series) for (const v of s.values) if (v !== null && v > peak) peak = v;
  const max = peak > 0 ? peak * 1.1 : 1;  // (an empty chart's axis still spans 0 .. 1)
  ctx.strokeStyle = COLORS.grid;
  ctx.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = bottom - (bottom - top) * f;
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(right, y);
    ctx.stroke();
  }
  ctx.fillStyle = COLORS.text;
  ctx.textBaseline = "top";
  ctx.fillText(`${formatNumber(peak, 2)} ${unit}`, left, 1);
  let x = right;
  ctx.textAlign = "right";
  for (const s of [...series].reverse()) {
    const last = [...s.values].reverse().find((v) => v !== null);
    const text = `${s.label} ${formatNumber(last ?? null, 2)}`;
    ctx.fillStyle = s.color;
    ctx.fillText(text, x, 1);
    x -= ctx.measureText(text).width + 10;
  }
  ctx.textAlign = "left";
  for (const s of series) {
    const n = s.values.length;
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v === null) {
        drawing = false;
        return;
      }
      const px = left + ((right - left) * i) / Math.max(n - 1, 1);
      const py = bottom - ((bottom - top) * v) / max;
      if (drawing) ctx.lineTo(px, py);
      else ctx.moveTo(px, py);
      drawing = true;
    });
    ctx.stroke();
  }
}

const MAX_CELLS = 2048;

// The KV pool, one cell per block (or per group of blocks when there are more than
// MAX_CELLS): blocks held by requests, then free blocks still caching a prefix, then free.
export function kvGrid(canvas, kv) {
  const [ctx, width, height] = fit(canvas);
  if (!kv.num_blocks) return;
  const perCell = Math.ceil(kv.num_blocks / MAX_CELLS);
  const numCells = Math.ceil(kv.num_blocks / perCell);
  // the largest square cell size that fits numCells cells in the canvas
  let size = Math.floor(Math.sqrt((width * height) / numCells));
  while (size > 2 && Math.floor(width / size) * Math.floor(height / size) < numCells) size--;
  const columns = Math.max(1, Math.floor(width / size));
  const gap = size >= 6 ? 1 : 0;
  const usedCells = Math.round(kv.used / perCell);
  const cachedCells = Math.round(kv.cached / perCell);
  for (let i = 0; i < numCells; i++) {
    ctx.fillStyle = i < usedCells ? COLORS.used
      : i < usedCells + cachedCells ? COLORS.cached : COLORS.free;
    ctx.fillRect((i % columns) * size, Math.floor(i / columns) * size, size - gap, size - gap);
  }
}

// One row per request, time flowing right to "now" at the right edge: queued (grey), each
// prefill chunk (orange), decode (blue), and a finish tick coloured by reason.
export function timeline(canvas, requests) {
  const [ctx, width, height] = fit(canvas);
  if (!requests.length) {
    ctx.fillStyle = COLORS.text;
    ctx.fillText("No requests yet.", 8, 16);
    return;
  }
  const labelWidth = Math.min(110, width * 0.28);
  const left = labelWidth + 4, right = width - 6, axis = 14;
  const oldest = Math.min(...requests.map((r) => r.arrival));
  const span = Math.min(Math.max(-oldest, 5), 300);  // seconds shown
  const x = (t) => right - ((right - left) * Math.min(-t, span)) / span;
  const rowHeight = Math.max(3, Math.min(14, (height - axis) / requests.length));
  ctx.textBaseline = "middle";
  requests.forEach((r, i) => {
    const y = i * rowHeight;
    const bar = Math.max(2, rowHeight - 3);
    const start = r.chunks.length ? r.chunks[0][0] : 0;
    ctx.fillStyle = COLORS.queued;
    ctx.fillRect(x(r.arrival), y + bar / 2 - 0.5, Math.max(1, x(start) - x(r.arrival)), 1.5);
    ctx.fillStyle = COLORS.prefill;
    for (const [chunkStart, chunkEnd] of r.chunks) {
      ctx.fillRect(x(chunkStart), y, Math.max(2, x(chunkEnd) - x(chunkStart)), bar);
    }
    if (r.first_token !== null) {
      const end = r.finish ?? 0;
      ctx.fillStyle = COLORS.decode;
      ctx.fillRect(x(r.first_token), y + 1, Math.max(1, x(end) - x(r.first_token)), bar - 2);
    }
    if (r.finish !== null) {
      ctx.fillStyle = COLORS[r.finish_reason] || COLORS.text;
      ctx.fillRect(x(r.finish) - 1, y - 1, 3, bar + 2);
    }
    if (rowHeight >= 9) {
      ctx.fillStyle = COLORS.text;
      const label = r.id.length > 16 ? `…${r.id.slice(-15)}` : r.id;
      ctx.fillText(label, 2, y + bar / 2, labelWidth - 4);
    }
  });
  // the time axis: a line under the rows, a tick every quarter of the span, labelled
  const axisY = height - axis + 2;
  ctx.strokeStyle = COLORS.text;
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(left, axisY);
  ctx.lineTo(right, axisY);
  for (let quarter = 0; quarter <= 4; quarter++) {
    const tickX = left + ((right - left) * quarter) / 4;
    ctx.moveTo(tickX, axisY);
    ctx.lineTo(tickX, axisY + 3);
  }
  ctx.stroke();
  ctx.fillStyle = COLORS.text;
  ctx.textBaseline = "bottom";
  ctx.textAlign = "center";
  for (let quarter = 1; quarter < 4; quarter++) {
    const seconds = (span * (4 - quarter)) / 4;
    ctx.fillText(`-${seconds.toFixed(seconds < 10 ? 1 : 0)} s`,
                 left + ((right - left) * quarter) / 4, height);
  }
  ctx.textAlign = "left";
  ctx.fillText(`-${span.toFixed(0)} s`, left, height);
  ctx.textAlign = "right";
  ctx.fillText("now", right, height);
  ctx.textAlign = "left";
}
