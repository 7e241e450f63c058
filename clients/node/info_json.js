'use strict';
// A result's info as a plain object, from either form the server sends it in:
//
// - info_json (sent when the stream opened with the openenv-info: json metadata): JSON
//   text with the env's types kept. JSON.parse would make every number a double, so 2^60+1
//   would lose its last digits; parseInfoJson reads numbers itself: an int a double holds
//   exactly (|n| <= 2^53 - 1) is a Number, a larger int a BigInt, a float a Number. (A JS
//   Number cannot tell 2.0 from 2: a whole float reads as an integral Number.)
// - info, a google.protobuf.Struct (an older server, or an info holding NaN or infinity,
//   which JSON cannot write): every number a double, NaN and infinities kept.

/** Header a client sends at open to get infos as JSON text, and its value. */
const INFO_KEY = 'openenv-info';
const INFO_JSON = 'json';

const STRING = /"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/y;
const NUMBER = /-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/y;
const SPACE = /[ \t\n\r]*/y;
const WORDS = { true: true, false: false, null: null };

/** Parses JSON text as JSON.parse does, except that ints beyond 2^53 - 1 become BigInts. */
function parseInfoJson(text) {
  let at = 0;
  const fail = (what) => {
    throw new SyntaxError(`info_json: ${what} at offset ${at}`);
  };
  const take = (pattern) => {
    pattern.lastIndex = at;
    const found = pattern.exec(text);
    if (found) at = pattern.lastIndex;
    return found;
  };
  const expect = (char) => {
    take(SPACE);
    if (text[at] !== char) fail(`expected '${char}'`);
    at++;
  };
  const set = (target, key, value) => // "__proto__" too, as an own property (as JSON.parse)
    Object.defineProperty(target, key, { value, enumerable: true, writable: true, configurable: true });

  function value() {
    take(SPACE);
    const char = text[at];
    if (char === '{') {
      at++;
      const object = {};
      take(SPACE);
      if (text[at] === '}') return at++, object;
      for (;;) {
        take(SPACE);
        const key = take(STRING);
        if (!key) fail('expected a key');
        expect(':');
        set(object, JSON.parse(key[0]), value());
        take(SPACE);
        if (text[at] === '}') return at++, object;
        expect(',');
      }
    }
    if (char === '[') {
      at++;
      const list = [];
      take(SPACE);
      if (text[at] === ']') return at++, list;
      for (;;) {
        list.push(value());
        take(SPACE);
        if (text[at] === ']') return at++, list;
        expect(',');
      }
    }
    if (char === '"') {
      const string = take(STRING);
      if (!string) fail('bad string');
      return JSON.parse(string[0]);
    }
    const number = take(NUMBER);
    if (number) {
      if (number[1] !== undefined || number[2] !== undefined) return Number(number[0]);
      const int = Number(number[0]);
      return Number.isSafeInteger(int) ? int : BigInt(number[0]);
    }
    for (const [word, result] of Object.entries(WORDS)) {
      if (text.startsWith(word, at)) return (at += word.length), result;
    }
    return fail('unexpected character');
  }

  const result = value();
  take(SPACE);
  if (at !== text.length) fail('trailing characters');
  return result;
}

/** A google.protobuf.Value as decoded by @grpc/proto-loader (oneofs: true) as plain JS. */
function valueToJs(value) {
  // proto-loader names the well-known types' fields in camelCase even under keepCase.
  const kind = String(value.kind || '').replace(/_([a-z])/g, (_, c) => c.toUpperCase());
  const inner = value[value.kind];
  switch (kind) {
    case 'numberValue':
    case 'stringValue':
    case 'boolValue':
      return inner;
    case 'structValue': return structToObject(inner);
    case 'listValue': return ((inner && inner.values) || []).map(valueToJs);
    default: return null;
  }
}

/** A google.protobuf.Struct as decoded by @grpc/proto-loader, as a plain object. */
function structToObject(struct) {
  const object = {};
  for (const [key, value] of Object.entries((struct && struct.fields) || {})) object[key] = valueToJs(value);
  return object;
}

/** A StepResult's info: its info_json when sent (types kept), else its Struct. */
function infoOf(result) {
  return result.info_json ? parseInfoJson(result.info_json) : structToObject(result.info);
}

/** A VectorResult's infos by env index, from its Struct map and its JSON map. */
function infosOf(structs, texts) {
  const infos = {};
  for (const [index, struct] of Object.entries(structs || {})) infos[index] = structToObject(struct);
  for (const [index, text] of Object.entries(texts || {})) infos[index] = parseInfoJson(text);
  return infos;
}

module.exports = { INFO_JSON, INFO_KEY, infoOf, infosOf, parseInfoJson, structToObject };
