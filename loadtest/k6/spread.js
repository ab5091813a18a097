// loadtest/k6/spread.js: payments of 1 to 100 from wallets picked at random (loadtest/README.md).
import { anyWallet, iteration, move, randomInt, scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('spread', { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 1000, p99_ms: 2000 });
export default iteration((runId) => move(runId, 'pay', anyWallet(runId), randomInt(1, 100)));
