"""Property-based fuzzing of ``agentrl serve`` from its own OpenAPI document (hypothesis).

Every operation in ``/openapi.json`` gets requests built from its schema: path and query
parameters, headers, and JSON bodies generated from the request schema (valid, nearly valid and
hostile: out-of-range numbers, NaN, unknown keys, wrong types, odd Unicode), plus arbitrary
JSON and raw bytes. Path ids are sometimes real (an open session, a finished job), so the
fuzzer reaches past the 404s. The property: no 5xx and no hang, ever; afterwards the service
still serves a known-answer job correctly.
"""

from __future__ import annotations

import json
import string
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.client import RolloutClient
from tests.integration.service_helpers import (
    API_KEY,
    running_service,
    start_inference_servers,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLES = 300

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def from_schema(
    schema: dict[str, Any], components: dict[str, Any], depth: int = 0
) -> st.SearchStrategy:
    """Values for a JSON schema, mostly conforming, sometimes not (hostile on purpose)."""
    schema = _resolve(schema, components)
    if depth > 4:
        return st.none()
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, components, depth + 1) for s in schema[key]])
    if "allOf" in schema:
        return from_schema(schema["allOf"][0], components, depth + 1)
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | st.text(max_size=10)
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=min(int(schema.get("maxLength", 40)), 60))
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        valid = st.integers(min_value=lo, max_value=hi)
        return st.one_of(valid, valid, valid, st.integers(-(2**70), 2**70))
    if kind == "number":
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1), max_size=3)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = [k for k in schema.get("required", []) if k in props]
        optional = {k: v for k, v in props.items() if k not in required}
        fixed = st.fixed_dictionaries(
            {k: from_schema(props[k], components, depth + 1) for k in required},
            optional={k: from_schema(v, components, depth + 1) for k, v in optional.items()},
        )
        extra = st.dictionaries(st.text(max_size=6), JSON, max_size=2)
        # mostly well-formed, sometimes with unknown keys
        return st.one_of(fixed, fixed, fixed, st.builds(lambda a, b: {**b, **a}, fixed, extra))
    return JSON


@pytest.fixture(scope="module")
def fuzz_service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (server,) = start_inference_servers(tmp, 1)
    try:
        config = write_config(tmp, [server.base_url])
        extra = ["--max-episodes-per-job", "4", "--max-active-jobs", "8", "--max-sessions", "50"]
        with running_service(config, tmp, *extra, "--max-body-mb", "1") as svc:
            yield svc
    finally:
        server.stop()


def test_fuzzing_the_openapi_schema_finds_no_5xx_and_no_hang(fuzz_service, report_metric):
    headers = {"authorization": f"Bearer {API_KEY}"}
    http = httpx.Client(base_url=fuzz_service.url, headers=headers, timeout=60)
    schema = http.get("/openapi.json").json()
    components = schema.get("components", {}).get("schemas", {})
    with RolloutClient(fuzz_service.url, api_key=API_KEY) as client:
        task = {
            "prompt": "What is 2 + 3?",
            "data_source": "calculator",
            "reward_spec": {"ground_truth": "5"},
        }
        job = client.submit([task], n=1)
        client.collect(job.id)
        sessions = [client.open_session(task).id for _ in range(3)]
    ids = {"job_id": [job.id], "session_id": sessions}
    operations = [
        (path, method, op) for path, ops in schema["paths"].items() for method, op in ops.items()
    ]
    statuses: dict[int, int] = {}
    # Any value an HTTP client can send: no leading/trailing blanks (h11 refuses them).
    header_text = st.text(alphabet=string.ascii_letters + string.digits + "-_ ", max_size=30).map(
        str.strip
    )

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one_request(data: st.DataObject) -> None:
        path, method, op = data.draw(st.sampled_from(operations))
        url, query, extra_headers = path, {}, {}
        for param in op.get("parameters", []):
            where, name = param["in"], param["name"]
            if where == "path":
                real = st.sampled_from(ids.get(name, ["x"]))
                value = data.draw(st.one_of(real, real, real, st.text(min_size=1, max_size=20)))
                url = url.replace("{" + name + "}", quote(value, safe=""))
            elif where == "query" and data.draw(st.booleans()):
                query[name] = data.draw(from_schema(param.get("schema", {}), components))
            elif where == "header" and data.draw(st.booleans()):
                extra_headers[name] = data.draw(header_text)
        kwargs: dict[str, Any] = {}
        body = op.get("requestBody", {}).get("content", {})
        if body:
            ctype = data.draw(st.sampled_from(sorted(body)))
            if ctype == "application/octet-stream":
                kwargs["content"] = data.draw(st.binary(max_size=200))
            else:
                valid = from_schema(body[ctype].get("schema", {}), components)
                value = data.draw(st.one_of(valid, valid, valid, JSON))
                kwargs["content"] = json.dumps(value).encode()
            extra_headers["content-type"] = ctype
        query = {k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in query.items()}
        r = http.request(method.upper(), url, params=query, headers=extra_headers, **kwargs)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (method, url, query, kwargs, r.status_code, r.text[:500])

    one_request()
    report_metric("fuzz_requests", sum(statuses.values()))
    for code, n in sorted(statuses.items()):
        report_metric(f"fuzz_status_{code}", n)
    assert sum(n for s, n in statuses.items() if s < 300) > 0  # it reached past validation
    # still serving, and correctly: a known-answer job
    assert http.get("/health").status_code == 200
    with RolloutClient(fuzz_service.url, api_key=API_KEY) as client:
        known = {
            "prompt": "What is 2 + 3?",
            "data_source": "calculator",
            "reward_spec": {"ground_truth": "5"},
        }
        job = client.submit([known], n=2)
        trajs = client.collect(job.id)
        status = client.status()
        counts = client.job(job.id).counts
    assert len(trajs) == 2, counts
    assert all(t.prompt_ids and "correct" in t.reward_info for t in trajs)
    assert all(s["alive"] for s in status["servers"])
    http.close()


# ---- client errors are 4xx, never 5xx (issue 21) ----------------------------------------------
TASK = {
    "prompt": "What is 2 + 3?",
    "data_source": "calculator",
    "reward_spec": {"ground_truth": "5"},
}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tasks": [TASK], "n": "4"}, "n"),
        ({"tasks": [TASK], "n": True}, "n"),
        ({"tasks": [TASK], "group": 1}, "group"),
        ({"tasks": [TASK], "sampling": {"max_tokens": "8"}}, "sampling.max_tokens"),
        ({"tasks": [TASK], "sampling": {"temperature": "0.5"}}, "sampling.temperature"),
        ({"dataset": {"path": "a\u0000b"}}, "dataset.path"),
    ],
)
def test_loosely_typed_fields_are_refused_naming_the_field(fuzz_service, body, param):
    headers = {"authorization": f"Bearer {API_KEY}"}
    r = httpx.post(fuzz_service.url + "/v1/rollouts", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_nul_bytes_long_paths_and_deep_json_are_4xx(fuzz_service):
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=fuzz_service.url, headers=headers, timeout=60) as http:
        for path in ("a\u0000b", "w" * 8192, "/" + "x/" * 4000):
            r = http.post("/v1/weights", json={"path": path})
            assert 400 <= r.status_code < 500, (path[:20], r.status_code, r.text[:300])
        for url in ("/v1/rollouts/%00", "/v1/sessions/%00", "/v1/sessions/a%00b/v1/models"):
            r = http.get(url)
            assert 400 <= r.status_code < 500, (url, r.status_code, r.text[:300])
        deep = "[" * 100_000 + "]" * 100_000
        r = http.post(
            "/v1/rollouts",
            content='{"tasks": [{"prompt": "x", "extra_info": ' + deep + "}]}",
            headers={"content-type": "application/json"},
        )
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        r = http.post(
            "/v1/weights",
            content='{"path": ' + deep + "}",
            headers={"content-type": "application/json"},
        )
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert http.get("/health").status_code == 200
