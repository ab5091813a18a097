// loadtest/k6/mixed.js: deposits (40%) and payments (60%) on small wallets, so that some payments
// meet insufficient funds (loadtest/README.md).
import { anyWallet, iteration, move, randomInt, scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('mixed', { wallets: 100, initial: 100, vus: 32, p95_ms: 1000, p99_ms: 2000 });
export default iteration((runId) => {
  if (Math.random() < 0.4) move(runId, 'deposit', anyWallet(runId), randomInt(1, 50));
  else move(runId, 'pay', anyWallet(runId), randomInt(1, 40));
});
