// Prints (as JSON on stdout) the WebGPU adapter that a Dawn instance in Node gets on this machine.
//
// Why a separate process: onnxruntime-node does not expose the adapter or device of its WebGPU EP
// (`ort.env.webgpu` is an empty object there), so the only way to learn the limits in Node is a second Dawn
// (the `webgpu` npm package, dawn.node). It uses the same Vulkan driver (VK_ICD_FILENAMES) but is a different
// Dawn build than the one linked into libonnxruntime, so it runs in its own process to rule out any clash,
// and the Python side labels its answer as a probe, not as the EP's own adapter.
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);

async function main() {
  const { create } = await import('webgpu');
  const gpu = create([]);
  const adapter = await gpu.requestAdapter();
  if (!adapter) {
    process.stdout.write(JSON.stringify({ adapter: null, error: 'requestAdapter() returned null' }) + '\n');
    return;
  }
  const info = adapter.info || {};
  const pick = (k) => (info[k] !== undefined ? info[k] : null);
  const lim = adapter.limits;
  const out = {
    source: `webgpu@${require('webgpu/package.json').version} (dawn.node) probe in a separate process`,
    vendor: pick('vendor'),
    architecture: pick('architecture'),
    device: pick('device'),
    description: pick('description'),
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
  process.stdout.write(JSON.stringify({ adapter: out, error: null }) + '\n');
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stdout.write(JSON.stringify({ adapter: null, error: String(e && e.stack ? e.stack : e) }) + '\n');
    process.exit(0);
  },
);
