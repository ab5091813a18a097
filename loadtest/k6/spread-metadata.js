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

function pick(values) {
  return values[randomInt(0, values.length - 1)];
}

// order_id: one per iteration (VU and iteration, as the key); customer: `cus_` and 10 random base-36
// digits.
function metadata() {
  return `"metadata":{"order_id":"ORD-${String(__VU).padStart(4, '0')}-${String(__ITER).padStart(8, '0')}",` +
    `"channel":"${pick(CHANNELS)}","country":"${pick(COUNTRIES)}",` +
    `"customer":"cus_${randomInt(36 ** 9, 36 ** 10 - 1).toString(36)}"}`;
}

export default iteration((runId) => move(runId, 'pay', anyWallet(runId), randomInt(1, 100), metadata()));
