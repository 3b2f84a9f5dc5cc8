// Creates an onnxruntime-node session with the native WebGPU EP and reports placement (and optionally a run).
//
// Usage: node ort_node_harness.mjs --model M.onnx --out RESULT.json [--io DIR --run] [--no-adapter-probe]
//          [--watch-stdin]  (exit when stdin closes: the Python caller died)
// Environment (set by the Python runner): VK_ICD_FILENAMES=/usr/lib/chromium/vk_swiftshader_icd.json (SwiftShader;
// Mesa lavapipe is rejected by Dawn) and a writable XDG_RUNTIME_DIR.
//
// ORT writes its verbose log from C++ straight to this process's stderr; the Python side parses it. Only the
// structured result goes to --out, because stderr/stdout ordering with native writes is not reliable.
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import {
  errorText,
  newResult,
  parseArgs,
  progress,
  readInputsMeta,
  runOnce,
  runtimeRequire,
  watchParent,
  writeResult,
} from './harness_node.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));

/** Adapter info in a child process (see adapter_probe_node.mjs for why); never fails the harness. */
function probeAdapter() {
  const r = spawnSync(process.execPath, [path.join(HERE, 'adapter_probe_node.mjs')], {
    encoding: 'utf8',
    timeout: 30000,
    env: process.env,
  });
  if (r.error) return { adapter: null, error: `adapter probe failed: ${errorText(r.error)}` };
  const line = (r.stdout || '').trim().split('\n').pop();
  try {
    return JSON.parse(line);
  } catch {
    return { adapter: null, error: `adapter probe printed no JSON (exit ${r.status}): ${(r.stderr || '').slice(0, 500)}` };
  }
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  if (!args.model || !args.out) throw new Error('--model and --out are required');
  const result = newResult({ runtime: 'node', bundle: null, versions: {} });
  const finish = () => writeResult(args.out, result);
  // On a signal (or the caller's death) leave what is known so far and exit; the ORT session and its Dawn
  // device die with the process.
  const stop = (why) => {
    result.error = result.error || `harness interrupted by ${why}`;
    if (result.run && !result.run.ok && !result.run.error) result.run.error = `interrupted by ${why}`;
    try {
      finish();
    } catch {
      // best effort
    }
    process.exit(130);
  };
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) process.on(sig, () => stop(sig));
  if (args['watch-stdin']) watchParent(() => stop('end of stdin (parent exited)'));

  if (!args['no-adapter-probe']) {
    progress('probing WebGPU adapter (dawn.node)');
    const probe = probeAdapter();
    result.adapter = probe.adapter;
    result.adapter_note =
      'onnxruntime-node exposes no adapter/device of its WebGPU EP; these values come from a separate Dawn ' +
      '(webgpu npm package) on the same Vulkan driver' + (probe.error ? `; probe error: ${probe.error}` : '');
  }

  progress('loading onnxruntime-node');
  const ort = runtimeRequire('onnxruntime-node');
  result.versions['onnxruntime-node'] = runtimeRequire('onnxruntime-node/package.json').version;
  ort.env.logLevel = 'verbose';

  progress('creating session (webgpu EP)');
  const t0 = performance.now();
  let session;
  try {
    session = await ort.InferenceSession.create(args.model, {
      executionProviders: ['webgpu'],
      logSeverityLevel: 0,
      logVerbosityLevel: 0,
    });
    result.session_ok = true;
  } catch (e) {
    result.error = errorText(e);
  }
  result.timings.session_create_s = (performance.now() - t0) / 1000;
  progress(`session ${result.session_ok ? 'created' : 'failed'} in ${result.timings.session_create_s.toFixed(2)} s`);

  if (result.session_ok && args.run) {
    result.run = { ok: false, error: null, outputs: {} };
    try {
      const read = (m) => fs.readFileSync(path.join(args.io, m.file));
      const write = (file, bytes) => fs.writeFileSync(path.join(args.io, file), bytes);
      await runOnce(ort, session, readInputsMeta(args.io), read, write, progress, result);
      result.run.ok = true;
      progress(`run finished in ${result.timings.run_s.toFixed(2)} s`);
    } catch (e) {
      result.run.error = errorText(e);
      progress('run failed');
    }
  }
  if (session) {
    try {
      await session.release();
    } catch {
      // release errors do not change the measurement
    }
  }
  finish();
}

let outPath = null;
try {
  outPath = parseArgs(process.argv.slice(2)).out || null;
} catch {
  outPath = null;
}
main().then(
  () => process.exit(0),
  (e) => {
    // A harness bug (not a model failure): still leave a result behind so the caller can report it verbatim.
    if (outPath) {
      try {
        writeResult(outPath, { runtime: 'node', bundle: null, session_ok: false, error: `harness error: ${e && e.stack ? e.stack : e}` });
      } catch {
        // nothing more to do
      }
    }
    process.stderr.write(`harness error: ${e && e.stack ? e.stack : e}\n`);
    process.exit(3);
  },
);
