// loadtest/k6/health.js: GET /healthz through nginx (no token, no Redis, no Postgres), the health
// ceiling (loadtest/README.md).
import http from 'k6/http';
import { cfg, iteration, json, judge, scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('health', { wallets: 0, initial: 1, vus: 64, p95_ms: 1000, p99_ms: 2000, op: 'health' });
export default iteration(() => {
  const res = http.get(`${cfg.baseUrl}/healthz`, { tags: { op: 'health', name: 'GET /healthz' } });
  const body = res.status === 200 ? json(res) : null;
  judge(res, body !== null && body.status === 'ok', 'health: ok');
});
