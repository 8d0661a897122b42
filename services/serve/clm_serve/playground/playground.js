/* clm-serve playground: a form for POST /v1/systemone and a view of its answers.
 *
 * Talks to the server that served this page (or the one named in "Server", which must then allow this
 * page's origin: CLM_SERVE_CORS_ORIGINS):
 *   GET  /health         the status pill
 *   GET  /v1/models      the model picker (OpenAI's {"data": [{"id"}]} or upstream's {"models": [{"name"}]})
 *   GET  /v1/heads       which heads version is serving (the status pill's tooltip)
 *   POST /v1/systemone   the request this page builds
 * Every call carries "Authorization: Bearer <key>" when an API key is entered.
 *
 * Plain ES2020: no build step, no network imports, no inline script or style (the page's CSP allows none).
 */
'use strict';

(() => {
  const $ = (selector, root = document) => root.querySelector(selector);
  const $$ = (selector, root = document) => [...root.querySelectorAll(selector)];

  const STORE_FORM = 'clm-serve.playground.form.v1';
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

  /* ───────────── form state ───────────── */

  let uidSeq = 0;
  let form = null;
  let lastSent = null;       // the request of the answers on screen: {body, questions}
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
      stateFormat: d.stateFormat === 'text' ? 'text' : 'json',
      state: typeof d.state === 'string' ? d.state : '',
      instructions: typeof d.instructions === 'string' ? d.instructions : '',
      model: typeof d.model === 'string' ? d.model : '',
      questions: (Array.isArray(d.questions) ? d.questions : [])
        .filter((q) => q && types.has(q.type))
        .map((q) => newQuestion(q.type, q)),
    };
  }

  function exampleForm() {
    return formFrom({ ...EXAMPLE, model: form ? form.model : '' });
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

  /* ───────────── the request ───────────── */

  /** -> {body: Map, problems: [string]}: problems are what cannot be written as a request at all
   * (the server never sees them); everything else is sent and the server's answer shown. */
  function buildRequest() {
    const problems = [];
    const body = new Map();
    if (form.model) body.set('model', form.model);
    if (form.stateFormat === 'json') {
      try {
        JSON.parse(form.state);
        body.set('state', parseOrdered(form.state));
      } catch (e) {
        problems.push(`State is not valid JSON (${e.message}). Fix it, or switch the state to Text.`);
        body.set('state', form.state);
      }
    } else {
      body.set('state', form.state);
    }
    if (form.instructions.trim()) body.set('instructions', form.instructions);
    const questions = new Map();
    for (const q of form.questions) {
      if (questions.has(q.id)) problems.push(`Two questions have the id “${q.id}”: each needs its own.`);
      questions.set(q.id, questionBody(q, problems));
    }
    body.set('questions', questions);
    return { body, problems };
  }

  function questionBody(q, problems) {
    const spec = new Map([['type', q.type]]);
    if (q.instructions) spec.set('instructions', q.instructions);
    if (q.type === 'choice') {
      const criteria = new Map();
      for (const o of q.options) {
        if (!o.name && !o.description) continue;                 // a blank row asks nothing
        if (criteria.has(o.name)) problems.push(`Question “${q.id}” has two options named “${o.name}”.`);
        criteria.set(o.name, o.description ? o.description : null);
      }
      spec.set('criteria', criteria);
    } else if (q.type === 'noul') {
      const criteria = new Map();
      for (const k of ['true', 'false']) if (q.truths[k]) criteria.set(k, q.truths[k]);
      if (criteria.size) spec.set('criteria', criteria);
    } else {
      spec.set('criteria', q.levels.filter((level) => level !== ''));
    }
    return spec;
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

  function renderCode() {
    const { body, problems } = buildRequest();
    const warn = problems.map((p) => `Not sendable: ${p}`);
    const url = apiUrl('v1/systemone');
    const json = pretty(body, scalarJson);
    $('#view-json').textContent = [...warn.map((w) => `// ${w}`), json].join('\n');

    const curl = [`curl -sS ${shellQuote(url)}`, `-H 'Content-Type: application/json'`];
    if (apiKey()) curl.push(`-H "Authorization: Bearer $CLM_API_KEY"`);
    curl.push(`-d ${shellQuote(json)}`);
    $('#view-curl').textContent = [...warn.map((w) => `# ${w}`), curl.join(' \\\n  ')].join('\n');

    const python = [
      ...warn.map((w) => `# ${w}`),
      ...(apiKey() ? ['import os', ''] : []),
      'import httpx  # or requests: the same call, requests.post(...)',
      '',
      'response = httpx.post(',
      `    ${JSON.stringify(url)},`,
      ...(apiKey() ? ['    headers={"Authorization": f"Bearer {os.environ[\'CLM_API_KEY\']}"},'] : []),
      `    json=${pretty(body, scalarPython, '    ').replace(/\n/g, '\n    ')},`,
      '    timeout=30.0,',
      ')',
      'response.raise_for_status()',
      'for question_id, answer in response.json()["answers"].items():',
      '    print(question_id, answer)',
    ];
    $('#view-python').textContent = python.join('\n');
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
    const { body, problems } = buildRequest();
    if (problems.length) {
      showError({ title: 'Not sent', message: problems.join(' '), hint: 'Nothing left this page: the form cannot be written as a request yet.' });
      return;
    }
    const sent = { body, questions: form.questions.map((q) => ({ ...q, options: q.options.map((o) => ({ ...o })),
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
        result = await call('POST', 'v1/systemone', compactJson(body));
      } catch (e) {
        showError({
          title: 'Could not reach the server',
          message: `${apiUrl('v1/systemone')}: ${e.message}`,
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
            ? 'This server wants an API key: enter it in “API key” at the top.' : '',
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
    const meta = [`${result.response.status} OK`, `${Math.round(result.ms)} ms`];
    if (data.model) meta.push(`model ${data.model}`);
    if (version) meta.push(`heads ${version}`);
    if (data.usage && data.usage.input_tokens !== undefined) meta.push(`${data.usage.input_tokens} input tokens`);
    $('#meta').textContent = meta.join(' · ');
    $('#meta').title = data.system_fingerprint ? `system_fingerprint ${data.system_fingerprint}` : '';

    const answers = data.answers || {};
    const byId = new Map(sent.questions.map((q) => [q.id, q]));
    const cards = [];
    for (const [qid, answer] of orderedAnswers(answers, sent.body)) cards.push(answerCard(qid, answer, byId.get(qid)));
    $('#answers').replaceChildren(...cards);
    $('#result').scrollTop = 0;
  }

  /** The answers in the request's question order (a JS object lists integer-like ids first). */
  function orderedAnswers(answers, body) {
    const ids = [...body.get('questions').keys()].filter((id) => Object.prototype.hasOwnProperty.call(answers, id));
    for (const id of Object.keys(answers)) if (!ids.includes(id)) ids.push(id);
    return ids.map((id) => [id, answers[id]]);
  }

  function answerCard(qid, answer, q) {
    const type = answer.type || (q && q.type) || '?';
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
      sub = [`confidence ${pct(answer.confidence)}`];
      bars.forEach((b) => { b.top = b.label === answer.choice; });
    } else if (type === 'noul') {
      const pYes = typeof answer.noul === 'number' ? answer.noul : probs.yes;
      bars = [{ label: 'yes', desc: q ? q.truths.true : '', p: probs.yes ?? pYes, top: pYes >= 0.5 },
              { label: 'no', desc: q ? q.truths.false : '', p: probs.no ?? 1 - pYes, top: pYes < 0.5 }];
      headline = pYes >= 0.5 ? 'yes' : 'no';
      sub = [`p(yes) ${pct(pYes)}`, `confidence ${pct(answer.confidence)}`];
    } else if (type === 'score') {
      const legend = answer.legend || {};
      const levels = Object.keys(probs).sort((a, b) => Number(a) - Number(b));
      let best = levels[0];
      for (const k of levels) if (probs[k] > probs[best]) best = k;
      bars = levels.map((k) => ({ label: k, desc: legend[k] || '', p: probs[k], top: k === best }));
      const nearest = legend[String(Math.round(answer.score))];
      headline = `${Number(answer.score).toFixed(2)}${nearest ? ` ≈ ${nearest}` : ''}`;
      sub = [`expected level on 0–${levels.length - 1}`,
             `most likely ${legend[best] ? `${legend[best]} (${best})` : best}`, `confidence ${pct(answer.confidence)}`];
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

    return el('article', { class: 'answer', 'data-testid': 'answer', 'data-qid': qid, 'data-type': type,
                           'aria-label': `Answer to ${qid}` },
      el('div', { class: 'answer-head' },
        el('span', { class: 'answer-id', text: qid }),
        el('span', { class: 'q-chip', 'data-type': type, text: type }),
        q && q.instructions ? el('span', { class: 'answer-q', text: q.instructions }) : null),
      el('div', { class: 'answer-top-row' },
        el('span', { class: 'answer-top', 'data-testid': 'answer-top', text: headline }),
        el('span', { class: 'answer-sub', 'data-testid': 'answer-confidence', text: sub.join(' · ') })),
      barList);
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
