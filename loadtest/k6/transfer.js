// loadtest/k6/transfer.js: transfers of 1 to 100 (POST /transfers) from payers picked at random to
// PAYEES (100) payees picked by a Zipf law, the k-th most popular paid 1/k as often as the first
// (loadtest/README.md). Wallets 0..PAYEES-1 are the payees, the rest the payers.
import { cfg, finish, isLeg, iteration, leg, operation, positiveInt, randomInt, scenario, settle, walletId } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('transfer', { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 });
const PAYEES = positiveInt('PAYEES', 100);
if (PAYEES >= cfg.wallets) throw new Error(`PAYEES (${PAYEES}) must be fewer than WALLETS (${cfg.wallets})`);
// The Zipf law's cumulative weights (payee k, from 1, weighs 1/k), for picking a payee by bisection.
const CDF = [];
for (let k = 1, total = 0; k <= PAYEES; k++) CDF.push((total += 1 / k));
const TOTAL = CDF[CDF.length - 1];

function zipfPayee() {
  const u = Math.random() * TOTAL;
  let lo = 0;
  let hi = CDF.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (CDF[mid] < u) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

function describes(body, op) {
  return body.from === op.wallet && body.to === op.to && body.amount === op.amount && typeof body.id === 'string' &&
    isLeg(body.from_entry, op.wallet, 'transfer_out', op.amount, body.id) &&
    isLeg(body.to_entry, op.to, 'transfer_in', op.amount, body.id);
}

function acked(op, body) {
  return `${leg(op.wallet, -op.amount, body.from_entry.id)},${leg(op.to, op.amount, body.to_entry.id)}`;
}

export default iteration((runId) => {
  const wallet = walletId(runId, randomInt(PAYEES, cfg.wallets - 1));
  const to = walletId(runId, zipfPayee());
  const amount = randomInt(1, 100);
  const key = `${runId}-transfer-${__VU}-${__ITER}`;
  const op = operation({ kind: 'transfer', wallet, to, amount, key, path: '/transfers', route: 'POST /transfers',
    body: `{"from":"${wallet}","to":"${to}","amount":${amount},"reference":"${key}"}`, describes, acked });
  finish(op, settle(op, null));
});
