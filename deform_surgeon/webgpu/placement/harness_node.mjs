// Helpers of the Node-side processes of deform_surgeon.webgpu.placement (the Node harness and the browser harness that drives
// Chromium); what the page itself needs too lives in harness_node_and_page.mjs.
//
// Protocol with the Python side (deform_surgeon/webgpu/placement/runner.py):
//   * stdout: one line per progress step, `@@progress <text>`; nothing else is printed there.
//   * stderr: ORT's own log (native stderr in Node, forwarded console messages in the browser), unchanged,
//     so that the Python log parser sees the same line format for both runtimes.
//   * --out FILE: one JSON document with the structured result (session_ok, error, adapter, run, ...).
//   * --io DIR (with --run): DIR/inputs.json lists {name, dtype, dims, file} of raw little-endian input
//     files in DIR; outputs are written as DIR/out_<i>.bin and listed in the result JSON.
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const HERE = path.dirname(fileURLToPath(import.meta.url));

/**
 * The folder whose node_modules holds the pinned npm packages: DEFORM_SURGEON_RUNTIMES (set by the Python side
 * from `deform_surgeon.base.js_runtimes.runtimes_dir()`: the per-user cache of `deform-surgeon setup`), else this folder
 * (a checkout's in-tree install). Packages are resolved from there, never from wherever this file is installed.
 */
export const RUNTIMES_DIR = process.env.DEFORM_SURGEON_RUNTIMES || HERE;
export const runtimeRequire = createRequire(path.join(RUNTIMES_DIR, 'package.json'));

/** ESM import of a pinned package (resolved in RUNTIMES_DIR like runtimeRequire). */
export function runtimeImport(name) {
  return import(pathToFileURL(runtimeRequire.resolve(name)).href);
}

// Headless Chromium as every browser harness starts it. Without --enable-unsafe-webgpu there is no adapter in
// headless Chromium on Linux.
export const CHROMIUM_FLAGS = [
  '--headless',
  '--no-sandbox',
  '--enable-unsafe-webgpu',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--disable-quic',
];

/** Chromium as a browser without WebGPU starts: what a page falls back to the wasm backend in. */
export const NO_WEBGPU_FLAGS = CHROMIUM_FLAGS.filter((f) => f !== '--enable-unsafe-webgpu');

/**
 * A playwright persistent context on the system Chromium; signals are left to the caller's handlers. `flags`:
 * CHROMIUM_FLAGS unless a caller needs others (NO_WEBGPU_FLAGS: a browser without WebGPU).
 */
export function launchChromium(userDataDir, executablePath, flags = CHROMIUM_FLAGS) {
  const { chromium } = runtimeRequire('playwright-core');
  return chromium.launchPersistentContext(userDataDir, {
    executablePath: executablePath || '/usr/bin/chromium',
    headless: true,
    args: flags,
    acceptDownloads: true,
    handleSIGINT: false,
    handleSIGTERM: false,
    handleSIGHUP: false,
    timeout: 60000,
  });
}

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

/** The result every harness writes, as it stands before anything is known; `fields` are the harness's own. */
export function newResult(fields) {
  return { ...fields, session_ok: false, error: null, adapter: null, adapter_note: null, timings: {}, run: null };
}

/** Writes the result atomically so that a killed harness never leaves a half-written JSON behind. */
export function writeResult(outPath, result) {
  const tmp = `${outPath}.tmp`;
  fs.writeFileSync(tmp, JSON.stringify(result, null, 1));
  fs.renameSync(tmp, outPath);
}

export { bytesOfData, describeAdapter, errorText, runOnce, typedFromBytes } from './harness_node_and_page.mjs';

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

/**
 * Peak resident memory (VmHWM, MiB) of the Chromium started with `userDataDir`, by process type (`browser`,
 * `renderer`: the page, its JS and wasm heaps; `gpu-process`: where Dawn holds what the WebGPU EP uploads; others
 * summed under their type). Read from /proc while the browser still runs: on a machine without /proc, {}.
 */
export function chromiumPeakMemory(userDataDir) {
  const procs = new Map(); // pid -> {ppid, cmd}
  let entries = [];
  try {
    entries = fs.readdirSync('/proc').filter((d) => /^\d+$/.test(d));
  } catch {
    return {};
  }
  for (const pid of entries) {
    try {
      const cmd = fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').join(' ');
      const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      procs.set(Number(pid), { ppid, cmd });
    } catch {
      // gone meanwhile
    }
  }
  const ours = new Set([...procs].filter(([, p]) => p.cmd.includes(userDataDir) && !p.cmd.includes('--type='))
    .map(([pid]) => pid));
  for (let grew = true; grew;) {
    grew = false;
    for (const [pid, p] of procs) {
      if (!ours.has(pid) && ours.has(p.ppid)) {
        ours.add(pid);
        grew = true;
      }
    }
  }
  const out = {};
  for (const pid of ours) {
    const type = (/--type=([\w-]+)/.exec(procs.get(pid).cmd) || [null, 'browser'])[1];
    try {
      const kb = Number(/VmHWM:\s+(\d+)/.exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'))[1]);
      out[type] = Math.round(((out[type] || 0) + kb / 1024) * 10) / 10;
    } catch {
      // gone meanwhile
    }
  }
  return out;
}
