"""Fuzzing from the server's own OpenAPI schema (schemathesis): valid and invalid requests of
every documented shape get an answer below 500, and the server stays healthy."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from pagedjax.entrypoints.openai import AsyncEngine, build_app

from .conftest import MODEL, running_server
from .fake_engine import FakeEngine

schema = schemathesis.openapi.from_dict(build_app(AsyncEngine(FakeEngine()), MODEL).openapi())
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])

EXAMPLES = 20  # per operation and mode: ~290 cases in all


@pytest.fixture(scope="module")
def server():
    """One server for every case; a short context, so a valid request that asks for no limit
    generates 32 tokens, not 256 (the cases check answers, not lengths)."""
    with running_server(FakeEngine(max_model_len=32, step_delay=0.001)) as s:
        yield s


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx(case, server):
    response = case.call(base_url=server.url, timeout=30)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)


def test_healthy_after_fuzzing(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.async_engine.is_alive

