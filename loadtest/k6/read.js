// loadtest/k6/read.js: GET /wallets/{id} on wallets picked at random, the read ceiling
// (loadtest/README.md).
import http from 'k6/http';
import { JSON_HEADERS, anyWallet, cfg, iteration, json, judge, scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('read', { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 1000, p99_ms: 2000, op: 'read' });
// One read of a wallet: a 200 with that wallet's figures, or an unexpected answer.
export default iteration((runId) => {
  const wallet = anyWallet(runId);
  const res = http.get(`${cfg.baseUrl}/wallets/${wallet}`, { headers: JSON_HEADERS, tags: { op: 'read', name: 'GET /wallets/{id}' } });
  const body = res.status === 200 ? json(res) : null;
  judge(res, body !== null && body.id === wallet && Number.isInteger(body.balance) && body.balance >= 0, 'read: the wallet');
});
