#!/usr/bin/env node
'use strict';
// Steps N echo envs over one VectorSession stream and prints one JSON summary line on
// stdout (progress goes to stderr): per-env episodes, autoresets, in-band errors.
//
//   node clients/node/vector.js --target 127.0.0.1:50051 --envs 4 --autoreset next_step

const grpc = require('@grpc/grpc-js');
const { EnvError, VectorSession, loadProtos } = require('./session');

const USAGE = `usage: node vector.js --target HOST:PORT [options]
  --envs N           envs on the stream (default 4)
  --autoreset MODE   next_step, same_step or disabled (default next_step)
  --max-steps N      env i's episodes are truncated after N + i steps (default 2)
  --steps N          vector steps of every env (default 6)
  --seed N           env i is reset with seed N + i (default 1)`;

function parseArgs(argv) {
  const args = { target: '', envs: 4, autoreset: 'next_step', maxSteps: 2, steps: 6, seed: 1 };
  const numeric = { '--envs': 'envs', '--max-steps': 'maxSteps', '--steps': 'steps', '--seed': 'seed' };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = argv[i + 1];
    if (flag === '-h' || flag === '--help') {
      console.log(USAGE);
      process.exit(0);
    } else if (value === undefined) {
      throw new Error(`${flag} needs a value`);
    } else if (flag === '--target') args.target = value;
    else if (flag === '--autoreset') args.autoreset = value;
    else if (numeric[flag]) {
      if (!/^\d+$/.test(value)) throw new Error(`${flag} needs a non-negative integer, got ${value}`);
      args[numeric[flag]] = Number(value);
    } else throw new Error(`unknown flag ${flag}`);
    i++;
  }
  if (!args.target) throw new Error('--target is required');
  return args;
}

function log(message) {
  process.stderr.write(`vector.js: ${message}\n`);
}

function info(client) {
  return new Promise((resolve, reject) => {
    client.Info({}, { deadline: Date.now() + 10000 }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

/** A request that must be refused as a whole; returns {when, code, code_name, message}. */
async function expectRefusal(when, promise) {
  try {
    await promise;
  } catch (err) {
    if (!(err instanceof EnvError)) throw err;
    log(`${when}: refused, ${err.codeName} (${err.code}): ${err.detail}`);
    return { when, code: err.code, code_name: err.codeName, message: err.detail };
  }
  throw new Error(`${when}: expected the request to be refused, it succeeded`);
}

async function play(envs, args, summary) {
  const n = args.envs;
  const all = [...Array(n).keys()];
  // Per-index errors: no env has been reset, so each answers FAILED_PRECONDITION.
  const early = await envs.step(all.map(() => ({ message: 'too early' })));
  summary.per_env_errors.push({
    when: 'step before reset',
    rows: early.indices.length,
    codes: all.map((i) => (early.errors[i] ? early.errors[i].code : 0)),
  });
  const resets = all.map((i) => ({ seed: args.seed + i, options: { max_steps: args.maxSteps + i } }));
  const first = await envs.reset({ resets });
  if (first.indices.length !== n) throw new Error('reset answered fewer envs than it named');
  summary.refusals.push(await expectRefusal('wrong action count', envs.step([{ message: 'one' }])));
  summary.refusals.push(await expectRefusal('index out of range', envs.step([{ message: 'x' }], { indices: [n] })));
  const counts = all.map(() => 0);
  for (let t = 0; t < args.steps; t++) {
    const messages = all.map((i) => `t${t} e${i}`);
    const out = await envs.step(messages.map((message) => ({ message })));
    out.indices.forEach((index, row) => {
      if (out.autoreset[row]) summary.autoresets[index]++;
      if (out.truncated[row] || out.terminated[row]) summary.episodes_ended[index]++;
      const echoed = out.observations[row].echoed_message;
      const nextStepReset = out.autoreset[row] && args.autoreset === 'next_step';
      if (!out.autoreset[row] && echoed !== messages[index]) throw new Error(`env ${index}: echo mismatch`);
      if (nextStepReset && out.rewards[row] !== 0) throw new Error(`env ${index}: reward after autoreset`);
      counts[index] = out.step_counts[row];
    });
    summary.env_steps += out.indices.length;
    summary.steps++;
  }
  const part = await envs.step([{ message: 'first' }, { message: 'last' }], { indices: [0, n - 1] });
  part.indices.forEach((index, row) => {
    counts[index] = part.step_counts[row];
  });
  summary.partial_rows = part.indices;
  const { rows } = await envs.state();
  summary.step_counts = rows.map((row) => row.step_count);
  summary.state_ok = rows.every((row) => row.step_count === counts[row.index]);
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const { EnvService, root } = loadProtos();
  const client = new EnvService(args.target, grpc.credentials.createInsecure());
  const summary = {
    client: 'node',
    kind: 'vector',
    num_envs: args.envs,
    autoreset: args.autoreset,
    native: null,
    session_id: '',
    per_env_errors: [],
    refusals: [],
    steps: 0,
    env_steps: 0,
    episodes_ended: Array(args.envs).fill(0),
    autoresets: Array(args.envs).fill(0),
    partial_rows: [],
    step_counts: [],
    state_ok: false,
    closed: false,
  };
  try {
    const described = await info(client);
    if (!described.vector || !described.vector.supported) throw new Error('the server serves no VectorSession');
    const envs = await VectorSession.open(client, root, described, args.envs, { autoreset: args.autoreset });
    summary.native = envs.native;
    summary.session_id = envs.sessionId;
    log(`vector session ${envs.sessionId} of ${args.envs} ${described.env_name} envs (${args.autoreset})`);
    await play(envs, args, summary);
    await envs.close();
    summary.closed = true;
  } catch (err) {
    summary.failure = String(err.stack || err);
    process.exitCode = 1;
  } finally {
    client.close();
  }
  process.stdout.write(`${JSON.stringify(summary)}\n`);
}

if (require.main === module) {
  main().catch((err) => {
    log(String(err.stack || err));
    process.exit(2);
  });
}

module.exports = { parseArgs };
