// loadtest/pay.js: payments against walletlock, through nginx, with k6.
//
//   SCENARIO=spread k6 run loadtest/pay.js          (loadtest/run wraps this and checks the books)
//
// Scenarios (SCENARIO):
//   hot        every VU pays 1 from one wallet
//   spread     payments of 1 to 100 from 10,000 wallets, picked at random
//   doubletap  every payment is sent twice at the same instant with one Idempotency-Key; the two
//              answers must agree on one charge (same ledger entry)
//   mixed      deposits (40%) and payments (60%) on 100 small wallets, so that some payments meet
//              insufficient funds
//   read       GET /wallets/{id} (with the token) on 10,000 wallets picked at random: the read
//              ceiling, what the same fleet answers when nothing moves
//   health     GET /healthz through nginx, no wallets: the health ceiling (nginx, a replica, no
//              Redis, no Postgres)
//   transfer   transfers of 1 to 100 (POST /transfers) from payers picked at random among 10,000
//              wallets to PAYEES (100) merchants picked by a Zipf law (the k-th most popular is
//              paid 1/k as often as the first): a few hot payees, a long tail, both legs booked
//   split      movements of three legs (POST /movements): 2 to 100 out of a wallet picked at random
//              among 10,000, a tenth (at least 1) to a second as a fee and the rest to a third, all
//              three distinct, every leg or none
//   holds      holds of 1 to 100 (POST /wallets/{id}/holds) on 10,000 wallets picked at random: a
//              fifth placed for 1 s and left to expire, the rest placed for HOLD_EXPIRES_IN (30) s
//              and at once captured in full, captured in part (1 to the amount) or voided, a
//              third each; every placing, capture and void with a key of its own
//   flood      FLOOD (10,000) payments of 1 on one wallet, all sent at the same instant, each on a
//              connection of its own, once (no retry): VUS (10) users each send FLOOD / VUS in one
//              http.batch. Every one must be answered 200, 503 `overloaded` or `lock_timeout`, or
//              429, each 503 and 429 with Retry-After; a connection without an answer counts in
//              `dropped_connections`. DURATION only bounds the run (the flood itself takes seconds).
//
// Load model (MODEL):
//   closed     (default) VUS virtual users, each sending its next payment when the last answered
//   open       RATE payments per second (constant-arrival-rate) whatever the latency, with up to
//              MAX_VUS users; iterations k6 could not start in time are `dropped_iterations`, and
//              more than MAX_DROPPED_PCT percent of the planned ones fails the run
//
// Other settings, all optional: BASE_URL (http://127.0.0.1:8080), DURATION (60s), VUS, RATE,
// WALLETS and INITIAL (per scenario below), RUN_ID (prefix of the run's wallet ids and keys; made up
// in setup() when unset), P95_MS and P99_MS (latency thresholds on deposits and payments; per
// scenario below), HOLD_EXPIRES_IN (holds: the life in seconds of those not left to expire, 30),
// API_TOKEN (sent as `Authorization: Bearer`; loadtest/run takes it from `deploy/local token`),
// MAX_ERROR_RATE (0.001, unexpected answers per request), SUMMARY_JSON (where handleSummary writes
// the JSON summary; none when unset), ACK_LOG=1 (one `WL {...}` line per finished
// operation: what the client saw acknowledged, read by loadtest/books.py; a VU logs its lines in
// batches, see ack()).
//
// Phases, for a runner that measures the run alone (loadtest/run with COSTS=1): OPEN_ONLY=1 runs
// setup() only (opens the wallets, one iteration that does nothing, no summary file); OPENED=1
// skips the opening in setup() and uses the wallets RUN_ID's OPEN_ONLY run opened. Unset, setup()
// opens the wallets and the scenario runs, in one k6 run.
//
// Every deposit, payment, transfer, hold placed, capture and void carries a unique Idempotency-Key
// (also the `reference` of a payment, a transfer or a hold, and so of a capture's pay entry). An
// answer that leaves the outcome unknown (no answer, a 502/504 from nginx, 500, 503
// request_timeout, 409 idempotency_key_in_flight) is retried with the same key until it is decided;
// what is still undecided at the end is logged as such, and loadtest/books.py settles it after the
// run by replaying the key. So every operation ends as applied exactly once, or not at all, and the
// client knows which: the books can be checked exactly.
//
// Expected outcomes, not failures: 200 (201 for a hold placed), 409 hold_expired (a capture or void
// that came after its hold's expiry), 422 insufficient_funds, 503 lock_timeout, 503 overloaded,
// 409 lease_lost, 503 dependency_unavailable, 409 idempotency_key_in_flight, 429 rate_limited (each
// 503 and 429 with Retry-After). Anything else (a status 0, a 5xx that is not one of those, a 400,
// a 200 whose entry does not match the request, a 503 or 429 without Retry-After) counts in
// `unexpected_errors`.

import http from 'k6/http';
import { check, fail, sleep } from 'k6';
import exec from 'k6/execution';
import { Counter, Rate } from 'k6/metrics';

// Latency thresholds (p95_ms, p99_ms) are per scenario: every payment on the hot wallet waits for
// one lease, one holder at a time, so there the bound is the lease wait (LEASE_WAIT, 3 s): a p99
// under it means payments get the lease before they give up. Elsewhere wallets rarely collide.
const PROFILES = {
  hot: { wallets: 1, initial: 1000000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 },
  spread: { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 1000, p99_ms: 2000 },
  doubletap: { wallets: 1000, initial: 1000000000, vus: 32, p95_ms: 1000, p99_ms: 2000 },
  mixed: { wallets: 100, initial: 100, vus: 32, p95_ms: 1000, p99_ms: 2000 },
  transfer: { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 },
  split: { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 },
  holds: { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 2000, p99_ms: 3000 },
  read: { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 1000, p99_ms: 2000 },
  health: { wallets: 0, initial: 1, vus: 64, p95_ms: 1000, p99_ms: 2000 },
  // A shed answer is immediate, a served one waits its turn: bounded by nginx's read timeout.
  flood: { wallets: 1, initial: 1000000000000, vus: 10, p95_ms: 10000, p99_ms: 10000 },
};

const SCENARIO = __ENV.SCENARIO || 'spread';
const PROFILE = PROFILES[SCENARIO];
if (!PROFILE) {
  throw new Error(`SCENARIO must be one of ${Object.keys(PROFILES).join(', ')}, not ${SCENARIO}`);
}

function positiveInt(name, fallback) {
  const raw = __ENV[name];
  if (raw === undefined || raw === '') return fallback;
  const value = Number(raw);
  if (!Number.isInteger(value) || value < 1) throw new Error(`${name} must be a positive integer, not ${raw}`);
  return value;
}

function positiveNumber(name, fallback) {
  const raw = __ENV[name];
  if (raw === undefined || raw === '') return fallback;
  const value = Number(raw);
  if (!(value >= 0)) throw new Error(`${name} must be a non-negative number, not ${raw}`);
  return value;
}

// "90s", "2m", "1m30s", "1h" -> seconds.
function seconds(text) {
  const re = /(\d+(?:\.\d+)?)(ms|s|m|h)/g;
  const unit = { ms: 0.001, s: 1, m: 60, h: 3600 };
  let total = 0;
  let matched = '';
  let m;
  while ((m = re.exec(text)) !== null) {
    total += Number(m[1]) * unit[m[2]];
    matched += m[0];
  }
  if (matched !== text || total <= 0) throw new Error(`DURATION must look like 60s, 2m or 1m30s, not ${text}`);
  return total;
}

const BASE_URL = (__ENV.BASE_URL || 'http://127.0.0.1:8080').replace(/\/+$/, '');
const MODEL = __ENV.MODEL || 'closed';
const DURATION = __ENV.DURATION || '60s';
const DURATION_S = seconds(DURATION);
const VUS = positiveInt('VUS', PROFILE.vus);
const RATE = positiveInt('RATE', 200);
const MAX_VUS = positiveInt('MAX_VUS', 4 * VUS);
const WALLETS = positiveInt('WALLETS', PROFILE.wallets);
const INITIAL = positiveInt('INITIAL', PROFILE.initial);
const P95_MS = positiveNumber('P95_MS', PROFILE.p95_ms);
const P99_MS = positiveNumber('P99_MS', PROFILE.p99_ms);
const MAX_ERROR_RATE = positiveNumber('MAX_ERROR_RATE', 0.001);
const MAX_DROPPED_PCT = positiveNumber('MAX_DROPPED_PCT', 1);
const ACK_LOG = __ENV.ACK_LOG === '1';
const OPEN_ONLY = __ENV.OPEN_ONLY === '1';
const OPENED = __ENV.OPENED === '1';
const FLOOD = positiveInt('FLOOD', 10000);
// holds: the share placed for 1 s and left alone, to expire. The others last HOLD_EXPIRES_IN s: long
// enough that their capture or void, sent right after, comes first even on a loaded machine, short
// enough that the book check, which waits for every hold not settled to expire, waits little for
// one whose capture or void was refused.
const HOLDS_LEFT = 0.2;
const HOLD_EXPIRES_IN = positiveInt('HOLD_EXPIRES_IN', 30);
if (HOLD_EXPIRES_IN > 604800) throw new Error(`HOLD_EXPIRES_IN must be at most 604800 (7 days), not ${HOLD_EXPIRES_IN}`);
// transfer: wallets 0..PAYEES-1 are the payees, the rest the payers (so never one wallet twice).
const PAYEES = positiveInt('PAYEES', 100);
if (SCENARIO === 'split' && WALLETS < 3) throw new Error(`a split needs 3 wallets, not WALLETS=${WALLETS}`);
if (SCENARIO === 'transfer' && PAYEES >= WALLETS) throw new Error(`PAYEES (${PAYEES}) must be fewer than WALLETS (${WALLETS})`);
// The Zipf law's cumulative weights (payee k, from 1, weighs 1/k), for picking a payee by bisection.
const PAYEE_CDF = (() => {
  if (SCENARIO !== 'transfer') return [];
  const cdf = [];
  let total = 0;
  for (let k = 1; k <= PAYEES; k++) cdf.push((total += 1 / k));
  return cdf.map((c) => c / total);
})();
// Each flood user's share, sent in one batch, every request on a connection of its own.
const FLOOD_BATCH = Math.ceil(FLOOD / VUS);
// The requests the scenario times and counts (tag `op`): deposits and payments, or reads, or
// health checks.
const OP = { read: 'read', health: 'health' }[SCENARIO] || 'move';
// Tries per operation before it is logged as undecided (and settled after the run).
const TRIES = 5;

if (MODEL !== 'closed' && MODEL !== 'open') throw new Error(`MODEL must be closed or open, not ${MODEL}`);

function scenarioConfig() {
  if (OPEN_ONLY) return { executor: 'shared-iterations', vus: 1, iterations: 1, maxDuration: '1m' };
  if (SCENARIO === 'flood') {
    return { executor: 'per-vu-iterations', vus: VUS, iterations: 1, maxDuration: DURATION, gracefulStop: '15s' };
  }
  if (MODEL === 'closed') {
    return { executor: 'constant-vus', vus: VUS, duration: DURATION, gracefulStop: '10s' };
  }
  return {
    executor: 'constant-arrival-rate',
    rate: RATE,
    timeUnit: '1s',
    duration: DURATION,
    preAllocatedVUs: VUS,
    maxVUs: MAX_VUS,
    gracefulStop: '10s',
  };
}

const thresholds = {
  // Answers outside the API's contract, per request.
  unexpected_errors: [`rate<${MAX_ERROR_RATE}`],
  // The scenario's own requests only (deposits and payments, or reads, or health checks): setup's
  // wallet creations are not timed here.
  [`http_req_duration{op:${OP}}`]: [`p(95)<${P95_MS}`, `p(99)<${P99_MS}`],
  // Two answers to one key that report different ledger entries: a double charge.
  double_charges: ['count==0'],
  // Connections closed without an answer (status 0): never, not even under a flood.
  dropped_connections: ['count==0'],
  // Listed so that the summary carries the request count of the scenario's own requests alone.
  [`http_reqs{op:${OP}}`]: ['count>0'],
};
if (MODEL === 'open' && !OPEN_ONLY) {
  const planned = RATE * DURATION_S;
  thresholds.dropped_iterations = [`count<=${Math.floor((planned * MAX_DROPPED_PCT) / 100)}`];
}

export const options = {
  scenarios: { [SCENARIO]: scenarioConfig() },
  thresholds: OPEN_ONLY ? {} : thresholds,
  setupTimeout: '10m',
  // setup() opens wallets 100 at a time; doubletap sends its two requests together; a flood user
  // its whole share at once.
  batch: Math.max(100, SCENARIO === 'flood' ? FLOOD_BATCH : 0),
  batchPerHost: Math.max(100, SCENARIO === 'flood' ? FLOOD_BATCH : 0),
  // A flood is that many clients, not one client's keep-alive pool.
  noConnectionReuse: SCENARIO === 'flood',
  // Without `url` (one per wallet: 10,000 time series); `name` carries the route instead.
  systemTags: ['status', 'method', 'name', 'group', 'check', 'error', 'error_code', 'scenario', 'expected_response'],
  summaryTrendStats: ['avg', 'min', 'med', 'max', 'p(90)', 'p(95)', 'p(99)'],
  discardResponseBodies: false,
};

// Statuses the API answers by contract; everything else marks http_req_failed.
http.setResponseCallback(http.expectedStatuses(200, 201, 409, 422, 429, 503));

// Final outcome of each operation (one payment or deposit, however many requests it took).
const accepted = new Counter('accepted'); // payments charged (200)
const deposited = new Counter('deposited'); // deposits credited (200)
const holdsPlaced = new Counter('holds_placed'); // holds placed (201)
const captured = new Counter('captured'); // holds captured (200; also counted in accepted)
const voided = new Counter('voided'); // holds voided (200)
const holdsLeft = new Counter('holds_left'); // holds placed and left to expire
const holdExpired = new Counter('hold_expired'); // a capture or void too late: 409 hold_expired
const insufficientFunds = new Counter('insufficient_funds');
const lockTimeout = new Counter('lock_timeout');
const leaseLost = new Counter('lease_lost');
const dependencyUnavailable = new Counter('dependency_unavailable');
const overloaded = new Counter('overloaded'); // 503 overloaded: shed by a replica or nginx
const rateLimited = new Counter('rate_limited'); // 429 from nginx
const droppedConnections = new Counter('dropped_connections'); // no answer at all (status 0)
const noRetryAfter = new Counter('no_retry_after'); // a 503 or 429 without Retry-After
const undecided = new Counter('undecided'); // still unknown after TRIES; settled by the runner
const operations = new Counter('operations');
// Per response.
const replayed = new Counter('replayed'); // answers with Idempotent-Replayed: true
const inFlight = new Counter('in_flight'); // 409 idempotency_key_in_flight
const unexpected = new Counter('unexpected'); // the count behind unexpected_errors
const unexpectedErrors = new Rate('unexpected_errors');
const doubleCharges = new Counter('double_charges');

const JSON_HEADERS = { 'Content-Type': 'application/json' };
if (__ENV.API_TOKEN) JSON_HEADERS.Authorization = `Bearer ${__ENV.API_TOKEN}`;

// The headers of a request with an Idempotency-Key. Built as a literal, not spread from
// JSON_HEADERS: k6's JavaScript runs on the cores it measures, and every iteration builds one.
function keyedHeaders(key) {
  return JSON_HEADERS.Authorization === undefined
    ? { 'Content-Type': 'application/json', 'Idempotency-Key': key }
    : { 'Content-Type': 'application/json', Authorization: JSON_HEADERS.Authorization, 'Idempotency-Key': key };
}

function walletId(runId, index) {
  return `${runId}-${index}`;
}

function code(res) {
  try {
    const body = res.json();
    return body && typeof body.code === 'string' ? body.code : '';
  } catch (_) {
    return '';
  }
}

// The acknowledgements this VU has not logged yet, and when the oldest was added. A console line
// costs k6 about as much CPU as a request's own checks, so in the closed model a VU logs up to
// ACK_BATCH of them in one message (one `WL {...}` per line), at the latest ACK_HOLD_MS after the
// first, and in the scenario's last ACK_TAIL_MS each as it comes: a constant-vus VU's last
// iteration ends after the scenario does, so nothing is left unlogged when the run ends. Elsewhere
// (setup, the open model, the flood: a VU may run no further iteration) every iteration logs its
// own at its end.
const ACK_BATCH = 64;
const ACK_HOLD_MS = 500;
const ACK_TAIL_MS = 2000;
const ACKS_BATCHED = MODEL === 'closed' && SCENARIO !== 'flood';
let unlogged = [];
let unloggedSince = 0;
// When the scenario ends, in ms since the epoch: read once (`exec.scenario` builds its object
// anew on every access).
let scenarioEnds = null;

// Queues one acknowledgement: a record, or its JSON already written out.
function ack(record) {
  if (!ACK_LOG) return;
  if (unlogged.length === 0) unloggedSince = Date.now();
  unlogged.push(`WL ${typeof record === 'string' ? record : JSON.stringify(record)}`);
}

// Logs what ack() gathered, unless it may wait for a fuller batch (see above).
function flushAcks(batched) {
  if (unlogged.length === 0) return;
  if (batched) {
    const now = Date.now();
    if (scenarioEnds === null) scenarioEnds = exec.scenario.startTime + DURATION_S * 1000;
    if (unlogged.length < ACK_BATCH && now - unloggedSince < ACK_HOLD_MS && now < scenarioEnds - ACK_TAIL_MS) return;
  }
  console.log(unlogged.join('\n'));
  unlogged = [];
}

function randomInt(min, max) {
  return min + Math.floor(Math.random() * (max - min + 1));
}

// A payee's index, by the Zipf law of PAYEE_CDF.
function zipfPayee() {
  const u = Math.random();
  let lo = 0;
  let hi = PAYEE_CDF.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (PAYEE_CDF[mid] < u) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------
// setup: open the run's wallets through the API, 100 at a time.

export function setup() {
  const runId = __ENV.RUN_ID || `lt-${SCENARIO}-${Date.now().toString(36)}`;
  if (!/^[A-Za-z0-9_-]{1,50}$/.test(runId)) fail(`RUN_ID must be 1 to 50 of A-Z a-z 0-9 _ -, not ${runId}`);
  if (OPENED && !__ENV.RUN_ID) fail('OPENED=1 needs the RUN_ID whose wallets an OPEN_ONLY=1 run opened');
  if (OPENED || WALLETS === 0) return { runId };
  const started = Date.now();
  let pending = [];
  for (let i = 0; i < WALLETS; i++) pending.push(i);
  for (let round = 0; round < TRIES && pending.length > 0; round++) {
    if (round > 0) sleep(0.2 * round);
    const retry = [];
    for (let start = 0; start < pending.length; start += 100) {
      const chunk = pending.slice(start, start + 100);
      const requests = chunk.map((i) => {
        const id = walletId(runId, i);
        return {
          method: 'POST',
          url: `${BASE_URL}/wallets`,
          body: JSON.stringify({ id, balance: INITIAL }),
          params: {
            headers: keyedHeaders(`${id}-open`),
            tags: { op: 'open', name: 'POST /wallets' },
          },
        };
      });
      const responses = http.batch(requests);
      responses.forEach((res, n) => {
        const i = chunk[n];
        if (res.status === 201) {
          const wallet = res.json();
          ack({ op: 'open', w: walletId(runId, i), amount: wallet.balance, s: 201 });
        } else if (res.status === 0 || res.status >= 500 || (res.status === 409 && code(res) === 'idempotency_key_in_flight')) {
          retry.push(i);
        } else {
          fail(`opening wallet ${walletId(runId, i)}: HTTP ${res.status} ${res.body}`);
        }
      });
    }
    pending = retry;
  }
  if (pending.length > 0) fail(`could not open ${pending.length} wallets (first: ${walletId(runId, pending[0])})`);
  flushAcks(false);
  console.info(`opened ${WALLETS} wallets ${walletId(runId, 0)}..${WALLETS - 1} in ${Date.now() - started} ms`);
  return { runId };
}

// ---------------------------------------------------------------------------------------------
// One deposit, payment, transfer, hold placed, capture or void: send, classify, retry while
// undecided.

// Whether a 200's (a hold placed: 201's) body describes this operation: a ledger entry of `wallet`
// (pay, deposit), a transfer from `wallet` to `to` with both its legs, a new hold of `amount` on
// `wallet`, or hold `to` of `wallet` captured (`amount`: what was charged, with its pay entry) or
// voided.
function describes(body, kind, wallet, amount, to) {
  if (body === null) return false;
  if (kind === 'split') {
    // `to`: the legs sent, [[wallet, signed amount], ...], each answered in order with its entry.
    return (
      typeof body.id === 'string' &&
      Array.isArray(body.legs) &&
      body.legs.length === to.length &&
      body.legs.every(
        (entry, n) =>
          entry !== null &&
          entry.wallet_id === to[n][0] &&
          entry.kind === (to[n][1] < 0 ? 'transfer_out' : 'transfer_in') &&
          entry.amount === Math.abs(to[n][1]) &&
          entry.transfer_id === body.id &&
          Number.isInteger(entry.balance) &&
          entry.balance >= 0 &&
          typeof entry.id === 'string',
      )
    );
  }
  if (kind === 'hold') {
    return (
      body.wallet_id === wallet &&
      body.amount === amount &&
      body.status === 'held' &&
      body.captured === 0 &&
      typeof body.id === 'string' &&
      typeof body.expires_at === 'string'
    );
  }
  if (kind === 'capture') {
    const entry = body.entry;
    return (
      body.id === to &&
      body.wallet_id === wallet &&
      body.status === 'captured' &&
      body.captured === amount &&
      entry !== null &&
      typeof entry === 'object' &&
      entry.wallet_id === wallet &&
      entry.kind === 'pay' &&
      entry.amount === amount &&
      entry.hold_id === to &&
      body.capture_entry === entry.id &&
      Number.isInteger(entry.balance) &&
      entry.balance >= 0
    );
  }
  if (kind === 'void') {
    return body.id === to && body.wallet_id === wallet && body.status === 'voided' && body.captured === 0;
  }
  if (kind !== 'transfer') {
    return (
      body.wallet_id === wallet &&
      body.kind === kind &&
      body.amount === amount &&
      Number.isInteger(body.balance) &&
      body.balance >= 0 &&
      typeof body.id === 'string'
    );
  }
  const leg = (entry, owner, legKind) =>
    entry !== null &&
    typeof entry === 'object' &&
    entry.wallet_id === owner &&
    entry.kind === legKind &&
    entry.amount === amount &&
    entry.transfer_id === body.id &&
    Number.isInteger(entry.balance) &&
    entry.balance >= 0 &&
    typeof entry.id === 'string';
  return (
    body.from === wallet &&
    body.to === to &&
    body.amount === amount &&
    typeof body.id === 'string' &&
    leg(body.from_entry, wallet, 'transfer_out') &&
    leg(body.to_entry, to, 'transfer_in')
  );
}

// What one answer says about the operation (`to`: a transfer's payee, or the hold a capture or
// void settles).
//   decided: 'charged' (200, 201 for a hold placed: applied), 'refused' (nothing applied, the API
//            says so), or null (unknown yet)
function classify(res, kind, wallet, amount, to) {
  const replay = res.headers['Idempotent-Replayed'] === 'true';
  if (replay) replayed.add(1);
  const ok = kind === 'hold' || kind === 'split' ? 201 : 200;
  const errorCode = res.status === ok ? '' : code(res);
  let decided = null;
  let expected = true;
  let entry = null;
  if (res.status === ok) {
    try {
      entry = res.json();
    } catch (_) {
      entry = null;
    }
    if (describes(entry, kind, wallet, amount, to)) {
      decided = 'charged';
    } else {
      expected = false; // a 200 that does not describe this request: settle it by replaying the key
    }
  } else if (res.status === 422 && (errorCode === 'insufficient_funds' || errorCode === 'balance_overflow')) {
    decided = 'refused';
  } else if (
    res.status === 503 &&
    (errorCode === 'lock_timeout' || errorCode === 'overloaded' || errorCode === 'dependency_unavailable')
  ) {
    decided = 'refused';
  } else if (res.status === 429 && errorCode === 'rate_limited') {
    decided = 'refused';
  } else if (res.status === 409 && errorCode === 'lease_lost') {
    decided = 'refused';
  } else if (res.status === 409 && errorCode === 'hold_expired') {
    decided = 'refused';
  } else if (res.status === 409 && errorCode === 'idempotency_key_in_flight') {
    inFlight.add(1);
  } else if (res.status >= 400 && res.status < 500 && res.status !== 408 && res.status !== 429) {
    // A request the API rejected (400, 404, 422 idempotency_key_reused): nothing was applied, but
    // this script should never send one.
    decided = 'refused';
    expected = false;
  } else {
    // Status 0 (no answer), 500, 502/504 from nginx, 503 request_timeout: may or may not have run.
    expected = false;
  }
  if (res.status === 0) droppedConnections.add(1);
  if ((res.status === 503 || res.status === 429) && !res.headers['Retry-After']) {
    noRetryAfter.add(1);
    expected = false;
  }
  unexpectedErrors.add(!expected);
  if (!expected) unexpected.add(1);
  check(res, { [`${kind}: an answer the API promises`]: () => expected });
  return { decided, code: errorCode, entry, replay, status: res.status };
}

// The route of each kind's requests (the `name` tag).
const MOVE_NAMES = {
  pay: 'POST /wallets/{id}/pay',
  deposit: 'POST /wallets/{id}/deposit',
  transfer: 'POST /transfers',
  split: 'POST /movements',
  hold: 'POST /wallets/{id}/holds',
  capture: 'POST /holds/{id}/capture',
  void: 'POST /holds/{id}/void',
};

// A key is made of RUN_ID (checked in setup) and numbers: it needs no escaping in JSON, so the
// body is written out rather than built by JSON.stringify, one less object per iteration.
function moveRequest(kind, wallet, amount, key) {
  const body = kind === 'pay' ? `{"amount":${amount},"reference":"${key}"}` : `{"amount":${amount}}`;
  return {
    method: 'POST',
    url: `${BASE_URL}/wallets/${wallet}/${kind}`,
    body,
    params: { headers: keyedHeaders(key), tags: { op: 'move', name: MOVE_NAMES[kind] } },
  };
}

function transferRequest(from, to, amount, key) {
  return {
    method: 'POST',
    url: `${BASE_URL}/transfers`,
    body: `{"from":"${from}","to":"${to}","amount":${amount},"reference":"${key}"}`,
    params: { headers: keyedHeaders(key), tags: { op: 'move', name: MOVE_NAMES.transfer } },
  };
}

// `legs`: [[wallet, signed amount], ...].
function splitRequest(legs, key) {
  const body = legs.map(([wallet, amount]) => `{"wallet_id":"${wallet}","amount":${amount}}`).join(',');
  return {
    method: 'POST',
    url: `${BASE_URL}/movements`,
    body: `{"legs":[${body}],"reference":"${key}"}`,
    params: { headers: keyedHeaders(key), tags: { op: 'move', name: MOVE_NAMES.split } },
  };
}

function holdRequest(wallet, amount, expiresIn, key) {
  return {
    method: 'POST',
    url: `${BASE_URL}/wallets/${wallet}/holds`,
    body: `{"amount":${amount},"expires_in":${expiresIn},"reference":"${key}"}`,
    params: { headers: keyedHeaders(key), tags: { op: 'move', name: MOVE_NAMES.hold } },
  };
}

// A capture (`amount`: null for all of the hold, `{}`) or a void (no body) of hold `hold`.
function settleHoldRequest(kind, hold, amount, key) {
  let body = null;
  if (kind === 'capture') body = amount === null ? '{}' : `{"amount":${amount}}`;
  return {
    method: 'POST',
    url: `${BASE_URL}/holds/${hold}/${kind}`,
    body,
    params: { headers: keyedHeaders(key), tags: { op: 'move', name: MOVE_NAMES[kind] } },
  };
}

function send(request) {
  return http.request(request.method, request.url, request.body, request.params);
}

// Records the final outcome of one operation (`to`: a transfer's payee, or the hold a capture or
// void settles, logged as `hold`; `amount`: a capture's is what it charges). A transfer and a
// capture count as accepted, like a payment: money left a wallet.
function finish(kind, wallet, amount, key, request, outcome, to) {
  operations.add(1);
  const other = kind === 'capture' || kind === 'void' ? 'hold' : 'to';
  if (outcome === null) {
    undecided.add(1);
    ack({ op: kind, w: wallet, [other]: to, amount, key, s: 'undecided', url: request.url, body: request.body });
    return;
  }
  if (outcome.decided === 'charged') {
    if (kind === 'deposit') deposited.add(1);
    else if (kind === 'hold') holdsPlaced.add(1);
    else if (kind === 'void') voided.add(1);
    else accepted.add(1);
    if (kind === 'capture') captured.add(1);
    // The line of nearly every operation, written out (wallets, keys and hold ids need no escaping).
    if (kind === 'hold') {
      const hold = `"hold":"${outcome.entry.id}","expires_at":${JSON.stringify(outcome.entry.expires_at)}`;
      ack(`{"op":"hold","w":"${wallet}","amount":${amount},"key":"${key}","s":201,${hold}}`);
    } else if (kind === 'capture') {
      const entry = JSON.stringify(outcome.entry.entry.id);
      ack(`{"op":"capture","w":"${wallet}","hold":"${to}","amount":${amount},"key":"${key}","s":200,"entry":${entry}}`);
    } else if (kind === 'void') {
      ack(`{"op":"void","w":"${wallet}","hold":"${to}","amount":${amount},"key":"${key}","s":200}`);
    } else if (kind === 'split') {
      const legs = outcome.entry.legs.map((entry, n) => [to[n][0], to[n][1], entry.id]);
      ack(`{"op":"split","w":"${wallet}","amount":${amount},"key":"${key}","s":201,"legs":${JSON.stringify(legs)}}`);
    } else if (kind === 'transfer') {
      const legs = `"entry":${JSON.stringify(outcome.entry.from_entry.id)},"to_entry":${JSON.stringify(outcome.entry.to_entry.id)}`;
      ack(`{"op":"transfer","w":"${wallet}","to":"${to}","amount":${amount},"key":"${key}","s":200,${legs}}`);
    } else {
      ack(`{"op":"${kind}","w":"${wallet}","amount":${amount},"key":"${key}","s":200,"entry":${JSON.stringify(outcome.entry.id)}}`);
    }
    return;
  }
  if (outcome.code === 'insufficient_funds') insufficientFunds.add(1);
  else if (outcome.code === 'lock_timeout') lockTimeout.add(1);
  else if (outcome.code === 'lease_lost') leaseLost.add(1);
  else if (outcome.code === 'dependency_unavailable') dependencyUnavailable.add(1);
  else if (outcome.code === 'overloaded') overloaded.add(1);
  else if (outcome.code === 'rate_limited') rateLimited.add(1);
  else if (outcome.code === 'hold_expired') holdExpired.add(1);
  ack({ op: kind, w: wallet, [other]: to, amount, key, s: outcome.status, code: outcome.code });
}

// Sends the request until an answer decides it, at most TRIES times in all (`first` may hold the
// answers already received). Returns the deciding outcome, or null.
function settle(request, kind, wallet, amount, first, to) {
  let tries = 0;
  if (first) {
    const decided = first.filter((o) => o.decided !== null);
    if (decided.length > 0) return decided[0];
    tries = first.length;
  }
  while (tries < TRIES) {
    if (tries > 0) sleep(0.05 * 2 ** (tries - 1));
    tries++;
    const outcome = classify(send(request), kind, wallet, amount, to);
    if (outcome.decided !== null) return outcome;
  }
  return null;
}

function move(runId, kind, wallet, amount) {
  const key = `${runId}-${kind}-${__VU}-${__ITER}`;
  const request = moveRequest(kind, wallet, amount, key);
  finish(kind, wallet, amount, key, request, settle(request, kind, wallet, amount, null));
}

// One transfer from a payer at random to a payee by the Zipf law.
function transfer(runId) {
  const from = walletId(runId, randomInt(PAYEES, WALLETS - 1));
  const to = walletId(runId, zipfPayee());
  const amount = randomInt(1, 100);
  const key = `${runId}-transfer-${__VU}-${__ITER}`;
  const request = transferRequest(from, to, amount, key);
  finish('transfer', from, amount, key, request, settle(request, 'transfer', from, amount, null, to), to);
}

// `count` distinct wallet numbers, picked at random.
function distinctWallets(count) {
  const picked = [];
  while (picked.length < count) {
    const n = randomInt(0, WALLETS - 1);
    if (!picked.includes(n)) picked.push(n);
  }
  return picked;
}

// One split of 2 to 100 out of a wallet at random: a tenth (at least 1) to a second wallet, the
// rest to a third.
function split(runId) {
  const [payer, merchant, fee] = distinctWallets(3);
  const amount = randomInt(2, 100);
  const cut = Math.max(1, Math.floor(amount / 10));
  const legs = [
    [walletId(runId, payer), -amount],
    [walletId(runId, merchant), amount - cut],
    [walletId(runId, fee), cut],
  ];
  const key = `${runId}-split-${__VU}-${__ITER}`;
  const request = splitRequest(legs, key);
  finish('split', legs[0][0], amount, key, request, settle(request, 'split', legs[0][0], amount, null, legs), legs);
}

// One hold of 1 to 100 on a wallet at random: placed for 1 s and left to expire (HOLDS_LEFT), or
// placed for HOLD_EXPIRES_IN s and at once captured in full, captured in part or voided. A hold
// that was not placed (refused, or undecided: books.py settles it, and then it is left to expire)
// goes no further.
function holds(runId) {
  const wallet = walletId(runId, randomInt(0, WALLETS - 1));
  const amount = randomInt(1, 100);
  const left = Math.random() < HOLDS_LEFT;
  const key = `${runId}-hold-${__VU}-${__ITER}`;
  const request = holdRequest(wallet, amount, left ? 1 : HOLD_EXPIRES_IN, key);
  const placed = settle(request, 'hold', wallet, amount, null);
  finish('hold', wallet, amount, key, request, placed);
  if (placed === null || placed.decided !== 'charged') return;
  if (left) {
    holdsLeft.add(1);
    return;
  }
  const hold = placed.entry.id;
  // Captured in full (`{}`: no amount), captured in part, or voided (nothing charged).
  const pick = Math.random();
  const kind = pick < 2 / 3 ? 'capture' : 'void';
  const part = pick >= 1 / 3 && pick < 2 / 3 ? randomInt(1, amount) : null;
  // What the answer and the record show: a capture's charge, a void's hold.
  const figure = part === null ? amount : part;
  const settleKey = `${runId}-${kind}-${__VU}-${__ITER}`;
  const settleRequest = settleHoldRequest(kind, hold, part, settleKey);
  const outcome = settle(settleRequest, kind, wallet, figure, null, hold);
  finish(kind, wallet, figure, settleKey, settleRequest, outcome, hold);
}

// The same payment twice at once, one key: one charge, and both answers say so.
function doubletap(runId, wallet, amount) {
  const key = `${runId}-pay-${__VU}-${__ITER}`;
  const request = moveRequest('pay', wallet, amount, key);
  const [a, b] = http.batch([request, request]).map((res) => classify(res, 'pay', wallet, amount));
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
  if (!agree) doubleCharges.add(1);
  check(null, { 'doubletap: both answers agree on one charge': () => agree });
  // A charge decides it even if the other one was refused; else the first decided answer.
  const outcome = charged.length > 0 ? charged[0] : settle(request, 'pay', wallet, amount, [a, b]);
  finish('pay', wallet, amount, key, request, outcome);
}

// The flood: this user's share of FLOOD payments on one wallet, all at once, each answer final
// (a client that is told to come back later does, but not within the flood). An answer that leaves
// the outcome open is logged undecided and settled by the book check.
function flood(runId, wallet) {
  const requests = [];
  for (let i = 0; i < FLOOD_BATCH && (__VU - 1) * FLOOD_BATCH + i < FLOOD; i++) {
    requests.push(moveRequest('pay', wallet, 1, `${runId}-flood-${__VU}-${i}`));
  }
  http.batch(requests).forEach((res, i) => {
    const key = `${runId}-flood-${__VU}-${i}`;
    const outcome = classify(res, 'pay', wallet, 1);
    finish('pay', wallet, 1, key, requests[i], outcome.decided === null ? null : outcome);
  });
}

// One read of a wallet: a 200 with that wallet's figures, or an unexpected answer.
function read(wallet) {
  const res = http.get(`${BASE_URL}/wallets/${wallet}`, {
    headers: JSON_HEADERS,
    tags: { op: 'read', name: 'GET /wallets/{id}' },
  });
  let body = null;
  try {
    body = res.status === 200 ? res.json() : null;
  } catch (_) {
    body = null;
  }
  const expected = body !== null && body.id === wallet && Number.isInteger(body.balance) && body.balance >= 0;
  operations.add(1);
  unexpectedErrors.add(!expected);
  if (!expected) unexpected.add(1);
  check(res, { 'read: the wallet': () => expected });
}

// One liveness check through nginx (no token, no Redis, no Postgres).
function health() {
  const res = http.get(`${BASE_URL}/healthz`, { tags: { op: 'health', name: 'GET /healthz' } });
  let expected = false;
  try {
    expected = res.status === 200 && res.json().status === 'ok';
  } catch (_) {
    expected = false;
  }
  operations.add(1);
  unexpectedErrors.add(!expected);
  if (!expected) unexpected.add(1);
  check(res, { 'health: ok': () => expected });
}

export default function (data) {
  const runId = data.runId;
  if (OPEN_ONLY) return;
  switch (SCENARIO) {
    case 'hot':
      move(runId, 'pay', walletId(runId, 0), 1);
      break;
    case 'spread':
      move(runId, 'pay', walletId(runId, randomInt(0, WALLETS - 1)), randomInt(1, 100));
      break;
    case 'doubletap':
      doubletap(runId, walletId(runId, randomInt(0, WALLETS - 1)), randomInt(1, 100));
      break;
    case 'mixed': {
      const wallet = walletId(runId, randomInt(0, WALLETS - 1));
      if (Math.random() < 0.4) move(runId, 'deposit', wallet, randomInt(1, 50));
      else move(runId, 'pay', wallet, randomInt(1, 40));
      break;
    }
    case 'transfer':
      transfer(runId);
      break;
    case 'split':
      split(runId);
      break;
    case 'holds':
      holds(runId);
      break;
    case 'read':
      read(walletId(runId, randomInt(0, WALLETS - 1)));
      break;
    case 'health':
      health();
      break;
    case 'flood':
      flood(runId, walletId(runId, 0));
      break;
  }
  flushAcks(ACKS_BATCHED);
}

// ---------------------------------------------------------------------------------------------
// The summary: JSON for the runner (SUMMARY_JSON), a few lines for people.

function metric(data, name, field) {
  const m = data.metrics[name];
  return m && m.values && m.values[field] !== undefined ? m.values[field] : 0;
}

function failedThresholds(data) {
  const failed = [];
  for (const [name, m] of Object.entries(data.metrics)) {
    for (const [expr, t] of Object.entries(m.thresholds || {})) {
      if (!t.ok) failed.push(`${name}: ${expr}`);
    }
  }
  return failed;
}

export function handleSummary(data) {
  if (OPEN_ONLY) return { stdout: '' };
  const moves = metric(data, `http_reqs{op:${OP}}`, 'count');
  const figures = {
    scenario: SCENARIO,
    model: MODEL,
    duration_s: DURATION_S,
    vus: MODEL === 'closed' ? VUS : null,
    rate: MODEL === 'open' ? RATE : null,
    wallets: WALLETS,
    initial: INITIAL,
    base_url: BASE_URL,
    run_id: (data.setup_data && data.setup_data.runId) || __ENV.RUN_ID || null,
    // The scenario's own operations (deposits and payments, or reads, or health checks), over its
    // own duration (setup's wallet openings excluded).
    op: OP,
    operations: metric(data, 'operations', 'count'),
    ops_per_s: metric(data, 'operations', 'count') / DURATION_S,
    requests: moves,
    rps: moves / DURATION_S,
    p50_ms: metric(data, `http_req_duration{op:${OP}}`, 'med'),
    p95_ms: metric(data, `http_req_duration{op:${OP}}`, 'p(95)'),
    p99_ms: metric(data, `http_req_duration{op:${OP}}`, 'p(99)'),
    max_ms: metric(data, `http_req_duration{op:${OP}}`, 'max'),
    accepted: metric(data, 'accepted', 'count'),
    deposited: metric(data, 'deposited', 'count'),
    holds_placed: metric(data, 'holds_placed', 'count'),
    captured: metric(data, 'captured', 'count'),
    voided: metric(data, 'voided', 'count'),
    holds_left: metric(data, 'holds_left', 'count'),
    hold_expired: metric(data, 'hold_expired', 'count'),
    insufficient_funds: metric(data, 'insufficient_funds', 'count'),
    lock_timeout: metric(data, 'lock_timeout', 'count'),
    lease_lost: metric(data, 'lease_lost', 'count'),
    dependency_unavailable: metric(data, 'dependency_unavailable', 'count'),
    overloaded: metric(data, 'overloaded', 'count'),
    rate_limited: metric(data, 'rate_limited', 'count'),
    dropped_connections: metric(data, 'dropped_connections', 'count'),
    no_retry_after: metric(data, 'no_retry_after', 'count'),
    replayed: metric(data, 'replayed', 'count'),
    in_flight: metric(data, 'in_flight', 'count'),
    undecided: metric(data, 'undecided', 'count'),
    unexpected: metric(data, 'unexpected', 'count'),
    unexpected_rate: metric(data, 'unexpected_errors', 'rate'),
    double_charges: metric(data, 'double_charges', 'count'),
    dropped_iterations: metric(data, 'dropped_iterations', 'count'),
    failed_thresholds: failedThresholds(data),
  };
  const f = (x) => (Math.round(x * 10) / 10).toFixed(1);
  const text =
    [
      `k6 ${SCENARIO} (${MODEL}${MODEL === 'closed' ? `, ${VUS} VUs` : `, ${RATE}/s`}, ${DURATION}, ${WALLETS} wallets):`,
      `  ${figures.operations} operations, ${f(figures.ops_per_s)}/s; ${moves} requests, ${f(figures.rps)}/s`,
      `  latency p50 ${f(figures.p50_ms)} ms, p95 ${f(figures.p95_ms)} ms, p99 ${f(figures.p99_ms)} ms, max ${f(figures.max_ms)} ms`,
      `  accepted=${figures.accepted} deposited=${figures.deposited} insufficient_funds=${figures.insufficient_funds}` +
        ` lock_timeout=${figures.lock_timeout} lease_lost=${figures.lease_lost}` +
        ` dependency_unavailable=${figures.dependency_unavailable} overloaded=${figures.overloaded}` +
        ` rate_limited=${figures.rate_limited} replayed=${figures.replayed}` +
        ` in_flight=${figures.in_flight} undecided=${figures.undecided}`,
      ...(SCENARIO === 'holds'
        ? [
            `  holds placed=${figures.holds_placed} (${f(figures.holds_placed / DURATION_S)}/s)` +
              ` captured=${figures.captured} (${f(figures.captured / DURATION_S)}/s)` +
              ` voided=${figures.voided} (${f(figures.voided / DURATION_S)}/s)` +
              ` left to expire=${figures.holds_left} hold_expired=${figures.hold_expired}`,
          ]
        : []),
      `  dropped connections: ${figures.dropped_connections}; 503/429 without Retry-After: ${figures.no_retry_after}`,
      `  unexpected errors: ${figures.unexpected} (${(figures.unexpected_rate * 100).toFixed(3)}% of requests)` +
        (MODEL === 'open' ? `, dropped iterations: ${figures.dropped_iterations}` : ''),
      figures.failed_thresholds.length === 0
        ? '  thresholds: all passed'
        : `  thresholds FAILED: ${figures.failed_thresholds.join('; ')}`,
    ].join('\n') + '\n';
  const out = { stdout: text };
  if (__ENV.SUMMARY_JSON) out[__ENV.SUMMARY_JSON] = JSON.stringify({ figures, k6: data }, null, 1);
  return out;
}
