// Measures placement (and optionally runs) a model in headless Chromium with an onnxruntime-web bundle.
//
// Usage: node browser_harness.mjs --model M.onnx --out RESULT.json --bundle webgpu|jsep|all|wasm
//          [--io DIR --run] [--user-data-dir DIR] [--chromium /usr/bin/chromium] [--external '["a.data"]']
//          [--limits '{"maxStorageBuffersPerShaderStage": 8, ...}']  (the device profile to apply)
//          [--session-options JSON]  (more options for InferenceSession.create, as a page passes them)
//          [--jsep-debug 0|1]  (default 1 for the JSEP bundles jsep/all: ort.env.debug = true)
//          [--watch-stdin]     (stop everything when stdin closes: the Python caller died)
//        --bundle transformers --folder DIR --model-file NAME --dtype D
//                              (transformers.js's pipeline on the model folder DIR: config.json, onnx/NAME.onnx)
//
// Why this shape: the console of the page carries ORT's verbose log (as messages of type `error`), so every
// console message is forwarded unchanged to stderr, one line per line, for the Python parser; progress goes to
// stdout; the structured result to --out. The model, the bundle and the page come from an HTTP server bound to
// 127.0.0.1 on a free port, because module workers/wasm need http(s) and nothing may listen beyond loopback.
// Browser, server and temp profile are torn down on every exit path (normal, error, SIGINT, SIGTERM).
import fs from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import {
  errorText,
  chromiumPeakMemory,
  launchChromium,
  newResult,
  parseArgs,
  progress,
  readInputsMeta,
  RUNTIMES_DIR,
  watchParent,
  writeResult,
} from './harness_node.mjs';
import { BUNDLES } from './harness_node_and_page.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));

const MIME = {
  '.html': 'text/html; charset=utf-8',
  '.mjs': 'text/javascript; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.wasm': 'application/wasm',
  '.json': 'application/json',
  '.map': 'application/json',
};

/** Resolves `rel` inside `root` and refuses anything that escapes it. */
function inside(root, rel) {
  const p = path.resolve(root, rel);
  const r = path.resolve(root);
  if (p !== r && !p.startsWith(r + path.sep)) return null;
  return p;
}

function serveFile(res, file) {
  fs.stat(file, (err, st) => {
    if (err || !st.isFile()) {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, {
      'Content-Type': MIME[path.extname(file)] || 'application/octet-stream',
      'Content-Length': st.size,
      'Cache-Control': 'no-store',
    });
    fs.createReadStream(file).pipe(res);
  });
}

function startServer({ model, ortDist, io, external, folder, transformersDist }) {
  const modelDir = path.dirname(path.resolve(model));
  const externalSet = new Set(external);
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://127.0.0.1');
    const p = decodeURIComponent(url.pathname);
    if (req.method === 'POST' && p.startsWith('/upload/')) {
      const name = p.slice('/upload/'.length);
      if (!io || !/^out_\d+\.bin$/.test(name)) {
        res.writeHead(403).end();
        return;
      }
      const ws = fs.createWriteStream(path.join(io, name));
      req.pipe(ws);
      ws.on('finish', () => res.writeHead(200).end('ok'));
      ws.on('error', (e) => res.writeHead(500).end(String(e)));
      return;
    }
    if (req.method !== 'GET') {
      res.writeHead(405).end();
      return;
    }
    if (p === '/' || p === '/page.html') return serveFile(res, path.join(HERE, 'page.html'));
    if (p === '/browser_page.mjs') return serveFile(res, path.join(HERE, 'browser_page.mjs'));
    if (p === '/harness_node_and_page.mjs') return serveFile(res, path.join(HERE, 'harness_node_and_page.mjs'));
    if (p === '/browser_device.mjs') return serveFile(res, path.join(HERE, 'browser_device.mjs'));
    if (p === '/wasm_heap.mjs') return serveFile(res, path.join(HERE, 'wasm_heap.mjs'));
    if (p === '/transformers_page.mjs') return serveFile(res, path.join(HERE, 'transformers_page.mjs'));
    if (p.startsWith('/transformers/') && transformersDist) {
      const f = inside(transformersDist, p.slice('/transformers/'.length));
      return f ? serveFile(res, f) : res.writeHead(403).end();
    }
    if (p.startsWith('/models/model/') && folder) { // the model folder, as transformers.js's localModelPath
      const f = inside(folder, p.slice('/models/model/'.length));
      return f ? serveFile(res, f) : res.writeHead(403).end();
    }
    if (p === '/model.onnx') return serveFile(res, path.resolve(model));
    if (p === '/favicon.ico') return res.writeHead(204).end();
    if (p.startsWith('/ort/')) {
      const f = inside(ortDist, p.slice(5));
      return f ? serveFile(res, f) : res.writeHead(403).end();
    }
    if (p.startsWith('/external/')) {
      const rel = p.slice('/external/'.length);
      const f = externalSet.has(rel) ? inside(modelDir, rel) : null;
      return f ? serveFile(res, f) : res.writeHead(403).end();
    }
    if (p.startsWith('/io/') && io) {
      const f = inside(io, p.slice(4));
      return f ? serveFile(res, f) : res.writeHead(403).end();
    }
    res.writeHead(404).end();
  });
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => resolve(server)); // port 0: the OS picks a free port
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  if (!args.model || !args.out) throw new Error('--model and --out are required');
  const bundleName = args.bundle || 'webgpu';
  const bundle = BUNDLES[bundleName];
  if (!bundle) throw new Error(`unknown --bundle ${bundleName} (webgpu|jsep|all|wasm)`);
  // onnxruntime-web's "exports" hide package.json and dist/, so locate it on disk in the runtimes folder.
  const transformersDir = path.join(RUNTIMES_DIR, 'node_modules', '@huggingface', 'transformers');
  const ortWebDir = bundleName === 'transformers' // transformers.js bundles its own onnxruntime-web (its wasm here)
    ? path.join(transformersDir, 'node_modules', 'onnxruntime-web')
    : path.join(RUNTIMES_DIR, 'node_modules', 'onnxruntime-web');
  const ortDist = path.join(ortWebDir, 'dist');
  const ortWebVersion = JSON.parse(fs.readFileSync(path.join(ortWebDir, 'package.json'), 'utf8')).version;
  const external = args.external ? JSON.parse(args.external) : [];
  const io = args.io ? path.resolve(args.io) : null;

  const result = newResult({
    runtime: 'browser',
    bundle: bundleName,
    bundle_file: bundle.file,
    versions: { 'onnxruntime-web': ortWebVersion },
  });
  result.page_errors = [];
  result.gpu_errors = [];

  let server = null;
  let context = null;
  let ownProfile = null;
  let finished = false;

  const cleanup = async () => {
    if (context) {
      const c = context;
      context = null;
      try {
        await c.close();
      } catch {
        // the browser may already be gone
      }
    }
    if (server) {
      const s = server;
      server = null;
      s.closeAllConnections?.();
      await new Promise((r) => s.close(() => r()));
    }
    if (ownProfile) {
      fs.rmSync(ownProfile, { recursive: true, force: true });
      ownProfile = null;
    }
  };

  const onSignal = (sig) => {
    if (finished) return;
    finished = true;
    result.error = result.error || `harness interrupted by ${sig}`;
    if (result.run && !result.run.ok && !result.run.error) result.run.error = `interrupted by ${sig}`;
    progress(`interrupted by ${sig}; closing browser`);
    const hardStop = setTimeout(() => process.exit(130), 5000);
    cleanup()
      .catch(() => {})
      .finally(() => {
        clearTimeout(hardStop);
        try {
          writeResult(args.out, result);
        } catch {
          // best effort
        }
        process.exit(130);
      });
  };
  process.on('SIGINT', () => onSignal('SIGINT'));
  process.on('SIGTERM', () => onSignal('SIGTERM'));
  process.on('SIGHUP', () => onSignal('SIGHUP'));
  if (args['watch-stdin']) watchParent(() => onSignal('end of stdin (parent exited)'));

  try {
    progress('starting local HTTP server on 127.0.0.1');
    const tjs = bundleName === 'transformers';
    if (tjs && !args.folder) throw new Error('--bundle transformers needs --folder');
    server = await startServer({
      model: args.model, ortDist, io, external,
      folder: tjs ? path.resolve(args.folder) : null,
      transformersDist: tjs ? path.join(transformersDir, 'dist') : null,
    });
    if (tjs) {
      const pkg = JSON.parse(fs.readFileSync(path.join(transformersDir, 'package.json'), 'utf8'));
      result.versions['transformers.js'] = pkg.version;
    }
    const origin = `http://127.0.0.1:${server.address().port}`;

    let userDataDir = args['user-data-dir'];
    if (!userDataDir) {
      ownProfile = fs.mkdtempSync(path.join(os.tmpdir(), 'ds-chromium-'));
      userDataDir = ownProfile;
    }
    progress('launching headless chromium');
    const t0 = performance.now();
    context = await launchChromium(userDataDir, args.chromium);
    result.timings.browser_launch_s = (performance.now() - t0) / 1000;
    result.versions.chromium = context.browser()?.version() ?? null;
    const page = context.pages()[0] || (await context.newPage());
    let phase = 'session';
    const consoleRunGpuErrors = [];
    page.on('console', (msg) => {
      const text = msg.text();
      if (text.startsWith('@@progress ')) {
        const t = text.slice('@@progress '.length);
        if (t === 'running inference') phase = 'run';
        progress(t);
        return;
      }
      if (/uncaught WebGPU|WebGPU (validation|out-of-memory|internal) error/i.test(text)) {
        result.gpu_errors.push(text);
        if (phase === 'run') consoleRunGpuErrors.push(text);
      }
      fs.writeSync(2, text.endsWith('\n') ? text : `${text}\n`);
    });
    page.on('pageerror', (err) => {
      const t = `uncaught exception in page: ${err && err.stack ? err.stack : err}`;
      result.page_errors.push(t);
      fs.writeSync(2, `${t}\n`);
    });
    page.on('crash', () => {
      result.page_errors.push('page crashed');
    });
    progress(`opening ${origin}/page.html`);
    await page.goto(`${origin}/page.html`);
    await page.waitForFunction(() => window.__harnessReady === true, null, { timeout: 30000 });
    const cfg = {
      bundle: bundleName,
      bundleFile: bundle.file,
      // --jsep-debug 0 exists only to demonstrate the silent failure mode; the default is the safe setting.
      debug: args['jsep-debug'] === undefined ? bundle.debug : args['jsep-debug'] !== '0',
      run: Boolean(args.run),
      // The device profile: the page requests its device with these limits and reports them as the adapter's.
      limits: args.limits ? JSON.parse(args.limits) : null,
      externalData: external,
      inputs: args.run && bundleName !== 'transformers' ? readInputsMeta(io) : [],
      modelFile: args['model-file'],
      userDtype: args.dtype,
      // more session options, as a page passes them (e.g. '{"graphOptimizationLevel": "disabled"}')
      sessionOptions: args['session-options'] ? JSON.parse(args['session-options']) : null,
    };
    const r = await page.evaluate((c) => window.runHarness(c), cfg);
    result.peak_rss_mib = chromiumPeakMemory(userDataDir); // before the browser closes: its processes' peaks
    const consoleGpuErrors = result.gpu_errors;
    const before = { versions: result.versions, timings: result.timings, adapter_note: result.adapter_note };
    Object.assign(result, r);
    result.versions = { ...before.versions, ...(r.versions || {}) };
    result.timings = { ...before.timings, ...(r.timings || {}) };
    // union of errors seen by the device hook and Chrome's console reports
    result.gpu_errors = [...(r.gpu_errors || []), ...consoleGpuErrors];
    if (result.run && consoleRunGpuErrors.length) {
      result.run.gpu_errors = [...(result.run.gpu_errors || []), ...consoleRunGpuErrors];
    }
  } catch (e) {
    result.error = result.error || `harness: ${errorText(e)}`;
  } finally {
    if (!finished) {
      finished = true;
      await cleanup();
      writeResult(args.out, result);
    } else {
      // A signal handler owns the shutdown (it writes the result and exits); do not race it to process.exit.
      await new Promise(() => {});
    }
  }
}

main().then(
  () => process.exit(0),
  (e) => {
    // A harness bug (not a model failure): leave a result behind so the caller can report it verbatim.
    try {
      const out = parseArgs(process.argv.slice(2)).out;
      if (out && !fs.existsSync(out)) {
        writeResult(out, { runtime: 'browser', session_ok: false, error: `harness error: ${e && e.stack ? e.stack : e}` });
      }
    } catch {
      // nothing more to do
    }
    process.stderr.write(`harness error: ${e && e.stack ? e.stack : e}\n`);
    process.exit(3);
  },
);
