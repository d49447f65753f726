"""TensorFlow for the tests that compare with it, or a skip that says how to run them: `make test`
has no TensorFlow, `make test-tf` builds an environment with it. tests/conftest.py counts these
skips at the end of the session."""

import pytest

REASON = "compares with TensorFlow, which is not installed: run `make test-tf`"


def tf_or_skip():
    """``tensorflow``, else skips the module (called at import) or the test (called in it)."""
    __tracebackhide__ = True  # The skip is reported at the caller's line.
    return pytest.importorskip("tensorflow", reason=REASON)
