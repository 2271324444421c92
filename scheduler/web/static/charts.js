// Line charts as inline SVG, drawn by hand: no library, nothing fetched, works offline.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

// series: [{name, cls, points: [[x, y], ...], dots}]; y may be null (a gap).
// opts: {width, height, xMin, xMax, yMin, yMax, axes, xFormat}
function lineChart(container, series, opts) {
  const o = Object.assign({ width: 560, height: 180, axes: true }, opts || {});
  // Room for the tick labels; a sparkline keeps a few pixels so a line at 0 or 100 shows.
  const pad = o.axes ? { l: 44, r: 12, t: 8, b: 22 } : { l: 3, r: 3, t: 3, b: 3 };
  const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && Number.isFinite(p[1])));
  const svg = svgEl("svg", {
    viewBox: `0 0 ${o.width} ${o.height}`, width: o.width, height: o.height, class: "linechart",
    role: "img",
  });
  container.replaceChildren(svg);
  if (!o.axes) svg.appendChild(svgEl("rect", { x: 0, y: 0, width: o.width, height: o.height, class: "frame" }));
  if (all.length === 0) {
    const t = svgEl("text", { x: o.width / 2, y: o.height / 2 + 4, "text-anchor": "middle", class: "empty" });
    t.textContent = "no samples yet";
    svg.appendChild(t);
    return svg;
  }
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  let x0 = o.xMin !== undefined ? o.xMin : Math.min(...xs);
  let x1 = o.xMax !== undefined ? o.xMax : Math.max(...xs);
  let y0 = o.yMin !== undefined ? o.yMin : Math.min(...ys);
  let y1 = o.yMax !== undefined ? o.yMax : Math.max(...ys);
  // The labels name the data's own ends (one label for a single x), before any widening.
  const xTicks = x0 === x1 ? [x0] : [x0, x1];
  const yTicks = y0 === y1 ? [y0] : [y0, y1];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const w = o.width - pad.l - pad.r;
  const h = o.height - pad.t - pad.b;
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * w;
  const Y = (y) => pad.t + h - ((y - y0) / (y1 - y0)) * h;
  if (o.axes) {
    svg.appendChild(svgEl("line", { x1: pad.l, y1: pad.t + h, x2: pad.l + w, y2: pad.t + h, class: "axis" }));
    svg.appendChild(svgEl("line", { x1: pad.l, y1: pad.t, x2: pad.l, y2: pad.t + h, class: "axis" }));
    for (const y of yTicks) {
      const t = svgEl("text", { x: pad.l - 4, y: Y(y) + 4, "text-anchor": "end", class: "tick y" });
      t.textContent = Number(y).toPrecision(3);
      svg.appendChild(t);
    }
    // The first label starts at its tick and the last ends at its own, so neither is cut
    // off by the edge of the drawing.
    xTicks.forEach((x, i) => {
      const anchor = xTicks.length === 1 ? "middle" : i === 0 ? "start" : "end";
      const t = svgEl("text", { x: X(x), y: o.height - 6, "text-anchor": anchor, class: "tick x" });
      t.textContent = o.xFormat ? o.xFormat(x) : String(Math.round(x));
      svg.appendChild(t);
    });
  }
  for (const s of series) {
    // A null value breaks the line: one polyline per run of values; a run of one value
    // (a lone sample) is a dot, so that it shows too.
    let run = [];
    const flush = () => {
      if (run.length > 1) {
        svg.appendChild(svgEl("polyline", { points: run.map((p) => p.join(",")).join(" "), class: `line ${s.cls || ""}` }));
      } else if (run.length === 1 && !s.dots) {
        svg.appendChild(svgEl("circle", { cx: run[0][0], cy: run[0][1], r: 1.5, class: `lone ${s.cls || ""}` }));
      }
      run = [];
    };
    for (const [x, y] of s.points) {
      if (y === null || !Number.isFinite(y)) { flush(); continue; }
      const px = [X(x).toFixed(1), Y(y).toFixed(1)];
      run.push(px);
      if (s.dots) {
        const c = svgEl("circle", { cx: px[0], cy: px[1], r: 3, class: `pt ${s.cls || ""}` });
        const tip = svgEl("title");
        tip.textContent = `${s.name} ${o.xFormat ? o.xFormat(x) : x}: ${y}`;
        c.appendChild(tip);
        svg.appendChild(c);
      }
    }
    flush();
  }
  return svg;
}
