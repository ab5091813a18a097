// loadtest/k6/spread-metadata.js: spread (payments of 1 to 100 from wallets picked at random), each
// payment with a `metadata` object of 4 keys, as a shop would send it (loadtest/README.md).
import { anyWallet, iteration, move, randomInt, scenario } from './lib.js';

export { setup, handleSummary } from './lib.js';
export const options = scenario('spread-metadata', { wallets: 10000, initial: 1000000000, vus: 64, p95_ms: 1000,
  p99_ms: 2000 });

// The values (6 to 23 characters) need no escaping in JSON: lib's payment() writes the body out.
const CHANNELS = ['web-checkout', 'ios-app/5.12.0', 'android-app/5.11.3', 'pos-terminal-0042', 'call-center',
  'partner-api:acme-travel'];
const COUNTRIES = ['Germany', 'France', 'United Kingdom', 'Netherlands', 'United States', 'Brazil', 'South Africa',
  'New Zealand'];

// The metadata's values but the order id, built once per VU (k6 runs this file's top level in each
// VU): an iteration then only writes its order id, so the load generator, on the same cores as the
// service, spends next to nothing more per payment than spread's and the ratio is the service's.
const TAILS = Array.from({ length: 64 }, (_, n) =>
  `"channel":"${CHANNELS[n % CHANNELS.length]}","country":"${COUNTRIES[(n * 5) % COUNTRIES.length]}",` +
  `"customer":"cus_${(36 ** 9 + n * 7919 * 104729).toString(36)}"}`);

// order_id: one per iteration (VU and iteration, as the key); the rest from TAILS.
function metadata() {
  return `"metadata":{"order_id":"ORD-${__VU}-${__ITER}",${TAILS[__ITER % TAILS.length]}`;
}

export default iteration((runId) => move(runId, 'pay', anyWallet(runId), randomInt(1, 100), metadata()));
