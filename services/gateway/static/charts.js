"use strict";
// A run's figures over time (GET runs/{id}/series), drawn with uPlot (vendored: vendor/uplot/VERSION).
// Each chart keeps the arrays it plots in its data-series attribute: what is drawn can be read back off the page.
const Charts = (() => {
  // Not the progress bars' and alerts' colours (#2b8a3e, #1971c2, #e03131): the page's tests measure those.
  const BLUE = "#4263eb", ORANGE = "#e8590c", GREEN = "#37b24d", RED = "#f03e3e", VIOLET = "#7048e8",
    GREY = "#868e96", TEAL = "#0c8599";
  const POSITIONS = [BLUE, ORANGE, GREEN, VIOLET, RED, TEAL, GREY, "#c2255c"];
  const si = (v, unit = "") => v == null ? "–" : Math.abs(v) >= 1e9 ? `${(v / 1e9).toFixed(1)} G${unit}`
    : Math.abs(v) >= 1e6 ? `${(v / 1e6).toFixed(1)} M${unit}` : Math.abs(v) >= 1e3 ? `${(v / 1e3).toFixed(1)} k${unit}`
    : `${+v.toFixed(3)}${unit && " " + unit}`;
  const line = (label, color, value, extra) => ({label, color, value, ...extra});
  // source: which part of the series answer; x: "time" (unix s) or "step"; series: one line each.
  const SPECS = [
    {id: "throughput", title: "extraction: tokens/s and samples/s", source: "extraction", x: "time", series: () => [
      line("tokens/s", BLUE, p => p.tokens_per_s),
      line("samples/s", ORANGE, p => p.samples_per_s, {scale: "samples"})]},
    {id: "outcomes", title: "samples done and failed", source: "extraction", x: "time", series: () => [
      line("done", GREEN, p => p.done), line("failed", RED, p => p.failed)]},
    {id: "stages", title: "worker seconds a sample: server / check / store", source: "extraction", x: "time",
      series: () => [line("server", BLUE, p => p.stage_seconds.prefill ?? null),
        line("check", ORANGE, p => p.stage_seconds.check ?? null),
        line("store", VIOLET, p => p.stage_seconds.store ?? null)]},
    {id: "disk", title: "disk: written and projected", source: "extraction", x: "time", unit: "B", series: () => [
      line("written", TEAL, p => p.bytes_written), line("projected", GREY, p => p.projected_total_bytes)]},
    {id: "loss", title: "training loss", source: "training", x: "step", series: () => [line("loss", RED, p => p.loss)]},
    {id: "accuracy", title: "training accuracy per draft position", source: "training", x: "step",
      series: points => points[points.length - 1].acc.map((_, i) =>
        line(`position ${i + 1}`, POSITIONS[i % POSITIONS.length], p => p.acc[i] ?? null))},
    {id: "train-throughput", title: "training tokens/s", source: "training", x: "step",
      series: () => [line("tokens/s", BLUE, p => p.tokens_per_s)]},
  ];
  const runs = new Map();  // run id -> {node, plots: Map chart id -> uPlot, fetching}

  function holder(box, id, title) {
    let node = box.querySelector(`[data-chart="${id}"]`);
    if (!node) {
      node = el("div", {class: "chart", "data-chart": id}, el("h3", {}, title), el("div", {class: "plot"}));
      box.querySelector(".chart-grid").append(node);
    }
    return node;
  }

  function draw(state, id, node, data, options) {
    node.dataset.series = JSON.stringify(data);
    node.dataset.points = String(data[0].length);
    const area = node.querySelector(".plot"), width = Math.max(200, area.clientWidth);
    let plot = state.plots.get(id);
    if (plot && plot.series.length !== data.length) { plot.destroy(); plot = null; }
    if (plot) { plot.setData(data); if (Math.abs(plot.width - width) > 2) plot.setSize({width, height: 170}); return; }
    state.plots.set(id, new uPlot({width, height: 170, legend: {live: false}, cursor: {drag: {x: false}},
      ...options}, data, area));
  }

  function lines(state, spec, points) {
    const node = holder(state.node, spec.id, spec.title);
    if (!points.length) { node.dataset.points = "0"; return; }
    const series = spec.series(points);
    const data = [points.map(p => spec.x === "time" ? p.t : p.step), ...series.map(s => points.map(s.value))];
    const scales = {x: {time: spec.x === "time"}};
    const axes = [{}, {size: 72, values: (u, vals) => vals.map(v => si(v, spec.unit || ""))}];
    if (series.some(s => s.scale)) axes.push({scale: "samples", side: 1, size: 50, grid: {show: false}});
    draw(state, spec.id, node, data, {scales, axes, series: [{label: spec.x === "time" ? "time" : "step"},
      ...series.map(s => ({label: s.label, stroke: s.color, width: 2, scale: s.scale || "y", spanGaps: false}))]});
  }

  function acceptance(state, evaluation) {
    const node = holder(state.node, "acceptance", "evaluation: acceptance per draft position");
    const rates = evaluation.accept_rate || [];
    if (!rates.length) { node.dataset.points = "0"; return; }
    const data = [rates.map((_, i) => i + 1), rates];
    draw(state, "acceptance", node, data, {
      scales: {x: {time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5]}, y: {range: [0, 1]}},
      axes: [{splits: () => data[0], values: (u, vals) => vals.map(v => `pos ${v}`)}, {size: 50}],
      series: [{label: "position"}, {label: "accepted", stroke: GREEN, fill: GREEN + "99",
        paths: uPlot.paths.bars({size: [0.6, 80]}), points: {show: false}}]});
  }

  async function refresh(runId, state) {
    state.fetching = true;
    try {
      const response = await fetch(`runs/${encodeURIComponent(runId)}/series`, {headers: authHeaders()});
      if (!response.ok) throw new Error(`series of ${runId}: ${response.status}`);
      const body = await response.json();
      for (const spec of SPECS) lines(state, spec, body[spec.source].points);
      acceptance(state, body.evaluation);
      state.node.querySelector(".chart-error").textContent = "";
    } catch (e) {
      state.node.querySelector(".chart-error").textContent = String(e.message || e);
    } finally {
      state.fetching = false;
    }
  }

  // The charts of a run, one node kept across the page's redraws; drawn only while open (the newest run's is).
  function of(run, open) {
    let state = runs.get(run.run_id);
    if (!state) {
      const node = el("details", {class: "charts", "data-run": run.run_id}, el("summary", {}, "over time"),
        el("div", {class: "chart-error lost"}), el("div", {class: "chart-grid"}));
      if (open) node.open = true;
      state = {node, plots: new Map(), fetching: false};
      node.addEventListener("toggle", () => { if (node.open) refresh(run.run_id, state); });
      runs.set(run.run_id, state);
    }
    if (state.node.open && !state.fetching) refresh(run.run_id, state);
    return state.node;
  }

  return {of};
})();
