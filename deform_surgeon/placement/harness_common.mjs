// Shared helpers of the Node and browser harnesses of deform_surgeon.placement.
//
// Protocol with the Python side (deform_surgeon/placement/runner.py):
//   * stdout: one line per progress step, `@@progress <text>`; nothing else is printed there.
//   * stderr: ORT's own log (native stderr in Node, forwarded console messages in the browser), unchanged,
//     so that the Python log parser sees the same line format for both runtimes.
//   * --out FILE: one JSON document with the structured result (session_ok, error, adapter, run, ...).
//   * --io DIR (with --run): DIR/inputs.json lists {name, dtype, dims, file} of raw little-endian input
//     files in DIR; outputs are written as DIR/out_<i>.bin and listed in the result JSON.
import fs from 'node:fs';
import path from 'node:path';

/** Parses `--key value` / `--flag` arguments; keeps the harness free of dependencies. */
export function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (!a.startsWith('--')) throw new Error(`unexpected argument: ${a}`);
    const key = a.slice(2);
    if (i + 1 < argv.length && !argv[i + 1].startsWith('--')) {
      args[key] = argv[++i];
    } else {
      args[key] = true;
    }
  }
  return args;
}

export function progress(text) {
  // Synchronous write: progress must be visible while a long session creation blocks the event loop.
  fs.writeSync(1, `@@progress ${text}\n`);
}

/** Writes the result atomically so that a killed harness never leaves a half-written JSON behind. */
export function writeResult(outPath, result) {
  const tmp = `${outPath}.tmp`;
  fs.writeFileSync(tmp, JSON.stringify(result, null, 1));
  fs.renameSync(tmp, outPath);
}

export function errorText(e) {
  if (e === undefined || e === null) return String(e);
  if (typeof e === 'string') return e;
  const msg = e.message !== undefined ? String(e.message) : String(e);
  return msg;
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

export function readInputsMeta(ioDir) {
  return JSON.parse(fs.readFileSync(path.join(ioDir, 'inputs.json'), 'utf8'));
}

/**
 * Calls `onGone` when stdin reaches EOF. The Python runner keeps a pipe to the harness's stdin open and never
 * writes to it, so EOF means the runner died (even by SIGKILL, which no signal handler sees): the harness then
 * tears down what it started instead of running on as an orphan.
 */
export function watchParent(onGone) {
  process.stdin.on('end', onGone);
  process.stdin.on('error', onGone);
  process.stdin.on('data', () => {});
  process.stdin.resume();
}
