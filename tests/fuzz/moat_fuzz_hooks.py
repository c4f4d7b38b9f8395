"""Schemathesis hooks for moat's API (loaded through SCHEMATHESIS_HOOKS by test_openapi.py)."""

import schemathesis

# `PUT .../fs/tar` takes `application/x-tar`: bytes, like application/octet-stream.
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")
