"""The end-to-end cluster fixtures (real processes) for the other-language client tests."""

from tests.e2e.conftest import e2e_postgres, make_cluster  # noqa: F401
