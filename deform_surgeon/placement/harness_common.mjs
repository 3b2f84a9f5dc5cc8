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

export { bytesOfData, describeAdapter, errorText, typedFromBytes } from './harness_shared.mjs';

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
