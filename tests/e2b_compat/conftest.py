"""An older release of E2B's Python SDK against the same kind of daemon as tests/e2b (its fixtures,
loaded from there): releases behave differently enough to need their own run (scripts/test.sh
installs them in a venv of their own)."""

from __future__ import annotations

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "moat_e2b_conftest", os.path.join(os.path.dirname(__file__), "..", "e2b", "conftest.py"))
_e2b = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2b)

daemon = _e2b.daemon
sbx = _e2b.sbx
