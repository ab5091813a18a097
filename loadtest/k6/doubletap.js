// loadtest/k6/doubletap.js: every payment sent twice at the same instant with one Idempotency-Key;
// the two answers must agree on one charge, the same ledger entry (loadtest/README.md).
import http from 'k6/http';
import { check } from 'k6';
import { anyWallet, classify, count, finish, iteration, payment, randomInt, scenario, settle } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('doubletap', { wallets: 1000, initial: 1000000000, vus: 32, p95_ms: 1000, p99_ms: 2000 });
export default iteration((runId) => {
  const op = payment('pay', anyWallet(runId), randomInt(1, 100), `${runId}-pay-${__VU}-${__ITER}`);
  const [a, b] = http.batch([op, op]).map((res) => classify(res, op));
  const charged = [a, b].filter((o) => o.decided === 'charged');
  const refused = [a, b].filter((o) => o.decided === 'refused');
  let agree = true;
  if (charged.length === 2) {
    // Both 200: one ran, the other is its replay, and both name the same ledger entry.
    agree = charged[0].entry.id === charged[1].entry.id && (charged[0].replay || charged[1].replay);
  } else if (charged.length === 1 && refused.length === 1) {
    // Charged by one, refused by the other: fine only when the refusal was transient (lock or
    // dependency) and the other request then ran; a stored refusal and a charge cannot both be.
    agree = refused[0].code !== 'insufficient_funds';
  }
  if (!agree) count.double_charges.add(1);
  check(null, { 'doubletap: both answers agree on one charge': () => agree });
  // A charge decides it even if the other one was refused; else the first decided answer.
  finish(op, charged.length > 0 ? charged[0] : settle(op, [a, b]));
});
