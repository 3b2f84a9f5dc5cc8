// Prints (as JSON on stdout) the WebGPU adapter that a Dawn instance in Node gets on this machine.
//
// Why a separate process: onnxruntime-node does not expose the adapter or device of its WebGPU EP
// (`ort.env.webgpu` is an empty object there), so the only way to learn the limits in Node is a second Dawn
// (the `webgpu` npm package, dawn.node). It uses the same Vulkan driver (VK_ICD_FILENAMES) but is a different
// Dawn build than the one linked into libonnxruntime, so it runs in its own process to rule out any clash,
// and the Python side labels its answer as a probe, not as the EP's own adapter.
import { runtimeImport, runtimeRequire } from './harness_node.mjs';
import { describeAdapter } from './harness_node_and_page.mjs';

async function main() {
  const { create } = await runtimeImport('webgpu');
  const gpu = create([]);
  const adapter = await gpu.requestAdapter();
  if (!adapter) {
    process.stdout.write(JSON.stringify({ adapter: null, error: 'requestAdapter() returned null' }) + '\n');
    return;
  }
  const out = describeAdapter(adapter, `webgpu@${runtimeRequire('webgpu/package.json').version} (dawn.node) probe in a separate process`);
  process.stdout.write(JSON.stringify({ adapter: out, error: null }) + '\n');
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stdout.write(JSON.stringify({ adapter: null, error: String(e && e.stack ? e.stack : e) }) + '\n');
    process.exit(0);
  },
);
