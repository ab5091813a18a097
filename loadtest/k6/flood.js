// loadtest/k6/flood.js: FLOOD (10,000) payments of 1 on one wallet, all sent at the same instant,
// each on a connection of its own, once: VUS (10) users each send their share in one http.batch
// (loadtest/README.md). DURATION only bounds the run.
import http from 'k6/http';
import { cfg, classify, finish, iteration, payment, positiveInt, scenario, walletId } from './lib.js';

export { setup, handleSummary } from './lib.js';
// A shed answer is immediate, a served one waits its turn: bounded by nginx's read timeout.
export const options = scenario('flood', { wallets: 1, initial: 1000000000000, vus: 10, p95_ms: 10000, p99_ms: 10000 });
const FLOOD = positiveInt('FLOOD', 10000);
const SHARE = Math.ceil(FLOOD / cfg.vus);
if (!cfg.openOnly) {
  options.scenarios.flood = { executor: 'per-vu-iterations', vus: cfg.vus, iterations: 1, maxDuration: cfg.duration, gracefulStop: '15s' };
}
// A flood is that many clients, not one client's keep-alive pool.
Object.assign(options, { batch: Math.max(100, SHARE), batchPerHost: Math.max(100, SHARE), noConnectionReuse: true });
// A flood user runs one iteration: it logs its record at its end.
cfg.acksBatched = false;

// Each answer is final (a client told to come back later does, but not within the flood); one that
// leaves the outcome open is logged undecided and settled by the book check.
export default iteration((runId) => {
  const ops = [];
  for (let i = 0; i < SHARE && (__VU - 1) * SHARE + i < FLOOD; i++) {
    ops.push(payment('pay', walletId(runId, 0), 1, `${runId}-flood-${__VU}-${i}`));
  }
  http.batch(ops).forEach((res, i) => {
    const outcome = classify(res, ops[i]);
    finish(ops[i], outcome.decided === null ? null : outcome);
  });
});
