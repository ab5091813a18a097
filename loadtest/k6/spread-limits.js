// loadtest/k6/spread-limits.js: spread (payments of 1 to 100 from wallets picked at random) on
// wallets that each have a daily and a monthly velocity limit, set by setup, high enough never to
// refuse: what checking and counting them costs a payment (loadtest/README.md).
import { anyWallet, iteration, move, randomInt, scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('spread-limits', {
  wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 1000, p99_ms: 2000,
  limits: { velocity: [{ per: 'day', amount: 1000000000, count: 1000000 }, { per: 'month', amount: 1000000000 }] },
});
export default iteration((runId) => move(runId, 'pay', anyWallet(runId), randomInt(1, 100)));
