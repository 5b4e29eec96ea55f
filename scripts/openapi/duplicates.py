"""Concurrent duplicates against the running checkout service, which schemathesis does not send:
the same request under one key from many clients at once, then one key with different bodies at
once. Exactly one runs; every other answer is its stored answer replayed byte for byte, a 409
with Retry-After, or (another body) a 422; a later retry is the replay; one order exists.

Usage: python duplicates.py BASE_URL (exit 1 and a line per broken promise if any).
"""

import json
import sys
import threading
import uuid

import requests

CLIENTS = 8
ROUNDS = 5
HEADERS = {"Authorization": "Bearer duplicates", "Content-Type": "application/json"}


def send_at_once(url, key, bodies, prefer=None):
    """Sends each body under `key`, all released at once; the answers in the order of `bodies`."""
    barrier = threading.Barrier(len(bodies))
    answers = [None] * len(bodies)

    def send(index, body):
        headers = dict(HEADERS, **{"Idempotency-Key": key})
        if prefer:
            headers["Prefer"] = prefer
        barrier.wait()
        answers[index] = requests.post(url, data=json.dumps(body), headers=headers, timeout=30)

    threads = [threading.Thread(target=send, args=(index, body)) for index, body in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def replayed(answer):
    return answer.headers.get("Idempotent-Replayed") == "true"


def problem_code(answer):
    try:
        return answer.json().get("code")
    except ValueError:
        return None


def check_round(base, bodies, prefer, failures):
    key = f"duplicates-{uuid.uuid4()}"
    answers = send_at_once(f"{base}/v1/checkouts", key, bodies, prefer)
    fresh = [index for index, answer in enumerate(answers) if answer.status_code == 201 and not replayed(answer)]
    if len(fresh) != 1:
        failures.append(f"{key}: {len(fresh)} requests ran, not 1: {[a.status_code for a in answers]}")
        return
    winner = answers[fresh[0]]
    for index, answer in enumerate(answers):
        if index == fresh[0]:
            continue
        same = bodies[index] == bodies[fresh[0]]
        if answer.status_code == 409:
            if problem_code(answer) != "request_in_progress" or "Retry-After" not in answer.headers:
                failures.append(f"{key}: a 409 without its problem or Retry-After: {answer.text}")
        elif same and not (replayed(answer) and answer.content == winner.content):
            failures.append(f"{key}: a duplicate answered {answer.status_code}, not the replay")
        elif not same and not (answer.status_code == 422 and problem_code(answer) == "idempotency_key_reused"):
            failures.append(f"{key}: another body answered {answer.status_code}, not 422")
    retry = send_at_once(f"{base}/v1/checkouts", key, [bodies[fresh[0]]])[0]
    if not (replayed(retry) and retry.content == winner.content):
        failures.append(f"{key}: the retry after the race is not the replay: {retry.status_code}")
    order = requests.get(f"{base}/v1/checkouts/{winner.json()['order_id']}", headers=HEADERS, timeout=10)
    if order.status_code != 200 or order.json().get("status") != "paid":
        failures.append(f"{key}: the order reads {order.status_code} {order.text}")


def main():
    base = sys.argv[1].rstrip("/")
    failures = []
    body = {"amount": 2500, "currency": "usd", "source": "tok_visa"}
    other = {"amount": 9900, "currency": "usd", "source": "tok_visa"}
    for round_ in range(ROUNDS):
        check_round(base, [body] * CLIENTS, None, failures)
        check_round(base, [body] * CLIENTS, "wait=5", failures)
        check_round(base, [body, other] * (CLIENTS // 2), None if round_ % 2 else "wait=5", failures)
    for failure in failures:
        print(f"FAILED {failure}")
    rounds = ROUNDS * 3
    print(f"concurrent duplicates: {rounds - len(set(f.split(':')[0] for f in failures))} passed, "
          f"{len(set(f.split(':')[0] for f in failures))} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
