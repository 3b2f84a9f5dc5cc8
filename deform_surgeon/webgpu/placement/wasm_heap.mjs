// Runs in the browser page before onnxruntime-web is imported: the wasm heap of its CPU (wasm) backend.
//
// Why a hook on WebAssembly.Memory: onnxruntime-web's threaded build creates its heap in JavaScript
// (`new WebAssembly.Memory({initial, maximum: 65536, shared: true})`, 65536 pages = 4 GiB, the most a 32-bit wasm
// heap can address) and grows it, never shrinks it, whenever malloc finds no free block. So the heap's size after a
// step is the most that step needed at once, and a grow the engine refuses is where `std::bad_alloc` comes from.
// Emscripten asks for no grow at all when the request alone would pass the limit: then `failed_grows` stays empty.

/** The most bytes onnxruntime-web's heap may reach: emscripten's cap, 4 GiB less one 64 KiB page. */
export const HEAP_LIMIT = 4294901760;

/**
 * Starts watching every wasm memory the page creates from now on. Returns `read()`: {bytes, limit, failed_grows}
 * where `bytes` is the largest heap's size now (its peak so far) and `failed_grows` lists each refused grow as
 * {from, asked} (the heap's size then and the size it asked for, in bytes).
 */
export function watchWasmHeap() {
  const Memory = WebAssembly.Memory;
  const heaps = [];
  const failedGrows = [];
  function Watched(descriptor) {
    const memory = new Memory(descriptor);
    if ((descriptor && descriptor.maximum) > 1) heaps.push(memory); // not the 0-page probe of SharedArrayBuffer
    return memory;
  }
  Watched.prototype = Memory.prototype;
  WebAssembly.Memory = Watched;
  const grow = Memory.prototype.grow;
  Memory.prototype.grow = function watchedGrow(pages) {
    const from = this.buffer.byteLength;
    try {
      return grow.call(this, pages);
    } catch (e) {
      failedGrows.push({ from, asked: from + pages * 65536 });
      throw e;
    }
  };
  return () => ({
    bytes: heaps.reduce((most, m) => Math.max(most, m.buffer.byteLength), 0),
    limit: HEAP_LIMIT,
    failed_grows: failedGrows.slice(),
  });
}
