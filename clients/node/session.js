'use strict';
// openenv-grpc clients for Node.js: a Session stream owns one environment, a VectorSession
// stream owns N of them (stepped together, one message each way per vector step).
//
// No generated code: the core protocol (proto/openenv_grpc/v1/session.proto) is loaded by
// @grpc/proto-loader for the service stub, and every env's messages (the .proto files
// under proto/) are loaded into a protobufjs Root that packs and unpacks the
// google.protobuf.Any payloads. Both read the .proto files when the process starts.

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const { INFO_JSON, INFO_KEY, infoOf, infosOf } = require('./info_json');

/** The repo's proto/ folder; OPENENV_PROTO_DIR overrides it for a client copied elsewhere. */
const PROTO_DIR = process.env.OPENENV_PROTO_DIR || path.resolve(__dirname, '..', '..', 'proto');
const SESSION_PROTO = 'openenv_grpc/v1/session.proto';
const TYPE_URL_PREFIX = 'type.googleapis.com/';
const ADMITTED_KEY = 'openenv-env';
const SESSION_ID_KEY = 'openenv-session-id';
const RETRY_PUSHBACK_KEY = 'grpc-retry-pushback-ms';
const NUM_ENVS_KEY = 'openenv-num-envs';
const AUTORESET_KEY = 'openenv-autoreset';
const BATCH_KEY = 'openenv-batch';

/** Call metadata every stream opens with: infos as JSON text, so ints stay ints. */
function openMetadata() {
  const metadata = new grpc.Metadata();
  metadata.set(INFO_KEY, INFO_JSON);
  return metadata;
}

/** gRPC status code numbers to names, e.g. 8 -> "RESOURCE_EXHAUSTED". */
const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

// Shapes of decoded messages: snake_case fields as in the .proto, 64-bit integers as JS
// numbers (step counts and ids stay far below 2^53), enums by name, unset fields at their
// defaults, and a virtual field naming each oneof's chosen member.
const CONVERSION = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };

/** Every .proto file under dir, relative to it (e.g. "openenv_grpc_envs/echo/v1/echo.proto"). */
function protoFiles(dir, prefix = '') {
  const found = [];
  for (const entry of fs.readdirSync(path.join(dir, prefix), { withFileTypes: true })) {
    const rel = prefix ? `${prefix}/${entry.name}` : entry.name;
    if (entry.isDirectory()) found.push(...protoFiles(dir, rel));
    else if (entry.name.endsWith('.proto')) found.push(rel);
  }
  return found.sort();
}

/**
 * Loads the service stub and every message type from protoDir.
 * Returns {EnvService, root}: the grpc-js client constructor and a protobufjs Root holding
 * all types under proto/ (the google/protobuf well-known types come bundled with
 * protobufjs, so imports of them resolve without a protoc install).
 */
function loadProtos(protoDir = PROTO_DIR) {
  const definition = protoLoader.loadSync(SESSION_PROTO, { ...CONVERSION, includeDirs: [protoDir] });
  const { EnvService } = grpc.loadPackageDefinition(definition).openenv_grpc.v1;
  const root = new protobuf.Root();
  // Names and imports are relative to proto/, as for protoc; protobufjs serves the
  // google/protobuf/*.proto well-known types itself.
  root.resolvePath = (_origin, target) =>
    target.startsWith('google/protobuf/') ? target : path.join(protoDir, target);
  root.loadSync(protoFiles(protoDir), { keepCase: true });
  root.resolveAll();
  return { EnvService, root };
}

/** An in-band failure of one request: the session stays usable. */
class EnvError extends Error {
  constructor(error) {
    super(`${CODE_NAMES[error.code] || error.code}: ${error.message}`);
    this.code = error.code;
    this.codeName = CODE_NAMES[error.code] || String(error.code);
    this.detail = error.message;
    this.exceptionType = error.exception_type;
  }
}

/** The server refused to open a session because it is full (RESOURCE_EXHAUSTED). */
class CapacityError extends Error {
  constructor(status, pushbackMs) {
    super(status.details);
    this.code = status.code;
    this.pushbackMs = pushbackMs; // null when the server sent no (valid) hint
  }
}

/** The stream ended (or could not open) for any other reason. */
class SessionLost extends Error {
  constructor(status) {
    super(`${CODE_NAMES[status.code] || status.code}: ${status.details}`);
    this.code = status.code;
  }
}

function pushbackOf(metadata) {
  // A missing, negative or non-numeric hint means "do not retry" (gRPC retry semantics).
  const values = metadata ? metadata.get(RETRY_PUSHBACK_KEY) : [];
  const ms = values.length ? Number(String(values[0])) : NaN;
  return Number.isInteger(ms) && ms >= 0 ? ms : null;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * What both kinds of stream share: request ids, answers matched to them (notices, with
 * request_id 0, answer nothing and are dropped), in-band errors, the stream's end, and
 * packing of the google.protobuf.Any payloads.
 */
class Stream {
  constructor(call, root, types) {
    this._call = call;
    this._root = root;
    this.types = types; // full names of the env's action/observation/state/options types
    this.sessionId = '';
    this.headers = null; // the server's response headers, once admitted
    this._nextId = 1;
    this._pending = new Map(); // request_id -> {resolve, reject}
    this._ended = null; // the SessionLost that ended the stream, once it has
    call.on('data', (response) => this._answer(response));
    call.on('error', (err) => this._end(new SessionLost(err)));
    call.on('end', () => this._end(new SessionLost({ code: grpc.status.OK, details: 'stream ended' })));
  }

  /**
   * Resolves with the stream once the server admitted it (its envs exist): `makeCall`
   * starts the call, `makeStream(call)` wraps it. Rejects with CapacityError when the
   * server is full, SessionLost on any other refusal.
   */
  static _admit(makeCall, makeStream) {
    return new Promise((resolve, reject) => {
      const call = makeCall();
      const stream = makeStream(call);
      call.once('metadata', (metadata) => {
        const admitted = metadata.get(ADMITTED_KEY);
        if (!admitted.length) return; // trailers-only refusal: 'status' tells why
        stream.sessionId = String(metadata.get(SESSION_ID_KEY)[0] || '');
        stream.headers = metadata;
        resolve(stream);
      });
      call.once('status', (status) => {
        if (status.code === grpc.status.RESOURCE_EXHAUSTED) {
          reject(new CapacityError(status, pushbackOf(status.metadata)));
        } else {
          reject(new SessionLost(status));
        }
      });
    });
  }

  /** Packs a plain object as a google.protobuf.Any of the named message type. */
  pack(typeName, object) {
    const type = this._root.lookupType(typeName);
    const problem = type.verify(object);
    if (problem) throw new TypeError(`${typeName}: ${problem}`);
    const value = type.encode(type.fromObject(object)).finish();
    return { type_url: TYPE_URL_PREFIX + typeName, value: Buffer.from(value) };
  }

  /** Unpacks a google.protobuf.Any into a plain object (its type taken from type_url). */
  unpack(any) {
    if (!any || !any.type_url) return null;
    const type = this._root.lookupType(any.type_url.slice(any.type_url.lastIndexOf('/') + 1));
    return type.toObject(type.decode(any.value), CONVERSION);
  }

  _answer(response) {
    const waiter = this._pending.get(response.request_id);
    if (!waiter) return; // an answer nobody waits for any more
    this._pending.delete(response.request_id);
    if (response.outcome === 'error') waiter.reject(new EnvError(response.error));
    else waiter.resolve(response);
  }

  _end(err) {
    if (this._ended) return;
    this._ended = err;
    for (const waiter of this._pending.values()) waiter.reject(err);
    this._pending.clear();
  }

  _request(command, body) {
    if (this._ended) return Promise.reject(this._ended);
    const request_id = this._nextId++;
    return new Promise((resolve, reject) => {
      this._pending.set(request_id, { resolve, reject });
      this._call.write({ request_id, [command]: body });
    });
  }

  /** Closes the env(s) and ends the stream; returns once the server confirmed the close. */
  async close() {
    await this._request('close', {});
    this._call.end();
  }
}

/** One Session stream (one env); use Session.open() to make one. */
class Session extends Stream {
  /**
   * Opens a session on client; returns it once the server admitted it (its env exists).
   * Throws CapacityError when the server is full, SessionLost on any other refusal.
   */
  static open(client, root, types) {
    return Stream._admit(() => client.Session(openMetadata()), (call) => new Session(call, root, types));
  }

  /**
   * Opens a session, retrying while the server is full: each retry waits the server's
   * grpc-retry-pushback-ms hint (fallbackMs when it sent none). onRefused(err, attempt)
   * is called before each wait. Throws the last CapacityError after `retries` retries.
   */
  static async openWithRetry(client, root, types, { retries = 20, fallbackMs = 500, onRefused } = {}) {
    for (let attempt = 1; ; attempt++) {
      try {
        return await Session.open(client, root, types);
      } catch (err) {
        if (!(err instanceof CapacityError) || attempt > retries) throw err;
        if (onRefused) onRefused(err, attempt);
        await sleep(err.pushbackMs === null ? fallbackMs : err.pushbackMs);
      }
    }
  }

  /**
   * Starts an episode; returns {observation, reward, terminated, truncated, episode_id,
   * step_count, info}: info a plain object, its ints Numbers (BigInts beyond 2^53 - 1).
   */
  async reset({ seed, episodeId, options } = {}) {
    const body = {};
    if (seed !== undefined) body.seed = seed;
    if (episodeId !== undefined) body.episode_id = episodeId;
    if (options) body.options = this.pack(this.types.reset_options_type, options);
    return this._result(await this._request('reset', body));
  }

  /** Applies one action (a plain object of the env's action type); returns like reset(). */
  async step(action) {
    const response = await this._request('step', { action: this.pack(this.types.action_type, action) });
    return this._result(response);
  }

  /** Returns {state, episode_id, step_count}: the env's state as a plain object. */
  async state() {
    const { state } = await this._request('state', {});
    return { ...state, state: this.unpack(state.state) };
  }

  /**
   * Returns {frame, episode_id, step_count}: a picture of the env, `frame.text` or
   * `frame.image` ({height, width, channels, pixels: Buffer}). In-band errors:
   * UNIMPLEMENTED (the env does not render), INTERNAL (its render raised).
   */
  async render() {
    const { rendered } = await this._request('render', {});
    return rendered;
  }

  /**
   * Captures the current episode; returns the snapshot as a Buffer (signed by the server,
   * opaque here): restore() it on this session, another one, or any server of the same env
   * and version that holds the key. Rejects with an EnvError: UNIMPLEMENTED (the env has no
   * snapshots), FAILED_PRECONDITION (no episode yet), RESOURCE_EXHAUSTED (over the limit).
   */
  async snapshot() {
    const { snapshot } = await this._request('snapshot', {});
    return snapshot.snapshot;
  }

  /**
   * Continues from a snapshot (a Buffer from snapshot()); returns
   * {episode_id, step_count, terminated, truncated}: where the session now is. Rejects with
   * an EnvError, the episode unchanged: INVALID_ARGUMENT (altered, truncated, over the
   * limit), FAILED_PRECONDITION (another key, env or env version), UNIMPLEMENTED.
   */
  async restore(snapshot) {
    const { restored } = await this._request('restore', { snapshot });
    return restored;
  }

  _result({ result }) {
    const { info_json: _text, ...rest } = result;
    return { ...rest, observation: this.unpack(result.observation), info: infoOf(result) };
  }
}

/**
 * One VectorSession stream: numEnvs envs, indexed 0 .. numEnvs-1, admitted all or none.
 * Every call names the envs it is about with `indices` (increasing; omitted: all).
 * Results are columns, one row per env that answered (`indices`, `observations`,
 * `rewards`, `terminated`, `truncated`, `episode_ids`, `step_counts`, `autoreset`, ...;
 * `infos` and `final_infos` by env index, plain objects with their ints kept);
 * an env that failed has no row but an entry in `errors` (by index) and the others still
 * answer. A refused request (bad indices, wrong action count, ...) rejects with EnvError.
 */
class VectorSession extends Stream {
  constructor(call, root, types, numEnvs) {
    super(call, root, types);
    this.numEnvs = numEnvs;
    this.native = false; // the server answers in batch form (header openenv-batch: native)
  }

  /**
   * Opens a vector stream of numEnvs envs; autoreset is next_step, same_step or disabled.
   * Throws CapacityError when numEnvs slots are not free, SessionLost on any other refusal.
   */
  static async open(client, root, types, numEnvs, { autoreset = 'next_step' } = {}) {
    const metadata = openMetadata();
    metadata.set(NUM_ENVS_KEY, String(numEnvs));
    metadata.set(AUTORESET_KEY, autoreset);
    const stream = await Stream._admit(
      () => client.VectorSession(metadata),
      (call) => new VectorSession(call, root, types, numEnvs),
    );
    stream.native = String(stream.headers.get(BATCH_KEY)[0] || '') === 'native';
    return stream;
  }

  /** Resets the envs named; `resets` is one {seed, episodeId, options} per env, or none. */
  async reset({ indices = [], resets = [] } = {}) {
    const envs = resets.map(({ seed, episodeId, options }) => {
      const command = {};
      if (seed !== undefined) command.seed = seed;
      if (episodeId !== undefined) command.episode_id = episodeId;
      if (options) command.options = this.pack(this.types.reset_options_type, options);
      return command;
    });
    return this._columns(await this._request('reset', { indices, envs }));
  }

  /** Steps the envs named with one action (a plain object) each. */
  async step(actions, { indices = [] } = {}) {
    const packed = actions.map((action) => this.pack(this.types.action_type, action));
    return this._columns(await this._request('step', { indices, actions: packed }));
  }

  /** Returns {rows: [{index, state, episode_id, step_count}], errors} for the envs named. */
  async state({ indices = [] } = {}) {
    const { states } = await this._request('state', { indices });
    const rows = states.states.map((entry, row) => ({
      index: states.indices[row],
      state: this.unpack(entry.state),
      episode_id: entry.episode_id,
      step_count: entry.step_count,
    }));
    return { rows, errors: states.errors };
  }

  _columns({ result }) {
    const observations = result.observations.map((any) => this.unpack(any));
    const autoreset = result.autoreset.length ? result.autoreset : result.indices.map(() => false);
    // Infos by env index, as plain objects (see info_json.js), whichever map they came in.
    const { infos_json: _texts, final_infos_json: _finalTexts, ...rest } = result;
    const infos = infosOf(result.infos, result.infos_json);
    const final_infos = infosOf(result.final_infos, result.final_infos_json);
    return { ...rest, observations, autoreset, infos, final_infos };
  }
}

module.exports = {
  CODE_NAMES,
  CapacityError,
  EnvError,
  PROTO_DIR,
  Session,
  SessionLost,
  VectorSession,
  loadProtos,
};
