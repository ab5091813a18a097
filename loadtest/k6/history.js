// loadtest/k6/history.js: the history's reads of one long wallet (WALLET, its entries written
// between FROM and TO; loadtest/bench's history run seeds it) beside GET /wallets/{id} of the same
// wallet, VUS users each, while PAY_VUS users pay WALLETS other wallets (lib's setup opens them)
// spread at random. Each scenario's p99 goes to SUMMARY (tab-separated), for the bench's history ratios.
import http from 'k6/http';
import { check } from 'k6';
import { JSON_HEADERS, anyWallet, cfg, keyedHeaders, metric, positiveInt } from './lib.js';

export { setup } from './lib.js';
Object.assign(cfg, { name: 'history', baseUrl: __ENV.BASE_URL, wallets: positiveInt('WALLETS', 1000), initial: 1000000000 });
const wallet = `${cfg.baseUrl}/wallets/${__ENV.WALLET}`;
const [from, to] = [Date.parse(__ENV.FROM), Date.parse(__ENV.TO)];
const DAY_MS = 24 * 3600 * 1000;
const SCENARIOS = ['pay', 'read', 'balance_at', 'statement', 'entries'];
export const options = { scenarios: {}, thresholds: {}, summaryTrendStats: ['avg', 'p(50)', 'p(99)', 'max', 'count'] };
for (const name of SCENARIOS) {
  const vus = name === 'pay' ? positiveInt('PAY_VUS', 16) : positiveInt('VUS', 8);
  options.scenarios[name] = { executor: 'constant-vus', vus, duration: __ENV.DURATION || '30s', exec: name };
  // A threshold per scenario, so that the summary has each one's figures.
  options.thresholds[`http_req_duration{scenario:${name}}`] = ['max>=0'];
  options.thresholds[`checks{scenario:${name}}`] = ['rate>0.99'];
}

const iso = (ms) => new Date(ms).toISOString();
const get = (url, what) => check(http.get(url, { headers: JSON_HEADERS }), { [what]: (r) => r.status === 200 });

export function pay(data) {
  const res = http.post(`${cfg.baseUrl}/wallets/${anyWallet(data.runId)}/pay`, '{"amount":1}',
    { headers: keyedHeaders(`${data.runId}-pay-${__VU}-${__ITER}`) });
  check(res, { paid: (r) => r.status === 200 });
}
// The read ceiling: the wallet itself.
export const read = () => get(wallet, 'the wallet');
export const balance_at = () => get(`${wallet}/balance?at=${iso(from + Math.random() * (to - from))}`, 'as of');
// The whole period's statement: every entry of it counted and summed.
export const statement = () => get(`${wallet}/statement?from=${iso(from)}&to=${iso(to)}`, 'a statement');
// The first page of a day's entries of one kind, from a day picked at random within the period.
export function entries() {
  const start = from + Math.random() * (to - from - DAY_MS);
  get(`${wallet}/entries?from=${iso(start)}&to=${iso(start + DAY_MS)}&kind=deposit&limit=50`, 'a page');
}

// One line a scenario: name, p99 (ms), requests, share answered as expected.
export function handleSummary(data) {
  const lines = SCENARIOS.map((name) => [name, metric(data, `http_req_duration{scenario:${name}}`, 'p(99)'),
    metric(data, `http_req_duration{scenario:${name}}`, 'count'), metric(data, `checks{scenario:${name}}`, 'rate')]);
  const text = `${lines.map((line) => line.join('\t')).join('\n')}\n`;
  return { [__ENV.SUMMARY]: text, stdout: text };
}
