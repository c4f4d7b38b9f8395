// moat's JavaScript kernel (node): the same line protocol as kernel.py. One JSON request per line on
// stdin ({"id", "code", "env"}); JSON messages on stdout ({"id", "type", ...}). Cells run in one
// persistent `vm` context, so variables (including top-level let/const) survive between cells; the
// value of the last expression is the main result. console.* and process.stdout/stderr.write are
// captured, so user output never mixes with the protocol.
"use strict";
const vm = require("vm");
const util = require("util");
const fs = require("fs");

let current = null;
let count = 0;

function send(msg) {
  const line = JSON.stringify(msg) + "\n";
  let buf = Buffer.from(line, "utf8");
  while (buf.length > 0) {
    try {
      const n = fs.writeSync(1, buf);
      buf = buf.subarray(n);
    } catch (e) {
      if (e.code !== "EAGAIN") throw e;
    }
  }
}

function output(kind) {
  return (chunk, encoding, cb) => {
    const data = typeof chunk === "string" ? chunk : Buffer.from(chunk).toString("utf8");
    if (current !== null && data.length > 0) send({ id: current, type: kind, data });
    if (typeof encoding === "function") encoding();
    else if (typeof cb === "function") cb();
    return true;
  };
}
process.stdout.write = output("stdout");
process.stderr.write = output("stderr");
const cellConsole = new console.Console({ stdout: process.stdout, stderr: process.stderr });

function display(value) {
  send(Object.assign(bundle(value), { id: current, type: "result", is_main_result: false }));
}

const sandbox = {
  console: cellConsole, require, process, Buffer, URL, URLSearchParams, TextEncoder, TextDecoder,
  setTimeout, clearTimeout, setInterval, clearInterval, setImmediate, clearImmediate, queueMicrotask,
  display, module: { exports: {} },
};
sandbox.global = sandbox;
sandbox.globalThis = sandbox;
const context = vm.createContext(sandbox);

function bundle(value) {
  const out = { text: typeof value === "string" ? JSON.stringify(value) : util.inspect(value) };
  if (value !== null && typeof value === "object") {
    for (const [m, k] of [["_repr_html_", "html"], ["_repr_markdown_", "markdown"], ["_repr_svg_", "svg"]]) {
      if (typeof value[m] === "function") {
        try { out[k] = String(value[m]()); } catch (_) { /* ignore */ }
      }
    }
  }
  return out;
}

function errorOf(e) {
  if (e instanceof Error || (e && typeof e === "object" && "stack" in e)) {
    // Drop the kernel's own frames (everything from node's vm module on).
    const lines = String(e.stack ?? e).split("\n");
    const cut = lines.findIndex((l) => /\(node:vm:|at Script\.runInContext|sigintHandlersWrap/.test(l));
    const traceback = (cut > 0 ? lines.slice(0, cut) : lines).join("\n");
    return { name: e.name || "Error", value: String(e.message ?? ""), traceback };
  }
  return { name: "Error", value: util.inspect(e), traceback: "Uncaught " + util.inspect(e) };
}

async function handle(req) {
  count += 1;
  current = req.id;
  const env = req.env || {};
  const saved = {};
  for (const k of Object.keys(env)) { saved[k] = process.env[k]; process.env[k] = String(env[k]); }
  let err = null;
  try {
    const script = new vm.Script(req.code || "", { filename: `<cell-${count}>` });
    let value = script.runInContext(context, { breakOnSigint: true, displayErrors: false });
    if (value && typeof value.then === "function") value = await value;
    if (value !== undefined) {
      send(Object.assign(bundle(value), { id: current, type: "result", is_main_result: true }));
    }
  } catch (e) {
    err = errorOf(e);
    if (/Script execution was interrupted/.test(err.value)) err.name = "KeyboardInterrupt";
  } finally {
    for (const k of Object.keys(saved)) {
      if (saved[k] === undefined) delete process.env[k]; else process.env[k] = saved[k];
    }
  }
  if (err) send(Object.assign(err, { id: current, type: "error" }));
  send({ id: current, type: "end", execution_count: count });
  current = null;
}

// SIGINT outside a running script (e.g. while awaiting a promise) must not kill the kernel.
process.on("SIGINT", () => {});

let queue = Promise.resolve();
let pending = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => {
  pending += chunk;
  let i;
  while ((i = pending.indexOf("\n")) >= 0) {
    const line = pending.slice(0, i);
    pending = pending.slice(i + 1);
    if (!line.trim()) continue;
    let req;
    try { req = JSON.parse(line); } catch (_) { continue; }
    queue = queue.then(() => handle(req));
  }
});
process.stdin.on("end", () => process.exit(0));
send({ id: null, type: "ready", pid: process.pid });
