// Runs inside headless Chromium (served by browser_harness.mjs from 127.0.0.1): loads an onnxruntime-web bundle,
// creates a session on WebGPU (or on the wasm CPU backend) with the verbose log on, optionally runs it, and returns a JSON-able result.
// The WebGPU device hooks (uncaptured errors, device profile) are in browser_device.mjs, shared with `serve`'s page.

import { adapterInfo, applyProfile, gpuErrors, hookDevices } from '/browser_device.mjs';
import { createTimed, errorText, runOnce } from '/harness_node_and_page.mjs';
import { watchWasmHeap } from '/wasm_heap.mjs';

window.__gpuErrors = gpuErrors;

function progress(text) {
  console.log(`@@progress ${text}`);
}

async function fetchBytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`GET ${url}: HTTP ${r.status}`);
  return r.arrayBuffer();
}

/** cfg: {bundle, bundleFile, debug, run, limits, externalData: [path], inputs: [{name, dtype, dims, file}]} */
window.runHarness = async function runHarness(cfg) {
  const result = { session_ok: false, error: null, adapter: null, adapter_note: null, timings: {}, run: null, versions: {},
    applied_limits: null };
  const probe = await adapterInfo();
  result.adapter = probe.adapter;
  if (probe.error) result.adapter_note = probe.error;
  if (cfg.limits && probe.adapter) {
    result.applied_limits = applyProfile(await navigator.gpu.requestAdapter(), cfg.limits);
  }
  hookDevices(); // after applyProfile: every device the page creates reports its errors

  if (cfg.bundle === 'transformers') {
    const { runTransformers } = await import('/transformers_page.mjs');
    const pipe = await runTransformers(cfg, result, progress, gpuErrors);
    result.gpu_errors = gpuErrors.slice();
    try {
      await pipe?.dispose();
    } catch {
      // release errors do not change the measurement
    }
    return result;
  }

  const onWasm = cfg.bundle === 'wasm';
  const heap = onWasm ? watchWasmHeap() : null; // before the import: the bundle creates its heap as it loads
  progress(`importing /ort/${cfg.bundleFile}`);
  const ort = await import(`/ort/${cfg.bundleFile}`);
  result.versions['onnxruntime-web'] = ort.env.versions ? ort.env.versions.web || ort.env.versions.common : null;
  ort.env.wasm.wasmPaths = '/ort/';
  ort.env.wasm.numThreads = 1; // no cross-origin isolation on this page, and one thread keeps the log ordered
  ort.env.wasm.proxy = false;
  ort.env.logLevel = 'verbose';
  if (cfg.debug) ort.env.debug = true; // JSEP: makes shader compile failures reject session.run()

  progress('fetching model');
  const model = new Uint8Array(await fetchBytes('/model.onnx'));
  const options = {
    executionProviders: [onWasm ? 'wasm' : 'webgpu'],
    logSeverityLevel: 0,
    logVerbosityLevel: 0,
    ...(cfg.sessionOptions || {}),
  };
  if (cfg.externalData && cfg.externalData.length) {
    options.externalData = cfg.externalData.map((p) => ({ path: p, data: `/external/${encodeURI(p)}` }));
  }
  progress(`creating session (${cfg.bundle} bundle)`);
  const session = await createTimed(() => ort.InferenceSession.create(model, options), result, progress);
  result.gpu_errors_after_session = gpuErrors.slice();
  if (heap) result.wasm_heap = { after_session: heap() };

  if (session && cfg.run) {
    result.run = { ok: false, error: null, outputs: {}, gpu_errors: [] };
    const before = gpuErrors.length;
    try {
      const read = (m) => fetchBytes(`/io/${encodeURIComponent(m.file)}`);
      const upload = async (file, bytes, name) => {
        const r = await fetch(`/upload/${file}`, { method: 'POST', body: bytes });
        if (!r.ok) throw new Error(`upload of ${name} failed: HTTP ${r.status}`);
      };
      await runOnce(ort, session, cfg.inputs, read, upload, progress, result);
      result.run.ok = true;
      progress(`run finished in ${result.timings.run_s.toFixed(2)} s`);
    } catch (e) {
      result.run.error = errorText(e);
      progress('run failed');
    }
    // Let queued uncaptured-error events arrive before judging the run.
    await new Promise((r) => setTimeout(r, 200));
    result.run.gpu_errors = gpuErrors.slice(before);
    if (heap) result.wasm_heap.after_run = heap();
  }
  if (session) {
    try {
      await session.release();
    } catch {
      // release errors do not change the measurement
    }
  }
  result.gpu_errors = gpuErrors.slice();
  return result;
};

window.__harnessReady = true;
