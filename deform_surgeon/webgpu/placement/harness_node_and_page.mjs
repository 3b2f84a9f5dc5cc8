// Helpers shared by every harness of deform_surgeon.webgpu.placement, in Node and in the browser page alike:
// nothing here may import a Node module (browser_harness.mjs serves this file to the page as /harness_node_and_page.mjs).

/**
 * onnxruntime-web bundles by the name the command lines use: what `import 'onnxruntime-web/webgpu'` and the default
 * `import 'onnxruntime-web'` load. `debug`: ort.env.debug = true, which makes JSEP's WGSL compile failures reject
 * session.run() (without it such a run "succeeds" with wrong outputs).
 */
export const BUNDLES = {
  webgpu: { file: 'ort.webgpu.min.mjs', debug: false, ep: 'native C++ WebGpuExecutionProvider (asyncify wasm)' },
  jsep: { file: 'ort.min.mjs', debug: true, ep: 'JsExecutionProvider (JSEP)' },
  all: { file: 'ort.all.min.mjs', debug: true, ep: 'JSEP, plus webgl/wasm' },
  // the CPU backend a page falls back to without WebGPU: ORT's CPU EP compiled to 32-bit wasm (a 4 GiB heap)
  wasm: { file: 'ort.wasm.min.mjs', debug: false, ep: 'wasm (ORT CPU EP in WebAssembly), no WebGPU' },
  // transformers.js's pipeline over the onnxruntime-web it bundles (its `onnxruntime-web/webgpu`: the native EP)
  transformers: { file: 'transformers.js', debug: false, ep: 'native WebGpuExecutionProvider, through transformers.js' },
};

export function errorText(e) {
  if (e === undefined || e === null) return String(e);
  if (typeof e === 'string') return e;
  const msg = e.message !== undefined ? String(e.message) : String(e);
  return msg;
}

// The one JS copy of deform_surgeon/checks/verdict.py's split_errors / summarize_errors
// (tests/checks/test_verdict.py runs both on the same text): the page collects its WebGPU errors before any
// server round trip.
const ERROR_START = /^(?=GPU validation error for kernel |GPUValidationError: |GPUOutOfMemoryError: |GPUInternalError: |device lost )/m;
const KERNEL_NAME = /kernel "\[([^\]"]+)\] [^"]*"/g;

/** The errors of one runtime error text (JSEP joins one paragraph per failed kernel). */
export function splitErrors(text) {
  const parts = String(text).split(ERROR_START).map((p) => p.trim()).filter(Boolean);
  return parts.length ? parts : (String(text).trim() ? [String(text).trim()] : []);
}

/** Each distinct error once, in order: its first line (cut at `width`) and "(xN)" when it came N > 1 times. */
export function summarizeErrors(errors, width = 240) {
  const counts = new Map();
  for (const raw of errors) {
    const e = String(raw).trim();
    const key = e.replace(KERNEL_NAME, 'kernel "[$1] *"');
    if (counts.has(key)) counts.get(key)[1] += 1;
    else counts.set(key, [e, 1]);
  }
  return [...counts.values()].map(([first, n]) => {
    let line = first.split('\n')[0];
    if (line.length > width) line = `${line.slice(0, width)}…`;
    return n > 1 ? `${line} (x${n})` : line;
  });
}

/**
 * A session (or pipeline) made by `create()`, timed as every harness reports it: fills `result.session_ok`,
 * `result.error` and `result.timings.session_create_s`, and says so through `progress`. Returns it, or null.
 */
export async function createTimed(create, result, progress) {
  const t0 = performance.now();
  let made = null;
  try {
    made = await create();
    result.session_ok = true;
  } catch (e) {
    result.error = errorText(e);
  }
  result.timings.session_create_s = (performance.now() - t0) / 1000;
  progress(`session ${result.session_ok ? 'created' : 'failed'} in ${result.timings.session_create_s.toFixed(2)} s`);
  return made;
}

/** Typed array constructors per ONNX tensor type as onnxruntime-js names them. */
const TYPED = {
  float32: Float32Array,
  float64: Float64Array,
  float16: Uint16Array, // onnxruntime-js accepts Uint16Array bits for float16 (Float16Array is not in Node 20)
  int8: Int8Array,
  uint8: Uint8Array,
  int16: Int16Array,
  uint16: Uint16Array,
  int32: Int32Array,
  uint32: Uint32Array,
  int64: BigInt64Array,
  uint64: BigUint64Array,
  bool: Uint8Array,
};

/** Builds a typed array of `dtype` over a copy of `bytes` (a Buffer / ArrayBuffer / Uint8Array). */
export function typedFromBytes(dtype, bytes) {
  const Ctor = TYPED[dtype];
  if (!Ctor) throw new Error(`unsupported input dtype ${dtype}`);
  const u8 = bytes instanceof ArrayBuffer ? new Uint8Array(bytes) : new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const copy = new Uint8Array(u8.byteLength);
  copy.set(u8);
  return new Ctor(copy.buffer, 0, copy.byteLength / Ctor.BYTES_PER_ELEMENT);
}

/** Raw bytes of a tensor's data, whatever typed array (or Float16Array) backs it. */
export function bytesOfData(data) {
  if (Array.isArray(data)) {
    // string tensors: not expected in the models this tool handles
    return new TextEncoder().encode(JSON.stringify(data));
  }
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

/** What a harness reports of a WebGPU adapter: its info, features and the buffer limits `budget` reads. */
export function describeAdapter(adapter, source) {
  const info = adapter.info || {};
  const lim = adapter.limits;
  return {
    source,
    vendor: info.vendor ?? null,
    architecture: info.architecture ?? null,
    device: info.device ?? null,
    description: info.description ?? null,
    isFallbackAdapter: info.isFallbackAdapter ?? adapter.isFallbackAdapter ?? null,
    features: [...adapter.features].sort(),
    limits: {
      maxBufferSize: Number(lim.maxBufferSize),
      maxStorageBufferBindingSize: Number(lim.maxStorageBufferBindingSize),
      maxComputeWorkgroupStorageSize: Number(lim.maxComputeWorkgroupStorageSize),
      maxComputeInvocationsPerWorkgroup: Number(lim.maxComputeInvocationsPerWorkgroup),
      maxComputeWorkgroupsPerDimension: Number(lim.maxComputeWorkgroupsPerDimension),
      maxStorageBuffersPerShaderStage: Number(lim.maxStorageBuffersPerShaderStage),
    },
  };
}

/**
 * One inference, the same in Node and in the page: the inputs `inputs` ({name, dtype, dims, file}) are read as
 * bytes by `read(m)`, each output is handed to `write(file, bytes)` as `out_<i>.bin`; fills `result.timings.run_s`
 * and `result.run.outputs` ({dtype, dims, file} per output name). Throws what the run or a write throws.
 */
export async function runOnce(ort, session, inputs, read, write, progress, result) {
  const feeds = {};
  for (const m of inputs) {
    feeds[m.name] = new ort.Tensor(m.dtype, typedFromBytes(m.dtype, await read(m)), m.dims);
  }
  progress('running inference');
  const t1 = performance.now();
  const outs = await session.run(feeds);
  result.timings.run_s = (performance.now() - t1) / 1000;
  let i = 0;
  for (const name of session.outputNames) {
    const t = outs[name];
    const file = `out_${i++}.bin`;
    await write(file, bytesOfData(t.data), name);
    result.run.outputs[name] = { dtype: t.type, dims: Array.from(t.dims), file };
  }
}
