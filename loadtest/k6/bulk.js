// loadtest/k6/bulk.js: payments of 1 to 100 from wallets picked at random, BATCH (100, up to
// 1,000) to a `POST /batches`, each item with its own key (loadtest/README.md).
import http from 'k6/http';
import { sleep } from 'k6';
import { JSON_HEADERS, REFUSED, TRANSIENT, TRIES, anyWallet, cfg, count, finish, iteration, json, judge, payment, positiveInt, randomInt,
  scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('bulk', { wallets: 10000, initial: 1000000000, vus: 8, p95_ms: 3000, p99_ms: 5000 });

const BATCH = positiveInt('BATCH', 100);
if (BATCH > 1000) throw new Error(`BATCH is at most 1000, not ${BATCH}`);

export default iteration((runId) => {
  const ops = [];
  for (let n = 0; n < BATCH; n++) {
    ops.push(payment('pay', anyWallet(runId), randomInt(1, 100), `${runId}-bulk-${__VU}-${__ITER}-${n}`));
  }
  const items = ops.map((op) => `{"op":"pay","wallet_id":"${op.wallet}","idempotency_key":"${op.key}",${op.body.slice(1)}`);
  const body = `{"items":[${items.join(',')}]}`;
  const outcomes = new Array(BATCH).fill(null);
  // Items a try left undecided: they may still run, so a TRANSIENT refusal no longer decides them.
  const unsure = new Array(BATCH).fill(false);
  // The batch, sent whole until every item is decided (the decided ones replay), TRIES at most.
  for (let tries = 0; tries < TRIES && outcomes.includes(null); tries++) {
    if (tries > 0) sleep(0.05 * 2 ** (tries - 1));
    const res = http.post(`${cfg.baseUrl}/batches`, body, { headers: JSON_HEADERS, tags: { op: 'move', name: 'POST /batches' } });
    if (res.status === 0) count.dropped_connections.add(1);
    const answers = res.status === 200 ? (json(res) || {}).items : null;
    const whole = Array.isArray(answers) && answers.length === BATCH;
    // Anything but a 200 with every item's answer: nginx's 502/504 or a 503 leave the items open.
    judge(res, whole || [502, 503, 504].includes(res.status), 'bulk: an answer the API promises', false);
    if (!whole) {
      unsure.fill(true);
      continue;
    }
    answers.forEach((answer, n) => {
      if (outcomes[n] !== null) return;
      const op = ops[n];
      if (answer.replayed) count.replayed.add(1);
      const code = answer.body && typeof answer.body.code === 'string' ? answer.body.code : '';
      if (answer.status === 200 && op.describes(answer.body, op)) {
        outcomes[n] = { decided: 'charged', code: '', entry: answer.body };
      } else if ((REFUSED[answer.status] || []).includes(code) && (answer.status !== 503 || answer.retry_after !== undefined)) {
        if (!(unsure[n] && TRANSIENT.has(code))) outcomes[n] = { decided: 'refused', code };
      } else if (code === 'idempotency_key_in_flight') {
        count.in_flight.add(1);
        unsure[n] = true;
      } else if (answer.status === 503 && code === 'request_timeout') {
        unsure[n] = true;
      } else {
        count.unexpected.add(1);
      }
    });
  }
  ops.forEach((op, n) => finish(op, outcomes[n]));
});
