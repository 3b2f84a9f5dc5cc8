// Runs in the browser page, shared by the placement harness page (browser_page.mjs) and `deform-surgeon serve`'s
// page: the WebGPU adapter as a harness reports it, the device profile a page requests its devices with, and the
// uncaptured WebGPU errors of every device the page creates.
//
// Why hooks on GPUAdapter.requestDevice: on JSEP a WGSL compile failure surfaces only as an *uncaptured* WebGPU
// error, and session.run() still resolves. Listening for `uncapturederror` on every device that the page creates
// (ORT's included) is the only way to see it as data rather than as a console line.

import { describeAdapter } from '/harness_node_and_page.mjs';

/** Every uncaptured WebGPU error and device loss of the page's devices, as text, in order. */
export const gpuErrors = [];

export function hookDevices() {
  if (!('gpu' in navigator) || typeof GPUAdapter === 'undefined') return;
  const orig = GPUAdapter.prototype.requestDevice;
  GPUAdapter.prototype.requestDevice = async function (...a) {
    const device = await orig.apply(this, a);
    device.addEventListener('uncapturederror', (ev) => {
      const err = ev.error;
      const kind = err && err.constructor ? err.constructor.name : 'GPUError';
      // No preventDefault(): Chrome still prints its own console report, which the harness forwards too.
      gpuErrors.push(`${kind}: ${err && err.message ? err.message : String(err)}`);
    });
    // A device destroyed on purpose (ORT's session.release() destroys its device) is not an error.
    device.lost.then((info) => info.reason !== 'destroyed' && gpuErrors.push(`device lost (${info.reason}): ${info.message}`));
    return device;
  };
}

// Limits where a smaller number is the better one: a device with a profile's limits has the larger of the two.
const ALIGNMENTS = new Set(['minUniformBufferOffsetAlignment', 'minStorageBufferOffsetAlignment']);

/**
 * Makes the page behave like a device with the profile's limits (never beyond what the real adapter offers):
 * `adapter.limits` reports them, so ORT sizes its work to them, and every `requestDevice` asks for exactly them,
 * so WebGPU validation enforces them ("exceeds the maximum per-stage limit") as it would on a user's GPU.
 * Returns the limits applied.
 */
export function applyProfile(adapter, profile) {
  const real = adapter.limits;
  const applied = {};
  for (const [key, value] of Object.entries(profile)) {
    if (!(key in real)) continue;
    const a = Number(real[key]);
    applied[key] = ALIGNMENTS.has(key) ? Math.max(value, a) : Math.min(value, a);
  }
  const limitsGetter = Object.getOwnPropertyDescriptor(GPUAdapter.prototype, 'limits').get;
  Object.defineProperty(GPUAdapter.prototype, 'limits', {
    configurable: true,
    get() {
      const own = limitsGetter.call(this);
      const view = {};
      for (const key in own) view[key] = key in applied ? applied[key] : own[key];
      return view;
    },
  });
  const request = GPUAdapter.prototype.requestDevice;
  GPUAdapter.prototype.requestDevice = function (descriptor = {}) {
    return request.call(this, { ...descriptor, requiredLimits: { ...applied } });
  };
  return applied;
}

export async function adapterInfo() {
  if (!('gpu' in navigator)) return { adapter: null, error: 'navigator.gpu is missing (WebGPU disabled?)' };
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) return { adapter: null, error: 'navigator.gpu.requestAdapter() returned null' };
  const source = 'navigator.gpu.requestAdapter() in the page (same browser, same default adapter ORT requests)';
  return { adapter: describeAdapter(adapter, source), error: null };
}
