// Runs inside headless Chromium (served by browser_harness.mjs, `--bundle transformers`): loads a model folder the
// way a page that uses transformers.js does, `pipeline('background-removal', MODEL, {device: 'webgpu', dtype})`,
// with ORT's verbose log on through the pipeline's own `session_options`, and optionally runs the pipeline once.
//
// Why the pipeline and not a session of our own: most pages run BiRefNet through transformers.js, which picks the
// file by dtype, fetches external data only when config.json says so, and runs its own onnxruntime-web build
// (bundled inside transformers.js). A model that loads with plain onnxruntime-web can still fail there.
//
// The file is chosen with `model_file_name` (`onnx/model_fp16.onnx` -> 'model_fp16', dtype 'fp32': the same file,
// session options and external data as `dtype: 'fp16'`), so a float16 file is placed even on an adapter without
// `shader-f16`, where transformers.js refuses dtype 'fp16' before it loads anything.
//
// With a run, the one inference of `pipe(image)` is observed at its session: the preprocessed input, every output
// and the mask (the alpha channel of the returned image) are uploaded for the Python side, which runs ORT CPU on
// the same preprocessed input.

import { errorText, bytesOfData } from '/harness_node_and_page.mjs';

const MODEL_ID = 'model'; // served at /models/model/ (config.json, preprocessor_config.json, onnx/...)

async function upload(file, bytes) {
  const r = await fetch(`/upload/${file}`, { method: 'POST', body: bytes });
  if (!r.ok) throw new Error(`upload of ${file} failed: HTTP ${r.status}`);
}

/**
 * cfg: {modelFile, dtype, userDtype, run}; fills `result` as browser_page.mjs's runHarness does for onnxruntime-web
 * (`gpuErrors`: the page's list of uncaptured WebGPU errors, which a run must not add to). Returns the pipeline.
 */
export async function runTransformers(cfg, result, progress, gpuErrors) {
  progress('importing /transformers/transformers.js');
  const { pipeline, env, RawImage } = await import('/transformers/transformers.js');
  result.versions['transformers.js'] = env.version;
  result.versions['onnxruntime-web'] = env.backends.onnx.versions?.web ?? null;
  env.allowRemoteModels = false; // the local folder only: nothing is fetched from a model hub
  env.allowLocalModels = true;
  env.localModelPath = '/models/';
  env.useBrowserCache = false;
  env.useWasmCache = false;
  const wasm = env.backends.onnx.wasm; // the bundled onnxruntime-web's own settings (its files are served at /ort/)
  wasm.wasmPaths = {
    mjs: '/ort/ort-wasm-simd-threaded.asyncify.mjs',
    wasm: '/ort/ort-wasm-simd-threaded.asyncify.wasm',
  };
  wasm.numThreads = 1; // no cross-origin isolation on this page, and one thread keeps the log ordered
  env.backends.onnx.setLogLevel(10); // transformers.js's DEBUG: onnxruntime-web's 'verbose'

  const options = {
    device: 'webgpu',
    dtype: cfg.dtype,
    model_file_name: cfg.modelFile,
    session_options: { logSeverityLevel: 0, logVerbosityLevel: 0 },
  };
  result.call = `pipeline('background-removal', MODEL, {device: 'webgpu', dtype: '${cfg.userDtype}'})`;
  progress(`creating the pipeline (${result.call}, file onnx/${cfg.modelFile}.onnx)`);
  const t0 = performance.now();
  let pipe = null;
  try {
    pipe = await pipeline('background-removal', MODEL_ID, options);
    result.session_ok = true;
  } catch (e) {
    result.error = errorText(e);
  }
  result.timings.session_create_s = (performance.now() - t0) / 1000;
  progress(`session ${result.session_ok ? 'created' : 'failed'} in ${result.timings.session_create_s.toFixed(2)} s`);
  result.gpu_errors_after_session = gpuErrors.slice();
  if (!pipe || !cfg.run) return pipe;

  result.run = { ok: false, error: null, outputs: {}, feeds: {}, mask: null, gpu_errors: [] };
  try {
    const session = pipe.model.sessions.model;
    const seen = {};
    const run = session.run.bind(session);
    const copy = (tensors) => Object.fromEntries(Object.entries(tensors).map(
      ([name, t]) => [name, { type: t.type, dims: t.dims, data: t.data.slice() }])); // the pipeline edits in place
    session.run = async (feeds, ...rest) => {
      seen.feeds = copy(feeds);
      const outputs = await run(feeds, ...rest);
      seen.outputs = copy(outputs);
      return outputs;
    };
    const image = await RawImage.fromURL('/io/image.png');
    progress('running inference');
    const t1 = performance.now();
    const cut = await pipe(image);
    result.timings.run_s = (performance.now() - t1) / 1000;
    let i = 0;
    for (const [where, tensors] of [['feeds', seen.feeds], ['outputs', seen.outputs]]) {
      for (const [name, t] of Object.entries(tensors)) {
        const file = `out_${i++}.bin`;
        await upload(file, bytesOfData(t.data));
        result.run[where][name] = { dtype: t.type, dims: Array.from(t.dims), file };
      }
    }
    const alpha = new Uint8Array(cut.width * cut.height);
    for (let p = 0; p < alpha.length; p++) alpha[p] = cut.data[p * cut.channels + cut.channels - 1];
    const file = `out_${i++}.bin`;
    await upload(file, alpha);
    result.run.mask = { dims: [cut.height, cut.width], channels: cut.channels, file };
    result.run.ok = true;
    progress(`run finished in ${result.timings.run_s.toFixed(2)} s`);
  } catch (e) {
    result.run.error = errorText(e);
    progress('run failed');
  }
  await new Promise((r) => setTimeout(r, 200)); // let queued uncaptured-error events arrive before judging the run
  result.run.gpu_errors = gpuErrors.slice(result.gpu_errors_after_session.length);
  return pipe;
}
