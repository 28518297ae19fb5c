"""Weight payloads: the zero-copy safetensors layout, the strict parser, the complete check, and
the pull path (WeightServer -> fetch_into) over a real local socket."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from agentrl.inference.weights import (
    SafetensorsPayload,
    WeightLoadError,
    WeightServer,
    check_state_dict,
    fetch_into,
    local_address_for,
    parse_safetensors,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),  # odd bf16 before an f32
        "c.weight": torch.randn(2, 2, generator=g),
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_payload_is_a_standard_safetensors_file_and_parses_back_as_views() -> None:
    state = _state()
    payload = SafetensorsPayload.from_state_dict(state)
    data = payload.to_bytes()
    assert len(data) == payload.num_bytes
    _same(load(data), state)  # the reference reader agrees
    buf = bytearray(data)
    parsed = parse_safetensors(buf)
    _same(parsed, state)
    # Views, not copies: writing the buffer changes the tensors; every one is aligned.
    for name, t in parsed.items():
        assert t.numel() == 0 or t.data_ptr() % t.element_size() == 0, name
    parsed["a.weight"].zero_()
    assert parse_safetensors(buf)["a.weight"].abs().sum() == 0


def test_payload_streams_the_callers_memory_without_copies() -> None:
    t = torch.arange(12, dtype=torch.float32)
    payload = SafetensorsPayload.from_state_dict({"t": t})
    chunks = list(payload.chunks(chunk_bytes=16))
    assert [len(c) for c in chunks[1:]] == [16, 16, 16]
    t[0] = 99.0  # the payload reads the tensor itself
    assert load(payload.to_bytes())["t"][0] == 99.0


def test_aliases_send_a_tied_tensor_twice_under_both_names() -> None:
    emb = torch.randn(4, 3)
    payload = SafetensorsPayload.from_state_dict(
        {"model.embed_tokens.weight": emb}, aliases={"lm_head.weight": "model.embed_tokens.weight"}
    )
    back = load(payload.to_bytes())
    assert torch.equal(back["lm_head.weight"], emb) and torch.equal(
        back["model.embed_tokens.weight"], emb
    )
    with pytest.raises(KeyError, match="nope"):
        SafetensorsPayload.from_state_dict({"x": emb}, aliases={"y": "nope"})
    with pytest.raises(ValueError, match="contiguous"):
        SafetensorsPayload.from_state_dict({"x": emb.t()})


def _raw(header: dict, data: bytes = b"") -> bytearray:
    h = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (bytearray(b"abc"), "a safetensors file has >= 8"),
        (bytearray(struct.pack("<Q", 10**12) + b"{}"), "claims"),
        (bytearray(struct.pack("<Q", 3) + b"{x}"), "not valid JSON"),
        (_raw([1, 2]), "not a JSON object"),  # type: ignore[arg-type]  # a hostile header
        (_raw({"t": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "dtype"),
        (_raw({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "shape"),
        (_raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "outside"),
        (
            _raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
            "needs 8 bytes",
        ),
        (
            _raw(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            "overlap",
        ),
    ],
)
def test_malformed_files_are_refused_naming_the_problem(buf: bytearray, match: str) -> None:
    with pytest.raises(WeightLoadError, match=match):
        parse_safetensors(buf)


def test_a_misaligned_tensor_from_another_writer_is_copied_aligned() -> None:
    data = b"\0" * 2 + torch.tensor([1.5, 2.5]).numpy().tobytes()
    buf = _raw(
        {
            "h": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
            "f": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]},
        },
        data,
    )
    parsed = parse_safetensors(buf)
    assert parsed["f"].tolist() == [1.5, 2.5] and parsed["f"].data_ptr() % 4 == 0


# ---- the complete check -------------------------------------------------------------------------
def _params() -> dict[str, torch.Tensor]:
    emb = torch.zeros(4, 3)
    return {"emb.weight": emb, "head.weight": emb, "norm.weight": torch.ones(3)}  # tied head


def test_check_accepts_a_full_update_and_a_tied_copy_may_be_left_out() -> None:
    assert (
        check_state_dict({"emb.weight": torch.ones(4, 3), "norm.weight": torch.ones(3)}, _params())
        == {}
    )


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            {"emb.weight": torch.ones(4, 3), "norm.weight": torch.ones(3), "x": torch.ones(1)},
            "do not name",
        ),
        ({"emb.weight": torch.ones(4, 2), "norm.weight": torch.ones(3)}, "shape"),
        (
            {"emb.weight": torch.ones(4, 3, dtype=torch.float64), "norm.weight": torch.ones(3)},
            "dtype",
        ),
        (
            {"emb.weight": torch.ones(4, 3, dtype=torch.int64), "norm.weight": torch.ones(3)},
            "dtype",
        ),
        (
            {"emb.weight": torch.full((4, 3), float("nan")), "norm.weight": torch.ones(3)},
            "non-finite",
        ),
        (
            {"emb.weight": torch.ones(4, 3), "norm.weight": torch.tensor([1, float("inf"), 1])},
            "non-finite",
        ),
        ({"emb.weight": torch.ones(4, 3)}, "missing"),
    ],
)
def test_check_refuses_what_cannot_replace_the_weights_exactly(state, match) -> None:
    with pytest.raises(WeightLoadError, match=match):
        check_state_dict(state, _params())


def test_check_reports_lossless_widenings_and_refuses_narrowing() -> None:
    params = {"w": torch.zeros(3), "v": torch.zeros(2, dtype=torch.bfloat16)}
    casts = check_state_dict(
        {"w": torch.ones(3, dtype=torch.float16), "v": torch.ones(2, dtype=torch.bfloat16)}, params
    )
    assert casts == {"float16->float32": 1}
    with pytest.raises(WeightLoadError, match=r"float16 but the server holds torch\.bfloat16"):
        check_state_dict({"w": torch.ones(3), "v": torch.ones(2, dtype=torch.float16)}, params)
    huge = torch.full((4,), 3e38)  # a finite tensor whose sum overflows is still finite
    assert (
        check_state_dict(
            {"w": huge[:3].contiguous(), "v": torch.ones(2, dtype=torch.bfloat16)}, params
        )
        == {}
    )


# ---- the pull path ------------------------------------------------------------------------------
def test_weight_server_serves_published_payloads_and_fetch_into_reads_them_whole() -> None:
    state = _state()
    payload = SafetensorsPayload.from_state_dict(state)
    server = WeightServer()
    try:
        token = server.publish(payload)
        url = server.url_for("http://127.0.0.1:8000", token)
        assert url.startswith("http://127.0.0.1:") and token in url
        buffers: list[bytearray] = []

        def buffer_for(n: int) -> memoryview:
            buffers.append(bytearray(n))
            return memoryview(buffers[-1])

        got = fetch_into(url, buffer_for, max_bytes=payload.num_bytes)
        _same(parse_safetensors(got), state)
        with pytest.raises(WeightLoadError, match="Content-Length"):
            fetch_into(url, buffer_for, max_bytes=payload.num_bytes - 1)
        server.unpublish()
        with pytest.raises(WeightLoadError, match="HTTP 404"):
            fetch_into(url, buffer_for, max_bytes=payload.num_bytes)
        with pytest.raises(WeightLoadError, match="scheme") as info:
            fetch_into("file:///etc/passwd", buffer_for, max_bytes=10)
        assert "passwd" not in str(info.value)
        with pytest.raises(WeightLoadError, match="could not fetch"):
            fetch_into(
                url.replace(f":{url.split(':')[2].split('/')[0]}", ":9"), buffer_for, max_bytes=10
            )
    finally:
        server.close()


def test_local_address_for_names_the_interface_that_reaches_the_host() -> None:
    assert local_address_for("http://127.0.0.1:5") == "127.0.0.1"
    assert local_address_for("http://localhost:5") == "127.0.0.1"


def test_payload_matches_the_reference_writer_byte_for_byte_in_content() -> None:
    state = _state()
    ours = load(SafetensorsPayload.from_state_dict(state).to_bytes())
    theirs = load(save(state))
    _same(ours, theirs)


# ---- the weight-group routes and LoRA over HTTP (in-process app on the tiny model) -------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from agentrl.inference.engine import InferenceEngine

    engine = InferenceEngine(tiny_model_dir, max_batch_size=2)
    yield engine
    engine.close()


def _app_client(engine, client_host: str = "127.0.0.1"):
    import httpx

    from agentrl.inference.server import create_app

    app = create_app(engine, served_model_name="tiny")
    transport = httpx.ASGITransport(app=app, client=(client_host, 1234))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_weight_group_routes_refuse_bad_requests_by_field(tiny_engine) -> None:
    join = {
        "group_id": "g",
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank": 1,
        "world_size": 2,
        "backend": "nccl",
        "timeout_s": 1,
    }
    receive = {"group_id": "g", "version": 3, "buckets": [{"names": ["x"]}]}
    async with _app_client(tiny_engine) as c:
        r = await c.post("/weight_group/join", json=join)
        assert r.status_code == 400 and "nccl" in r.text and "gloo" in r.text
        r = await c.post("/weight_group/join", json={**join, "backend": "gloo", "rank": 2})
        assert r.status_code == 400 and "outside world_size" in r.text
        r = await c.post("/weight_group/receive", json=receive)
        assert r.status_code == 400 and r.json()["error"]["param"] == "buckets"
        layout = [{"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}]
        r = await c.post("/weight_group/receive", json={**receive, "buckets": layout})
        assert r.status_code == 409 and "join it first" in r.text
        bad_lora = {**receive, "buckets": layout, "lora": {"r": 0}}
        r = await c.post("/weight_group/receive", json=bad_lora)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
        r = await c.post("/weight_group/leave")
        assert r.status_code == 200 and r.json()["left"] is False
    async with _app_client(tiny_engine, client_host="10.1.2.3") as c:  # no key: loopback only
        for path in ("/weight_group/join", "/weight_group/receive", "/weight_group/leave"):
            assert (await c.post(path, json=join)).status_code == 403, path


async def test_an_adapter_streamed_over_http_is_merged_and_a_bad_one_changes_nothing(
    tiny_engine,
) -> None:
    from agentrl.inference.lora import METADATA_KEY, LoraSpec

    spec = LoraSpec(r=2, lora_alpha=4, target_modules=("q_proj",))
    g = torch.Generator().manual_seed(0)
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    adapter = {
        f"{prefix}.lora_A.weight": torch.randn(2, 128, generator=g),
        f"{prefix}.lora_B.weight": torch.randn(128, 2, generator=g),
    }
    meta = {"format": "pt", METADATA_KEY: spec.to_json()}
    data = SafetensorsPayload.from_state_dict(adapter, metadata=meta).to_bytes()
    base = tiny_engine.model.state_dict()["model.layers.1.self_attn.q_proj.weight"].clone()
    headers = {"content-type": "application/octet-stream", "x-weight-version": "11"}
    async with _app_client(tiny_engine) as c:
        r = await c.post("/update_weights", content=data, headers=headers)
        assert r.status_code == 200 and r.json()["weight_version"] == 11, r.text
        merged = tiny_engine.model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
        delta = 2.0 * adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
        assert torch.allclose(merged, base + delta, atol=1e-5)
        assert (await c.get("/weight_info")).json()["lora"]["modules"] == 1

        wrong = {
            **meta,
            METADATA_KEY: LoraSpec(r=3, lora_alpha=4, target_modules=("q_proj",)).to_json(),
        }
        data = SafetensorsPayload.from_state_dict(adapter, metadata=wrong).to_bytes()
        r = await c.post(
            "/update_weights", content=data, headers={**headers, "x-weight-version": "12"}
        )
        assert r.status_code == 400 and "at r=3" in r.text
        assert (await c.get("/weight_info")).json()["weight_version"] == 11


def test_metadata_is_read_from_the_header() -> None:
    from agentrl.inference.weights import safetensors_metadata

    data = SafetensorsPayload.from_state_dict(_state(), metadata={"k": "v"}).to_bytes()
    assert safetensors_metadata(data) == {"k": "v"}
    assert safetensors_metadata(save(_state())) == {}
    with pytest.raises(WeightLoadError, match="not valid JSON"):
        safetensors_metadata(struct.pack("<Q", 2) + b"{x")


def test_a_source_that_trickles_bytes_is_cut_off_by_the_total_deadline() -> None:
    """Issue 21: each byte arrives well within the read timeout, the whole never does; the pull
    ends with an error instead of holding the load (and the staging lock) for ~10,000 s."""
    import socket
    import threading

    from agentrl.inference.weights import WeightLoadError, fetch_into

    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n")
            while not stop.wait(0.02):  # a byte every 20 ms, until the test ends
                try:
                    conn.sendall(b"x")
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        with pytest.raises(WeightLoadError, match="did not arrive within"):
            fetch_into(
                f"http://127.0.0.1:{port}/w",
                lambda n: memoryview(bytearray(n)),
                max_bytes=1 << 20,
                timeout_s=0.5,
                min_bytes_per_s=1e6,
            )
    finally:
        stop.set()
        listener.close()
        thread.join(30)
