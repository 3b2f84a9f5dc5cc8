// The page of `deform-surgeon serve` (runs in the user's browser): runs the original and the patched model with
// onnxruntime-web on this browser's WebGPU adapter and shows what a user wants to know: does it run on my GPU,
// how fast, is the mask right.
//
// Never a silent success: every device the page creates reports its uncaptured WebGPU errors (browser_device.mjs,
// shared with the placement harness), JSEP runs with ort.env.debug = true, and a run with a WebGPU error is a
// failed run even when session.run() resolved. ORT's verbose log of session creation is posted to the server,
// which parses it with the placement parser; the outputs are posted with their input, and the server compares
// them byte for byte with ORT CPU's outputs for that input and with the original model's outputs.
//
// URL parameters: bundle=jsep|webgpu, runs=N, autorun=1 (run at once; `serve --headless` uses it).

import { adapterInfo, applyProfile, gpuErrors, hookDevices } from '/browser_device.mjs';
import { BUNDLES, bytesOfData, errorText } from '/harness_node_and_page.mjs';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const MEAN = [0.485, 0.456, 0.406];
const STD = [0.229, 0.224, 0.225];
const BUNDLE_LABELS = {
  jsep: "import 'onnxruntime-web' (default: JSEP, ort.min.mjs)",
  webgpu: "import 'onnxruntime-web/webgpu' (native EP, ort.webgpu.min.mjs)",
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
/** Text for innerHTML: file names and adapter strings are data, never markup. */
const esc = (v) => String(v).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function progress(text) {
  $('status').textContent = text;
  console.log(`@@progress ${text}`);
}

// ORT writes its log to the console; the lines printed while a session is created are kept for the server's parser.
const logSink = { lines: null };
for (const level of ['log', 'info', 'warn', 'error', 'debug']) {
  const original = console[level].bind(console);
  console[level] = (...a) => {
    if (logSink.lines && !(typeof a[0] === 'string' && a[0].startsWith('@@progress '))) {
      logSink.lines.push(a.map(String).join(' '));
    }
    original(...a);
  };
}

// ---------------------------------------------------------------------------------------------- float16 bits

function f32ToF16(v) {
  const f = new Float32Array([v]);
  const x = new Uint32Array(f.buffer)[0];
  const sign = (x >>> 16) & 0x8000;
  const exp = ((x >>> 23) & 0xff) - 127 + 15;
  const mant = x & 0x7fffff;
  if (((x >>> 23) & 0xff) === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  if (exp >= 0x1f) return sign | 0x7c00;
  if (exp <= 0) {
    if (exp < -10) return sign;
    const m = (mant | 0x800000) >> (1 - exp);
    return sign | ((m + 0x1000) >> 13);
  }
  return sign | ((exp << 10) + ((mant + 0x1000) >> 13));
}

function f16ToF32(h) {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const m = h & 0x3ff;
  if (e === 0) return s * m * 2 ** -24;
  if (e === 31) return m ? NaN : s * Infinity;
  return s * (1 + m / 1024) * 2 ** (e - 15);
}

/** Float32 values of a tensor's data (float16 arrives as Uint16Array bits or as Float16Array). */
function floats(t) {
  if (t.type === 'float16' && t.data instanceof Uint16Array) return Float32Array.from(t.data, f16ToF32);
  return Float32Array.from(t.data, Number);
}

// ---------------------------------------------------------------------------------------------- images

async function loadImage(src) {
  const img = new Image();
  img.src = src;
  await img.decode();
  return img;
}

function pixels(img, w, h) {
  const c = document.createElement('canvas');
  c.width = w;
  c.height = h;
  const ctx = c.getContext('2d', { willReadFrequently: true });
  ctx.drawImage(img, 0, 0, w, h);
  return ctx.getImageData(0, 0, w, h);
}

function drawGrey(canvas, values, w, h) {
  canvas.width = w;
  canvas.height = h;
  const ctx = canvas.getContext('2d');
  const im = ctx.createImageData(w, h);
  for (let i = 0; i < w * h; i++) {
    const v = Math.round(255 * Math.min(1, Math.max(0, values[i])));
    im.data.set([v, v, v, 255], 4 * i);
  }
  ctx.putImageData(im, 0, 0);
}

/**
 * What to show of a model's outputs: the last output as a mask (sigmoid of the logits, the way BiRefNet's users
 * display it; values already within [0, 1] are shown as they are) when it has one channel, else the first
 * output's first plane, min-max scaled to grey.
 */
function picture(outs, names) {
  const last = outs[names[names.length - 1]];
  const d = Array.from(last.dims);
  const channels = d.slice(0, -2).reduce((a, b) => a * b, 1);
  if (d.length >= 2 && channels === 1) {
    const v = floats(last);
    const inUnit = v.every((x) => x >= 0 && x <= 1);
    const values = inUnit ? v : v.map((x) => 1 / (1 + Math.exp(-x)));
    return { kind: inUnit ? 'mask (last output, already in [0, 1])' : 'mask = sigmoid(last output)',
      w: d[d.length - 1], h: d[d.length - 2], values };
  }
  const first = outs[names[0]];
  const fd = Array.from(first.dims);
  const w = fd.length ? fd[fd.length - 1] : 1;
  const h = fd.length >= 2 ? fd[fd.length - 2] : 1;
  const v = floats(first).slice(0, w * h);
  let lo = Infinity;
  let hi = -Infinity;
  for (const x of v) if (Number.isFinite(x)) [lo, hi] = [Math.min(lo, x), Math.max(hi, x)];
  const span = hi > lo ? hi - lo : 1;
  return { kind: `first output '${names[0]}', first plane, min-max scaled (not a mask)`, w, h,
    values: v.map((x) => (x - lo) / span) };
}

function resampled(values, w, h, W, H) {
  const c = document.createElement('canvas');
  drawGrey(c, values, w, h);
  const im = pixels(c, W, H);
  const out = new Float32Array(W * H);
  for (let i = 0; i < W * H; i++) out[i] = im.data[4 * i] / 255;
  return out;
}

/** The input dimmed to grey with the original's mask in red and the patched's in cyan (both: white). */
function drawOverlay(canvas, input, masks) {
  const { width: W, height: H } = input;
  canvas.width = W;
  canvas.height = H;
  const [a, b] = masks.map((m) => resampled(m.values, m.w, m.h, W, H));
  const ctx = canvas.getContext('2d');
  const im = ctx.createImageData(W, H);
  for (let i = 0; i < W * H; i++) {
    const p = input.data;
    const grey = 0.5 * (0.299 * p[4 * i] + 0.587 * p[4 * i + 1] + 0.114 * p[4 * i + 2]);
    const mb = b ? b[i] : a[i];
    im.data.set([grey + 127 * a[i], grey + 127 * mb, grey + 127 * mb, 255], 4 * i);
  }
  ctx.putImageData(im, 0, 0);
}

function figure(id, caption) {
  let c = $(id);
  if (!c) {
    const f = document.createElement('figure');
    f.innerHTML = `<canvas id="${id}"></canvas><figcaption></figcaption>`;
    $('images').appendChild(f);
    c = $(id);
  }
  c.parentElement.querySelector('figcaption').textContent = caption;
  return c;
}

// ---------------------------------------------------------------------------------------------- runs

async function fetchOk(url, init) {
  const r = await fetch(url, init);
  if (!r.ok) throw new Error(`${init && init.method ? init.method : 'GET'} ${url}: HTTP ${r.status}`);
  return r;
}

function inputTensor(ort, input, img, W, H, normalize) {
  const im = pixels(img, W, H);
  const data = new Float32Array(3 * W * H);
  for (let c = 0; c < 3; c++) {
    for (let i = 0; i < W * H; i++) {
      const v = im.data[4 * i + c] / 255;
      data[c * W * H + i] = normalize ? (v - MEAN[c]) / STD[c] : v;
    }
  }
  const dims = [1, 3, H, W];
  if (input.dtype === 'float16') return new ort.Tensor('float16', Uint16Array.from(data, f32ToF16), dims);
  return new ort.Tensor('float32', data, dims);
}

async function runModel(ort, m, tensor, runs) {
  const e = { label: m.label, file: m.name, ok: false, error: null, fetch_s: null, session_create_s: null,
    first_run_ms: null, runs_ms: [], min_ms: null, median_ms: null, placement: null, gpu_errors: [], outputs: [],
    vs_cpu: null, max_abs_diff_vs_cpu: null, within_tolerance: null, vs_original: null,
    identical_to_original: null, cpu_reference_s: null, display: null };
  const before = gpuErrors.length;
  let session = null;
  let outs = null;
  let lines = null;
  const parseLog = async () => (await fetchOk('/logparse', { method: 'POST', body: lines.join('\n') })).json();
  try {
    progress(`${m.label}: fetching ${m.name}`);
    const t0 = performance.now();
    const bytes = new Uint8Array(await (await fetchOk(m.url)).arrayBuffer());
    e.fetch_s = (performance.now() - t0) / 1000;
    const options = { executionProviders: ['webgpu'], logSeverityLevel: 0, logVerbosityLevel: 0 };
    if (m.external.length) options.externalData = m.external.map((x) => ({ path: x.path, data: x.url }));
    progress(`${m.label}: creating the session`);
    logSink.lines = [];
    const t1 = performance.now();
    try {
      session = await ort.InferenceSession.create(bytes, options);
    } finally {
      e.session_create_s = (performance.now() - t1) / 1000;
      lines = logSink.lines;
      logSink.lines = null;
    }
    e.placement = await parseLog();
    const feeds = { [session.inputNames[0]]: tensor };
    const quiet = { logSeverityLevel: 3 }; // the verbose log is for placement; runs are timed without it
    progress(`${m.label}: first run`);
    let t = performance.now();
    outs = await session.run(feeds, quiet);
    e.first_run_ms = performance.now() - t;
    // The first run compiled every shader with ort.env.debug on (JSEP: a compile failure rejects the run). The
    // timed runs go without its per-kernel error scopes, which cost more than the kernels on a small model; the
    // uncaptured-error listener still sees every error they raise.
    const debug = ort.env.debug;
    ort.env.debug = false;
    ort.env.logLevel = 'warning'; // JS-side per-kernel log lines would be timed too
    for (let i = 0; i < runs; i++) {
      progress(`${m.label}: warm run ${i + 1}/${runs}`);
      t = performance.now();
      outs = await session.run(feeds, quiet);
      e.runs_ms.push(performance.now() - t);
    }
    ort.env.debug = debug;
    const sorted = [...e.runs_ms].sort((a, b) => a - b);
    e.min_ms = sorted[0];
    e.median_ms = sorted.length % 2 ? sorted[(sorted.length - 1) / 2]
      : (sorted[sorted.length / 2 - 1] + sorted[sorted.length / 2]) / 2;
    await sleep(200); // queued uncaptured-error events arrive before the run is judged
    e.gpu_errors = gpuErrors.slice(before);
    e.outputs = session.outputNames.map((n) => ({ name: n, dtype: outs[n].type, dims: Array.from(outs[n].dims) }));
    progress(`${m.label}: ORT CPU reference on the server`);
    const layout = { input: { name: session.inputNames[0], dtype: tensor.type, dims: Array.from(tensor.dims) },
      outputs: e.outputs };
    const body = new Blob([bytesOfData(tensor.data), ...session.outputNames.map((n) => bytesOfData(outs[n].data))]);
    const c = await (await fetch(`/compare/${m.label}`, { method: 'POST', body,
      headers: { 'X-Layout': encodeURIComponent(JSON.stringify(layout)) } })).json();
    if (c.error) throw new Error(`comparison on the server failed: ${c.error}`);
    e.vs_cpu = c.vs_cpu;
    e.cpu_reference_s = c.cpu_run_s;
    e.within_tolerance = c.within_tolerance;
    const diffs = Object.values(c.vs_cpu).map((x) => x.max_abs_diff);
    e.max_abs_diff_vs_cpu = diffs.includes(null) ? null : Math.max(...diffs);
    if (c.vs_original) {
      e.vs_original = c.vs_original;
      e.identical_to_original = c.identical_to_original;
    }
    e.ok = e.gpu_errors.length === 0 && c.within_tolerance;
    if (e.gpu_errors.length) e.error = `uncaptured WebGPU error (session.run() resolved anyway): ${e.gpu_errors[0]}`;
    else if (!c.within_tolerance) e.error = 'outputs differ from ORT CPU beyond the tolerance';
  } catch (err) {
    e.error = errorText(err);
    e.gpu_errors = gpuErrors.slice(before);
    // what ORT logged before it failed (a session that fails after partitioning still shows its placement)
    if (lines && !e.placement) e.placement = await parseLog().catch(() => null);
  } finally {
    if (session) await session.release().catch(() => {});
    ort.env.debug = BUNDLES[state.bundle].debug;
    ort.env.logLevel = 'verbose'; // the next session's placement log
  }
  const pic = e.outputs.length ? picture(outs, e.outputs.map((o) => o.name)) : null;
  e.display = pic ? pic.kind : null;
  return { entry: e, picture: pic };
}

// ---------------------------------------------------------------------------------------------- page

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return '–';
  if (Number.isInteger(v)) return String(v);
  if (typeof v === 'number') return Math.abs(v) > 0 && Math.abs(v) < 1e-3 ? v.toExponential(2) : v.toFixed(digits);
  return String(v);
}

function firstLine(text) {
  const line = text.split('\n')[0];
  return line.length > 240 ? `${line.slice(0, 240)}…` : line;
}

function showTable(entries) {
  const rows = [
    ['file', (e) => esc(e.file)],
    ['runs on WebGPU without error, agrees with ORT CPU', (e) => (e.ok ? '<span class="good">yes</span>'
      : '<span class="bad">NO</span>')],
    ['model download (s)', (e) => fmt(e.fetch_s)],
    ['session creation (s)', (e) => fmt(e.session_create_s)],
    ['first run (ms)', (e) => fmt(e.first_run_ms, 1)],
    [`warm runs: min (ms)`, (e) => fmt(e.min_ms, 1)],
    ['warm runs: median (ms)', (e) => fmt(e.median_ms, 1)],
    ['nodes after ORT\'s optimisation', (e) => fmt(e.placement && e.placement.total_nodes)],
    ['CPU nodes', (e) => fmt(e.placement && e.placement.cpu_nodes)],
    ['Memcpy nodes (CPU↔GPU copies)', (e) => fmt(e.placement && e.placement.memcpy)],
    ['WebGPU errors', (e) => fmt(e.gpu_errors.length)],
    ['max |output − ORT CPU|', (e) => fmt(e.max_abs_diff_vs_cpu)],
    ['identical to the original (bytes)', (e) => (e.identical_to_original === null ? '–'
      : e.identical_to_original ? '<span class="good">yes</span>' : '<span class="bad">NO</span>')],
    ['max |output − original|', (e) => (e.vs_original ? fmt(Math.max(...Object.values(e.vs_original)
      .map((x) => x.max_abs_diff ?? Infinity))) : '–')],
    ['error (full text in the results JSON)', (e) => (e.error ? `<span class="bad">${esc(firstLine(e.error))}</span>`
      : '')],
  ];
  let html = `<tr><th></th>${entries.map((e) => `<th>${e.label}</th>`).join('')}</tr>`;
  for (const [name, fn] of rows) html += `<tr><td>${name}</td>${entries.map((e) => `<td>${fn(e)}</td>`).join('')}</tr>`;
  $('table').innerHTML = html;
}

function isSoftware(a) {
  if (!a) return false;
  const text = [a.vendor, a.architecture, a.device, a.description].join(' ');
  return a.isFallbackAdapter === true || /swiftshader|llvmpipe|lavapipe|software|basic render/i.test(text);
}

function showAdapter(a, note, profile, applied) {
  if (!a) {
    $('adapter').innerHTML = `<span class="bad">no WebGPU adapter: ${esc(note)}</span>`;
    return;
  }
  const keys = Object.keys(a.limits);
  $('adapter').innerHTML = `<div class="row"><div><p>vendor <b>${esc(a.vendor || '?')}</b>, architecture
    <b>${esc(a.architecture || '?')}</b>, device ${esc(a.device || '?')} ${a.description ? `(${esc(a.description)})` : ''},
    fallback adapter:
    <b>${a.isFallbackAdapter}</b>, ${a.features.length} features (shader-f16: ${a.features.includes('shader-f16')})</p>
    <p>device profile <b>${esc(profile.name)}</b>: ${esc(profile.source)}</p></div>
    <table><tr><th>limit</th><th>adapter</th><th>requested for ORT's device</th></tr>
    ${keys.map((k) => `<tr><td>${k}</td><td>${a.limits[k]}</td><td>${applied ? applied[k] : '–'}</td></tr>`).join('')}
    </table></div>`;
  if (isSoftware(a)) {
    $('software').hidden = false;
    $('software').textContent = 'This is a software adapter (' + [a.vendor, a.architecture, a.description]
      .filter(Boolean).join(', ') + '): the GPU is emulated on the CPU, so the timings on this page are NOT GPU '
      + 'timings. Open the page in a browser on a machine with a GPU to measure those.';
  }
}

const state = { config: null, bundle: null, image: null, imageName: null, result: null };

async function main() {
  const config = await (await fetchOk('/config.json')).json();
  const bundle = params.get('bundle') || config.default_bundle;
  Object.assign(state, { config, bundle });
  for (const b of config.bundles) $('bundle').add(new Option(BUNDLE_LABELS[b] || b, b, false, b === bundle));
  $('bundle').onchange = () => {
    params.set('bundle', $('bundle').value);
    params.delete('autorun');
    location.search = params.toString(); // one bundle per page load: ORT and the device hooks load once
  };
  $('runs').value = params.get('runs') || config.runs;
  const input = config.models[0].inputs[0];
  for (const [id, d] of [['height', input.dims[2]], ['width', input.dims[3]]]) {
    $(id).value = d ?? 1024;
    $(id).disabled = d !== null; // fixed by the model
  }

  const probe = await adapterInfo();
  let applied = null;
  if (probe.adapter) {
    const adapter = await navigator.gpu.requestAdapter();
    let limits = config.profile.limits;
    if (!limits) {
      limits = {};
      for (const k in adapter.limits) limits[k] = adapter.limits[k]; // every limit the adapter offers
    }
    applied = applyProfile(adapter, limits);
  }
  hookDevices(); // after applyProfile: every device the page creates reports its errors
  showAdapter(probe.adapter, probe.error, config.profile, applied);

  progress(`importing /ort/${BUNDLES[bundle].file}`);
  const ort = await import(`/ort/${BUNDLES[bundle].file}`);
  ort.env.wasm.wasmPaths = '/ort/';
  ort.env.wasm.numThreads = 1; // no cross-origin isolation on this page
  ort.env.logLevel = 'verbose';
  if (BUNDLES[bundle].debug) ort.env.debug = true; // JSEP: a WGSL compile failure rejects session.run()

  const showInput = () => {
    const W = Number($('width').value);
    const H = Number($('height').value);
    const c = figure('c-input', `input: ${state.imageName}, resized to ${W}×${H}`);
    c.width = W;
    c.height = H;
    c.getContext('2d').drawImage(state.image, 0, 0, W, H);
  };
  const setImage = async (src, name) => {
    state.image = await loadImage(src);
    state.imageName = name;
    showInput();
  };
  await setImage('/sample.png', 'sample.png (bundled)');
  const pick = (f) => f && setImage(URL.createObjectURL(f), f.name).catch((e) => progress(`${f.name}: ${errorText(e)}`));
  $('file').onchange = () => pick($('file').files[0]);
  const drop = $('drop');
  drop.ondragover = (ev) => {
    ev.preventDefault();
    drop.classList.add('over');
  };
  drop.ondragleave = () => drop.classList.remove('over');
  drop.ondrop = (ev) => {
    ev.preventDefault();
    drop.classList.remove('over');
    pick(ev.dataTransfer.files[0]);
  };

  const run = async () => {
    $('run').disabled = true;
    const W = Number($('width').value);
    const H = Number($('height').value);
    const runs = Math.max(1, Number($('runs').value) || 1);
    showInput();
    const tensor = inputTensor(ort, input, state.image, W, H, $('normalize').checked);
    const entries = [];
    const pictures = [];
    for (const m of config.models) {
      const { entry, picture: pic } = await runModel(ort, m, tensor, runs);
      entries.push(entry);
      showTable(entries);
      if (pic) {
        pictures.push(pic);
        drawGrey(figure(`c-${m.label}`, `${m.label}: ${pic.kind}`), pic.values, pic.w, pic.h);
      }
    }
    if (pictures.length) {
      drawOverlay(figure('c-overlay', pictures.length > 1 ? 'overlay: original red, patched cyan, both white'
        : 'overlay'), pixels(state.image, W, H), pictures);
    }
    $('legend').textContent = `Tolerance against ORT CPU (max |difference| of the raw outputs): float32 `
      + `${config.tolerance.float32}, float16 ${config.tolerance.float16}: GPU kernels add in another order. `
      + 'The patched model is held to byte identity with the original on the same runtime.';
    state.result = {
      tool: 'deform-surgeon serve',
      generated_at: new Date().toISOString(),
      ok: entries.every((e) => e.ok) && entries.every((e) => e.identical_to_original !== false),
      software_adapter: isSoftware(probe.adapter),
      timing_note: 'Timings are GPU timings only on a hardware adapter; on a software adapter (SwiftShader, '
        + 'fallback) they are not GPU timings.',
      adapter: probe.adapter,
      adapter_note: probe.error,
      profile: config.profile,
      applied_limits: applied,
      bundle,
      bundle_file: BUNDLES[bundle].file,
      ort_env_debug: { session_and_first_run: Boolean(BUNDLES[bundle].debug), timed_runs: false },
      versions: { ...config.versions, 'onnxruntime-web (page)': ort.env.versions ? ort.env.versions.web : null,
        browser: navigator.userAgent },
      image: { name: state.imageName, width: state.image.naturalWidth, height: state.image.naturalHeight,
        resized_to: [H, W], normalize: $('normalize').checked ? { mean: MEAN, std: STD } : null },
      input: { name: input.name, dtype: tensor.type, dims: Array.from(tensor.dims) },
      runs,
      tolerance: config.tolerance,
      models: entries,
      gpu_errors: gpuErrors.slice(),
    };
    window.__serveResult = state.result;
    $('download').disabled = false;
    $('run').disabled = false;
    progress(state.result.ok ? 'done' : 'done, with failures (see the table)');
  };
  $('run').onclick = () => run().catch((e) => progress(`failed: ${errorText(e)}`));
  $('download').onclick = () => {
    const a = document.createElement('a');
    a.href = URL.createObjectURL(new Blob([JSON.stringify(state.result, null, 1)], { type: 'application/json' }));
    a.download = 'deform-surgeon-serve-results.json';
    a.click();
  };
  progress('ready');
  if (params.get('autorun') === '1') {
    await run().catch((e) => {
      window.__serveResult = { ok: false, error: errorText(e), models: [] };
    });
    window.__serveDone = true;
  }
}

main().catch((e) => {
  progress(`page failed: ${errorText(e)}`);
  window.__serveResult = { ok: false, error: `page failed: ${errorText(e)}`, models: [] };
  window.__serveDone = true;
});
