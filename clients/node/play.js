#!/usr/bin/env node
'use strict';
// Plays full episodes of echo or an OpenSpiel game against an openenv-grpc server and
// prints one JSON summary line on stdout (progress goes to stderr).
//
//   node clients/node/play.js --target 127.0.0.1:50051 --env echo
//   node clients/node/play.js --target 127.0.0.1:50051 --env openspiel --game tic_tac_toe

const grpc = require('@grpc/grpc-js');
const { CODE_NAMES, CapacityError, EnvError, Session, loadProtos } = require('./session');

const USAGE = `usage: node play.js --target HOST:PORT --env echo|openspiel [options]
  --episodes N       episodes to play (default 2)
  --max-steps N      echo: EchoResetOptions.max_steps, the episode is truncated after it (default 3)
  --game NAME        openspiel: the game (default tic_tac_toe)
  --seed N           first episode's seed; episode i uses seed+i (default 1)
  --open-retries N   retries of a refused open while the server is full (default 20)
  --snapshot         echo: first branch an episode: snapshot it, play on, restore it on
                     the same and on a second session, replay, and send a tampered copy`;

function parseArgs(argv) {
  const args = {
    target: '', env: '', episodes: 2, maxSteps: 3, game: 'tic_tac_toe', seed: 1, openRetries: 20, snapshot: false,
  };
  const numeric = { '--episodes': 'episodes', '--max-steps': 'maxSteps', '--seed': 'seed', '--open-retries': 'openRetries' };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = argv[i + 1];
    if (flag === '-h' || flag === '--help') {
      console.log(USAGE);
      process.exit(0);
    } else if (flag === '--snapshot') {
      args.snapshot = true;
      continue;
    } else if (value === undefined) {
      throw new Error(`${flag} needs a value`);
    } else if (flag === '--target') args.target = value;
    else if (flag === '--env') args.env = value;
    else if (flag === '--game') args.game = value;
    else if (numeric[flag]) {
      if (!/^\d+$/.test(value)) throw new Error(`${flag} needs a non-negative integer, got ${value}`);
      args[numeric[flag]] = Number(value);
    } else throw new Error(`unknown flag ${flag}`);
    i++;
  }
  if (!args.target) throw new Error('--target is required');
  if (args.env !== 'echo' && args.env !== 'openspiel') throw new Error('--env must be echo or openspiel');
  return args;
}

function log(message) {
  process.stderr.write(`play.js: ${message}\n`);
}

/**
 * Sends a request that must fail in-band; returns the error as {code, code_name, message, when}.
 * Throws if it succeeded: the server broke the protocol.
 */
async function expectError(when, promise) {
  try {
    await promise;
  } catch (err) {
    if (!(err instanceof EnvError)) throw err;
    log(`${when}: in-band error ${err.codeName} (${err.code}): ${err.detail}`);
    return { when, code: err.code, code_name: err.codeName, message: err.detail };
  }
  throw new Error(`${when}: expected an in-band error, the request succeeded`);
}

/** Echo: each episode is truncated after maxSteps; the state's total_length is checked. */
async function playEcho(session, args, summary) {
  summary.errors.push(await expectError('step before reset', session.step({ message: 'too early' })));
  for (let i = 0; i < args.episodes; i++) {
    let result = await session.reset({ seed: args.seed + i, options: { max_steps: args.maxSteps } });
    let totalLength = 0;
    let reward = 0;
    while (!result.terminated && !result.truncated) {
      const message = `episode ${i} step ${result.step_count + 1}`;
      result = await session.step({ message });
      if (result.observation.echoed_message !== message) throw new Error('echo mismatch');
      totalLength += [...message].length;
      reward += result.reward;
    }
    const { state, step_count } = await session.state();
    summary.episodes.push({
      episode_id: result.episode_id,
      steps: result.step_count,
      reward,
      terminated: result.terminated,
      truncated: result.truncated,
      state_step_count: step_count,
      state_ok: state.total_length === totalLength && state.seed === args.seed + i,
    });
    if (i === 0) {
      summary.errors.push(await expectError('step after truncation', session.step({ message: 'late' })));
    }
  }
}

/** Steps each message; returns the rewards. */
async function rewardsOf(session, messages) {
  const rewards = [];
  for (const message of messages) rewards.push((await session.step({ message })).reward);
  return rewards;
}

/**
 * Echo with --snapshot: a seeded episode branched after two steps. The snapshot is restored
 * on the same session and on a second one, and the same messages must give the same
 * rewards; a tampered copy must be refused in-band with the session going on. An env
 * without snapshots answers UNIMPLEMENTED: recorded, and the run goes on. `open` opens a
 * session on the server.
 */
async function playSnapshots(open, args, summary) {
  const session = await open(); // sessions of their own: the main one plays on afterwards
  try {
    await branchEpisode(session, open, args, summary);
  } finally {
    await session.close();
  }
}

async function branchEpisode(session, open, args, summary) {
  await session.reset({ seed: args.seed, options: { max_steps: 100 } });
  await rewardsOf(session, ['prefix 1', 'prefix 2']);
  let snapshot;
  try {
    snapshot = await session.snapshot();
  } catch (err) {
    if (!(err instanceof EnvError)) throw err;
    log(`snapshot: in-band error ${err.codeName} (${err.code}): ${err.detail}`);
    summary.snapshot = { code: err.code, code_name: err.codeName, message: err.detail };
    return;
  }
  const messages = ['one', 'two', 'three'];
  const original = await rewardsOf(session, messages);
  const restored = await session.restore(snapshot);
  const again = await rewardsOf(session, messages);
  const other = await open();
  const elsewhere = await other.restore(snapshot);
  const there = await rewardsOf(other, messages);
  const tampered = Buffer.from(snapshot);
  tampered[tampered.length - 1] ^= 1;
  const refused = await expectError('tampered snapshot', other.restore(tampered));
  const after = await other.step({ message: 'after the refusal' });
  await other.close();
  summary.snapshot = {
    bytes: snapshot.length,
    hex: snapshot.toString('hex'),
    restored: { episode_id: restored.episode_id, step_count: restored.step_count },
    elsewhere: { episode_id: elsewhere.episode_id, step_count: elsewhere.step_count },
    original,
    again,
    there,
    tampered_code: refused.code,
    step_after_refusal: after.step_count,
  };
}

/** A small seeded generator so that a run is repeatable (xorshift32). */
function rng(seed) {
  let x = (seed >>> 0) || 0x9e3779b9;
  return (n) => {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    return x % n;
  };
}

/** An id the observer may not play now: the smallest non-negative id not among the legal ones. */
function illegalId(legalActions) {
  const legal = new Set(legalActions.map((a) => a.id));
  let id = 0;
  while (legal.has(id)) id++;
  return id;
}

/** OpenSpiel: the agent (seat 0) picks seeded-random legal actions against random opponents. */
async function playOpenSpiel(session, args, summary) {
  summary.errors.push(await expectError('step before reset', session.step({ id: 0 })));
  const pick = rng(args.seed);
  for (let i = 0; i < args.episodes; i++) {
    let result = await session.reset({ seed: args.seed + i, options: { game: args.game } });
    let reward = 0;
    if (i === 0) {
      const bad = illegalId(result.observation.legal_actions);
      summary.errors.push(await expectError(`illegal action id ${bad}`, session.step({ id: bad })));
    }
    while (!result.terminated && !result.truncated) {
      const legal = result.observation.legal_actions;
      if (!legal.length) throw new Error('no legal action in a running episode');
      result = await session.step({ id: legal[pick(legal.length)].id });
      reward += result.reward;
    }
    const { state, step_count } = await session.state();
    const { frame } = await session.render();
    summary.episodes.push({
      episode_id: result.episode_id,
      steps: result.step_count,
      reward,
      terminated: result.terminated,
      truncated: result.truncated,
      returns: result.observation.returns,
      state_step_count: step_count,
      state_ok: state.terminal === result.observation.terminal && state.game !== '',
      game: state.game,
      board_ok: frame.text !== '' && frame.text === state.state_string,
    });
  }
}

function info(client) {
  return new Promise((resolve, reject) => {
    client.Info({}, { deadline: Date.now() + 10000 }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const { EnvService, root } = loadProtos();
  const client = new EnvService(args.target, grpc.credentials.createInsecure());
  const summary = {
    client: 'node',
    env: args.env,
    env_name: '',
    session_id: '',
    capacity: { refusals: 0, pushback_ms: [], admitted: false },
    errors: [],
    episodes: [],
    episodes_finished: 0,
    closed: false,
  };
  try {
    const described = await info(client);
    summary.env_name = described.env_name;
    const session = await Session.openWithRetry(client, root, described, {
      retries: args.openRetries,
      onRefused(err, attempt) {
        summary.capacity.refusals++;
        summary.capacity.pushback_ms.push(err.pushbackMs);
        log(`open refused (attempt ${attempt}): RESOURCE_EXHAUSTED: ${err.message}; retrying in ${err.pushbackMs} ms`);
      },
    });
    summary.capacity.admitted = true;
    summary.session_id = session.sessionId;
    log(`session ${session.sessionId} open on ${described.env_name}`);
    if (args.snapshot) await playSnapshots(() => Session.open(client, root, described), args, summary);
    await (args.env === 'echo' ? playEcho : playOpenSpiel)(session, args, summary);
    await session.close();
    summary.closed = true;
  } catch (err) {
    summary.failure = err instanceof CapacityError ? `RESOURCE_EXHAUSTED: ${err.message}` : String(err.stack || err);
    process.exitCode = 1;
  } finally {
    summary.episodes_finished = summary.episodes.filter((e) => e.terminated || e.truncated).length;
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

module.exports = { CODE_NAMES, illegalId, parseArgs };
