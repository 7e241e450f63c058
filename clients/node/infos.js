#!/usr/bin/env node
'use strict';
// Prints the infos an echo-like env returns, as this client reads them, on one JSON line:
// a Session's reset and step, a step with message "nan" (an info JSON cannot write, sent
// as a Struct), and a VectorSession's step of 2 envs. BigInts (ints beyond 2^53 - 1) are
// printed as {"$bigint": "digits"}, which JSON.stringify cannot write itself.
//
//   node clients/node/infos.js --target 127.0.0.1:50051

const grpc = require('@grpc/grpc-js');
const { Session, VectorSession, loadProtos } = require('./session');

function info(client) {
  return new Promise((resolve, reject) => {
    client.Info({}, { deadline: Date.now() + 10000 }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

/** JSON.stringify's replacer: a BigInt as {"$bigint": "digits"}. */
function bigints(_key, value) {
  return typeof value === 'bigint' ? { $bigint: value.toString() } : value;
}

async function main() {
  const argv = process.argv.slice(2);
  const at = argv.indexOf('--target');
  if (at < 0 || !argv[at + 1]) throw new Error('usage: node infos.js --target HOST:PORT');
  const { EnvService, root } = loadProtos();
  const client = new EnvService(argv[at + 1], grpc.credentials.createInsecure());
  try {
    const described = await info(client);
    const session = await Session.open(client, root, described);
    const reset = await session.reset();
    const step = await session.step({ message: 'a' });
    const nan = await session.step({ message: 'nan' });
    await session.close();
    const envs = await VectorSession.open(client, root, described, 2);
    await envs.reset();
    const vector = await envs.step([{ message: 'b' }, { message: 'c' }]);
    await envs.close();
    const summary = {
      reset: reset.info,
      step: step.info,
      big_is_bigint: typeof step.info.big === 'bigint',
      lives_is_integer: Number.isInteger(step.info.lives),
      nan_loss_is_nan: Number.isNaN(nan.info.loss),
      nan_info_lives: nan.info.lives,
      vector: vector.infos,
    };
    process.stdout.write(`${JSON.stringify(summary, bigints)}\n`);
  } finally {
    client.close();
  }
}

main().catch((err) => {
  process.stderr.write(`infos.js: ${err.stack || err}\n`);
  process.exit(1);
});
