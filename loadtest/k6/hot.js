// loadtest/k6/hot.js: every VU pays 1 from one wallet (loadtest/README.md).
import { iteration, move, scenario, walletId } from './lib.js';

export { setup, handleSummary } from './lib.js';
// Every payment waits for the one wallet's lease, one holder at a time, so the latency bound is the
// lease wait (LEASE_WAIT, 3 s): a p99 under it means payments get the lease before they give up.
export const options = scenario('hot', { wallets: 1, initial: 1000000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 });
export default iteration((runId) => move(runId, 'pay', walletId(runId, 0), 1));
