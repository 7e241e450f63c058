'use strict';
// A burst of Session opens at once on ONE grpc-js channel (one HTTP/2 connection), with no
// retry: what a plain grpc-js client sees when it opens more sessions than the server
// holds. Prints one JSON line: how many opens were admitted, and every other outcome by
// status code, with or without the server's grpc-retry-pushback-ms hint.
//
//   node burst.js TARGET COUNT [--write-first]
//
// --write-first sends a reset before the headers arrive (a client that does not wait to
// be admitted); by default each open waits for the headers, as session.js does.

const grpc = require('@grpc/grpc-js');
const { loadProtos } = require('./session');

const ADMITTED_KEY = 'openenv-env';
const RETRY_PUSHBACK_KEY = 'grpc-retry-pushback-ms';
const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

function main() {
  const [target, countText, ...flags] = process.argv.slice(2);
  const count = Number(countText);
  const writeFirst = flags.includes('--write-first');
  const { EnvService } = loadProtos();
  const client = new EnvService(target, grpc.credentials.createInsecure());
  const admitted = [];
  const outcomes = {};
  let settled = 0;
  const settle = () => {
    settled += 1;
    if (settled < count) return;
    // Every open has its answer: let the admitted ones go, then report.
    for (const call of admitted) call.end();
    const summary = { admitted: admitted.length, outcomes };
    setTimeout(() => {
      process.stdout.write(`${JSON.stringify(summary)}\n`);
      client.close();
      process.exit(0);
    }, 200);
  };
  for (let i = 0; i < count; i += 1) {
    const call = client.Session();
    let done = false;
    call.on('data', () => {});
    call.on('error', () => {}); // the outcome is read from 'status'
    call.once('metadata', (metadata) => {
      if (done || !metadata.get(ADMITTED_KEY).length) return;
      done = true;
      admitted.push(call);
      settle();
    });
    call.once('status', (status) => {
      if (done) return;
      done = true;
      const hint = status.metadata.get(RETRY_PUSHBACK_KEY).length ? 'pushback' : 'no pushback';
      const key = `${CODE_NAMES[status.code] || status.code} (${hint})`;
      outcomes[key] = (outcomes[key] || 0) + 1;
      settle();
    });
    if (writeFirst) call.write({ request_id: 1, reset: {} });
  }
}

main();
