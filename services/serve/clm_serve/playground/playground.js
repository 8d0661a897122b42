/* clm-serve playground: one form of questions, sent in the API dialect the user picks, and a view of the answers.
 *
 * Talks to the server that served this page (or the one named in "Server", which must then allow this
 * page's origin: CLM_SERVE_CORS_ORIGINS):
 *   GET  /health         the status pill
 *   GET  /v1/models      the model picker (OpenAI's {"data": [{"id"}]} or upstream's {"models": [{"name"}]})
 *   GET  /v1/heads       which heads version is serving (the status pill's tooltip)
 *   POST /v1/systemone   the request of the "vLLM" and "contrastive-lm" dialects
 *   POST /v1/decisions   the request of the "OpenAI" dialect
 * Every call carries "Authorization: Bearer <key>" when an API key is entered.
 *
 * The form is one (a state, context instructions, typed questions); each dialect translates it into its
 * own request, such that the model reads the same texts in all three: what a dialect cannot say is moved
 * where clm-serve would put it (instructions appended to the state) or, when it has no equivalent (a
 * predicate's true/false descriptions), left out and listed in the dialect's notes above the form.
 *
 * Plain ES2020: no build step, no network imports, no inline script or style (the page's CSP allows none).
 */
'use strict';

(() => {
  const $ = (selector, root = document) => root.querySelector(selector);
  const $$ = (selector, root = document) => [...root.querySelectorAll(selector)];

  const STORE_FORM = 'clm-serve.playground.form.v1';   // v1 still: dialect and temperature are optional fields
  const STORE_BASE = 'clm-serve.playground.base-url';
  const STORE_KEY = 'clm-serve.playground.api-key';   // sessionStorage: the key is forgotten with the tab

  /* ───────────── the example: a state and one question of each type ───────────── */

  const EXAMPLE = {
    stateFormat: 'json',
    state: '{\n  "rule": "impossible travel",\n  "user": "j.doe",\n  "countries": ["DE", "BR"],\n'
      + '  "minutes_apart": 42\n}',
    instructions: 'You triage security alerts for a mid-size company.',
    questions: [
      { id: 'disposition', type: 'choice', instructions: 'What is this alert?',
        options: [{ name: 'benign', description: 'expected activity' },
                  { name: 'suspicious', description: 'needs a closer look' },
                  { name: 'malicious', description: 'an attack in progress' }] },
      { id: 'escalate', type: 'noul', instructions: 'Escalate to tier 2?',
        truths: { true: 'a human analyst must act now', false: 'it can wait or be closed' } },
      { id: 'severity', type: 'score', instructions: 'How severe is it?',
        levels: ['none', 'low', 'medium', 'high', 'critical'] },
    ],
  };

  const TYPE_HELP = {
    choice: 'Pick one option. Each option is a name (the answer) and an optional description, which is what the model reads (blank: the name itself).',
    noul: 'Yes or no: the answer is p(yes). Describing what true and false mean is optional.',
    score: 'An ordered scale, lowest first. The answer is the expected level index (0 = the first level).',
  };
  const INSTRUCTIONS_PLACEHOLDER = {
    choice: 'The question, e.g. “What is this alert?”',
    noul: 'A yes/no question, e.g. “Escalate to tier 2?”',
    score: 'What is rated, e.g. “How severe is it?”',
  };

  /* ───────────── the three API dialects ───────────── */

  const DIALECTS = {
    systemone: { path: 'v1/systemone', label: 'vLLM', python: 'httpx' },
    upstream: { path: 'v1/systemone', label: 'contrastive-lm', python: 'CLMClient' },
    decisions: { path: 'v1/decisions', label: 'OpenAI', python: 'openai' },
  };
  const DEFAULT_DIALECT = 'systemone';
  const UPSTREAM_DEFAULT_MODEL = 'clm-latest';   // what upstream's CLMClient sends when no model is given
  // A question's type as each dialect names it (OpenAI's decisions call a yes/no question a predicate).
  const TYPE_NAMES = {
    systemone: { choice: 'choice', noul: 'noul', score: 'score' },
    upstream: { choice: 'choice', noul: 'noul', score: 'score' },
    decisions: { choice: 'choice', noul: 'predicate', score: 'score' },
  };
  const CANONICAL_TYPE = { choice: 'choice', noul: 'noul', predicate: 'noul', score: 'score' };

  /* ───────────── form state ───────────── */

  let uidSeq = 0;
  let form = null;
  let lastSent = null;       // the request of the answers on screen: {body, path, dialect, questions}
  let inFlight = false;

  function newQuestion(type, seed = {}) {
    uidSeq += 1;
    const q = {
      uid: uidSeq,
      id: seed.id !== undefined ? String(seed.id) : '',
      type,
      instructions: seed.instructions || '',
      options: (seed.options || []).map((o) => ({ name: String(o.name ?? ''), description: String(o.description ?? '') })),
      truths: { true: String(seed.truths?.true ?? ''), false: String(seed.truths?.false ?? '') },
      levels: (seed.levels || []).map(String),
    };
    fillDefaults(q);
    return q;
  }

  function fillDefaults(q) {
    if (q.type === 'choice' && !q.options.length) q.options = [{ name: '', description: '' }, { name: '', description: '' }];
    if (q.type === 'score' && !q.levels.length) q.levels = ['', '', ''];
  }

  function uniqueId(type) {
    const taken = new Set(form.questions.map((q) => q.id));
    for (let n = 1; ; n += 1) {
      const id = n === 1 ? type : `${type}_${n}`;
      if (!taken.has(id)) return id;
    }
  }

  function formFrom(data) {
    const d = data && typeof data === 'object' ? data : EXAMPLE;
    const types = new Set(['choice', 'noul', 'score']);
    return {
      dialect: Object.prototype.hasOwnProperty.call(DIALECTS, d.dialect) ? d.dialect : DEFAULT_DIALECT,
      temperature: typeof d.temperature === 'string' ? d.temperature : '',
      stateFormat: d.stateFormat === 'text' ? 'text' : 'json',
      state: typeof d.state === 'string' ? d.state : '',
      instructions: typeof d.instructions === 'string' ? d.instructions : '',
      model: typeof d.model === 'string' ? d.model : '',
      questions: (Array.isArray(d.questions) ? d.questions : [])
        .filter((q) => q && types.has(q.type))
        .map((q) => newQuestion(q.type, q)),
    };
  }

  /** The example's state and questions; the connection-like choices (model, dialect, temperature) stay. */
  function exampleForm() {
    return formFrom({ ...EXAMPLE, model: form ? form.model : '', dialect: form ? form.dialect : DEFAULT_DIALECT,
                      temperature: form ? form.temperature : '' });
  }

  function save() {
    try {
      const { questions, ...rest } = form;
      const plain = { ...rest, questions: questions.map(({ uid, ...q }) => q) };
      localStorage.setItem(STORE_FORM, JSON.stringify(plain));
    } catch (e) { /* storage off: the form just is not kept */ }
  }

  function restore() {
    try {
      const stored = JSON.parse(localStorage.getItem(STORE_FORM) || 'null');
      if (stored && Array.isArray(stored.questions)) return formFrom(stored);
    } catch (e) { /* a damaged copy: start from the example */ }
    return formFrom(EXAMPLE);
  }

  /* ───────────── JSON that keeps its order ─────────────
   * A JSON state is sent as written: JavaScript objects list integer-like keys first and JSON.parse
   * turns 1.0 into 1, either of which would change the text the model reads. So the state is read
   * into Maps (insertion order) and Num (the number's own text), and written back from those. */

  class Num { constructor(raw) { this.raw = raw; } }

  function parseOrdered(text) {          // text is valid JSON (JSON.parse accepted it)
    let i = 0;
    const skip = () => { while (i < text.length && ' \t\n\r\ufeff'.includes(text[i])) i += 1; };
    const token = (re) => { re.lastIndex = i; const m = re.exec(text); i = re.lastIndex; return m[0]; };
    const STRING = /"(?:[^"\\]|\\.)*"/y;
    const NUMBER = /-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?/y;
    function value() {
      skip();
      const c = text[i];
      if (c === '{') {
        i += 1; const map = new Map(); skip();
        if (text[i] === '}') { i += 1; return map; }
        for (;;) {
          skip(); const key = JSON.parse(token(STRING)); skip(); i += 1;  // ':'
          map.set(key, value()); skip();
          if (text[i] === ',') { i += 1; continue; }
          i += 1; return map;                                              // '}'
        }
      }
      if (c === '[') {
        i += 1; const list = []; skip();
        if (text[i] === ']') { i += 1; return list; }
        for (;;) {
          list.push(value()); skip();
          if (text[i] === ',') { i += 1; continue; }
          i += 1; return list;                                             // ']'
        }
      }
      if (c === '"') return JSON.parse(token(STRING));
      if (text.startsWith('true', i)) { i += 4; return true; }
      if (text.startsWith('false', i)) { i += 5; return false; }
      if (text.startsWith('null', i)) { i += 4; return null; }
      return new Num(token(NUMBER));
    }
    return value();
  }

  const isContainer = (v) => v instanceof Map || Array.isArray(v);

  function scalarJson(v) {
    if (v instanceof Num) return v.raw;
    if (typeof v === 'number') return String(v);
    return JSON.stringify(v);              // strings, booleans, null
  }

  function scalarPython(v) {
    if (v === null || v === undefined) return 'None';
    if (v === true) return 'True';
    if (v === false) return 'False';
    return scalarJson(v);                  // a JSON string or number literal is a Python literal
  }

  function oneLine(v, scalar) {
    if (v instanceof Map) return '{' + [...v.entries()].map(([k, x]) => JSON.stringify(k) + ': ' + oneLine(x, scalar)).join(', ') + '}';
    if (Array.isArray(v)) return '[' + v.map((x) => oneLine(x, scalar)).join(', ') + ']';
    return scalar(v);
  }

  /* Pretty printer for both languages: a container that fits on one line stays on one line. */
  function pretty(v, scalar, unit = '  ', level = 0, width = 76) {
    if (!isContainer(v)) return scalar(v);
    const entries = v instanceof Map ? [...v.entries()] : v.map((x) => [null, x]);
    const [open, close] = v instanceof Map ? ['{', '}'] : ['[', ']'];
    if (!entries.length) return open + close;
    const item = (k, x, lvl) => (k === null ? '' : JSON.stringify(k) + ': ') + pretty(x, scalar, unit, lvl, width);
    const flat = oneLine(v, scalar);
    if (level > 0 && flat.length + level * unit.length <= width) return flat;
    const pad = unit.repeat(level + 1);
    return open + '\n' + entries.map(([k, x]) => pad + item(k, x, level + 1)).join(',\n')
      + '\n' + unit.repeat(level) + close;
  }

  function compactJson(v) {
    if (!isContainer(v)) return scalarJson(v);
    if (v instanceof Map) return '{' + [...v.entries()].map(([k, x]) => JSON.stringify(k) + ':' + compactJson(x)).join(',') + '}';
    return '[' + v.map(compactJson).join(',') + ']';
  }

  /* ───────────── the state as the model reads it ─────────────
   * clm-serve renders a JSON state as prose (clm.texts.to_text, upstream's: `key: value` fields in the
   * caller's order, top-level ones a blank line apart, nested ones indented; an array one `- item` line
   * per element) and places the context instructions after it, a blank line apart. A dialect without a
   * JSON state (OpenAI's input is text) or without context instructions (upstream's) is sent that very
   * text, so the model reads the same thing whichever dialect asks. */

  const PARAGRAPH = '\n\n';

  /** Python's str() of the number json.loads reads from `raw`: ints as written, floats as repr(). */
  function pyNumber(raw) {
    if (!/[.eE]/.test(raw)) return BigInt(raw).toString();      // a JSON int is a Python int: "-0" is "0"
    const x = Number(raw);
    if (!Number.isFinite(x)) return x > 0 ? 'inf' : '-inf';      // json.loads reads 1e999 as inf
    if (x === 0) return Object.is(x, -0) ? '-0.0' : '0.0';
    // toExponential() without digits: the shortest digits that read back as x, like Python's repr
    const [mantissa, exponent] = x.toExponential().split('e');
    const exp = Number(exponent);
    const digits = mantissa.replace('-', '').replace('.', '');
    const sign = x < 0 ? '-' : '';
    if (exp < -4 || exp >= 16) {                                  // repr switches to exponent notation
      const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
      return `${sign}${m}e${exp < 0 ? '-' : '+'}${String(Math.abs(exp)).padStart(2, '0')}`;
    }
    if (exp < 0) return `${sign}0.${'0'.repeat(-exp - 1)}${digits}`;
    return `${sign}${digits.slice(0, exp + 1).padEnd(exp + 1, '0')}.${digits.slice(exp + 1) || '0'}`;
  }

  const nonEmptyContainer = (v) => (v instanceof Map ? v.size > 0 : Array.isArray(v) && v.length > 0);

  /** clm.texts.to_text of a parsed (ordered) JSON value. */
  function toText(v, indent = 0) {
    if (v === null || v === undefined) return '';
    if (typeof v === 'string') return v;
    if (v === true) return 'true';
    if (v === false) return 'false';
    if (v instanceof Num) return pyNumber(v.raw);
    const pad = ' '.repeat(indent);
    if (v instanceof Map) {
      return [...v.entries()].map(([k, c]) => (nonEmptyContainer(c) ? `${pad}${k}:\n${toText(c, indent + 2)}`
        : `${pad}${k}: ${toText(c)}`)).join(indent === 0 ? PARAGRAPH : '\n');
    }
    if (Array.isArray(v)) {
      return v.map((c) => (nonEmptyContainer(c) ? `${pad}-\n${toText(c, indent + 2)}` : `${pad}- ${toText(c)}`)).join('\n');
    }
    return JSON.stringify(v);
  }

  /** The state followed by the context instructions, as clm-serve joins them (blank parts left out). */
  function stateWithInstructions(state, instructions) {
    const parts = [toText(state).trim(), instructions.trim()].filter(Boolean);
    return parts.join(PARAGRAPH);
  }

  /* ───────────── the request ───────────── */

  /** The form's state as sent: parsed (key order and number spelling kept) when JSON. */
  function formState(problems) {
    if (form.stateFormat !== 'json') return { value: form.state, json: false };
    try {
      JSON.parse(form.state);
      return { value: parseOrdered(form.state), json: true };
    } catch (e) {
      problems.push(`State is not valid JSON (${e.message}). Fix it, or switch the state to Text.`);
      return { value: form.state, json: false };
    }
  }

  /** The form's temperature (upstream's field): null when blank. */
  function formTemperature(problems) {
    const text = form.temperature.trim();
    if (!text) return null;
    const value = Number(text);
    if (!Number.isFinite(value) || !/^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(text)) {
      problems.push(`Temperature “${text}” is not a number.`);
      return null;
    }
    return new Num(String(value));
  }

  /** -> {body: Map, problems: [string], notes: [string], path}: problems are what cannot be written as a
   * request at all (the server never sees them); notes say what this dialect does with the form that the
   * form does not show (moved or left out). Everything else is sent and the server's answer shown. */
  function buildRequest(dialect = form.dialect) {
    const problems = [];
    const notes = [];
    const seen = new Set();
    for (const q of form.questions) {
      if (seen.has(q.id)) problems.push(`Two questions have the id “${q.id}”: each needs its own.`);
      seen.add(q.id);
    }
    const state = formState(problems);
    const temperature = formTemperature(problems);
    const instructions = form.instructions.trim() ? form.instructions : '';
    let body;
    if (dialect === 'decisions') {
      body = decisionsRequest(state, instructions, problems, notes);
    } else if (dialect === 'upstream') {
      body = upstreamRequest(state, instructions, temperature, problems, notes);
    } else {
      body = new Map();
      if (form.model) body.set('model', form.model);
      body.set('state', state.value);
      if (instructions) body.set('instructions', instructions);
      const questions = new Map();
      for (const q of form.questions) questions.set(q.id, systemoneQuestion(q, problems));
      body.set('questions', questions);
    }
    if (temperature !== null && dialect !== 'upstream') {
      notes.push(`Temperature is contrastive-lm's: ${DIALECTS[dialect].label} has none, so it is not sent.`);
    }
    return { body, problems, notes, path: DIALECTS[dialect].path };
  }

  /** vLLM's /v1/systemone question, which upstream shares: {type, instructions, criteria}. */
  function systemoneQuestion(q, problems) {
    const spec = new Map([['type', q.type]]);
    if (q.instructions) spec.set('instructions', q.instructions);
    if (q.type === 'choice') {
      spec.set('criteria', choiceCriteria(q, problems));
    } else if (q.type === 'noul') {
      const criteria = noulCriteria(q);
      if (criteria.size) spec.set('criteria', criteria);
    } else {
      spec.set('criteria', scoreLevels(q));
    }
    return spec;
  }

  function choiceCriteria(q, problems) {
    const criteria = new Map();
    for (const o of q.options) {
      if (!o.name && !o.description) continue;                 // a blank row asks nothing
      if (criteria.has(o.name)) problems.push(`Question “${q.id}” has two options named “${o.name}”.`);
      criteria.set(o.name, o.description ? o.description : null);
    }
    return criteria;
  }

  function noulCriteria(q) {
    const criteria = new Map();
    for (const k of ['true', 'false']) if (q.truths[k]) criteria.set(k, q.truths[k]);
    return criteria;
  }

  const scoreLevels = (q) => q.levels.filter((level) => level !== '');

  /** Upstream contrastive-lm's request, as its CLMClient.system_one writes it: {state, model, questions[,
   * temperature]}, every question with its instructions. It has no context instructions (its server
   * ignores the field), so they go at the end of the state, where clm-serve places them. */
  function upstreamRequest(state, instructions, temperature, problems, notes) {
    const body = new Map();
    if (instructions) {
      body.set('state', stateWithInstructions(state.value, instructions));
      notes.push('Instructions: contrastive-lm has none, so they are appended to the state, '
        + (state.json ? 'which is then sent as the text the model reads from the JSON.' : 'where clm-serve puts them.'));
    } else {
      body.set('state', state.value);
    }
    body.set('model', form.model || UPSTREAM_DEFAULT_MODEL);
    if (!form.model) notes.push(`Model: CLMClient sends ${UPSTREAM_DEFAULT_MODEL} when none is given.`);
    const questions = new Map();
    for (const q of form.questions) {
      const spec = new Map([['type', q.type], ['instructions', q.instructions]]);
      if (q.type === 'choice') spec.set('criteria', choiceCriteria(q, problems));
      else if (q.type === 'noul') { const c = noulCriteria(q); if (c.size) spec.set('criteria', c); }
      else spec.set('criteria', scoreLevels(q));
      questions.set(q.id, spec);
    }
    body.set('questions', questions);
    if (temperature !== null) body.set('temperature', temperature);
    return body;
  }

  /** OpenAI's /v1/decisions request: {model, input, questions: [...]}, the questions a list in the form's
   * order, each named by its id. The input is text: the state as the model reads it, instructions after. */
  function decisionsRequest(state, instructions, problems, notes) {
    const body = new Map();
    if (form.model) body.set('model', form.model);
    else problems.push('OpenAI’s decisions need a model: pick one.');
    const input = state.json || instructions ? stateWithInstructions(state.value, instructions) : state.value;
    body.set('input', input);
    if (state.json) notes.push('State: input is text, so the JSON state is sent as the text the model reads from it.');
    if (instructions) notes.push('Instructions: decisions have none, so they are appended to the input, where clm-serve puts them.');
    const questions = [];
    form.questions.forEach((q, index) => {
      const spec = new Map([['type', TYPE_NAMES.decisions[q.type]]]);
      if (q.id) spec.set('name', q.id);
      else notes.push(`Question ${index + 1} has no id: its answer is known by its place in the list.`);
      spec.set('instructions', q.instructions);                // required by OpenAI's schema, even blank
      if (q.type === 'choice') {
        spec.set('choices', [...choiceCriteria(q, problems)].map(([value, description]) => (
          description === null ? new Map([['value', value]]) : new Map([['value', value], ['description', description]]))));
      } else if (q.type === 'score') {
        spec.set('levels', scoreLevels(q).map((label) => new Map([['label', label]])));
      } else if (q.truths.true || q.truths.false) {
        notes.push(`“${q.id || index + 1}”: a predicate has no true/false descriptions, so they are not sent `
          + '(the answers then differ from the other dialects’).');
      }
      questions.push(spec);
    });
    body.set('questions', questions);
    return body;
  }

  /* ───────────── connection ───────────── */

  const baseUrl = () => $('#base-url').value.trim().replace(/\/+$/, '');
  const apiKey = () => $('#api-key').value.trim();

  /** Absolute URL of an API path ("v1/models"): under "Server" if set, else beside this page. */
  function apiUrl(path) {
    const base = baseUrl();
    return base ? `${base}/${path}` : new URL(path, document.baseURI).href;
  }

  async function call(method, path, body) {
    const headers = { Accept: 'application/json' };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const started = performance.now();
    const response = await fetch(apiUrl(path), { method, headers, body, cache: 'no-store' });
    const text = await response.text();
    const ms = performance.now() - started;
    let json = null;
    try { json = JSON.parse(text); } catch (e) { /* not JSON: shown as text */ }
    return { response, text, json, ms };
  }

  let statusTimer = null;

  function setStatus(state, text, title) {
    const pill = $('#status');
    pill.dataset.state = state;
    $('#status-text').textContent = text;
    pill.title = (title ? title + '\n' : '') + 'Server status (GET /health); click to refresh';
  }

  async function refreshStatus() {
    clearTimeout(statusTimer);
    setStatus('busy', 'connecting…');
    let health;
    try {
      health = await call('GET', 'health');
    } catch (e) {
      setStatus('bad', 'unreachable', `Could not reach ${apiUrl('health')}.`);
      statusTimer = setTimeout(refreshStatus, 10000);
      return;
    }
    const h = health.json || {};
    if (health.response.ok) {
      let title = `clm-serve is serving heads ${h.heads_version || ''}.`;
      try {
        const heads = await call('GET', 'v1/heads');
        if (heads.response.ok && heads.json) {
          const info = heads.json;
          title = [`heads ${info.version || '?'} (${info.mode || '?'}: ${info.source || '?'})`,
                   info.encoder ? `encoder ${info.encoder.model} (${info.encoder.dim} dims)` : '',
                   info.loaded_at ? `loaded ${info.loaded_at}` : ''].filter(Boolean).join('\n');
        }
      } catch (e) { /* the pill says enough */ }
      setStatus('ok', h.heads_version ? `ready · ${h.heads_version}` : 'ready', title);
    } else if (health.response.status === 503) {
      setStatus('warn', h.reason ? `not ready · ${h.reason}` : 'not ready',
        'clm-serve is up; its heads are not loaded yet (checked again every 3 s).');
      statusTimer = setTimeout(refreshStatus, 3000);
    } else {
      setStatus('bad', `HTTP ${health.response.status}`, `${apiUrl('health')} is no clm-serve /health.`);
    }
  }

  /** Model names from either shape: OpenAI's {"data": [{"id"}]} or upstream's {"models": [{"name"}]}. */
  function modelNames(json) {
    const out = [];
    const add = (name, title) => { if (typeof name === 'string' && name && !out.some((m) => m.name === name)) out.push({ name, title }); };
    if (json && Array.isArray(json.data)) for (const m of json.data) add(m && m.id, m && (m.root || m.owned_by));
    if (json && Array.isArray(json.models)) for (const m of json.models) add(m && (m.name || m.id), m && m.description);
    return out;
  }

  async function refreshModels() {
    const select = $('#model');
    const note = $('#model-note');
    let models = [];
    try {
      const result = await call('GET', 'v1/models');
      if (result.response.ok) {
        models = modelNames(result.json);
        note.textContent = '';
      } else {
        const message = result.json && result.json.error ? result.json.error.message : result.text;
        note.textContent = result.response.status === 401 || result.response.status === 403
          ? 'enter the API key to list models' : `models: HTTP ${result.response.status} ${message || ''}`.trim();
      }
    } catch (e) {
      note.textContent = 'could not list models';
    }
    select.replaceChildren(new Option('(server default)', ''));
    for (const m of models) {
      const option = new Option(m.name, m.name);
      if (m.title) option.title = String(m.title);
      select.append(option);
    }
    // A model this server does not list (kept from another server) gives way to its first one.
    if (models.length && !models.some((m) => m.name === form.model)) form.model = models[0].name;
    if (form.model && !models.some((m) => m.name === form.model)) select.append(new Option(form.model, form.model));
    select.value = form.model;
    changed();
  }

  /* ───────────── question editor ───────────── */

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (v === undefined || v === null) continue;
      if (k === 'class') node.className = v;
      else if (k === 'text') node.textContent = v;
      else if (k.startsWith('data-') || k.startsWith('aria-') || k === 'role') { if (v !== false) node.setAttribute(k, v); }
      else node[k] = v;                      // properties: value, type, placeholder, spellcheck, onclick…
    }
    node.append(...children.filter((c) => c !== null && c !== undefined && c !== false));
    return node;
  }

  function renderQuestions(focus) {
    const list = $('#questions');
    list.replaceChildren(...form.questions.map((q, index) => questionCard(q, index)));
    if (!form.questions.length) {
      list.append(el('p', { class: 'help', text: 'No questions: add one below.' }));
    }
    if (focus) {
      const target = $(focus, list);
      if (target) target.focus();
    }
  }

  function questionCard(q, index) {
    const card = $('#tpl-question').content.firstElementChild.cloneNode(true);
    card.dataset.type = q.type;
    card.dataset.index = String(index);
    card.dataset.uid = String(q.uid);
    $('legend', card).textContent = `Question ${index + 1}: ${q.type}`;
    $('.q-chip', card).textContent = q.type;
    $('.q-help', card).textContent = TYPE_HELP[q.type];

    const id = $('.q-id', card);
    id.value = q.id;
    id.addEventListener('input', () => { q.id = id.value; changed(); });

    const type = $('.q-type', card);
    type.value = q.type;
    type.addEventListener('change', () => {
      q.type = type.value; fillDefaults(q); renderQuestions(`[data-uid="${q.uid}"] .q-type`); changed();
    });

    const instructions = $('.q-instructions', card);
    instructions.value = q.instructions;
    instructions.placeholder = INSTRUCTIONS_PLACEHOLDER[q.type];
    instructions.addEventListener('input', () => { q.instructions = instructions.value; changed(); });

    $('.q-remove', card).setAttribute('aria-label', `Remove question ${q.id || index + 1}`);
    $('.q-remove', card).addEventListener('click', () => {
      form.questions.splice(form.questions.indexOf(q), 1); renderQuestions(); changed();
    });

    const rows = $('.q-rows', card);
    const add = $('.q-add', card);
    if (q.type === 'choice') {
      if (q.options.length) {
        rows.append(el('div', { class: 'row-head', 'aria-hidden': 'true' },
          el('span', { text: 'option' }), el('span', { text: 'description (optional)' })));
      }
      q.options.forEach((option, j) => rows.append(row({
        testid: 'option',
        key: textInput(option.name, 'name', `Option ${j + 1} name`, 'option-name', (v) => { option.name = v; }),
        value: textInput(option.description, 'what this option means', `Option ${j + 1} description`, 'option-description',
          (v) => { option.description = v; }),
        remove: () => { q.options.splice(j, 1); renderQuestions(`[data-uid="${q.uid}"] .q-add`); changed(); },
        removeLabel: `Remove option ${option.name || j + 1}`,
      })));
      add.textContent = '+ option';
      add.onclick = () => {
        q.options.push({ name: '', description: '' });
        renderQuestions(`[data-uid="${q.uid}"] [data-testid="option"]:last-of-type .row-key input`); changed();
      };
    } else if (q.type === 'noul') {
      for (const k of ['true', 'false']) {
        rows.append(row({
          testid: 'truth',
          key: el('span', { class: 'fixed-key', text: k === 'true' ? 'true (yes)' : 'false (no)' }),
          value: textInput(q.truths[k], `what ${k} means (optional)`, `What ${k} means`, `truth-${k}`, (v) => { q.truths[k] = v; }),
        }));
      }
      add.hidden = true;
    } else {
      q.levels.forEach((level, j) => rows.append(row({
        testid: 'level',
        key: el('span', { class: 'fixed-key level-index', text: String(j) }),
        value: textInput(level, `level ${j}${j === 0 ? ' (lowest)' : ''}`, `Level ${j}`, 'level-name', (v) => { q.levels[j] = v; }),
        remove: () => { q.levels.splice(j, 1); renderQuestions(`[data-uid="${q.uid}"] .q-add`); changed(); },
        removeLabel: `Remove level ${j}`,
      })));
      add.textContent = '+ level';
      add.onclick = () => {
        q.levels.push('');
        renderQuestions(`[data-uid="${q.uid}"] [data-testid="level"]:last-of-type input`); changed();
      };
    }
    add.dataset.testid = q.type === 'choice' ? 'add-option' : 'add-level';
    return card;
  }

  function textInput(value, placeholder, label, testid, onInput) {
    const input = el('input', { type: 'text', value, placeholder, spellcheck: false, autocomplete: 'off',
                                'aria-label': label, 'data-testid': testid });
    input.addEventListener('input', () => { onInput(input.value); changed(); });
    return input;
  }

  function row({ testid, key, value, remove, removeLabel }) {
    return el('div', { class: 'crit-row', 'data-testid': testid },
      el('div', { class: 'row-key' }, key),
      el('div', { class: 'row-value' }, value),
      remove
        ? el('button', { class: 'icon-btn', type: 'button', text: '×', title: removeLabel, 'aria-label': removeLabel,
                         'data-testid': `remove-${testid}`, onclick: remove })
        : el('span', { class: 'icon-spacer', 'aria-hidden': 'true' }));
  }

  /* ───────────── form ↔ page ───────────── */

  function paintForm() {
    $('#state').value = form.state;
    $(`#state-format-${form.stateFormat}`).checked = true;
    $('#instructions').value = form.instructions;
    $('#model').value = form.model;
    paintDialect();
    renderQuestions();
    changed();
  }

  /** After any edit: the state's checks, the code views, the stored copy. */
  function changed() {
    const n = form.state.length;
    $('#state-count').textContent = `${n.toLocaleString()} char${n === 1 ? '' : 's'}`;
    const stateError = $('#state-error');
    let problem = '';
    if (form.stateFormat === 'json') {
      try { JSON.parse(form.state); } catch (e) { problem = `Not valid JSON: ${e.message}`; }
    }
    stateError.textContent = problem;
    stateError.hidden = !problem;
    $('#state').setAttribute('aria-invalid', problem ? 'true' : 'false');
    renderCode();
    save();
  }

  /* ───────────── code views ───────────── */

  const shellQuote = (s) => `'${s.replace(/'/g, `'\\''`)}'`;

  /** A Python call, on one line when it fits, else one keyword argument per line (values pretty-printed). */
  function pyCall(callee, args, level = 0, unit = '    ', width = 76) {
    const flat = `${callee}(${args.map(([k, v]) => `${k}=${oneLine(v, scalarPython)}`).join(', ')})`;
    if (flat.length + level * unit.length <= width) return flat;
    const pad = unit.repeat(level + 1);
    return `${callee}(\n${args.map(([k, v]) => `${pad}${k}=${pretty(v, scalarPython, unit, level + 1, width)},`).join('\n')}`
      + `\n${unit.repeat(level)})`;
  }

  const PY_KEY = "os.environ['CLM_API_KEY']";   // single quotes: it also goes inside an f"..." string

  function pythonHttpx(url, body) {
    return [
      ...(apiKey() ? ['import os', ''] : []),
      'import httpx  # or requests: the same call, requests.post(...)',
      '',
      'response = httpx.post(',
      `    ${JSON.stringify(url)},`,
      ...(apiKey() ? [`    headers={"Authorization": f"Bearer {${PY_KEY}}"},`] : []),
      `    json=${pretty(body, scalarPython, '    ').replace(/\n/g, '\n    ')},`,
      '    timeout=30.0,',
      ')',
      'response.raise_for_status()',
      'for question_id, answer in response.json()["answers"].items():',
      '    print(question_id, answer)',
    ];
  }

  /** Upstream's client: `from clm import CLMClient` (contrastive-lm 0.1.0, clm/client.py). It reads the
   * key from CLM_API_KEY itself and posts {state, model, questions[, temperature]} to /v1/systemone. */
  function pythonUpstream(body) {
    const CLASSES = { choice: 'Choice', noul: 'Noul', score: 'Score' };
    const used = [...new Set(form.questions.map((q) => CLASSES[q.type]))];
    const questions = [...body.get('questions')].map(([id, spec]) => {
      const args = [['instructions', spec.get('instructions')]];
      if (spec.has('criteria')) args.push(['criteria', spec.get('criteria')]);
      return `        ${JSON.stringify(id)}: ${pyCall(CLASSES[spec.get('type')], args, 2)},`;
    });
    const call = [`    state=${pretty(body.get('state'), scalarPython, '    ', 1)},`,
                  '    questions={', ...questions, '    },'];
    if (form.model) call.push(`    model=${scalarPython(body.get('model'))},`);
    if (body.has('temperature')) call.push(`    temperature=${scalarPython(body.get('temperature'))},`);
    const base = baseUrl() || new URL('.', document.baseURI).href.replace(/\/+$/, '');
    return [
      `from clm import CLMClient, ${used.join(', ')}`.replace(/, $/, ''),
      '',
      `client = CLMClient(base_url=${JSON.stringify(base)})  # its API key: CLM_API_KEY${apiKey() ? '' : ' (if any)'}`,
      'response = client.system_one(',
      ...call,
      ')',
      'for question_id, answer in response.answers.items():',
      '    print(question_id, answer)',
    ];
  }

  /** OpenAI's SDK (openai-python's client.decisions.create), pointed at this server's /v1. */
  function pythonDecisions(body) {
    const key = apiKey() ? PY_KEY : '"none"';
    return [
      ...(apiKey() ? ['import os', ''] : []),
      'from openai import OpenAI',
      '',
      `client = OpenAI(base_url=${JSON.stringify(apiUrl('v1'))}, api_key=${key})`
        + (apiKey() ? '' : '  # the SDK needs a key; this server asks for none'),
      'decision = client.decisions.create(',
      ...[...body].map(([k, v]) => `    ${k}=${pretty(v, scalarPython, '    ', 1)},`),
      ')',
      'for answer in decision.answers:  # in question order',
      '    print(answer.name, answer)',
    ];
  }

  function renderCode() {
    const dialect = form.dialect;
    const { body, problems, notes, path } = buildRequest(dialect);
    const warn = problems.map((p) => `Not sendable: ${p}`);
    const url = apiUrl(path);
    const json = pretty(body, scalarJson);
    $('#view-json').textContent = [...warn.map((w) => `// ${w}`), json].join('\n');

    const curl = [`curl -sS ${shellQuote(url)}`, `-H 'Content-Type: application/json'`];
    if (apiKey()) curl.push(`-H "Authorization: Bearer $CLM_API_KEY"`);
    curl.push(`-d ${shellQuote(json)}`);
    $('#view-curl').textContent = [...warn.map((w) => `# ${w}`), curl.join(' \\\n  ')].join('\n');

    const python = dialect === 'decisions' ? pythonDecisions(body)
      : dialect === 'upstream' ? pythonUpstream(body) : pythonHttpx(url, body);
    $('#view-python').textContent = [...warn.map((w) => `# ${w}`), ...python].join('\n');
    $('#tab-python').title = `Python: ${{ httpx: 'httpx (or requests)', CLMClient: 'contrastive-lm’s CLMClient',
                                         openai: 'the openai SDK' }[DIALECTS[dialect].python]}`;

    $('#route').textContent = `POST /${path}`;
    const list = $('#dialect-notes');
    list.replaceChildren(...notes.map((note) => el('li', { 'data-testid': 'dialect-note', text: note })));
    list.hidden = !notes.length;
  }

  /** The dialect picker, the fields only one dialect has, and the differences panel follow form.dialect. */
  function paintDialect() {
    const radio = $(`#dialect-${form.dialect}`);
    if (radio) radio.checked = true;
    document.body.dataset.dialect = form.dialect;
    $('#temperature-field').hidden = form.dialect !== 'upstream';
    $('#temperature').value = form.temperature;
    for (const block of $$('[data-dialect-info]')) {
      const on = block.dataset.dialectInfo === form.dialect;
      block.classList.toggle('is-current', on);
      if (on) block.setAttribute('aria-current', 'true'); else block.removeAttribute('aria-current');
    }
  }

  function showTab(name, focus) {
    for (const tab of $$('.tabs [role="tab"]')) {
      const on = tab.dataset.view === name;
      tab.setAttribute('aria-selected', on ? 'true' : 'false');
      tab.tabIndex = on ? 0 : -1;
      $(`#view-${tab.dataset.view}`).hidden = !on;
      if (on && focus) tab.focus();
    }
  }

  async function copyActive() {
    const tab = $('.tabs [aria-selected="true"]');
    const text = $(`#view-${tab.dataset.view}`).textContent;
    let ok = false;
    try {
      if (navigator.clipboard && window.isSecureContext) { await navigator.clipboard.writeText(text); ok = true; }
    } catch (e) { /* fall back below */ }
    if (!ok) {
      const area = el('textarea', { value: text, class: 'offscreen', 'aria-hidden': 'true' });
      document.body.append(area);
      area.select();
      try { ok = document.execCommand('copy'); } catch (e) { ok = false; }
      area.remove();
    }
    const status = $('#copy-status');
    status.textContent = ok ? `${tab.textContent} copied` : 'Copy failed: select the text instead';
    setTimeout(() => { status.textContent = ''; }, 2000);
  }

  /* ───────────── sending and answers ───────────── */

  const pct = (p) => `${(p * 100).toFixed(1)}%`;

  async function send() {
    if (inFlight) return;
    const { body, problems, path } = buildRequest();
    if (problems.length) {
      showError({ title: 'Not sent', message: problems.join(' '), hint: 'Nothing left this page: the form cannot be written as a request yet.' });
      return;
    }
    const sent = { body, path, dialect: form.dialect, questions: form.questions.map((q) => ({ ...q, options: q.options.map((o) => ({ ...o })),
                                                                 truths: { ...q.truths }, levels: [...q.levels] })) };
    inFlight = true;
    const button = $('#send');
    button.disabled = true;
    button.classList.add('is-busy');
    $('#result').setAttribute('aria-busy', 'true');
    $('#meta').textContent = 'sending…';
    try {
      let result;
      try {
        result = await call('POST', path, compactJson(body));
      } catch (e) {
        showError({
          title: 'Could not reach the server',
          message: `${apiUrl(path)}: ${e.message}`,
          hint: baseUrl() ? 'Another server must allow this page\'s origin: start it with CLM_SERVE_CORS_ORIGINS='
            + `${location.origin} (or *).` : 'Is clm-serve still running?',
        });
        return;
      }
      $('#view-response').textContent = result.json ? JSON.stringify(result.json, null, 2) : result.text;
      if (!result.response.ok) {
        const error = result.json && result.json.error;
        const detail = result.json && result.json.detail;
        showError({
          title: `${result.response.status} ${error && error.type ? error.type : result.response.statusText}`.trim(),
          message: error && error.message ? error.message
            : typeof detail === 'string' ? detail : detail ? JSON.stringify(detail) : (result.text || 'no body'),
          param: error && error.param,
          hint: result.response.status === 401 || result.response.status === 403
            ? 'This server wants an API key: enter it in “API key” at the top.'
            : result.response.status === 404 && path !== 'v1/systemone'
              ? `This server has no /${path}: pick another API above.` : '',
          status: result.response.status,
          ms: result.ms,
        });
        return;
      }
      lastSent = sent;
      renderAnswers(result, sent);
    } finally {
      inFlight = false;
      button.disabled = false;
      button.classList.remove('is-busy');
      $('#result').setAttribute('aria-busy', 'false');
    }
  }

  function showError({ title, message, param, hint, status, ms }) {
    $('#empty').hidden = true;
    $('#answers').replaceChildren();
    $('#error-title').textContent = title;
    $('#error-message').textContent = message;
    $('#error-param').hidden = !param;
    $('#error-param').textContent = param ? `param: ${param}` : '';
    $('#error-hint').hidden = !hint;
    $('#error-hint').textContent = hint || '';
    $('#error').hidden = false;
    $('#meta').textContent = [status, ms !== undefined ? `${Math.round(ms)} ms` : ''].filter(Boolean).join(' · ');
    $('#meta').title = '';
  }

  function renderAnswers(result, sent) {
    const data = result.json || {};
    $('#empty').hidden = true;
    $('#error').hidden = true;
    const version = result.response.headers.get('X-CLM-Heads-Version');
    // which dialect asked: the answers stay on screen when the picker moves on
    const meta = [`${result.response.status} OK`, DIALECTS[sent.dialect].label, `${Math.round(result.ms)} ms`];
    if (data.model) meta.push(`model ${data.model}`);
    if (version) meta.push(`heads ${version}`);
    if (data.usage && data.usage.input_tokens !== undefined) meta.push(`${data.usage.input_tokens} tokens`);
    $('#meta').textContent = meta.join(' · ');
    $('#meta').title = [`${DIALECTS[sent.dialect].label}: POST /${sent.path}`,
                        data.system_fingerprint ? `system_fingerprint ${data.system_fingerprint}` : ''].filter(Boolean).join('\n');

    const cards = normalizedAnswers(data, sent).map(({ qid, answer, q, typeName, diagnostics }) => (
      answerCard(qid, answer, q, typeName, diagnostics)));
    $('#answers').replaceChildren(...cards);
    $('#result').scrollTop = 0;
  }

  /** [{qid, answer, q, typeName, diagnostics}] in the request's question order, whatever the dialect: an
   * answer in /v1/systemone's shape (type choice|noul|score, probabilities keyed by option), the form's
   * question it answers, and the type as the dialect names it. */
  function normalizedAnswers(data, sent) {
    if (sent.dialect === 'decisions') {
      // a list in question order: the i-th answer is the i-th question's (a name is optional)
      return (Array.isArray(data.answers) ? data.answers : []).map((a, i) => {
        const q = sent.questions[i];
        return { qid: a.name ?? (q && q.id) ?? `#${i + 1}`, answer: fromDecision(a), q, typeName: a.type };
      });
    }
    const answers = data.answers && typeof data.answers === 'object' ? data.answers : {};
    const byId = new Map(sent.questions.map((q) => [q.id, q]));
    const diagnostics = data.diagnostics || {};
    return orderedAnswers(answers, sent).map(([qid, answer]) => ({
      qid, answer, q: byId.get(qid), typeName: answer.type, diagnostics: diagnostics[qid] }));
  }

  /** An OpenAI decision answer in /v1/systemone's shape (a choice value keeps its JSON spelling when it is
   * no string: OpenAI's values are typed). */
  function fromDecision(a) {
    const key = (v) => (typeof v === 'string' ? v : JSON.stringify(v));
    if (a.type === 'predicate') {
      const p = Number(a.probability);
      return { type: 'noul', noul: p, probabilities: { yes: p, no: 1 - p } };
    }
    if (a.type === 'choice') {
      const probabilities = {};
      for (const c of a.probabilities || []) probabilities[key(c.value)] = c.probability;
      return { type: 'choice', choice: key(a.choice), confidence: a.confidence, probabilities };
    }
    if (a.type === 'score') {
      const probabilities = {};
      const legend = {};
      for (const l of a.probabilities || []) { probabilities[String(l.value)] = l.probability; legend[String(l.value)] = l.label; }
      return { type: 'score', score: a.score, confidence: a.confidence, probabilities, legend };
    }
    return { ...a };                                           // a refusal, or a type this page does not know
  }

  /** The answers in the request's question order (a JS object lists integer-like ids first). */
  function orderedAnswers(answers, sent) {
    const ids = sent.questions.map((q) => q.id).filter((id) => Object.prototype.hasOwnProperty.call(answers, id));
    for (const id of Object.keys(answers)) if (!ids.includes(id)) ids.push(id);
    return ids.map((id) => [id, answers[id]]);
  }

  function answerCard(qid, answer, q, typeName, diagnostics) {
    const type = CANONICAL_TYPE[answer.type] || answer.type || (q && q.type) || '?';
    const chip = typeName || type;                            // the dialect's name: predicate in decisions
    const confidence = () => (answer.confidence === undefined ? [] : [`confidence ${pct(answer.confidence)}`]);
    const probs = answer.probabilities || {};
    let headline;
    let sub = [];
    let bars = [];
    if (type === 'choice') {
      const names = q ? q.options.filter((o) => o.name || o.description).map((o) => o.name) : [];
      for (const name of Object.keys(probs)) if (!names.includes(name)) names.push(name);
      const describe = (name) => { const o = q && q.options.find((x) => x.name === name); return o ? o.description : ''; };
      bars = names.filter((n) => n in probs).map((n) => ({ label: n, desc: describe(n), p: probs[n] }));
      headline = String(answer.choice);
      sub = confidence();
      bars.forEach((b) => { b.top = b.label === answer.choice; });
    } else if (type === 'noul') {
      const pYes = typeof answer.noul === 'number' ? answer.noul : probs.yes;
      const truths = q && chip !== 'predicate' ? q.truths : { true: '', false: '' };  // a predicate sent none
      bars = [{ label: 'yes', desc: truths.true, p: probs.yes ?? pYes, top: pYes >= 0.5 },
              { label: 'no', desc: truths.false, p: probs.no ?? 1 - pYes, top: pYes < 0.5 }];
      headline = pYes >= 0.5 ? 'yes' : 'no';
      sub = [`p(yes) ${pct(pYes)}`, ...confidence()];
    } else if (type === 'score') {
      const legend = answer.legend || {};
      const levels = Object.keys(probs).sort((a, b) => Number(a) - Number(b));
      let best = levels[0];
      for (const k of levels) if (probs[k] > probs[best]) best = k;
      bars = levels.map((k) => ({ label: k, desc: legend[k] || '', p: probs[k], top: k === best }));
      const nearest = legend[String(Math.round(answer.score))];
      headline = `${Number(answer.score).toFixed(2)}${nearest ? ` ≈ ${nearest}` : ''}`;
      sub = [`expected level on 0–${levels.length - 1}`,
             `most likely ${legend[best] ? `${legend[best]} (${best})` : best}`, ...confidence()];
    } else {
      bars = Object.entries(probs).map(([k, p]) => ({ label: k, desc: '', p }));
      headline = JSON.stringify(answer);
    }

    const barList = el('div', { class: 'bars', role: 'list', 'aria-label': `Probabilities of ${qid}` },
      ...bars.map((b) => {
        const fill = el('span', { class: 'bar-fill' });
        fill.style.width = `${Math.max(0, Math.min(1, Number(b.p) || 0)) * 100}%`;
        return el('div', { class: `bar${b.top ? ' is-top' : ''}`, role: 'listitem', 'data-testid': 'bar',
                           'data-label': b.label, 'data-prob': String(b.p) },
          el('span', { class: 'bar-label' },
            el('span', { class: 'bar-name', text: type === 'score' ? `${b.label}` : b.label }),
            b.desc ? el('span', { class: 'bar-desc', text: b.desc, title: b.desc }) : null),
          el('span', { class: 'bar-track', 'aria-hidden': 'true' }, fill),
          el('span', { class: 'bar-pct', 'data-testid': 'bar-pct', text: pct(Number(b.p) || 0) }));
      }));

    // vLLM's diagnostics: what the server accepted and did not read (a typo'd field, say) is worth seeing
    const ignored = diagnostics && Array.isArray(diagnostics.ignored) && diagnostics.ignored.length
      ? el('p', { class: 'answer-ignored', 'data-testid': 'answer-ignored',
                  text: `not read: ${diagnostics.ignored.join(', ')}` }) : null;
    return el('article', { class: 'answer', 'data-testid': 'answer', 'data-qid': qid, 'data-type': chip,
                           'aria-label': `Answer to ${qid}` },
      el('div', { class: 'answer-head' },
        el('span', { class: 'answer-id', text: qid }),
        el('span', { class: 'q-chip', 'data-type': type, text: chip }),
        q && q.instructions ? el('span', { class: 'answer-q', text: q.instructions }) : null),
      el('div', { class: 'answer-top-row' },
        el('span', { class: 'answer-top', 'data-testid': 'answer-top', text: headline }),
        el('span', { class: 'answer-sub', 'data-testid': 'answer-confidence', text: sub.join(' · ') })),
      barList, ignored);
  }

  /* ───────────── wiring ───────────── */

  function init() {
    form = restore();
    try {
      $('#base-url').value = localStorage.getItem(STORE_BASE) || '';
      $('#api-key').value = sessionStorage.getItem(STORE_KEY) || '';
    } catch (e) { /* storage off */ }

    $('#state').addEventListener('input', (e) => { form.state = e.target.value; changed(); });
    for (const radio of $$('input[name="state-format"]')) {
      radio.addEventListener('change', () => { if (radio.checked) { form.stateFormat = radio.value; changed(); } });
    }
    $('#instructions').addEventListener('input', (e) => { form.instructions = e.target.value; changed(); });
    $('#model').addEventListener('change', (e) => { form.model = e.target.value; changed(); });
    for (const radio of $$('input[name="dialect"]')) {
      radio.addEventListener('change', () => { if (radio.checked) { form.dialect = radio.value; paintDialect(); changed(); } });
    }
    $('#temperature').addEventListener('input', (e) => { form.temperature = e.target.value; changed(); });
    for (const button of $$('[data-add]')) {
      button.addEventListener('click', () => {
        const q = newQuestion(button.dataset.add, { id: uniqueId(button.dataset.add) });
        form.questions.push(q);
        renderQuestions(`[data-uid="${q.uid}"] .q-instructions`);
        changed();
      });
    }
    $('#load-example').addEventListener('click', () => { form = exampleForm(); paintForm(); });
    $('#send').addEventListener('click', send);
    document.addEventListener('keydown', (e) => {
      if ((e.ctrlKey || e.metaKey) && e.key === 'Enter') { e.preventDefault(); send(); }
    });

    const reconnect = () => {
      try {
        localStorage.setItem(STORE_BASE, $('#base-url').value.trim());
        sessionStorage.setItem(STORE_KEY, $('#api-key').value);
      } catch (e) { /* storage off */ }
      renderCode();
      refreshStatus();
      refreshModels();
    };
    $('#base-url').addEventListener('change', reconnect);
    $('#api-key').addEventListener('change', reconnect);
    $('#api-key').addEventListener('input', renderCode);
    $('#status').addEventListener('click', () => { refreshStatus(); refreshModels(); });

    const tabs = $$('.tabs [role="tab"]');
    for (const tab of tabs) {
      tab.addEventListener('click', () => showTab(tab.dataset.view));
      tab.addEventListener('keydown', (e) => {
        const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
        if (!step) return;
        e.preventDefault();
        const next = tabs[(tabs.indexOf(tab) + step + tabs.length) % tabs.length];
        showTab(next.dataset.view, true);
      });
    }
    $('#copy').addEventListener('click', copyActive);

    paintForm();
    refreshStatus();
    refreshModels().then(() => { document.body.dataset.ready = 'true'; });
  }

  document.addEventListener('DOMContentLoaded', init);
})();
