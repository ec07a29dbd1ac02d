// Hand-drawn canvas charts for the live engine view (no libraries): moving line charts
// with their headline of current values, and the KV block pool as a grid (the request
// timeline is timeline.js). Each function redraws its canvas from scratch at the canvas's
// CSS size times devicePixelRatio.

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
export function fit(canvas) {
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

// The latest value of a series (null when it has none yet).
export function latest(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
  return null;
}

// The chart's headline, in `element` (HTML, next to its caption): each series' current
// value in its colour, e.g. "now generated 12.3 · prompt 40.1". The canvas carries the lines
// and, at the top gridline, the axis maximum marked "max": two different numbers, each
// named.
export function chartHeadline(element, series) {
  const parts = ["now "];
  series.forEach((s, i) => {
    if (i) parts.push(" · ");
    const part = document.createElement("span");
    part.style.color = s.color;
    const value = document.createElement("b");
    value.textContent = formatNumber(latest(s.values), 1);
    part.append(`${s.label} `, value);
    parts.push(part);
  });
  element.replaceChildren(...parts);
}

// series: [{label, color, values: [number|null, ...]}], oldest first, all the same length
// (the chart's capacity); the y axis starts at 0 and ends at the largest value shown,
// drawn as the top gridline and labelled "max <value> <unit>". `title` and `window` (the
// time the chart covers) go into the canvas's aria-label with the current values.
// Returns {max: that value or null, current: each series' latest value}.
export function lineChart(canvas, series, { title, unit, window }) {
  const [ctx, width, height] = fit(canvas);
  const top = 14, bottom = height - 4, left = 4, right = width - 4;
  let peak = null;
  for (const s of series) for (const v of s.values) if (v !== null && v > (peak ?? -1)) peak = v;
  const max = peak > 0 ? peak : 1;  // (an empty or all-zero chart's axis spans 0 .. 1)
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
  ctx.textBaseline = "bottom";
  const axisLabel = peak === null ? "no data yet" : `max ${formatNumber(peak, 1)} ${unit}`;
  ctx.fillText(axisLabel, left, top - 1);
  const current = series.map((s) => latest(s.values));
  canvas.setAttribute("aria-label", `${title}: now ` +
    series.map((s, i) => `${s.label} ${formatNumber(current[i], 1)}`).join(", ") +
    ` ${unit}; ${axisLabel} over ${window}`);
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
  return { max: peak, current };
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
