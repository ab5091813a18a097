// loadtest/k6/lib.js: what the k6 scenarios (loadtest/k6/<scenario>.js) share: the settings, the
// wallets setup() opens, operations retried with their Idempotency-Key until the API decides them,
// the client's record (ACK_LOG=1: what it was told, as `walletlock audit --acks` reads it),
// counters, thresholds and the summary. loadtest/README.md says what each scenario does, every
// setting, what counts as an error and how the books are checked.

import http from 'k6/http';
import { check, fail, sleep } from 'k6';
import exec from 'k6/execution';
import { Counter, Rate } from 'k6/metrics';

// The setting NAME (FALLBACK if unset): a positive integer, or with `any` a non-negative number.
export function positiveInt(name, fallback, any = false) {
  const raw = __ENV[name];
  if (raw === undefined || raw === '') return fallback;
  const value = Number(raw);
  if (any ? !(value >= 0) : !Number.isInteger(value) || value < 1) {
    throw new Error(`${name} must be a ${any ? 'non-negative number' : 'positive integer'}, not ${raw}`);
  }
  return value;
}
const positiveNumber = (name, fallback) => positiveInt(name, fallback, true);

// "90s", "2m", "1m30s", "1h" -> seconds.
function seconds(text) {
  const unit = { ms: 0.001, s: 1, m: 60, h: 3600 };
  let total = 0;
  let matched = '';
  for (const m of text.matchAll(/(\d+(?:\.\d+)?)(ms|s|m|h)/g)) {
    total += Number(m[1]) * unit[m[2]];
    matched += m[0];
  }
  if (matched !== text || total <= 0) throw new Error(`DURATION must look like 60s, 2m or 1m30s, not ${text}`);
  return total;
}

// Tries per operation before it is logged as undecided (and settled after the run).
export const TRIES = 5;

// The run's settings: scenario() fills them in, in the init context of every VU.
export const cfg = {};

// Refusals by status: nothing applied, and the API says so.
export const REFUSED = {
  422: ['insufficient_funds', 'balance_overflow'],
  503: ['lock_timeout', 'overloaded', 'dependency_unavailable'],
  429: ['rate_limited'],
  409: ['lease_lost', 'hold_expired'],
};

// The counters. Per operation (however many requests it took): accepted (payments, transfers,
// splits and captures charged; captured counts again), deposited, holds_placed, voided, holds_left,
// the refusals by code, undecided (unknown after TRIES). Per answer: replayed, in_flight,
// dropped_connections (no answer), no_retry_after (a 503 or 429 without it), unexpected.
const REFUSALS = new Set(Object.values(REFUSED).flat());
const COUNTERS = ['operations', 'accepted', 'deposited', 'holds_placed', 'captured', 'voided', 'holds_left',
  ...REFUSALS, 'dropped_connections', 'no_retry_after', 'replayed', 'in_flight', 'undecided', 'unexpected',
  'double_charges'];
export const count = {};
for (const name of COUNTERS) count[name] = new Counter(name);
const unexpectedErrors = new Rate('unexpected_errors');

// Statuses the API answers by contract; everything else marks http_req_failed.
http.setResponseCallback(http.expectedStatuses(200, 201, 409, 422, 429, 503));

export const JSON_HEADERS = { 'Content-Type': 'application/json' };
if (__ENV.API_TOKEN) JSON_HEADERS.Authorization = `Bearer ${__ENV.API_TOKEN}`;

// scenario NAME PROFILE: reads the settings (PROFILE: the scenario's defaults: wallets, initial,
// vus, p95_ms, p99_ms, limits, and op, the tag of its own requests: move, read or health) and
// returns k6's options.
export function scenario(name, profile) {
  const vus = positiveInt('VUS', profile.vus);
  Object.assign(cfg, {
    name, op: profile.op || 'move', baseUrl: (__ENV.BASE_URL || 'http://127.0.0.1:8080').replace(/\/+$/, ''),
    model: __ENV.MODEL || 'closed', duration: __ENV.DURATION || '60s', durationS: seconds(__ENV.DURATION || '60s'),
    vus, rate: positiveInt('RATE', 200), maxVus: positiveInt('MAX_VUS', 4 * vus),
    wallets: positiveInt('WALLETS', profile.wallets), initial: positiveInt('INITIAL', profile.initial),
    ackLog: __ENV.ACK_LOG === '1', openOnly: __ENV.OPEN_ONLY === '1', opened: __ENV.OPENED === '1',
    // What setup PUTs on each wallet as its limits (spread-limits.js), as JSON; none if unset.
    limits: profile.limits ? JSON.stringify(profile.limits) : null,
  });
  if (cfg.model !== 'closed' && cfg.model !== 'open') throw new Error(`MODEL must be closed or open, not ${cfg.model}`);
  // See ack(): a VU of the closed model runs to the end of the scenario.
  cfg.acksBatched = cfg.model === 'closed';
  let executor = { executor: 'constant-vus', vus, duration: cfg.duration, gracefulStop: '10s' };
  if (cfg.openOnly) executor = { executor: 'shared-iterations', vus: 1, iterations: 1, maxDuration: '1m' };
  else if (cfg.model === 'open') {
    executor = { executor: 'constant-arrival-rate', rate: cfg.rate, timeUnit: '1s', duration: cfg.duration,
      preAllocatedVUs: vus, maxVUs: cfg.maxVus, gracefulStop: '10s' };
  }
  // Unexpected answers per request; the latency of the scenario's own requests (not setup's); no
  // double charge, no connection closed without an answer; and http_reqs{op} listed, so that the
  // summary has the count of the scenario's own requests.
  const thresholds = {
    unexpected_errors: [`rate<${positiveNumber('MAX_ERROR_RATE', 0.001)}`],
    [`http_req_duration{op:${cfg.op}}`]: [`p(95)<${positiveNumber('P95_MS', profile.p95_ms)}`,
      `p(99)<${positiveNumber('P99_MS', profile.p99_ms)}`],
    double_charges: ['count==0'], dropped_connections: ['count==0'], [`http_reqs{op:${cfg.op}}`]: ['count>0'],
  };
  if (cfg.model === 'open') {
    const planned = cfg.rate * cfg.durationS;
    thresholds.dropped_iterations = [`count<=${Math.floor((planned * positiveNumber('MAX_DROPPED_PCT', 1)) / 100)}`];
  }
  return {
    scenarios: { [name]: executor },
    thresholds: cfg.openOnly ? {} : thresholds,
    setupTimeout: '10m',
    // setup() opens wallets 100 at a time (a flood raises these to a user's whole share).
    batch: 100,
    batchPerHost: 100,
    // Without `url` (one per wallet: 10,000 time series); `name` carries the route instead.
    systemTags: ['status', 'method', 'name', 'group', 'check', 'error', 'error_code', 'scenario', 'expected_response'],
    summaryTrendStats: ['avg', 'min', 'med', 'max', 'p(90)', 'p(95)', 'p(99)'],
    discardResponseBodies: false,
  };
}

// iteration WORK: the scenario's default function: WORK(runId), then the record of what it did.
export function iteration(work) {
  return (data) => {
    if (cfg.openOnly) return;
    work(data.runId);
    flushAcks(cfg.acksBatched);
  };
}

export function walletId(runId, index) {
  return `${runId}-${index}`;
}

export function randomInt(min, max) {
  return min + Math.floor(Math.random() * (max - min + 1));
}

// A wallet of the run, picked at random.
export function anyWallet(runId) {
  return walletId(runId, randomInt(0, cfg.wallets - 1));
}

// The headers of a request with an Idempotency-Key. Built as a literal, not spread from
// JSON_HEADERS: k6's JavaScript runs on the cores it measures, and every iteration builds one.
export function keyedHeaders(key) {
  return JSON_HEADERS.Authorization === undefined
    ? { 'Content-Type': 'application/json', 'Idempotency-Key': key }
    : { 'Content-Type': 'application/json', Authorization: JSON_HEADERS.Authorization, 'Idempotency-Key': key };
}

// An answer's body as JSON, or null.
export function json(res) {
  try {
    return res.json();
  } catch (_) {
    return null;
  }
}

function code(res) {
  const body = json(res);
  return body && typeof body.code === 'string' ? body.code : '';
}

// The acknowledgements this VU has not logged yet. A console line costs k6 about as much CPU as a
// request's checks, so in the closed model a VU logs up to ACK_BATCH in one message (a `WL {...}`
// a line), at the latest ACK_HOLD_MS after the first, and each as it comes in the scenario's last
// ACK_TAIL_MS (a constant-vus VU's last iteration ends after the scenario does). Elsewhere (setup,
// the open model, the flood) every iteration logs its own at its end.
const ACK_BATCH = 64;
const ACK_HOLD_MS = 500;
const ACK_TAIL_MS = 2000;
let unlogged = [];
let unloggedSince = 0;
// When the scenario ends (ms since the epoch), read once: `exec.scenario` is built on each access.
let scenarioEnds = null;

// Queues one acknowledgement, written out as JSON (src/ledger/books.rs's Ack).
export function ack(json) {
  if (!cfg.ackLog) return;
  if (unlogged.length === 0) unloggedSince = Date.now();
  unlogged.push(`WL ${json}`);
}

// Logs what ack() gathered, unless it may wait for a fuller batch (see above).
function flushAcks(batched) {
  if (unlogged.length === 0) return;
  if (batched) {
    const now = Date.now();
    if (scenarioEnds === null) scenarioEnds = exec.scenario.startTime + cfg.durationS * 1000;
    if (unlogged.length < ACK_BATCH && now - unloggedSince < ACK_HOLD_MS && now < scenarioEnds - ACK_TAIL_MS) return;
  }
  console.log(unlogged.join('\n'));
  unlogged = [];
}

// setup: the run's wallets (ids RUN_ID-0, RUN_ID-1, ...) opened through the API, 100 at a time,
// and, if the scenario has `limits` (spread-limits.js), those limits put on each.
export function setup() {
  const runId = __ENV.RUN_ID || `lt-${cfg.name}-${Date.now().toString(36)}`;
  if (!/^[A-Za-z0-9_-]{1,50}$/.test(runId)) fail(`RUN_ID must be 1 to 50 of A-Z a-z 0-9 _ -, not ${runId}`);
  if (cfg.opened && !__ENV.RUN_ID) fail('OPENED=1 needs the RUN_ID whose wallets an OPEN_ONLY=1 run opened');
  if (cfg.opened || cfg.wallets === 0) return { runId };
  const started = Date.now();
  eachWallet(runId, 'opening', 201, (id) => ({ method: 'POST', url: `${cfg.baseUrl}/wallets`,
    body: JSON.stringify({ id, balance: cfg.initial }),
    params: { headers: keyedHeaders(`${id}-open`), tags: { op: 'open', name: 'POST /wallets' } } }),
  (id, res) => ack(`{"ack":"opened","wallet":"${id}","balance":${res.json().balance}}`));
  flushAcks(false);
  console.info(`opened ${cfg.wallets} wallets ${walletId(runId, 0)}..${cfg.wallets - 1} in ${Date.now() - started} ms`);
  if (cfg.limits) {
    eachWallet(runId, 'setting the limits of', 200, (id) => ({ method: 'PUT', url: `${cfg.baseUrl}/wallets/${id}/limits`,
      body: cfg.limits,
      params: { headers: keyedHeaders(`${id}-limits`), tags: { op: 'limits', name: 'PUT /wallets/{id}/limits' } } }), () => {});
  }
  return { runId };
}

// eachWallet RUN_ID WHAT OK REQUEST DONE: REQUEST(id) (keyed) for each of the run's wallets, 100 a
// http.batch, DONE(id, response) for each answered OK; sent again while the fleet answers 5xx, none
// or idempotency_key_in_flight, TRIES rounds at most; any other answer fails the run, naming WHAT.
function eachWallet(runId, what, ok, request, done) {
  let pending = [...Array(cfg.wallets).keys()];
  for (let round = 0; round < TRIES && pending.length > 0; round++) {
    if (round > 0) sleep(0.2 * round);
    const retry = [];
    for (let start = 0; start < pending.length; start += 100) {
      const chunk = pending.slice(start, start + 100);
      const responses = http.batch(chunk.map((i) => request(walletId(runId, i))));
      responses.forEach((res, n) => {
        const id = walletId(runId, chunk[n]);
        if (res.status === ok) {
          done(id, res);
        } else if (res.status === 0 || res.status >= 500 || (res.status === 409 && code(res) === 'idempotency_key_in_flight')) {
          retry.push(chunk[n]);
        } else {
          fail(`${what} wallet ${id}: HTTP ${res.status} ${res.body}`);
        }
      });
    }
    pending = retry;
  }
  if (pending.length > 0) fail(`${what} ${pending.length} wallets failed (first: ${walletId(runId, pending[0])})`);
}

// operation FIELDS: a deposit, payment, transfer, split, hold placed, capture or void, made into a
// request with its Idempotency-Key. FIELDS: kind, wallet, amount, key, path, body, route, to (a
// transfer's payee, a split's legs, the hold a capture or void settles), ok (the status that
// applies it: 200), describes(body, op) (whether an answer's body is this operation's outcome) and
// acked(op, body) (the legs it applied, leg()s joined by commas; none: no `applied` line). Keys and
// wallet ids need no escaping: bodies and acknowledgements are written out, not JSON.stringify'd.
export function operation(fields) {
  fields.method = 'POST';
  fields.url = cfg.baseUrl + fields.path;
  fields.ok = fields.ok || 200;
  fields.params = { headers: keyedHeaders(fields.key), tags: { op: 'move', name: fields.route } };
  return fields;
}

// A payment (with the key as its reference) or a deposit. EXTRA (optional): more members of the
// body, written out, e.g. `"metadata":{"channel":"web"}` (spread-metadata.js).
export function payment(kind, wallet, amount, key, extra) {
  let body = kind === 'pay' ? `{"amount":${amount},"reference":"${key}"}` : `{"amount":${amount}}`;
  if (extra) body = `${body.slice(0, -1)},${extra}}`;
  return operation({ kind, wallet, amount, key, body, path: `/wallets/${wallet}/${kind}`,
    route: `POST /wallets/{id}/${kind}`, describes: describesEntry, acked: ackedEntry });
}

const describesEntry = (entry, op) => isEntry(entry, op.wallet, op.kind, op.amount);

function ackedEntry(op, entry) {
  return leg(op.wallet, op.kind === 'pay' ? -op.amount : op.amount, entry.id);
}

// One leg of an acknowledgement: AMOUNT into (> 0) or out of WALLET, by ledger entry ENTRY.
export function leg(wallet, amount, entry) {
  return `{"wallet":"${wallet}","amount":${amount},"entry":${JSON.stringify(entry)}}`;
}

// Whether `entry` is a ledger entry of `kind` that moves `amount` in `wallet`.
export function isEntry(entry, wallet, kind, amount) {
  return entry !== null && typeof entry === 'object' && entry.wallet_id === wallet && entry.kind === kind &&
    entry.amount === amount && Number.isInteger(entry.balance) && entry.balance >= 0 && typeof entry.id === 'string';
}

// Whether `entry` is the leg of movement `id` that moves `amount` (transfer_out or _in) in `wallet`.
export function isLeg(entry, wallet, kind, amount, id) {
  return isEntry(entry, wallet, kind, amount) && entry.transfer_id === id;
}

// Refusals of the request alone, not stored for its key (shed, lease lost, ...): nothing of this
// request applied, but an earlier try of the operation that got no answer may still run and apply,
// so after one such try they decide nothing (the key's replay, or the settling after the run, does).
export const TRANSIENT = new Set(['lock_timeout', 'overloaded', 'dependency_unavailable', 'rate_limited', 'lease_lost']);

// What one answer says about the operation. decided: 'charged' (applied), 'refused' (nothing
// applied, the API says so), or null (unknown yet).
export function classify(res, op) {
  const replay = res.headers['Idempotent-Replayed'] === 'true';
  if (replay) count.replayed.add(1);
  const errorCode = res.status === op.ok ? '' : code(res);
  let decided = null;
  let expected = true;
  let entry = null;
  if (res.status === op.ok) {
    entry = json(res);
    // A success that does not describe this request: settled by replaying the key.
    if (entry !== null && op.describes(entry, op)) decided = 'charged';
    else expected = false;
  } else if ((REFUSED[res.status] || []).includes(errorCode)) {
    decided = 'refused';
  } else if (res.status === 409 && errorCode === 'idempotency_key_in_flight') {
    count.in_flight.add(1);
  } else if (res.status >= 400 && res.status < 500 && res.status !== 408 && res.status !== 429) {
    // Rejected (400, 404, 422 idempotency_key_reused): nothing applied, but never sent by these scripts.
    decided = 'refused';
    expected = false;
  } else {
    // Status 0 (no answer), 500, 502/504 from nginx, 503 request_timeout: may or may not have run.
    expected = false;
  }
  if (res.status === 0) count.dropped_connections.add(1);
  if ((res.status === 503 || res.status === 429) && !res.headers['Retry-After']) {
    count.no_retry_after.add(1);
    expected = false;
  }
  judge(res, expected, `${op.kind}: an answer the API promises`, false);
  return { decided, code: errorCode, entry, replay, status: res.status };
}

// judge RES EXPECTED CHECK [COUNTS]: one answer, expected or not, under a check named CHECK; with
// COUNTS (reads, health checks: a request is an operation), also an operation.
export function judge(res, expected, name, counts = true) {
  if (counts) count.operations.add(1);
  unexpectedErrors.add(!expected);
  if (!expected) count.unexpected.add(1);
  check(res, { [name]: () => expected });
}

// Sends OP until an answer decides it, at most TRIES times in all (`first` may hold the answers
// already received). Returns the deciding outcome, or null.
export function settle(op, first) {
  let tries = 0;
  // Whether a try got no deciding answer: it may still run (see TRANSIENT).
  let unsure = false;
  const decides = (outcome) => {
    if (outcome.decided === null) unsure = true;
    return outcome.decided !== null && !(unsure && TRANSIENT.has(outcome.code));
  };
  for (const outcome of first || []) {
    if (decides(outcome)) return outcome;
    tries++;
  }
  while (tries < TRIES) {
    if (tries > 0) sleep(0.05 * 2 ** (tries - 1));
    tries++;
    const outcome = classify(http.request(op.method, op.url, op.body, op.params), op);
    if (decides(outcome)) return outcome;
  }
  return null;
}

// Counts and acknowledges the final outcome of OP (null: undecided, settled after the run by
// replaying its key). A transfer, a split and a capture count as accepted: money left a wallet.
export function finish(op, outcome) {
  count.operations.add(1);
  if (outcome === null) {
    count.undecided.add(1);
    ack(`{"ack":"undecided","key":"${op.key}","op":"${op.kind}","path":"${op.path}","body":${JSON.stringify(op.body)}}`);
  } else if (outcome.decided === 'charged') {
    count[{ deposit: 'deposited', hold: 'holds_placed', void: 'voided' }[op.kind] || 'accepted'].add(1);
    if (op.kind === 'capture') count.captured.add(1);
    const legs = op.acked(op, outcome.entry);
    if (legs) ack(`{"ack":"applied","key":"${op.key}","legs":[${legs}]}`);
  } else {
    if (REFUSALS.has(outcome.code)) count[outcome.code].add(1);
    ack(`{"ack":"refused","key":"${op.key}"}`);
  }
}

// One payment or deposit, sent until decided (EXTRA: as in payment()).
export function move(runId, kind, wallet, amount, extra) {
  const op = payment(kind, wallet, amount, `${runId}-${kind}-${__VU}-${__ITER}`, extra);
  finish(op, settle(op, null));
}

// The summary: JSON for the runner (SUMMARY_JSON), a few lines for people (and loadtest/bench).

export function metric(data, name, field) {
  const m = data.metrics[name];
  return m && m.values && m.values[field] !== undefined ? m.values[field] : 0;
}

export function handleSummary(data) {
  if (cfg.openOnly) return { stdout: '' };
  const own = (name, field) => metric(data, `${name}{op:${cfg.op}}`, field);
  const requests = own('http_reqs', 'count');
  const figures = {
    scenario: cfg.name, model: cfg.model, duration_s: cfg.durationS, vus: cfg.model === 'closed' ? cfg.vus : null,
    rate: cfg.model === 'open' ? cfg.rate : null, wallets: cfg.wallets, initial: cfg.initial, base_url: cfg.baseUrl,
    run_id: (data.setup_data && data.setup_data.runId) || __ENV.RUN_ID || null,
    // The scenario's own operations (deposits and payments, or reads, or health checks), over its
    // own duration (setup's wallet openings excluded).
    op: cfg.op, operations: metric(data, 'operations', 'count'), ops_per_s: metric(data, 'operations', 'count') / cfg.durationS,
    requests, rps: requests / cfg.durationS, p50_ms: own('http_req_duration', 'med'),
    p95_ms: own('http_req_duration', 'p(95)'), p99_ms: own('http_req_duration', 'p(99)'), max_ms: own('http_req_duration', 'max'),
  };
  for (const name of [...COUNTERS, 'dropped_iterations']) figures[name] = metric(data, name, 'count');
  figures.unexpected_rate = metric(data, 'unexpected_errors', 'rate');
  figures.failed_thresholds = [];
  for (const [name, m] of Object.entries(data.metrics)) {
    for (const [expr, t] of Object.entries(m.thresholds || {})) {
      if (!t.ok) figures.failed_thresholds.push(`${name}: ${expr}`);
    }
  }
  const f = (x) => (Math.round(x * 10) / 10).toFixed(1);
  const counts = (names) => names.map((name) => `${name}=${figures[name]}`).join(' ');
  const lines = [
    `k6 ${cfg.name} (${cfg.model}${cfg.model === 'closed' ? `, ${cfg.vus} VUs` : `, ${cfg.rate}/s`}, ${cfg.duration}, ${cfg.wallets} wallets):`,
    `  ${figures.operations} operations, ${f(figures.ops_per_s)}/s; ${requests} requests, ${f(figures.rps)}/s`,
    `  latency p50 ${f(figures.p50_ms)} ms, p95 ${f(figures.p95_ms)} ms, p99 ${f(figures.p99_ms)} ms, max ${f(figures.max_ms)} ms`,
    `  ${counts(['accepted', 'deposited', 'insufficient_funds', 'lock_timeout', 'lease_lost', 'dependency_unavailable',
      'overloaded', 'rate_limited', 'replayed', 'in_flight', 'undecided'])}`,
    ...(cfg.summaryLines ? cfg.summaryLines(figures, f) : []),
    `  dropped connections: ${figures.dropped_connections}; 503/429 without Retry-After: ${figures.no_retry_after}`,
    `  unexpected errors: ${figures.unexpected} (${(figures.unexpected_rate * 100).toFixed(3)}% of requests)` +
      (cfg.model === 'open' ? `, dropped iterations: ${figures.dropped_iterations}` : ''),
    figures.failed_thresholds.length === 0
      ? '  thresholds: all passed'
      : `  thresholds FAILED: ${figures.failed_thresholds.join('; ')}`,
  ];
  const out = { stdout: `${lines.join('\n')}\n` };
  if (__ENV.SUMMARY_JSON) out[__ENV.SUMMARY_JSON] = JSON.stringify({ figures, k6: data }, null, 1);
  return out;
}
