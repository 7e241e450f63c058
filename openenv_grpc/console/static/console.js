// openenv-grpc console: forms from the env's descriptors, one session per page.
// Plain browser JavaScript with no dependencies: everything comes from this console.
// Data from the env is only ever put into the page as text (never as HTML).
"use strict";

const $ = (id) => document.getElementById(id);

// -- small DOM helpers --------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

let uniqueId = 0;
const nextId = (prefix) => `${prefix}-${++uniqueId}`;

// -- forms from schemas -------------------------------------------------------------
//
// A schema (from /api/info) describes each message type: fields with a kind (float, int,
// uint, int64, uint64, bool, string, bytes, enum, message, map, json, text), repeated,
// optional, oneof. An editor is {node, value()}: value() returns the field's JSON in
// protobuf's JSON mapping, or undefined to leave it out. Nested messages are built
// lazily, so recursive types only grow as far as someone opens them.

class InputError extends Error {}

const INTEGER = /^-?\d+$/;

function scalarEditor(spec, label, { required = false } = {}) {
  const id = nextId("f");
  const kind = spec.kind;
  let input;
  if (kind === "bool") {
    input = el("input", { id, type: "checkbox", "data-kind": kind });
  } else if (kind === "enum") {
    input = el("select", { id, "data-kind": kind });
    for (const name of spec.enum) input.append(el("option", { value: name, text: name }));
  } else if (kind === "json") {
    input = el("textarea", { id, rows: 3, placeholder: "JSON", "data-kind": kind });
  } else {
    const hints = {
      float: "number", int: "integer", uint: "integer ≥ 0", int64: "integer",
      uint64: "integer ≥ 0", bytes: "base64", text: spec.message || "", string: "",
    };
    input = el("input", { id, "data-kind": kind, placeholder: hints[kind] || "" });
    if (kind !== "string" && kind !== "bytes" && kind !== "text") input.inputMode = "decimal";
  }
  const node = el("div", { class: "row" }, el("label", { for: id, text: label }), input);
  const value = () => {
    if (kind === "bool") return input.checked || (required ? false : undefined);
    if (kind === "enum") return input.value;
    const text = input.value;
    if (text === "") {
      if (!required) return undefined;
      if (kind === "string" || kind === "bytes" || kind === "text") return "";
      throw new InputError(`${label}: a value is needed`);
    }
    if (kind === "json") {
      try {
        return JSON.parse(text);
      } catch (err) {
        throw new InputError(`${label}: not JSON (${err.message})`);
      }
    }
    if (kind === "int" || kind === "uint") {
      // Sent as typed: the console's parser answers a non-integer with a precise error.
      return INTEGER.test(text.trim()) ? Number(text) : text;
    }
    if (kind === "int64" || kind === "uint64") return text.trim(); // exact beyond 2**53
    if (kind === "float") {
      const number = Number(text);
      return text.trim() !== "" && Number.isFinite(number) ? number : text.trim();
    }
    return text; // string, bytes (base64), text (Timestamp, Duration, ...)
  };
  return { node, value, input };
}

function fieldEditor(schemas, spec, depth, path, opts = {}) {
  if (spec.kind === "map") return mapEditor(schemas, spec, depth, path);
  if (spec.repeated) return listEditor(schemas, spec, depth, path);
  if (spec.kind === "message") return messageField(schemas, spec, depth, path, opts);
  return scalarEditor(spec, spec.name, opts);
}

function messageField(schemas, spec, depth, path, { required = false } = {}) {
  // A singular message: expanded at once unless deep or recursive; else a checkbox.
  const id = nextId("m");
  const box = el("input", { id, type: "checkbox", "data-kind": "presence" });
  const inner = el("div", { class: "nested" });
  const node = el("fieldset", { class: "message" },
    el("legend", {}, box, el("label", { for: id, text: ` ${spec.name} ` }),
      el("small", { text: shortName(spec.message) })),
    inner);
  let editor = null;
  const sync = () => {
    if (box.checked && editor === null) {
      editor = schemas[spec.message].tensor
        ? tensorEditor(spec.name)
        : messageEditor(schemas, spec.message, depth + 1, [...path, spec.message]);
      inner.append(editor.node);
    }
    inner.hidden = !box.checked;
  };
  box.addEventListener("change", sync);
  box.checked = required || (depth < 3 && !path.includes(spec.message));
  sync();
  if (required) box.disabled = true;
  const value = () => (box.checked && editor ? editor.value() : undefined);
  return { node, value };
}

function messageEditor(schemas, typeName, depth = 0, path = [typeName]) {
  const schema = schemas[typeName];
  const node = el("div", { class: "fields", "data-type": typeName });
  const parts = [];
  const inOneof = new Set();
  for (const oneof of schema.oneofs) {
    const members = schema.fields.filter((f) => f.oneof === oneof.name);
    members.forEach((f) => inOneof.add(f.name));
    const editor = oneofEditor(schemas, oneof.name, members, depth, path);
    parts.push({ oneof: true, editor });
  }
  for (const spec of schema.fields) {
    if (inOneof.has(spec.name)) continue;
    parts.push({ name: spec.name, editor: fieldEditor(schemas, spec, depth, path) });
  }
  // Fields in declaration order would split oneofs; oneofs first reads better.
  for (const part of parts) node.append(part.editor.node);
  if (parts.length === 0) node.append(el("p", { class: "muted", text: "(no fields)" }));
  const value = () => {
    const out = {};
    for (const part of parts) {
      const v = part.editor.value();
      if (v === undefined) continue;
      if (part.oneof) Object.assign(out, v);
      else out[part.name] = v;
    }
    return out;
  };
  return { node, value };
}

// A tensor (a message with data/shape/dtype) is typed as numbers, not base64 bytes: the
// console packs {"$tensor": {dtype, shape, values}} into the message's fields.
function tensorEditor(name) {
  const dtypeId = nextId("t");
  const shapeId = nextId("t");
  const valuesId = nextId("t");
  const dtype = el("select", { id: dtypeId, "data-kind": "dtype" });
  for (const d of page.info.dtypes) dtype.append(el("option", { value: d, text: d }));
  dtype.value = "float32";
  const shape = el("input", { id: shapeId, placeholder: "e.g. 3 or 2,2 (default: flat)" });
  const values = el("textarea", { id: valuesId, rows: 2, placeholder: "e.g. 0.5, -1, 2" });
  const node = el("div", { class: "tensor-editor", "data-tensor": name },
    el("div", { class: "row" }, el("label", { for: dtypeId, text: "dtype" }), dtype),
    el("div", { class: "row" }, el("label", { for: shapeId, text: "shape" }), shape),
    el("div", { class: "row" }, el("label", { for: valuesId, text: "values" }), values));
  const value = () => {
    const items = values.value.split(/[\s,;]+/).filter((v) => v !== "");
    const tensor = {
      dtype: dtype.value,
      // Numbers where they parse; anything else goes as typed, for a precise error.
      values: items.map((v) => (v === "true" ? 1 : v === "false" ? 0 :
        Number.isNaN(Number(v)) ? v : Number(v))),
    };
    const dims = shape.value.trim();
    if (dims !== "") {
      const sizes = dims.split(/[\s,x×]+/).filter((d) => d !== "");
      if (!sizes.every((d) => INTEGER.test(d))) {
        throw new InputError(`${name}: shape is sizes like 3 or 2,2`);
      }
      tensor.shape = sizes.map(Number);
    }
    return { $tensor: tensor };
  };
  return { node, value };
}

function oneofEditor(schemas, name, members, depth, path) {
  const id = nextId("o");
  const select = el("select", { id, "data-oneof": name });
  select.append(el("option", { value: "", text: "(none)" }));
  for (const m of members) select.append(el("option", { value: m.name, text: m.name }));
  const inner = el("div", { class: "nested" });
  const node = el("fieldset", { class: "oneof" },
    el("legend", {}, el("label", { for: id, text: `${name} ` }), select), inner);
  const built = new Map();
  let current = null;
  const sync = () => {
    for (const editor of built.values()) editor.node.hidden = true;
    current = null;
    const spec = members.find((m) => m.name === select.value);
    if (!spec) return;
    if (!built.has(spec.name)) {
      // A chosen member is always sent, even as its default ("" or 0 is a choice).
      const editor = fieldEditor(schemas, spec, depth, path, { required: true });
      built.set(spec.name, editor);
      inner.append(editor.node);
    }
    current = { spec, editor: built.get(spec.name) };
    current.editor.node.hidden = false;
  };
  select.addEventListener("change", sync);
  select.value = members.length ? members[0].name : "";
  sync();
  const value = () => {
    if (!current) return undefined;
    const v = current.editor.value();
    return v === undefined ? undefined : { [current.spec.name]: v };
  };
  return { node, value };
}

function itemEditor(schemas, spec, depth, path, label) {
  const item = { ...spec, repeated: false, name: label };
  if (item.kind === "message") return messageField(schemas, item, depth, path, { required: true });
  return scalarEditor(item, label, { required: true });
}

function listEditor(schemas, spec, depth, path) {
  const items = el("ol", { class: "items" });
  const editors = [];
  const add = () => {
    const editor = itemEditor(schemas, spec, depth, path, `${spec.name}[${editors.length}]`);
    const entry = { editor };
    const remove = el("button", { type: "button", class: "small", text: "remove", onclick: () => {
      editors.splice(editors.indexOf(entry), 1);
      li.remove();
    } });
    const li = el("li", {}, editor.node, remove);
    editors.push(entry);
    items.append(li);
  };
  const node = el("fieldset", { class: "repeated" },
    el("legend", { text: `${spec.name} ` },
      el("small", { text: `repeated ${spec.kind === "message" ? shortName(spec.message) : spec.kind}` })),
    items,
    el("button", { type: "button", class: "small add", text: `+ ${spec.name}`, onclick: add }));
  const value = () => (editors.length ? editors.map((e) => e.editor.value()) : undefined);
  return { node, value };
}

function mapEditor(schemas, spec, depth, path) {
  const rows = el("ol", { class: "items" });
  const entries = [];
  const add = () => {
    const key = scalarEditor({ kind: spec.key.kind }, "key", { required: true });
    const val = itemEditor(schemas, spec.value, depth, path, "value");
    const entry = { key, val };
    const remove = el("button", { type: "button", class: "small", text: "remove", onclick: () => {
      entries.splice(entries.indexOf(entry), 1);
      li.remove();
    } });
    const li = el("li", { class: "map-entry" }, key.node, val.node, remove);
    entries.push(entry);
    rows.append(li);
  };
  const node = el("fieldset", { class: "map" },
    el("legend", { text: `${spec.name} ` }, el("small", { text: "map" })),
    rows,
    el("button", { type: "button", class: "small add", text: `+ ${spec.name}`, onclick: add }));
  const value = () => {
    if (!entries.length) return undefined;
    const out = {};
    for (const { key, val } of entries) out[String(key.value())] = val.value();
    return out;
  };
  return { node, value };
}

const shortName = (full) => (full || "").split(".").pop();

// -- rendering results --------------------------------------------------------------

function renderValue(value) {
  if (value === null || value === undefined) return el("span", { class: "muted", text: "—" });
  if (typeof value === "string") {
    if (value.includes("\n") || value.length > 80) return el("pre", { class: "text", text: value });
    return el("span", { class: "str", text: value === "" ? '""' : value });
  }
  if (typeof value !== "object") return el("span", { class: typeof value, text: String(value) });
  if (Array.isArray(value)) {
    if (value.length === 0) return el("span", { class: "muted", text: "[]" });
    if (value.every((v) => v === null || typeof v !== "object") && value.length <= 32) {
      return el("span", { class: "inline-list", text: `[${value.map(String).join(", ")}]` });
    }
    return el("ol", { class: "list", start: 0 }, ...value.map((v) => el("li", {}, renderValue(v))));
  }
  if (value.$image) return renderImage(value.$image);
  if (value.$tensor) return renderTensor(value.$tensor);
  if (value.$bytes) {
    return el("span", { class: "bytes", title: value.$bytes.base64,
      text: `${value.$bytes.size} bytes` });
  }
  const keys = Object.keys(value);
  if (keys.length === 0) return el("span", { class: "muted", text: "{}" });
  const table = el("table", { class: "kv" });
  for (const key of keys) {
    table.append(el("tr", {}, el("th", { text: key }), el("td", {}, renderValue(value[key]))));
  }
  return table;
}

function renderImage(image) {
  const [height, width] = image.shape;
  const zoom = width <= 320 ? 2 : 1; // small frames (Atari: 160 wide) shown at twice the size
  const img = el("img", {
    class: "frame", src: `data:image/png;base64,${image.png}`,
    width: width * zoom, height: height * zoom,
    alt: `image ${image.shape.join("×")} ${image.dtype}`,
  });
  return el("figure", {}, img,
    el("figcaption", { text: `${image.shape.join("×")} ${image.dtype}` }));
}

function renderTensor(tensor) {
  const caption = `${tensor.shape.join("×") || "scalar"} ${tensor.dtype} (${tensor.size} bytes)`;
  const node = el("div", { class: "tensor" }, el("small", { text: caption }));
  if (tensor.values) node.append(el("pre", { class: "values", text: tensor.values.join(", ") }));
  return node;
}

// -- the page -----------------------------------------------------------------------

const page = {
  info: null,
  actionForm: null,
  optionsForm: null,
  socket: null,
  sessionOpen: false,
  busy: false,
  pending: null,
  entries: 0,
};

function wsUrl(path) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${path}`;
}

async function loadInfo() {
  const response = await fetch("/api/info", { cache: "no-store" });
  if (!response.ok) throw new Error(`/api/info: HTTP ${response.status}`);
  const info = await response.json();
  page.info = info;
  document.title = `${info.env.name} · openenv-grpc console`;
  $("env-name").textContent = info.env.name;
  $("env-version").textContent = info.env.version ? `v${info.env.version}` : "";
  $("env-description").textContent = info.env.description;
  $("target").textContent = info.target;
  $("server-version").textContent = info.server.version;
  $("server-protocol").textContent = info.server.protocol;
  $("security").textContent = [info.tls ? "TLS" : "plaintext", info.token ? "token" : ""]
    .filter(Boolean).join(" + ");
  $("type-action").textContent = info.types.action;
  $("type-observation").textContent = info.types.observation;
  $("type-state").textContent = info.types.state;
  $("type-reset-options").textContent = info.types.reset_options;
  showFigures({ ok: true, ...info.capacity, steps_per_second: null });

  page.actionForm = messageEditor(info.schemas, info.types.action);
  $("action").replaceChildren(page.actionForm.node);
  if (info.schemas[info.types.reset_options]) {
    page.optionsForm = messageEditor(info.schemas, info.types.reset_options);
    $("reset-options").replaceChildren(page.optionsForm.node);
  }
  $("action").addEventListener("input", previewAction);
  $("action").addEventListener("change", previewAction);
  $("action").addEventListener("click", () => setTimeout(previewAction));
  previewAction();
}

function previewAction() {
  try {
    $("action-json").textContent = JSON.stringify(page.actionForm.value(), null, 2);
  } catch (err) {
    $("action-json").textContent = err.message;
  }
}

// Live figures: a socket the console feeds once a second; reconnects if it drops.
function connectLive(delay = 500) {
  const socket = new WebSocket(wsUrl("/api/live"));
  socket.onmessage = (event) => showFigures(JSON.parse(event.data));
  socket.onclose = () => {
    $("live-status").textContent = "console unreachable";
    setTimeout(() => connectLive(Math.min(delay * 2, 10000)), delay);
  };
}

function showFigures(f) {
  if (!f.ok) {
    $("live-status").textContent = `${f.code}: ${f.message}`;
    $("live-status").className = "value bad";
    return;
  }
  $("live-active").textContent = f.active_sessions;
  $("live-max").textContent = f.max_sessions === 0 ? "∞" : f.max_sessions;
  $("live-steps").textContent =
    f.steps_per_second === null || f.steps_per_second === undefined
      ? "–" : f.steps_per_second.toFixed(1);
  $("live-opened").textContent = f.sessions_opened;
  $("live-refused").textContent = f.sessions_refused;
  $("live-workers").textContent = f.workers > 1
    ? `${f.workers} (figures are the answering worker's)` : String(f.workers || 1);
  $("live-status").textContent = f.draining ? "draining" : `serving (pid ${f.pid})`;
  $("live-status").className = f.draining ? "value bad" : "value good";
}

// The session socket: one command in flight at a time, one answer each.
function sessionSocket() {
  if (page.socket && page.socket.readyState <= WebSocket.OPEN) return page.socket;
  const socket = new WebSocket(wsUrl("/api/session"));
  socket.onmessage = (event) => {
    const pending = page.pending;
    page.pending = null;
    if (pending) pending.resolve(JSON.parse(event.data));
  };
  socket.onclose = () => {
    page.socket = null;
    if (page.pending) {
      page.pending.resolve({ type: "error", op: "?", code: "UNAVAILABLE", source: "console",
        message: "the console's connection closed", session: "lost" });
      page.pending = null;
    } else if (page.sessionOpen) {
      addError({ op: "?", code: "UNAVAILABLE", source: "console", session: "lost",
        message: "the console's connection closed: the session ended" });
    }
    setSession(false);
  };
  page.socket = socket;
  return socket;
}

function send(command) {
  const socket = sessionSocket();
  return new Promise((resolve) => {
    page.pending = { resolve };
    const go = () => socket.send(JSON.stringify(command));
    if (socket.readyState === WebSocket.OPEN) go();
    else socket.addEventListener("open", go, { once: true });
  });
}

async function run(command, sent) {
  if (page.busy) return;
  setBusy(true);
  try {
    const answer = await send(command);
    handleAnswer(answer, sent);
  } finally {
    setBusy(false);
  }
}

function handleAnswer(answer, sent) {
  if (answer.type === "error") {
    if (answer.session === "lost" || answer.session === "none") setSession(false);
    addError(answer, sent);
    return;
  }
  hideBanner();
  if (answer.type === "opened") {
    setSession(true, answer.session_id);
    addEntry("open", `session ${answer.session_id || ""} opened`, null);
  } else if (answer.type === "closed") {
    setSession(false);
    addEntry("close", "session closed", null);
  } else if (answer.type === "state") {
    addEntry("state", "state", renderValue(answer.state));
  } else if (answer.type === "result") {
    addResult(answer, sent);
  }
}

function addResult(result, sent) {
  const flags = [];
  if (result.terminated) flags.push("terminated");
  if (result.truncated) flags.push("truncated");
  const reward = result.reward === null ? "none" : result.reward;  // the env gave none
  const title = `${result.op} · step ${result.step_count} · reward ${reward}` +
    (flags.length ? ` · ${flags.join(", ")}` : "");
  const body = el("div", {});
  if (sent !== undefined) {
    body.append(el("details", { class: "sent" }, el("summary", { text: "sent" }),
      el("pre", { text: JSON.stringify(sent, null, 2) })));
  }
  body.append(el("div", { class: "observation" }, renderValue(result.observation)));
  if (result.info && Object.keys(result.info).length) {
    body.append(el("details", { class: "info", open: true }, el("summary", { text: "info" }),
      renderValue(result.info)));
  }
  const entry = addEntry(result.op, title, body);
  entry.dataset.reward = result.reward;
  entry.dataset.terminated = result.terminated;
  entry.dataset.truncated = result.truncated;
  if (flags.length) entry.classList.add("done");
}

function addError(error, sent) {
  const where = error.source === "console" ? "console" : "server";
  const left = { open: "the session is still open", lost: "the session ended",
    none: "no session is open" }[error.session] || "";
  const text = `${error.code}: ${error.message}`;
  const body = el("div", {}, el("p", { class: "message", text }),
    el("p", { class: "muted", text: `refused by the ${where}; ${left}` }));
  if (sent !== undefined) {
    body.append(el("details", { class: "sent" }, el("summary", { text: "sent" }),
      el("pre", { text: JSON.stringify(sent, null, 2) })));
  }
  const entry = addEntry(error.op, `${error.op} failed · ${error.code}`, body);
  entry.classList.add("error");
  entry.dataset.code = error.code;
  const banner = $("error-banner");
  banner.textContent = `${error.op}: ${text} (${left})`;
  banner.dataset.code = error.code;
  banner.hidden = false;
}

function hideBanner() {
  $("error-banner").hidden = true;
}

const MAX_ENTRIES = 500;

function addEntry(kind, title, body) {
  const history = $("history");
  const entry = el("li", { class: `entry ${kind}`, "data-op": kind },
    el("div", { class: "entry-title" },
      el("span", { class: "n", text: `#${++page.entries}` }), el("span", { text: title })),
    body);
  history.append(entry);
  while (history.children.length > MAX_ENTRIES) history.firstElementChild.remove();
  history.scrollTop = history.scrollHeight; // the newest in view, without moving the page
  return entry;
}

function setSession(open, id) {
  page.sessionOpen = open;
  $("session-status").textContent = open ? `session ${id || ""} open` : "no session";
  $("session-status").className = open ? "status good" : "status";
  setBusy(page.busy);
}

function setBusy(busy) {
  page.busy = busy;
  const open = page.sessionOpen;
  $("open-session").disabled = busy || open;
  $("close-session").disabled = busy || !open;
  $("get-state").disabled = busy || !open;
  $("reset").disabled = busy || !open;
  $("step").disabled = busy || !open;
  document.body.classList.toggle("busy", busy);
}

function localError(op, err) {
  addError({ op, code: "INVALID_ARGUMENT", message: err.message, source: "console",
    session: page.sessionOpen ? "open" : "none" });
}

function resetCommand() {
  const command = { op: "reset" };
  const seed = $("reset-seed").value.trim();
  if (seed !== "") {
    if (!INTEGER.test(seed)) throw new InputError("seed: an integer is needed");
    command.seed = Number(seed);
    if (!Number.isSafeInteger(command.seed)) throw new InputError("seed: too large for this page");
  }
  const episode = $("reset-episode-id").value.trim();
  if (episode !== "") command.episode_id = episode;
  if ($("reset-with-options").checked && page.optionsForm) {
    command.options = page.optionsForm.value();
  }
  return command;
}

function wire() {
  $("open-session").addEventListener("click", () => run({ op: "open" }));
  $("close-session").addEventListener("click", () => run({ op: "close" }));
  $("get-state").addEventListener("click", () => run({ op: "state" }));
  $("clear-history").addEventListener("click", () => {
    $("history").replaceChildren();
    hideBanner();
  });
  $("reset-with-options").addEventListener("change", (event) => {
    $("reset-options").hidden = !event.target.checked;
  });
  $("reset-form").addEventListener("submit", (event) => {
    event.preventDefault();
    let command;
    try {
      command = resetCommand();
    } catch (err) {
      if (err instanceof InputError) return localError("reset", err);
      throw err;
    }
    run(command, command.options);
  });
  $("action-form").addEventListener("submit", (event) => {
    event.preventDefault();
    let action;
    try {
      action = page.actionForm.value();
    } catch (err) {
      if (err instanceof InputError) return localError("step", err);
      throw err;
    }
    run({ op: "step", action }, action);
  });
  // Closing the page ends the socket, and with it the session's stream.
  window.addEventListener("pagehide", () => page.socket && page.socket.close());
}

async function main() {
  wire();
  setSession(false);
  try {
    await loadInfo();
  } catch (err) {
    addError({ op: "info", code: "UNAVAILABLE", message: err.message, source: "console",
      session: "none" });
    return;
  }
  connectLive();
  document.body.dataset.ready = "true";
}

main();
