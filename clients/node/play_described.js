#!/usr/bin/env node
'use strict';
// Plays one episode of ANY env server with message types taken from the server itself:
// the Info RPC's FileDescriptorSet becomes a protobufjs Root (no .proto files of the env
// needed; only the core protocol is loaded from proto/). Envs whose types exist only in
// their server, such as an OpenEnv env served with `openenv-grpc serve --openenv`, work
// the same as packaged ones.
//
//   node clients/node/play_described.js --target 127.0.0.1:50051 \
//     --reset '{"seed": 3, "options": {"difficulty": 2}}' --actions '[{"note": "hi"}]'
//
// Values are protobufjs plain objects of the described types: enums by number in actions
// (as verify() wants) and by name in answers, map fields as lists of {key, value} entries (protobufjs reads a
// described map as the repeated entry messages it is on the wire), Struct/Value as
// their fields.
//
// Prints one JSON line: {env_name, types, results: [reset, step...], errors, state, closed}.
// An action refused in-band is recorded in errors (with its index) and the episode goes on.

const grpc = require('@grpc/grpc-js');
const protobuf = require('protobufjs');
require('protobufjs/ext/descriptor'); // adds protobuf.Root.fromDescriptor
const { EnvError, Session, loadProtos } = require('./session');

const INFO_PATH = '/openenv_grpc.v1.EnvService/Info';

function parseArgs(argv) {
  const args = { target: '', reset: {}, actions: [] };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--target') args.target = value;
    else if (flag === '--reset') args.reset = JSON.parse(value);
    else if (flag === '--actions') args.actions = JSON.parse(value);
    else throw new Error(`unknown flag ${flag}`);
  }
  if (!args.target) throw new Error('--target is required');
  if (!Array.isArray(args.actions)) throw new Error('--actions must be a JSON list');
  return args;
}

/** The Info response, decoded by protobufjs (so its FileDescriptorSet can be re-encoded). */
function rawInfo(client, coreRoot) {
  const InfoResponse = coreRoot.lookupType('openenv_grpc.v1.InfoResponse');
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest(
      INFO_PATH, () => Buffer.alloc(0), (buffer) => InfoResponse.decode(buffer), {},
      { deadline: Date.now() + 10000 }, (err, response) => (err ? reject(err) : resolve(response)),
    );
  });
}

/** A Root holding every type the server described, built from its FileDescriptorSet. */
function describedRoot(coreRoot, info) {
  const FileDescriptorSet = coreRoot.lookupType('google.protobuf.FileDescriptorSet');
  const root = protobuf.Root.fromDescriptor(FileDescriptorSet.encode(info.descriptors).finish());
  root.resolveAll();
  return root;
}

/**
 * Drops the virtual fields protobufjs adds for proto3 `optional` fields (their synthetic
 * oneof "_name" naming the field): they say only that the field is set.
 */
function plain(value) {
  if (Array.isArray(value)) return value.map(plain);
  if (value === null || typeof value !== 'object' || Buffer.isBuffer(value)) return value;
  const out = {};
  for (const [key, item] of Object.entries(value)) {
    if (key.startsWith('_') && item === key.slice(1)) continue;
    out[key] = plain(item);
  }
  return out;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const { EnvService, root: coreRoot } = loadProtos();
  const client = new EnvService(args.target, grpc.credentials.createInsecure());
  const summary = { env_name: '', types: {}, results: [], errors: [], state: null, closed: false };
  try {
    const info = await rawInfo(client, coreRoot);
    const types = {
      action_type: info.action_type, observation_type: info.observation_type,
      state_type: info.state_type, reset_options_type: info.reset_options_type,
    };
    summary.env_name = info.env_name;
    summary.types = types;
    const session = await Session.open(client, describedRoot(coreRoot, info), types);
    summary.results.push(await session.reset(args.reset));
    for (const [index, action] of args.actions.entries()) {
      try {
        summary.results.push(await session.step(action));
      } catch (err) {
        if (!(err instanceof EnvError)) throw err;
        summary.errors.push({ index, code: err.code, code_name: err.codeName, message: err.detail });
      }
    }
    summary.state = (await session.state()).state;
    await session.close();
    summary.closed = true;
  } catch (err) {
    summary.failure = String(err.stack || err);
    process.exitCode = 1;
  } finally {
    client.close();
  }
  process.stdout.write(`${JSON.stringify(plain(summary))}\n`);
}

if (require.main === module) {
  main().catch((err) => {
    process.stderr.write(`play_described.js: ${err.stack || err}\n`);
    process.exit(2);
  });
}
