// Drives `deform-surgeon serve`'s page in headless Chromium as a user would (tests/webgpu/test_serve.py): picks files in
// its picker, clicks "run" and every PNG download link, and reports what the page showed after each step.
//
// Usage: node serve_page.mjs --url URL --out STATE.json --steps JSON [--no-webgpu] [--chromium PATH]
//   steps: [{"pick": FILE} | {"uncheck": ID} | {"run": true} | {"downloads": DIR}, ...]
// The state after each step: whether "run" is disabled, the status line, the notes, the table's cells, the input
// canvas's size and its middle row (grey), the download links, and (after "run") the page's result JSON.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { CHROMIUM_FLAGS, launchChromium, NO_WEBGPU_FLAGS, parseArgs } from '../../deform_surgeon/webgpu/placement/harness_node.mjs';

const args = parseArgs(process.argv.slice(2));
const steps = JSON.parse(args.steps || '[]');
const flags = args['no-webgpu'] ? NO_WEBGPU_FLAGS : CHROMIUM_FLAGS;
const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'ds-serve-test-'));
const context = await launchChromium(profile, args.chromium, flags);
const report = { states: [] };
try {
  const page = context.pages()[0] || (await context.newPage());
  page.on('pageerror', (err) => (report.page_errors ||= []).push(String(err)));
  await page.goto(args.url);
  await page.waitForFunction(() => document.body.dataset.ready === '1' || window.__serveDone, null,
    { timeout: 300000, polling: 200 });
  const state = (step) => page.evaluate((s) => {
    const text = (id) => (document.getElementById(id) && !document.getElementById(id).hidden
      ? document.getElementById(id).textContent : null);
    const c = document.getElementById('c-input');
    let row = null;
    if (c && c.width > 1) {
      const d = c.getContext('2d').getImageData(0, Math.floor(c.height / 2), c.width, 1).data;
      row = Array.from({ length: c.width }, (_, i) => Math.round((d[4 * i] + d[4 * i + 1] + d[4 * i + 2]) / 3));
    }
    return { step: s, run_disabled: document.getElementById('run').disabled, status: text('status'),
      title: text('title'), one_model: text('one-model'), no_webgpu: text('no-webgpu'), jsep_note: text('jsep-note'),
      letterbox: text('letterbox'), runs: document.getElementById('runs').value, runs_note: text('runs-note'),
      picker: document.getElementById('file').value,
      table: [...document.querySelectorAll('#table tr')].map((tr) => [...tr.children].map((td) => td.textContent)),
      input_canvas: c ? { width: c.width, height: c.height, middle_row_grey: row } : null,
      downloads: [...document.querySelectorAll('a[data-download]')].map((a) => a.dataset.download) };
  }, step);
  report.states.push(await state({ open: true }));
  for (const step of steps) {
    if (step.pick) {
      await page.setInputFiles('#file', step.pick);
      const name = path.basename(step.pick);
      await page.waitForFunction((n) => window.__serveState && window.__serveState.image === n
        && document.body.dataset.image !== 'loading', name, { timeout: 60000, polling: 100 });
    } else if (step.uncheck) {
      await page.uncheck(`#${step.uncheck}`);
    } else if (step.run) {
      await page.evaluate(() => { window.__serveResult = null; });
      await page.click('#run');
      await page.waitForFunction(() => window.__serveResult || /^failed/.test(document.getElementById('status')
        .textContent), null, { timeout: 600000, polling: 500 });
      report.result = await page.evaluate(() => window.__serveResult);
    } else if (step.downloads) {
      fs.mkdirSync(step.downloads, { recursive: true });
      for (const name of await page.$$eval('a[data-download]', (as) => as.map((a) => a.dataset.download))) {
        const [download] = await Promise.all([page.waitForEvent('download'),
          page.click(`a[data-download="${name}"]`)]);
        await download.saveAs(path.join(step.downloads, download.suggestedFilename()));
      }
    }
    report.states.push(await state(step));
  }
} finally {
  fs.writeFileSync(args.out, JSON.stringify(report, null, 1));
  await context.close().catch(() => {});
  fs.rmSync(profile, { recursive: true, force: true });
}
process.exit(0);
