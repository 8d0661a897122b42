// The official OpenAI TypeScript SDK (npm `openai`, the version of ./package-lock.json) as a client of
// clm-serve's POST /v1/decisions: run by tests/serve/test_decisions_clients.py with `node`.
//
// Environment: OPENAI_BASE_URL (clm-serve's .../v1), OPENAI_API_KEY (a key clm-serve accepts),
// DECISIONS_MODEL (a model it serves). Sends every request of ../decisions_requests.json (one question of
// each type, both kinds of choice value, string and user-message input: the same requests the Python SDK
// sends) with client.decisions.create, then two that must be refused, and prints ONE JSON document:
//   {"sdk": <the SDK's version>, "calls": {<case>: {"request": <params>, "response": <the SDK's Decision>}},
//    "errors": {"wrong_key": {...}, "unknown_model": {...}}}
import { readFileSync } from 'node:fs';

// `make setup` installs the SDK from this folder's lock into var/node (npm ci); nothing is downloaded here.
// It is imported by path: var/node is not on this file's module resolution path.
const SDK_DIR = new URL('../../../var/node/node_modules/openai/', import.meta.url);
const { default: OpenAI } = await import(new URL('index.mjs', SDK_DIR));
const SDK_VERSION = JSON.parse(readFileSync(new URL('package.json', SDK_DIR), 'utf8')).version;
const { requests } = JSON.parse(readFileSync(new URL('../decisions_requests.json', import.meta.url), 'utf8'));

const model = process.env.DECISIONS_MODEL;
if (!model || !process.env.OPENAI_BASE_URL || !process.env.OPENAI_API_KEY) {
  throw new Error('set OPENAI_BASE_URL, OPENAI_API_KEY and DECISIONS_MODEL');
}
// The SDK reads OPENAI_BASE_URL and OPENAI_API_KEY itself. maxRetries 0: a refusal surfaces at once.
const client = new OpenAI({ maxRetries: 0 });

const calls = {};
for (const [name, params] of Object.entries(requests)) {
  const request = { model, ...params };
  calls[name] = { request, response: await client.decisions.create(request) };
}

// What the SDK makes of a refused call: its error class (checked with instanceof, not only by name).
async function refused(makeCall) {
  try {
    await makeCall();
  } catch (error) {
    return {
      class: error.constructor.name,
      status: error.status ?? null,
      is_authentication_error: error instanceof OpenAI.AuthenticationError,
      is_not_found_error: error instanceof OpenAI.NotFoundError,
      error: error.error ?? null,
    };
  }
  return { class: null, status: null };
}

const first = calls[Object.keys(calls)[0]].request;
const errors = {
  wrong_key: await refused(() => new OpenAI({ apiKey: `${process.env.OPENAI_API_KEY}-wrong`, maxRetries: 0 })
    .decisions.create(first)),
  unknown_model: await refused(() => client.decisions.create({ ...first, model: `${model}-no-such-model` })),
};

process.stdout.write(JSON.stringify({ sdk: SDK_VERSION, calls, errors }) + '\n');
