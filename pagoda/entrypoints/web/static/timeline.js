// The request timeline of the live engine view: one labelled row per request, time flowing
// right to "now" at the right edge: queued (grey), each prefill chunk (orange), decode
// (blue), and a finish tick coloured by reason. Times are seconds relative to the tick
// (negative: in the past; see pagoda/entrypoints/web/engine_view.py).
//
// Two rules keep it readable under load:
// - the time axis is a window of at most WINDOW_SPANS_S's last entry: a request that
//   finished before the window has scrolled off; one still in flight from before it is
//   clipped at the left edge;
// - a row is never shorter than MIN_ROW_PX, so every row keeps its label: the rows that do
//   not fit are left out and counted on a last line, "+N more". In-flight requests are
//   kept first (oldest first), then the most recently finished.

import { COLORS, fit } from "./charts.js";

export const WINDOW_SPANS_S = [5, 10, 15, 30, 60];  // the axis spans the smallest that fits
export const MIN_ROW_PX = 12;  // (11px text)
const MAX_ROW_PX = 14;
const AXIS_PX = 14;

// Which requests get a row, given room for `maxRows` lines: {rows (in arrival order),
// numHidden (in the window, no room), span (seconds the axis covers)}.
export function timelineRows(requests, maxRows) {
  const window = WINDOW_SPANS_S[WINDOW_SPANS_S.length - 1];
  const recent = requests.filter((r) => r.finish === null || r.finish >= -window);
  let rows = recent;
  if (recent.length > maxRows) {
    const inFlight = recent.filter((r) => r.finish === null)
      .sort((a, b) => a.arrival - b.arrival);
    const finished = recent.filter((r) => r.finish !== null)
      .sort((a, b) => b.finish - a.finish);
    // the last line says "+N more", so one row fewer (but one at least)
    rows = [...inFlight, ...finished].slice(0, Math.max(maxRows - 1, 1))
      .sort((a, b) => a.arrival - b.arrival);
  }
  const oldest = rows.length ? -Math.min(...rows.map((r) => r.arrival)) : 0;
  const span = WINDOW_SPANS_S.find((s) => s >= oldest) ?? window;
  return { rows, numHidden: recent.length - rows.length, span };
}

// `text` cut from the left with "…" until it fits `width` pixels (request ids differ at
// their end).
function ellipsize(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let tail = text;
  while (tail.length > 1 && ctx.measureText(`…${tail}`).width > width) tail = tail.slice(1);
  return `…${tail}`;
}

// Draws the timeline; returns what it shows ({rows, numHidden, span}) and says it in the
// canvas's aria-label.
export function timeline(canvas, requests) {
  const [ctx, width, height] = fit(canvas);
  const maxRows = Math.max(1, Math.floor((height - AXIS_PX) / MIN_ROW_PX));
  const shown = timelineRows(requests, maxRows);
  const { rows, numHidden, span } = shown;
  canvas.setAttribute("aria-label", `Request timeline: ${rows.length} requests in the last ` +
    `${span} s` + (numHidden ? `, ${numHidden} more not shown` : ""));
  if (!rows.length) {
    ctx.fillStyle = COLORS.text;
    ctx.fillText(requests.length ? `No requests in the last ${span} s.` : "No requests yet.",
                 8, 16);
    return shown;
  }
  const labelWidth = Math.min(110, width * 0.28);
  const left = labelWidth + 4, right = width - 6;
  const x = (t) => right - ((right - left) * Math.min(-t, span)) / span;  // clipped at left
  const numLines = rows.length + (numHidden ? 1 : 0);
  const rowHeight = Math.min(MAX_ROW_PX, (height - AXIS_PX) / numLines);
  const bar = rowHeight - 3;
  ctx.textBaseline = "middle";
  rows.forEach((r, i) => {
    const y = i * rowHeight;
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
    ctx.fillStyle = COLORS.text;
    ctx.fillText(ellipsize(ctx, r.id, labelWidth - 4), 2, y + bar / 2);
  });
  if (numHidden) {
    ctx.fillStyle = COLORS.text;
    ctx.fillText(`+${numHidden} more`, 2, rows.length * rowHeight + bar / 2);
  }
  drawAxis(ctx, left, right, height, span);
  return shown;
}

// A line under the rows, a tick every quarter of the span, labelled.
function drawAxis(ctx, left, right, height, span) {
  const axisY = height - AXIS_PX + 2;
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
    ctx.fillText(`-${seconds.toFixed(Number.isInteger(seconds) ? 0 : 1)} s`,
                 left + ((right - left) * quarter) / 4, height);
  }
  ctx.textAlign = "left";
  ctx.fillText(`-${span} s`, left, height);
  ctx.textAlign = "right";
  ctx.fillText("now", right, height);
  ctx.textAlign = "left";
}
