// Opens `deform-surgeon serve`'s page in headless Chromium, waits until it has run every model, and writes the
// page's own result JSON (and a screenshot). Started by `deform-surgeon serve --headless`; the server is the
// Python process that started this one.
//
// Usage: node headless.mjs --url URL --out RESULT.json [--screenshot PAGE.png] [--user-data-dir DIR]
//          [--chromium /usr/bin/chromium] [--timeout SEC] [--watch-stdin]
//          [--no-webgpu]  (a Chromium without WebGPU: the page runs the models on the wasm backend)
//
// The page's console (ORT's verbose log) goes to stderr, progress lines to stdout (`@@progress`), as in the
// placement harnesses. Browser and temporary profile are closed on every exit path.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import {
  CHROMIUM_FLAGS,
  errorText,
  launchChromium,
  NO_WEBGPU_FLAGS,
  parseArgs,
  progress,
  watchParent,
  writeResult,
} from '../placement/harness_node.mjs';

async function main() {
  const args = parseArgs(process.argv.slice(2));
  if (!args.url || !args.out) throw new Error('--url and --out are required');
  const timeoutMs = 1000 * Number(args.timeout || 600);
  let context = null;
  let ownProfile = null;
  let finished = false;
  const pageErrors = [];

  const cleanup = async () => {
    if (context) {
      const c = context;
      context = null;
      await c.close().catch(() => {});
    }
    if (ownProfile) fs.rmSync(ownProfile, { recursive: true, force: true });
  };
  const onSignal = (sig) => {
    if (finished) return;
    finished = true;
    progress(`interrupted by ${sig}; closing browser`);
    const hardStop = setTimeout(() => process.exit(130), 5000);
    cleanup().finally(() => {
      clearTimeout(hardStop);
      process.exit(130);
    });
  };
  process.on('SIGINT', () => onSignal('SIGINT'));
  process.on('SIGTERM', () => onSignal('SIGTERM'));
  if (args['watch-stdin']) watchParent(() => onSignal('end of stdin (parent exited)'));

  try {
    let userDataDir = args['user-data-dir'];
    if (!userDataDir) {
      ownProfile = fs.mkdtempSync(path.join(os.tmpdir(), 'ds-chromium-'));
      userDataDir = ownProfile;
    }
    progress('launching headless chromium');
    context = await launchChromium(userDataDir, args.chromium, args['no-webgpu'] ? NO_WEBGPU_FLAGS : CHROMIUM_FLAGS);
    const page = context.pages()[0] || (await context.newPage());
    await page.setViewportSize({ width: 1280, height: 900 });
    page.on('console', (msg) => {
      const text = msg.text();
      if (text.startsWith('@@progress ')) return progress(text.slice('@@progress '.length));
      fs.writeSync(2, text.endsWith('\n') ? text : `${text}\n`);
    });
    page.on('pageerror', (err) => pageErrors.push(`uncaught exception in page: ${errorText(err)}`));
    page.on('crash', () => pageErrors.push('page crashed'));
    progress(`opening ${args.url}`);
    await page.goto(args.url);
    await page.waitForFunction(() => window.__serveDone === true, null, { timeout: timeoutMs, polling: 500 });
    const result = await page.evaluate(() => window.__serveResult);
    if (pageErrors.length) {
      result.page_errors = pageErrors;
      result.ok = false;
    }
    if (args.screenshot) {
      progress('screenshot');
      await page.screenshot({ path: args.screenshot, fullPage: true });
    }
    writeResult(args.out, result);
  } finally {
    if (!finished) {
      finished = true;
      await cleanup();
    } else {
      await new Promise(() => {}); // the signal handler owns the shutdown
    }
  }
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stderr.write(`headless: ${e && e.stack ? e.stack : e}\n`);
    process.exit(3);
  },
);
