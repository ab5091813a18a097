// loadtest/k6/holds.js: holds of 1 to 100 (POST /wallets/{id}/holds) on wallets picked at random: a
// fifth placed for 1 s and left to expire, the rest placed for HOLD_EXPIRES_IN (30) s and at once
// captured in full, captured in part (1 to the amount) or voided, a third each; every placing,
// capture and void with a key of its own (loadtest/README.md).
import { ack, anyWallet, cfg, count, finish, isEntry, iteration, leg, operation, positiveInt, randomInt, scenario, settle } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('holds', { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 });
// The share placed for 1 s and left to expire. The others last HOLD_EXPIRES_IN s: long enough for
// their capture or void to come first, short enough for the book check to wait little for them.
const HOLDS_LEFT = 0.2;
const HOLD_EXPIRES_IN = positiveInt('HOLD_EXPIRES_IN', 30);
if (HOLD_EXPIRES_IN > 604800) throw new Error(`HOLD_EXPIRES_IN must be at most 604800 (7 days), not ${HOLD_EXPIRES_IN}`);
cfg.summaryLines = (figures, f) => [
  `  holds placed=${figures.holds_placed} (${f(figures.holds_placed / cfg.durationS)}/s)` +
    ` captured=${figures.captured} (${f(figures.captured / cfg.durationS)}/s)` +
    ` voided=${figures.voided} (${f(figures.voided / cfg.durationS)}/s)` +
    ` left to expire=${figures.holds_left} hold_expired=${figures.hold_expired}`,
];

// A new hold of `amount` on `wallet`; hold `to` of `wallet` captured (`amount`: what was charged,
// by its pay entry) or voided.
const DESCRIBES = {
  hold: (b, op) => b.wallet_id === op.wallet && b.amount === op.amount && b.status === 'held' && b.captured === 0 &&
    typeof b.id === 'string' && typeof b.expires_at === 'string',
  capture: (b, op) => b.id === op.to && b.wallet_id === op.wallet && b.status === 'captured' && b.captured === op.amount &&
    isEntry(b.entry, op.wallet, 'pay', op.amount) && b.entry.hold_id === op.to && b.capture_entry === b.entry.id,
  void: (b, op) => b.id === op.to && b.wallet_id === op.wallet && b.status === 'voided' && b.captured === 0,
};
// What a placing or a capture or void applied: a capture's charge (the hold's own line says the rest).
const ACKED = { hold: () => null, capture: (op, b) => leg(op.wallet, -op.amount, b.entry.id), void: () => null };

// A hold that was not placed (refused, or undecided: settled after the run, then left to expire)
// goes no further; one placed is acknowledged at the end, with what its client was told became of it.
export default iteration((runId) => {
  const wallet = anyWallet(runId);
  const amount = randomInt(1, 100);
  const left = Math.random() < HOLDS_LEFT;
  const key = `${runId}-hold-${__VU}-${__ITER}`;
  const hold = operation({ kind: 'hold', wallet, amount, key, ok: 201, path: `/wallets/${wallet}/holds`,
    route: 'POST /wallets/{id}/holds', body: `{"amount":${amount},"expires_in":${left ? 1 : HOLD_EXPIRES_IN},"reference":"${key}"}`,
    describes: DESCRIBES.hold, acked: ACKED.hold });
  const placed = settle(hold, null);
  finish(hold, placed);
  if (placed === null || placed.decided !== 'charged') return;
  const to = placed.entry.id;
  let told = '{"as":"expired"}';
  if (left) count.holds_left.add(1);
  else told = settleHold(runId, wallet, amount, to);
  ack(`{"ack":"hold","hold":${JSON.stringify(to)},"wallet":"${wallet}","amount":${amount},"told":${told}}`);
});

// Captures hold TO (of AMOUNT on WALLET) in full or in part, or voids it; returns what its client
// was told: captured, voided, or (refused, or undecided until settled) expired.
function settleHold(runId, wallet, amount, to) {
  // Captured in full (`{}`: no amount), captured in part, or voided (nothing charged).
  const pick = Math.random();
  const kind = pick < 2 / 3 ? 'capture' : 'void';
  const part = pick >= 1 / 3 && pick < 2 / 3 ? randomInt(1, amount) : null;
  let body = null;
  if (kind === 'capture') body = part === null ? '{}' : `{"amount":${part}}`;
  // What the answer and the record show: a capture's charge, a void's hold.
  const op = operation({ kind, wallet, amount: part === null ? amount : part, to, key: `${runId}-${kind}-${__VU}-${__ITER}`,
    path: `/holds/${to}/${kind}`, route: `POST /holds/{id}/${kind}`, body, describes: DESCRIBES[kind], acked: ACKED[kind] });
  const outcome = settle(op, null);
  finish(op, outcome);
  if (outcome === null || outcome.decided !== 'charged') return '{"as":"expired"}';
  if (kind === 'void') return '{"as":"voided"}';
  return `{"as":"captured","amount":${op.amount},"entry":${JSON.stringify(outcome.entry.entry.id)}}`;
}
