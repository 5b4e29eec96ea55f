"""A check schemathesis runs on every answer of the checkout service, besides its own: what the
Idempotency-Key promises, over the requests schemathesis sends (which reuse a key across
different bodies: its examples share one key, and the stateful `retry` link sends a key again
with the same body or a new one).

Per tenant and key, the first answer that shows the key was taken (the workflow ran: 201, 402,
502, a stored 500; or 409 and 503 while it runs) is remembered with its body. Then:
- the same body again: the first stored answer, byte for byte, with Idempotent-Replayed: true
  (or 409 while the first still runs);
- another body: refused, never run: 422 idempotency_key_reused, or refused before the key is
  looked at (400, 401, 413, 415, 422 request_invalid);
- a key never taken: never a replay, never 422 idempotency_key_reused;
- a schema-valid request answered 422 is a reuse, never request_invalid: the document and the
  route agree on what a checkout is.

Loaded through SCHEMATHESIS_HOOKS by scripts/schemathesis; run with one worker, so answers come in
the order the requests were sent.
"""

import json
import re
import threading

import schemathesis

ROUTE = "/v1/checkouts"
TAKEN = {201, 402, 409, 500, 502, 503}
STORED = {201, 402, 500, 502}
REFUSED_BEFORE_LOOKUP = {400, 401, 413, 415}

_lock = threading.Lock()
# (tenant, key) -> (canonical body, status, body bytes) of the first stored answer; a key whose
# first run has not stored one yet (409, 503) holds status None.
_keys = {}


def _canonical(body):
    """The body as the service fingerprints it: JSON with members sorted and numbers by value."""
    if body is None:
        return None
    if isinstance(body, str):
        body = body.encode()
    try:
        value = json.loads(body, parse_float=float, parse_int=int)
    except (ValueError, UnicodeDecodeError):
        return None

    def normal(item):
        if isinstance(item, float) and item.is_integer():
            return int(item)
        if isinstance(item, dict):
            return {name: normal(member) for name, member in item.items()}
        if isinstance(item, list):
            return [normal(member) for member in item]
        return item

    return json.dumps(normal(value), sort_keys=True, separators=(",", ":"))


def _key(value):
    """The key a header value names, as the layer reads it: an RFC 8941 string unescaped, a bare
    value trimmed of spaces (`"0"` and `0` are one key)."""
    if value is None:
        return None
    value = value.strip(" ")
    if len(value) >= 2 and value.startswith('"') and value.endswith('"'):
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def _code(response):
    try:
        return json.loads(response.content).get("code")
    except (ValueError, AttributeError):
        return None


def _is_positive(case):
    meta = getattr(case, "meta", None)
    generation = getattr(meta, "generation", None)
    mode = getattr(generation, "mode", None)
    return bool(mode is not None and mode.is_positive)


@schemathesis.check
def idempotency_key_contract(ctx, response, case):
    request = response.request
    if request.method != "POST" or not request.path_url.split("?")[0].endswith(ROUTE):
        return None
    key = _key(request.headers.get("Idempotency-Key"))
    tenant = request.headers.get("Authorization")
    body = _canonical(request.body)
    status = response.status_code
    replayed = response.headers.get("idempotent-replayed", [""])[0] == "true"
    code = _code(response)
    if _is_positive(case) and status == 422 and code == "request_invalid":
        raise AssertionError(f"a schema-valid checkout was refused as invalid: {response.content!r}")
    if key is None or body is None or status in REFUSED_BEFORE_LOOKUP:
        # Refused before the key is looked at (no key, no JSON, a content type, a tenant):
        # nothing to say of the key.
        return None
    with _lock:
        first = _keys.get((tenant, key))
        if first is None:
            if replayed or code == "idempotency_key_reused":
                raise AssertionError(f"key {key!r} was never taken, yet the answer is {status} {code}")
            if status in TAKEN and not (status == 500 and code == "internal_error"):
                _keys[(tenant, key)] = (body, status if status in STORED else None, response.content)
            return None
        first_body, first_status, first_content = first
        if body != first_body:
            if status == 422 and code in ("idempotency_key_reused", "request_invalid"):
                return None
            raise AssertionError(
                f"key {key!r} was taken by another body, yet this body was answered {status} {code}"
            )
        if first_status is None:
            # The first answer was 409 or 503: the run finishes later; remember what it stores.
            if status in STORED:
                _keys[(tenant, key)] = (body, status, response.content)
            return None
        if status == 409:
            return None
        if status != first_status or response.content != first_content or not replayed:
            raise AssertionError(
                f"key {key!r} again with the same body: expected the stored {first_status} replayed "
                f"byte for byte, got {status} (replayed: {replayed})"
            )
    return None
