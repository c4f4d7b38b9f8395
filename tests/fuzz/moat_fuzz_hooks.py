"""Schemathesis hooks for moat's API (loaded through SCHEMATHESIS_HOOKS by test_openapi.py)."""

import schemathesis

# `PUT .../fs/tar` takes `application/x-tar`: bytes, like application/octet-stream.
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")


@schemathesis.hook
def before_call(context, case, kwargs):
    """`network/log?follow=true` streams for as long as the sandbox lives (the shared one lives as
    long as the run): follow a valid `true` as `false`, which answers at once with the same entries.
    Invalid values are sent as they are, to be refused."""
    if case.operation.path == "/v1/sandboxes/{id}/network/log" and case.query:
        if case.query.get("follow") in (True, "true"):
            case.query["follow"] = "false"


def _bounded(body, most: float) -> None:
    """Gives a valid request without a timeout (or with a longer one) `most` seconds."""
    if not isinstance(body, dict):
        return
    t = body.get("timeout")
    if t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and (t == 0 or t > most)):
        body["timeout"] = most


@schemathesis.hook("before_call")
def bounded_commands(context, case, kwargs):
    """A command or a code cell runs, and its answer streams, until it ends: a generated `cat` with
    stdin open would never end. Each gets at most 5 s (its timeout is part of what is tested; one
    that is invalid is sent as it is)."""
    if case.method.upper() != "POST" or not isinstance(case.body, dict):
        return
    if case.operation.path == "/v1/sandboxes/{id}/processes" and not case.body.get("background"):
        _bounded(case.body, 5)
    elif case.operation.path == "/v1/sandboxes/{id}/code":
        _bounded(case.body, 5)


_keys = iter(range(1 << 62))


@schemathesis.hook("before_call")
def fresh_idempotency_keys(context, case, kwargs):
    """A generated `Idempotency-Key` is made unique per request (a valid one stays valid): schemathesis
    reuses the same few values across phases, so a stateful scenario's create could replay a sandbox
    made by an earlier phase seconds before the daemon's 20 s default timeout ends it, and the
    scenario's next call would find it ended (ST302). Replays, their 409 after an end and their 422
    for another body are covered by the daemon's unit tests; invalid keys are sent as they are."""
    headers = case.headers or {}
    for name in list(headers):
        if name.lower() != "idempotency-key":
            continue
        v = headers[name]
        if isinstance(v, str) and 1 <= len(v) <= 200 and all(33 <= ord(ch) <= 126 for ch in v):
            headers[name] = f"{v}-{next(_keys)}"


def _at_least(body, field: str, least: int) -> None:
    """A valid lifetime (a positive integer) shorter than `least`, or none, becomes `least`."""
    v = body.get(field)
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 < v < least):
        body[field] = least


@schemathesis.hook("before_call")
def lifetimes_that_outlast_the_run(context, case, kwargs):
    """Sandboxes made by one phase are driven by later ones (the stateful phase's scenarios have met
    sandboxes created a minute before, by then ended at the 20 s default timeout or a generated
    one-second `idle_timeout`: a correct 404 that says when and why, but ST302 to schemathesis).
    Creates and forks of container and gVisor sandboxes get lifetimes that outlast the run (300 s;
    the daemon's bounds on them are what the coverage phase's invalid values test, and a sandbox
    ending at its timeout or idle timeout is tested by the daemon's unit and end-to-end tests).
    microVMs keep what was generated: each holds its guest's memory while it lives."""
    if case.method.upper() != "POST" or not isinstance(case.body, dict):
        return
    if case.body.get("isolation") == "microvm":
        return
    if case.operation.path == "/v1/sandboxes":
        _at_least(case.body, "timeout", 300)
        if "idle_timeout" in case.body:
            _at_least(case.body, "idle_timeout", 300)
    elif case.operation.path == "/v1/snapshots/{id}/fork":
        _at_least(case.body, "timeout", 300)
