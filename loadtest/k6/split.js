// loadtest/k6/split.js: movements of three legs (POST /movements): 2 to 100 out of a wallet picked
// at random, a tenth (at least 1) to a second as a fee and the rest to a third, all three distinct,
// every leg or none (loadtest/README.md).
import { cfg, finish, isLeg, iteration, leg, operation, randomInt, scenario, settle, walletId } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('split', { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 });
if (cfg.wallets < 3) throw new Error(`a split needs 3 wallets, not WALLETS=${cfg.wallets}`);

// `to`: the legs sent, [[wallet, signed amount], ...], each answered in order with its entry.
function describes(body, op) {
  return typeof body.id === 'string' && Array.isArray(body.legs) && body.legs.length === op.to.length &&
    body.legs.every((entry, n) => {
      const [wallet, amount] = op.to[n];
      return isLeg(entry, wallet, amount < 0 ? 'transfer_out' : 'transfer_in', Math.abs(amount), body.id);
    });
}

function acked(op, body) {
  return body.legs.map((entry, n) => leg(op.to[n][0], op.to[n][1], entry.id)).join(',');
}

export default iteration((runId) => {
  const picked = [];
  while (picked.length < 3) {
    const n = randomInt(0, cfg.wallets - 1);
    if (!picked.includes(n)) picked.push(n);
  }
  const [payer, merchant, fee] = picked.map((n) => walletId(runId, n));
  const amount = randomInt(2, 100);
  const cut = Math.max(1, Math.floor(amount / 10));
  const legs = [[payer, -amount], [merchant, amount - cut], [fee, cut]];
  const key = `${runId}-split-${__VU}-${__ITER}`;
  const body = legs.map(([wallet, signed]) => `{"wallet_id":"${wallet}","amount":${signed}}`).join(',');
  const op = operation({ kind: 'split', wallet: payer, amount, to: legs, key, ok: 201, path: '/movements',
    route: 'POST /movements', body: `{"legs":[${body}],"reference":"${key}"}`, describes, acked });
  finish(op, settle(op, null));
});
