// transformers.js in a page, as pages run BiRefNet with it: `pipeline('background-removal', MODEL, {device:
// 'webgpu', dtype})` on a model folder served at /models/<id>/ (config.json, preprocessor_config.json, onnx/...),
// with ORT's verbose log on through the pipeline's own `session_options`. Shared by the placement harness's page
// (browser_page.mjs, `--bundle transformers`) and `serve`'s page (its transformers bundle).
//
// Why the pipeline and not a session of our own: transformers.js picks the file by dtype, fetches external data
// only when config.json says so, preprocesses the picture itself and runs its own onnxruntime-web build (bundled
// inside transformers.js). A model that loads with plain onnxruntime-web can still fail there.
//
// The file is chosen with `model_file_name` (`onnx/model_fp16.onnx` -> 'model_fp16', dtype 'fp32': the same file,
// session options and external data as `dtype: 'fp16'`), so a float16 file is placed even on an adapter without
// `shader-f16`, where transformers.js refuses dtype 'fp16' before it loads anything.
//
// A run of `pipe(image)` is observed at its session (`observe`): the preprocessed input and every output are copied
// as the session returns them (the pipeline then edits the output in place), so that the caller can run ORT CPU on
// the very input the page ran.

import { bytesOfData, createTimed, errorText } from '/harness_node_and_page.mjs';

/** The call a user writes for this file (the dtype its name says), as the pages show it. */
export function pipelineCall(dtype) {
  return `pipeline('background-removal', MODEL, {device: 'webgpu', dtype: '${dtype}'})`;
}

/** transformers.js, set up to load local folders only (`/models/`), its onnxruntime-web files from `ortBase`. */
export async function loadTransformers(ortBase) {
  const tjs = await import('/transformers/transformers.js');
  const { env } = tjs;
  env.allowRemoteModels = false; // the local folder only: nothing is fetched from a model hub
  env.allowLocalModels = true;
  env.localModelPath = '/models/';
  env.useBrowserCache = false;
  env.useWasmCache = false;
  const wasm = env.backends.onnx.wasm; // the bundled onnxruntime-web's own settings
  wasm.wasmPaths = {
    mjs: `${ortBase}ort-wasm-simd-threaded.asyncify.mjs`,
    wasm: `${ortBase}ort-wasm-simd-threaded.asyncify.wasm`,
  };
  wasm.numThreads = 1; // no cross-origin isolation on these pages, and one thread keeps the log ordered
  env.backends.onnx.setLogLevel(10); // transformers.js's DEBUG: onnxruntime-web's 'verbose'
  return tjs;
}

/** The pipeline of model folder `modelId`'s file onnx/<modelFile>.onnx, its placement in ORT's verbose log. */
export function createPipeline(tjs, modelId, modelFile) {
  return tjs.pipeline('background-removal', modelId, {
    device: 'webgpu',
    dtype: 'fp32', // the file is named by modelFile (see above)
    model_file_name: modelFile,
    session_options: { logSeverityLevel: 0, logVerbosityLevel: 0 },
  });
}

/** Copies of what the pipeline's session is given and returns, filled at each run: {feeds, outputs}. */
export function observe(pipe) {
  const seen = { feeds: null, outputs: null };
  const session = pipe.model.sessions.model;
  const run = session.run.bind(session);
  const copy = (tensors) => Object.fromEntries(Object.entries(tensors).map(
    ([name, t]) => [name, { type: t.type, dims: Array.from(t.dims), data: t.data.slice() }]));
  session.run = async (feeds, ...rest) => {
    seen.feeds = copy(feeds);
    const outputs = await run(feeds, ...rest);
    seen.outputs = copy(outputs);
    return outputs;
  };
  return seen;
}

/** The mask of the picture the pipeline returns: its alpha channel (height x width bytes). */
export function alphaOf(cut) {
  const alpha = new Uint8Array(cut.width * cut.height);
  for (let p = 0; p < alpha.length; p++) alpha[p] = cut.data[p * cut.channels + cut.channels - 1];
  return alpha;
}

async function upload(file, bytes) {
  const r = await fetch(`/upload/${file}`, { method: 'POST', body: bytes });
  if (!r.ok) throw new Error(`upload of ${file} failed: HTTP ${r.status}`);
}

/**
 * The placement harness's page: cfg {modelFile, userDtype, run}; fills `result` as browser_page.mjs's runHarness does
 * for onnxruntime-web (`gpuErrors`: the page's list of uncaptured WebGPU errors, which a run must not add to).
 * With a run, the input, the outputs and the mask are uploaded as out_<i>.bin. Returns the pipeline.
 */
export async function runTransformers(cfg, result, progress, gpuErrors) {
  progress('importing /transformers/transformers.js');
  const tjs = await loadTransformers('/ort/');
  result.versions['transformers.js'] = tjs.env.version;
  result.versions['onnxruntime-web'] = tjs.env.backends.onnx.versions?.web ?? null;
  result.call = pipelineCall(cfg.userDtype);
  progress(`creating the pipeline (${result.call}, file onnx/${cfg.modelFile}.onnx)`);
  const pipe = await createTimed(() => createPipeline(tjs, 'model', cfg.modelFile), result, progress);
  result.gpu_errors_after_session = gpuErrors.slice();
  if (!pipe || !cfg.run) return pipe;

  result.run = { ok: false, error: null, outputs: {}, feeds: {}, mask: null, gpu_errors: [] };
  try {
    const seen = observe(pipe);
    const image = await tjs.RawImage.fromURL('/io/image.png');
    progress('running inference');
    const t1 = performance.now();
    const cut = await pipe(image);
    result.timings.run_s = (performance.now() - t1) / 1000;
    let i = 0;
    for (const where of ['feeds', 'outputs']) {
      for (const [name, t] of Object.entries(seen[where])) {
        const file = `out_${i++}.bin`;
        await upload(file, bytesOfData(t.data));
        result.run[where][name] = { dtype: t.type, dims: t.dims, file };
      }
    }
    const file = `out_${i++}.bin`;
    await upload(file, alphaOf(cut));
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
