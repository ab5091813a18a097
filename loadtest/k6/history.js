// loadtest/k6/history.js: the history's reads of one long wallet (WALLET, its entries written
// between FROM and TO; loadtest/bench-history seeds it) beside GET /wallets/{id} of the same
// wallet, VUS users each, while PAY_VUS users pay WALLETS other wallets spread at random. Each
// scenario's p99 goes to SUMMARY (tab-separated), for loadtest/bench-history's ratios.
import http from 'k6/http';
import { check } from 'k6';
import exec from 'k6/execution';

const base = __ENV.BASE_URL;
const wallet = __ENV.WALLET;
const from = Date.parse(__ENV.FROM);
const to = Date.parse(__ENV.TO);
const vus = parseInt(__ENV.VUS || '8', 10);
const payVus = parseInt(__ENV.PAY_VUS || '16', 10);
const spread = parseInt(__ENV.WALLETS || '1000', 10);
const duration = __ENV.DURATION || '30s';
const DAY_MS = 24 * 3600 * 1000;
const headers = { 'Content-Type': 'application/json' };
if (__ENV.API_TOKEN) headers.Authorization = `Bearer ${__ENV.API_TOKEN}`;

const READS = ['read', 'balance_at', 'statement', 'entries'];
export const options = {
  scenarios: { pay: { executor: 'constant-vus', vus: payVus, duration, exec: 'pay' } },
  // A threshold per scenario, so the summary has each one's figures.
  thresholds: {},
  summaryTrendStats: ['avg', 'p(50)', 'p(99)', 'max', 'count'],
};
for (const name of ['pay', ...READS]) {
  if (name !== 'pay') options.scenarios[name] = { executor: 'constant-vus', vus, duration, exec: name };
  options.thresholds[`http_req_duration{scenario:${name}}`] = ['max>=0'];
  options.thresholds[`checks{scenario:${name}}`] = ['rate>0.99'];
}

const iso = (ms) => new Date(ms).toISOString();
const instant = () => from + Math.random() * (to - from);
const ok = (res, what) => check(res, { [what]: (r) => r.status === 200 });

export function setup() {
  const run = `hb-${Date.now()}`;
  for (let i = 0; i < spread; i++) {
    const res = http.post(`${base}/wallets`, JSON.stringify({ id: `${run}-${i}`, balance: 1000000000 }), { headers });
    if (res.status !== 201) throw new Error(`opening ${run}-${i}: ${res.status} ${res.body}`);
  }
  return { run };
}

export function pay(data) {
  const target = `${data.run}-${Math.floor(Math.random() * spread)}`;
  const keyed = Object.assign({ 'Idempotency-Key': `${data.run}-${exec.vu.idInTest}-${exec.vu.iterationInScenario}` }, headers);
  const res = http.post(`${base}/wallets/${target}/pay`, JSON.stringify({ amount: 1 }), { headers: keyed });
  ok(res, 'paid');
}

// The read ceiling: the wallet itself.
export function read() {
  ok(http.get(`${base}/wallets/${wallet}`, { headers }), 'the wallet');
}

export function balance_at() {
  ok(http.get(`${base}/wallets/${wallet}/balance?at=${iso(instant())}`, { headers }), 'as of');
}

// The whole period's statement: every entry of it counted and summed.
export function statement() {
  ok(http.get(`${base}/wallets/${wallet}/statement?from=${iso(from)}&to=${iso(to)}`, { headers }), 'a statement');
}

// The first page of a day's entries of one kind, from a day picked at random within the period.
export function entries() {
  const start = from + Math.random() * (to - from - DAY_MS);
  const url = `${base}/wallets/${wallet}/entries?from=${iso(start)}&to=${iso(start + DAY_MS)}&kind=deposit&limit=50`;
  ok(http.get(url, { headers }), 'a page');
}

export function handleSummary(data) {
  const figures = {};
  for (const name of ['pay', ...READS]) {
    const trend = data.metrics[`http_req_duration{scenario:${name}}`];
    const checks = data.metrics[`checks{scenario:${name}}`];
    figures[name] = trend
      ? { p50_ms: trend.values['p(50)'], p99_ms: trend.values['p(99)'], count: trend.values.count, ok: checks ? checks.values.rate : 0 }
      : null;
  }
  // One line a scenario: name, p99 (ms), requests, share answered as expected.
  const lines = Object.entries(figures).map(([name, f]) => (f ? `${name}\t${f.p99_ms}\t${f.count}\t${f.ok}` : `${name}\t0\t0\t0`));
  return { [__ENV.SUMMARY]: `${lines.join('\n')}\n`, stdout: `${JSON.stringify(figures)}\n` };
}
