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
// The user's picture keeps its aspect ratio: it is letterboxed into the model's input (scaled to fit, centred, the
// bars filled with the ImageNet mean, which normalises to 0), and each model's mask is cut back out of the letterbox
// and shown at the picture's own size, with a cutout (the picture, the mask as its alpha), each downloadable as PNG.
//
// Without a WebGPU adapter the page runs the models on onnxruntime-web's wasm backend (ORT's CPU EP in WebAssembly),
// the backend onnxruntime-web and transformers.js fall back to, and says so.
//
// URL parameters: bundle=webgpu|jsep|wasm|transformers (model folders only), runs=N, autorun=1 (run at once; `serve
// --headless` uses it).

import { adapterInfo, applyProfile, gpuErrors, hookDevices } from '/browser_device.mjs';
import { BUNDLES, bytesOfData, errorText, splitErrors, summarizeErrors } from '/harness_node_and_page.mjs';
import { alphaOf, createPipeline, loadTransformers, observe, pipelineCall } from '/transformers_page.mjs';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const MEAN = [0.485, 0.456, 0.406];
const STD = [0.229, 0.224, 0.225];
const BUNDLE_LABELS = {
  webgpu: "import 'onnxruntime-web/webgpu' (native EP, ort.webgpu.min.mjs; what transformers.js uses)",
  jsep: "import 'onnxruntime-web' (JSEP, ort.min.mjs)",
  wasm: "import 'onnxruntime-web/wasm' (the CPU backend, ort.wasm.min.mjs: no WebGPU)",
  transformers: "transformers.js: pipeline('background-removal', MODEL, {device: 'webgpu', dtype}) on the model folder",
};
// The bars of a letterboxed picture: the ImageNet mean, 0 after normalisation.
const FILL = MEAN.map((m) => Math.round(255 * m));
const DISPLAY_PX = 180; // the longer side of a picture on the page (the PNG downloads keep their own size)
const ENABLE_WEBGPU = 'To enable WebGPU: Chrome or Edge 113+ on Windows, macOS or ChromeOS has it on; on Linux start '
  + 'Chrome with --enable-unsafe-webgpu --enable-features=Vulkan (or turn on chrome://flags/#enable-unsafe-webgpu); '
  + 'Safari 26+, Firefox 141+ on Windows.';
const JSEP_NOTE = "JSEP (import 'onnxruntime-web'): here the original model fails or leaves its deformable "
  + "convolutions on the CPU (its rank-5 GatherND does not compile: \"no matching constructor for 'i32(vec4<u32>)'\"). "
  + 'That failure is the bug the patched model fixes.';
const NO_WEBGPU = 'This browser gives the page no WebGPU adapter, so the models run on onnxruntime-web\'s wasm backend '
  + '(ORT\'s CPU EP in WebAssembly, one thread, a heap of at most 4 GiB), as onnxruntime-web and transformers.js do '
  + 'without WebGPU: slower than a GPU, and its sums in another order than ORT CPU\'s on this machine.';
const UNCAPTURED = 'uncaptured WebGPU error';
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
  if (!img.naturalWidth || !img.naturalHeight) throw new Error('the image has no pixels');
  return img;
}

function canvasOf(w, h) {
  const c = document.createElement('canvas');
  c.width = w;
  c.height = h;
  return c;
}

/** Shows a canvas with its own aspect ratio, its longer side DISPLAY_PX (small model outputs: pixelated). */
function fitDisplay(canvas) {
  const k = DISPLAY_PX / Math.max(canvas.width, canvas.height);
  canvas.style.width = `${Math.round(canvas.width * k)}px`;
  canvas.style.height = `${Math.round(canvas.height * k)}px`;
  canvas.style.imageRendering = k > 1 ? 'pixelated' : 'auto';
}

/**
 * Where the picture goes in a W x H input without changing its aspect ratio: scaled to fit, centred; the rest
 * (the bars) is FILL.
 */
function letterboxRect(img, W, H) {
  const scale = Math.min(W / img.naturalWidth, H / img.naturalHeight);
  const w = Math.max(1, Math.round(img.naturalWidth * scale));
  const h = Math.max(1, Math.round(img.naturalHeight * scale));
  return { x: Math.floor((W - w) / 2), y: Math.floor((H - h) / 2), w, h, scale };
}

/** The picture letterboxed into W x H: the canvas the page shows and the pixels the model's input is made of. */
function letterbox(img, W, H) {
  const c = canvasOf(W, H);
  const ctx = c.getContext('2d', { willReadFrequently: true });
  ctx.fillStyle = `rgb(${FILL.join(',')})`;
  ctx.fillRect(0, 0, W, H);
  const r = letterboxRect(img, W, H);
  ctx.drawImage(img, r.x, r.y, r.w, r.h);
  return { canvas: c, pixels: ctx.getImageData(0, 0, W, H), rect: r };
}

function greyCanvas(values, w, h) {
  const c = canvasOf(w, h);
  const ctx = c.getContext('2d');
  const im = ctx.createImageData(w, h);
  for (let i = 0; i < w * h; i++) {
    const v = Math.round(255 * Math.min(1, Math.max(0, values[i])));
    im.data.set([v, v, v, 255], 4 * i);
  }
  ctx.putImageData(im, 0, 0);
  return c;
}

/**
 * A model's picture (w x h, at the model's output resolution) cut back out of the letterbox and scaled to the
 * user's image size (iw x ih): the part of the output that covers the picture, without the bars.
 */
function atImageSize(pic, rect, W, H, iw, ih) {
  const src = greyCanvas(pic.values, pic.w, pic.h);
  const sx = pic.w / W;
  const sy = pic.h / H;
  const c = canvasOf(iw, ih);
  const ctx = c.getContext('2d', { willReadFrequently: true });
  ctx.imageSmoothingEnabled = true;
  ctx.imageSmoothingQuality = 'high';
  ctx.drawImage(src, rect.x * sx, rect.y * sy, rect.w * sx, rect.h * sy, 0, 0, iw, ih);
  return c;
}

/** The picture at its own size with the mask (grey, same size) as its alpha: the object cut out. */
function cutout(img, mask) {
  const { width: w, height: h } = mask;
  const c = canvasOf(w, h);
  const ctx = c.getContext('2d', { willReadFrequently: true });
  ctx.drawImage(img, 0, 0, w, h);
  const im = ctx.getImageData(0, 0, w, h);
  const m = mask.getContext('2d', { willReadFrequently: true }).getImageData(0, 0, w, h).data;
  for (let i = 0; i < w * h; i++) im.data[4 * i + 3] = m[4 * i];
  ctx.putImageData(im, 0, 0);
  return c;
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

/** Puts `canvas` on the page in the figure `id` (replacing what it showed), with a PNG download when `file`. */
function figure(id, canvas, caption, file = null) {
  let f = document.getElementById(`f-${id}`);
  if (!f) {
    f = document.createElement('figure');
    f.id = `f-${id}`;
    $('images').appendChild(f);
  }
  canvas.id = `c-${id}`;
  fitDisplay(canvas);
  f.replaceChildren(canvas);
  const cap = document.createElement('figcaption');
  cap.textContent = caption;
  f.appendChild(cap);
  if (file) {
    const a = document.createElement('a');
    a.textContent = `download ${file}`;
    a.download = file;
    a.dataset.download = file;
    a.href = canvas.toDataURL('image/png');
    f.appendChild(a);
  }
}

function clearFigures() {
  for (const f of [...$('images').querySelectorAll('figure')]) if (f.id !== 'f-input') f.remove();
}

// ---------------------------------------------------------------------------------------------- runs

async function fetchOk(url, init) {
  const r = await fetch(url, init);
  if (!r.ok) throw new Error(`${init && init.method ? init.method : 'GET'} ${url}: HTTP ${r.status}`);
  return r;
}

/** The model's input from the letterboxed pixels (an ImageData of W x H). */
function inputTensor(ort, input, im, W, H, normalize) {
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

/** A model's entry in the table and the results JSON, before anything is known. */
function newEntry(m) {
  return { label: m.label, file: m.name, ok: false, error: null, fetch_s: null, session_create_s: null,
    first_run_ms: null, runs_ms: [], min_ms: null, median_ms: null, placement: null, gpu_errors: [], outputs: [],
    vs_cpu: null, max_abs_diff_vs_cpu: null, within_tolerance: null, verdict_vs_cpu: null, vs_original: null,
    identical_to_original: null, verdict_vs_original: null, cpu_reference_s: null, display: null,
    bisect_command: (m.bisect || {})[state.bundle] || null };
}

/** The warm runs' times of `e.runs_ms`: their minimum and median. */
function timeStats(e) {
  const sorted = [...e.runs_ms].sort((a, b) => a - b);
  e.min_ms = sorted[0];
  e.median_ms = sorted.length % 2 ? sorted[(sorted.length - 1) / 2]
    : (sorted[sorted.length / 2 - 1] + sorted[sorted.length / 2]) / 2;
}

/**
 * The server's verdicts on one run: the outputs `outs` (tensors by name, in `names` order) for the input `tensor`
 * (`inputName`) against ORT CPU's for that input, and against the original's; fills `e` and judges it.
 */
async function judgeOnServer(e, m, inputName, tensor, outs, names) {
  e.outputs = names.map((n) => ({ name: n, dtype: outs[n].type, dims: Array.from(outs[n].dims) }));
  progress(`${m.label}: ORT CPU reference on the server`);
  const layout = { input: { name: inputName, dtype: tensor.type, dims: Array.from(tensor.dims) }, outputs: e.outputs,
    bundle: state.bundle };
  const body = new Blob([bytesOfData(tensor.data), ...names.map((n) => bytesOfData(outs[n].data))]);
  const c = await (await fetch(`/compare/${m.label}`, { method: 'POST', body,
    headers: { 'X-Layout': encodeURIComponent(JSON.stringify(layout)) } })).json();
  if (c.error) throw new Error(`comparison on the server failed: ${c.error}`);
  e.vs_cpu = c.vs_cpu;
  e.cpu_reference_s = c.cpu_run_s;
  e.within_tolerance = c.within_tolerance;
  e.verdict_vs_cpu = c.verdict_vs_cpu;
  if (c.bisect_command) e.bisect_command = c.bisect_command; // with the page's own input
  const diffs = Object.values(c.vs_cpu).map((x) => x.max_abs_diff);
  e.max_abs_diff_vs_cpu = diffs.includes(null) ? null : Math.max(...diffs);
  if (c.vs_original) {
    e.vs_original = c.vs_original;
    e.identical_to_original = c.identical_to_original;
    e.verdict_vs_original = c.verdict_vs_original;
  }
  e.ok = e.gpu_errors.length === 0 && c.within_tolerance;
  if (e.gpu_errors.length) e.error = `${UNCAPTURED} (session.run() resolved anyway): ${e.gpu_errors[0]}`;
  else if (!c.within_tolerance) e.error = `outputs vs ORT CPU: ${c.verdict_vs_cpu.text}`;
}

/** Posts the log lines ORT printed while a session was created to the server's parser: the placement. */
async function parseLines(lines) {
  return (await fetchOk('/logparse', { method: 'POST', body: lines.join('\n') })).json();
}

/**
 * One model through transformers.js, as a page that uses it runs it: `pipeline('background-removal', MODEL,
 * {device: 'webgpu', dtype})` on its folder (transformers_page.mjs), then `pipe(image)`: the pipeline preprocesses
 * the picture itself (no letterbox) and returns the picture with the mask as its alpha, at the picture's size. The
 * session's input and outputs are observed and judged on the server like the other bundles' runs.
 */
async function runPipeline(tjs, m, imageUrl, runs) {
  const e = newEntry(m);
  e.call = pipelineCall(m.folder.dtype);
  const before = gpuErrors.length;
  let pipe = null;
  let cut = null;
  try {
    progress(`${m.label}: ${e.call}, file onnx/${m.folder.file}.onnx`);
    logSink.lines = [];
    const t1 = performance.now();
    try {
      pipe = await createPipeline(tjs, m.folder.id, m.folder.file);
      e.session_create_s = (performance.now() - t1) / 1000; // the model's download included: the pipeline does it
    } finally {
      e.placement = await parseLines(logSink.lines).catch(() => null);
      logSink.lines = null;
    }
    const seen = observe(pipe);
    const image = await tjs.RawImage.fromURL(imageUrl);
    tjs.env.backends.onnx.setLogLevel(30); // the verbose log is for placement; runs are timed without it
    progress(`${m.label}: first run`);
    let t = performance.now();
    cut = await pipe(image);
    e.first_run_ms = performance.now() - t;
    for (let i = 0; i < runs; i++) {
      progress(`${m.label}: warm run ${i + 1}/${runs}`);
      t = performance.now();
      cut = await pipe(image);
      e.runs_ms.push(performance.now() - t);
    }
    timeStats(e);
    await sleep(200); // queued uncaptured-error events arrive before the run is judged
    e.gpu_errors = gpuErrors.slice(before);
    const [inputName, tensor] = Object.entries(seen.feeds)[0];
    await judgeOnServer(e, m, inputName, tensor, seen.outputs, Object.keys(seen.outputs));
  } catch (err) {
    e.error = errorText(err);
    e.gpu_errors = gpuErrors.slice(before);
  } finally {
    if (pipe) await pipe.dispose().catch(() => {});
    tjs.env.backends.onnx.setLogLevel(10); // the next session's placement log
  }
  e.display = cut ? "the pipeline's mask (the returned picture's alpha)" : null;
  return { entry: e, cut };
}

async function runModel(ort, m, tensor, runs) {
  const e = newEntry(m);
  const before = gpuErrors.length;
  let session = null;
  let outs = null;
  let lines = null;
  const parseLog = () => parseLines(lines);
  try {
    progress(`${m.label}: fetching ${m.name}`);
    const t0 = performance.now();
    const bytes = new Uint8Array(await (await fetchOk(m.url)).arrayBuffer());
    e.fetch_s = (performance.now() - t0) / 1000;
    const ep = state.bundle === 'wasm' ? 'wasm' : 'webgpu';
    const options = { executionProviders: [ep], logSeverityLevel: 0, logVerbosityLevel: 0 };
    if (m.external.length) options.externalData = m.external.map((x) => ({ path: x.path, data: x.url }));
    progress(`${m.label}: creating the session`);
    logSink.lines = [];
    const t1 = performance.now();
    try {
      session = await ort.InferenceSession.create(bytes, options);
      e.session_create_s = (performance.now() - t1) / 1000; // a failed creation has no creation time
    } finally {
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
    timeStats(e);
    await sleep(200); // queued uncaptured-error events arrive before the run is judged
    e.gpu_errors = gpuErrors.slice(before);
    await judgeOnServer(e, m, session.inputNames[0], tensor, outs, session.outputNames);
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
  if (v === null || v === undefined) return '-';
  if (Number.isInteger(v)) return String(v);
  if (typeof v === 'number') return Math.abs(v) > 0 && Math.abs(v) < 1e-3 ? v.toExponential(2) : v.toFixed(digits);
  return String(v);
}

/** A verdict from the server (deform_surgeon/checks/verdict.py): its short text, green when it passed. */
function verdictCell(v) {
  if (!v) return '-';
  return `<span class="${v.passed ? 'good' : 'bad'}" title="${esc(v.text)}">${esc(v.short)}</span>`;
}

/** A model's errors: its run's (unless it only repeats the first uncaptured one), then the uncaptured ones. */
function modelErrors(e) {
  const own = e.error && !e.error.startsWith(UNCAPTURED) ? splitErrors(e.error) : [];
  return [...own, ...e.gpu_errors];
}

/** The errors of a model, each distinct one once with its count (the full text is in the results JSON). */
function errorsCell(e) {
  return summarizeErrors(modelErrors(e)).map((x) => `<span class="bad">${esc(x)}</span>`).join('<br>');
}

/** The table; an entry that has not run (`ran` false: no WebGPU, or before the first run) shows '-' throughout. */
function showTable(entries) {
  const ran = (fn) => (e) => (e.ran ? fn(e) : '-');
  const rows = [
    ['file', (e) => esc(e.file)],
    [state.bundle === 'wasm' ? 'runs on the wasm backend without error' : 'runs on WebGPU without error',
      ran((e) => (e.outputs.length && !e.gpu_errors.length
      ? '<span class="good">yes</span>' : '<span class="bad">NO</span>'))],
    ['model download (s)', ran((e) => fmt(e.fetch_s))],
    ['session creation (s)', ran((e) => fmt(e.session_create_s))],
    ['first run (ms)', ran((e) => fmt(e.first_run_ms, 1))],
    ['warm runs: min (ms)', ran((e) => fmt(e.min_ms, 1))],
    ['warm runs: median (ms)', ran((e) => fmt(e.median_ms, 1))],
    ['nodes after ORT\'s optimisation', ran((e) => fmt(e.placement && e.placement.total_nodes))],
    ['CPU nodes', ran((e) => fmt(e.placement && e.placement.cpu_nodes))],
    ['Memcpy nodes (CPU↔GPU copies)', ran((e) => fmt(e.placement && e.placement.memcpy))],
    ['WebGPU errors', ran((e) => fmt(e.gpu_errors.length))],
    ['outputs vs ORT CPU', ran((e) => verdictCell(e.verdict_vs_cpu))],
    ['outputs vs the original (same page)', ran((e) => verdictCell(e.verdict_vs_original))],
    ['errors (full text in the results JSON)', ran(errorsCell)],
    ['find where it goes wrong', ran((e) => (e.ok || !e.bisect_command ? '' : `<code>${esc(e.bisect_command)}</code>`))],
  ];
  let html = `<tr><th></th>${entries.map((e) => `<th>${esc(e.label)}</th>`).join('')}</tr>`;
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
    $('no-webgpu').hidden = false;
    $('no-webgpu').textContent = `${NO_WEBGPU} ${ENABLE_WEBGPU}`;
    return;
  }
  const keys = Object.keys(a.limits);
  $('adapter').innerHTML = `<div class="row"><div><p>vendor <b>${esc(a.vendor || '?')}</b>, architecture
    <b>${esc(a.architecture || '?')}</b>, device ${esc(a.device || '?')} ${a.description ? `(${esc(a.description)})` : ''},
    fallback adapter:
    <b>${a.isFallbackAdapter}</b>, ${a.features.length} features (shader-f16: ${a.features.includes('shader-f16')})</p>
    <p>device profile <b>${esc(profile.name)}</b>: ${esc(profile.source)}</p></div>
    <table><tr><th>limit</th><th>adapter</th><th>requested for ORT's device</th></tr>
    ${keys.map((k) => `<tr><td>${k}</td><td>${a.limits[k]}</td><td>${applied ? applied[k] : '-'}</td></tr>`).join('')}
    </table></div>`;
  if (isSoftware(a)) {
    $('software').hidden = false;
    $('software').textContent = 'This is a software adapter (' + [a.vendor, a.architecture, a.description]
      .filter(Boolean).join(', ') + '): the GPU is emulated on the CPU, so the timings on this page are NOT GPU '
      + 'timings. Open the page in a browser on a machine with a GPU to measure those.';
  }
}

const state = { config: null, bundle: null, image: null, imageName: null, imageError: null, result: null,
  canRun: null };

/** "run" is enabled only when the page can run (WebGPU and ORT are there) and the current image decoded. */
function updateRun() {
  $('run').disabled = Boolean(state.canRun || state.imageError) || !state.image;
  window.__serveState = { runDisabled: $('run').disabled, status: $('status').textContent, image: state.imageName,
    imageError: state.imageError };
}

async function main() {
  const config = await (await fetchOk('/config.json')).json();
  const probe = await adapterInfo();
  // Without WebGPU every bundle's models run where the page's user's would: on the wasm backend.
  const bundle = probe.adapter ? params.get('bundle') || config.default_bundle : 'wasm';
  Object.assign(state, { config, bundle });
  const one = config.models.length === 1;
  const title = one ? `deform-surgeon serve: ${config.models[0].name} on this GPU`
    : 'deform-surgeon serve: original and patched on this GPU';
  $('title').textContent = title;
  document.title = title;
  if (one) {
    $('one-model').hidden = false;
    $('one-model').textContent = 'One model. To see it beside its patched version: deform-surgeon patch MODEL.onnx '
      + 'MODEL.patched.onnx, then deform-surgeon serve MODEL.onnx MODEL.patched.onnx.';
  }
  for (const b of config.bundles) $('bundle').add(new Option(BUNDLE_LABELS[b] || b, b, false, b === bundle));
  $('bundle').onchange = () => {
    params.set('bundle', $('bundle').value);
    params.delete('autorun');
    location.search = params.toString(); // one bundle per page load: ORT and the device hooks load once
  };
  if (bundle === 'jsep') {
    $('jsep-note').hidden = false;
    $('jsep-note').textContent = JSEP_NOTE;
  }
  if (bundle === 'transformers') { // the call a user writes, and the folder each model is loaded from
    $('jsep-note').hidden = false;
    $('jsep-note').textContent = 'transformers.js, as your page calls it: '
      + config.models.map((m) => `${m.label}: const pipe = await ${pipelineCall(m.folder.dtype)} `
        + `with MODEL the folder ${m.folder.root} (file onnx/${m.folder.file}.onnx); `
        + 'const cutout = await pipe(image)').join('. ');
  }
  const input = config.models[0].inputs[0];
  for (const [id, d] of [['height', input.dims[2]], ['width', input.dims[3]]]) {
    $(id).value = d ?? 1024;
    $(id).disabled = d !== null; // fixed by the model
  }
  const blank = config.models.map((m) => ({ label: m.label, file: m.name, ran: false }));
  showTable(blank);

  const software = isSoftware(probe.adapter);
  const onCpu = software || bundle === 'wasm'; // timings of a CPU, not of a GPU
  const runsDefault = config.runs ?? config.default_runs[onCpu ? 'software' : 'hardware'];
  $('runs').value = params.get('runs') || runsDefault;
  $('runs-note').textContent = config.runs ? `warm runs: ${config.runs} (serve --runs)`
    : `warm runs: ${runsDefault} by default on ${bundle === 'wasm' ? 'the wasm backend, whose timings are CPU timings'
      : software ? 'a software adapter, whose timings are not GPU timings' : 'a hardware adapter'} (serve --runs N, `
      + 'or the field above, for more)';
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

  let ort = null;
  let tjs = null;
  if (bundle === 'transformers') {
    progress('importing /transformers/transformers.js');
    tjs = await loadTransformers('/ort-transformers/');
  } else {
    progress(`importing /ort/${BUNDLES[bundle].file}`);
    ort = await import(`/ort/${BUNDLES[bundle].file}`);
    ort.env.wasm.wasmPaths = '/ort/';
    ort.env.wasm.numThreads = 1; // no cross-origin isolation on this page
    ort.env.logLevel = 'verbose';
    if (BUNDLES[bundle].debug) ort.env.debug = true; // JSEP: a WGSL compile failure rejects session.run()
  }

  const modelSize = () => [Number($('width').value), Number($('height').value)];
  const showInput = () => {
    if (!state.image) return null;
    const [W, H] = modelSize();
    const lb = letterbox(state.image, W, H);
    const { naturalWidth: iw, naturalHeight: ih } = state.image;
    figure('input', lb.canvas, `input: ${state.imageName}`);
    $('letterbox').textContent = `${state.imageName} (${iw}×${ih}) keeps its aspect ratio: scaled by `
      + `${lb.rect.scale.toFixed(3)} to ${lb.rect.w}×${lb.rect.h} and letterboxed into the model's ${W}×${H} input `
      + `(bars: the ImageNet mean). The masks and cutouts below are at the image's own size, ${iw}×${ih}.`;
    return lb;
  };
  const setImage = async (src, name) => {
    document.body.dataset.image = 'loading';
    try {
      state.image = await loadImage(src);
      state.imageName = name;
      state.imageError = null;
      showInput();
      clearFigures();
      progress(state.canRun ? `cannot run: ${state.canRun}` : 'ready');
    } catch (err) {
      state.image = null;
      state.imageName = name;
      state.imageError = `${name} cannot be decoded as an image (${errorText(err)}): choose another image`;
      $('file').value = ''; // the picker must not go on naming a file the page will not run
      const blankInput = canvasOf(1, 1);
      figure('input', blankInput, `input: none (${name} is not an image)`);
      $('letterbox').textContent = '';
      clearFigures();
      progress(state.imageError);
    } finally {
      updateRun();
      document.body.dataset.image = state.imageError ? 'bad' : 'ok';
    }
  };
  await setImage(config.image.url, config.image.name);
  const pick = (f) => f && setImage(URL.createObjectURL(f), f.name);
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
    if (state.canRun || state.imageError || !state.image) {
      throw new Error(state.canRun ? `cannot run: ${state.canRun}` : state.imageError || 'no image');
    }
    $('run').disabled = true;
    const [W, H] = modelSize();
    const runs = Math.max(1, Number($('runs').value) || 1);
    const img = state.image;
    const lb = showInput();
    clearFigures();
    const tensor = tjs ? null : inputTensor(ort, input, lb.pixels, W, H, $('normalize').checked);
    const { naturalWidth: iw, naturalHeight: ih } = img;
    const stem = state.imageName.replace(/\.[^.]*$/, '').replace(/[^\w.-]+/g, '_') || 'image';
    const entries = blank.map((b) => ({ ...b }));
    if (tjs) {
      $('letterbox').textContent = `transformers.js preprocesses ${state.imageName} (${iw}×${ih}) itself, as its `
        + "preprocessor_config.json says; the masks and cutouts below are the pipeline's, at the image's own size.";
    }
    for (const [k, m] of config.models.entries()) {
      if (tjs) {
        const { entry, cut } = await runPipeline(tjs, m, img.src, runs);
        entries[k] = { ...entry, ran: true, image_outputs: [] };
        if (cut) {
          const alpha = alphaOf(cut);
          figure(`${m.label}-mask`, greyCanvas(Float32Array.from(alpha, (v) => v / 255), cut.width, cut.height),
            `${m.label}: the pipeline's mask, ${cut.width}×${cut.height}`, `${stem}.${m.label}.mask.png`);
          const shown = canvasOf(cut.width, cut.height); // (toCanvas() may be an OffscreenCanvas: not on the page)
          shown.getContext('2d').drawImage(cut.toCanvas(), 0, 0);
          figure(`${m.label}-cutout`, shown, `${m.label}: the pipeline's cutout (its returned picture)`,
            `${stem}.${m.label}.cutout.png`);
          entries[k].image_outputs.push({ kind: 'mask', width: cut.width, height: cut.height,
            file: `${stem}.${m.label}.mask.png` }, { kind: 'cutout', width: cut.width, height: cut.height,
            file: `${stem}.${m.label}.cutout.png` });
        }
        showTable(entries);
        continue;
      }
      const { entry, picture: pic } = await runModel(ort, m, tensor, runs);
      entries[k] = { ...entry, ran: true, image_outputs: [] };
      if (pic) {
        const full = atImageSize(pic, lb.rect, W, H, iw, ih);
        const isMask = pic.kind.startsWith('mask');
        const what = isMask ? 'mask' : 'output';
        figure(`${m.label}-${what}`, full, `${m.label}: ${pic.kind}, at the image's size ${iw}×${ih}`,
          `${stem}.${m.label}.${what}.png`);
        entries[k].image_outputs.push({ kind: what, width: iw, height: ih, file: `${stem}.${m.label}.${what}.png` });
        if (isMask) {
          figure(`${m.label}-cutout`, cutout(img, full), `${m.label}: cutout (the image, the mask as alpha)`,
            `${stem}.${m.label}.cutout.png`);
          entries[k].image_outputs.push({ kind: 'cutout', width: iw, height: ih,
            file: `${stem}.${m.label}.cutout.png` });
        }
      }
      showTable(entries);
    }
    $('legend').textContent = 'Verdicts: byte-identical (max |diff| 0); agrees with ORT CPU within the GPU tolerance '
      + `(float32 ${config.tolerance.float32}, float16 ${config.tolerance.float16}: GPU kernels add in another `
      + 'order); or differs (max |diff| > tolerance). The patched model is held to byte identity with the original '
      + 'on this page (tolerance 0). Hover a verdict for its full text.';
    state.result = {
      tool: 'deform-surgeon serve',
      generated_at: new Date().toISOString(),
      ok: entries.every((e) => e.ok) && entries.every((e) => !e.verdict_vs_original || e.verdict_vs_original.passed),
      software_adapter: software,
      no_webgpu: !probe.adapter, // the page fell back to the wasm backend
      timing_note: 'Timings are GPU timings only on a hardware adapter; on a software adapter (SwiftShader, '
        + 'fallback) they are not GPU timings.',
      adapter: probe.adapter,
      adapter_note: probe.error,
      profile: config.profile,
      applied_limits: applied,
      bundle,
      bundle_file: BUNDLES[bundle].file,
      ort_env_debug: { session_and_first_run: Boolean(BUNDLES[bundle].debug), timed_runs: false },
      versions: { ...config.versions, 'onnxruntime-web (page)': tjs ? tjs.env.backends.onnx.versions?.web ?? null
        : ort.env.versions ? ort.env.versions.web : null, ...(tjs ? { 'transformers.js': tjs.env.version } : {}),
      browser: navigator.userAgent },
      image: { name: state.imageName, width: iw, height: ih, normalize: $('normalize').checked
        ? { mean: MEAN, std: STD } : null,
      letterbox: { into: [H, W], x: lb.rect.x, y: lb.rect.y, width: lb.rect.w, height: lb.rect.h,
        scale: lb.rect.scale, fill_rgb: FILL } },
      input: tjs ? { name: input.name, preprocessed_by: 'transformers.js' }
        : { name: input.name, dtype: tensor.type, dims: Array.from(tensor.dims) },
      runs,
      tolerance: config.tolerance,
      models: entries,
      gpu_errors: gpuErrors.slice(),
    };
    window.__serveResult = state.result;
    $('download').disabled = false;
    updateRun();
    progress(state.result.ok ? 'done' : 'done, with failures (see the table)');
  };
  $('run').onclick = () => run().catch((e) => {
    progress(`failed: ${errorText(e)}`);
    updateRun();
  });
  $('download').onclick = () => {
    const a = document.createElement('a');
    a.href = URL.createObjectURL(new Blob([JSON.stringify(state.result, null, 1)], { type: 'application/json' }));
    a.download = 'deform-surgeon-serve-results.json';
    a.click();
  };
  if (state.canRun) progress(`cannot run: ${state.canRun}`);
  updateRun();
  document.body.dataset.ready = '1';
  if (params.get('autorun') === '1') {
    await run().catch((e) => {
      window.__serveResult = { ok: false, error: errorText(e), models: [], adapter: probe.adapter,
        adapter_note: probe.error, bundle, profile: config.profile };
    });
    window.__serveDone = true;
  }
}

main().catch((e) => {
  progress(`page failed: ${errorText(e)}`);
  window.__serveResult = { ok: false, error: `page failed: ${errorText(e)}`, models: [] };
  window.__serveDone = true;
});
