"""The OpenAI-compatible server: same tokens as the engine in-process, streaming, the
official client, 4xx for bad input, disconnects free pages, many clients at once."""
import asyncio
import functools
import json
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from gpulab.engine.engine import LLM, EngineConfig
from gpulab.engine.model import TINY, TernaryTransformer
from gpulab.engine.sequence import SamplingParams
from gpulab.engine.server import MODEL_NAME, create_app

CONFIG = dict(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(7)
    return TernaryTransformer(TINY).pack()


def tiny_engine(overlap: bool = False) -> LLM:
    """The ``model`` fixture's engine, built where it is called (the engine process)."""
    torch.manual_seed(7)
    return LLM(TernaryTransformer(TINY).pack(), EngineConfig(**CONFIG, overlap=overlap))


class RemoteEngine:
    """What the tests ask of an engine in another process: whether it is idle, from /metrics."""

    def __init__(self, url: str):
        self.url = url

    def idle(self) -> bool:
        gauges = dict(line.split() for line in httpx.get(self.url + "/metrics").text.splitlines()
                      if line.startswith("gpulab_") and " " in line)
        return all(float(gauges[f"gpulab_{g}"]) == 0 for g in ("kv_pages_used", "requests_running",
                                                               "requests_waiting"))


@pytest.fixture(scope="module", params=["thread", "overlap", "process"])
def server(model, request):
    """A live server on a free loopback port, stopped at the end of the module; its engine
    on a thread of the server's process, the same with the host a step ahead of the device
    (``overlap``, a GPU's default), or in a process of its own (``make_llm``)."""
    if request.param == "process":
        app = create_app(make_llm=functools.partial(tiny_engine, overlap=True))
    else:
        llm = LLM(model, EngineConfig(**CONFIG, overlap=request.param == "overlap"))
        app = create_app(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    yield url, RemoteEngine(url) if request.param == "process" else llm
    srv.should_exit = True
    thread.join(timeout=10)


def wait_idle(llm, timeout=20.0):
    deadline = time.time() + timeout
    while not llm.idle():
        assert time.time() < deadline, "pages or requests left over: " + (
            f"{llm.block_manager.num_used} pages used, {len(llm.groups)} requests" if isinstance(llm, LLM)
            else httpx.get(llm.url + "/metrics").text)
        time.sleep(0.05)


def offline(model, prompt, **params):
    llm = LLM(model, EngineConfig(**CONFIG))
    return llm.generate([prompt], SamplingParams(**params))[0].text


def sse_chunks(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            body = line[len("data: "):]
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def test_models_health_metrics(server):
    url, _ = server
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
    text = httpx.get(url + "/metrics").text
    assert "gpulab_kv_pages_used" in text and "gpulab_requests_total" in text


def test_completion_equals_engine_in_process(server, model):
    url, llm = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "Tyger Tyger", "max_tokens": 12, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    choice = body["choices"][0]
    assert choice["text"] == offline(model, "Tyger Tyger", max_tokens=12)
    assert choice["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == len("Tyger Tyger") + 1
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    wait_idle(llm)


def test_stream_concatenates_to_the_same_text(server, model):
    url, llm = server
    req = {"prompt": "Shall I compare", "max_tokens": 10, "temperature": 0.8, "seed": 5, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=req, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r.iter_lines())
    assert chunks[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == offline(model, "Shall I compare", max_tokens=10, temperature=0.8, seed=5)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    wait_idle(llm)


def test_official_openai_client(server, model):
    openai = pytest.importorskip("openai")
    url, llm = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    out = client.completions.create(model=MODEL_NAME, prompt="The moon", max_tokens=8, temperature=0)
    assert out.choices[0].text == offline(model, "The moon", max_tokens=8)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="The moon", max_tokens=8, temperature=0, stream=True))
    assert streamed == out.choices[0].text
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    wait_idle(llm)


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": "hi", "max_tokenz": 3}, 400, "unknown field 'max_tokenz'"),
    ({"max_tokens": 3}, 400, "prompt is required"),
    ({"prompt": "", "max_tokens": 3}, 400, "empty"),
    ({"prompt": "x" * 5000, "max_tokens": 3}, 400, "context"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": ["a", "b"]}, 400, "one prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, says):
    url, llm = server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"]
    assert httpx.post(url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30).status_code == 200
    wait_idle(llm)


def test_stop_strings_end_the_completion(server, model):
    url, llm = server
    full = offline(model, "Tyger", max_tokens=16)
    stop = full[3:5]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Tyger", "max_tokens": 16, "temperature": 0,
                                                  "stop": stop}, timeout=60).json()
    assert r["choices"][0]["text"] == full[:full.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    wait_idle(llm)


def test_client_that_disconnects_frees_its_pages(server):
    url, llm = server
    req = {"prompt": "A long poem", "max_tokens": 200, "temperature": 0.9, "seed": 1, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=req, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break                       # one chunk, then hang up
    wait_idle(llm)
    assert "disconnected" in httpx.get(url + "/metrics").text


def test_many_streaming_clients_lose_nothing(server, model):
    """Bounded load on the loopback: 24 concurrent streams, each seeded; every one
    completes exactly once with the text the engine gives it alone."""
    url, llm = server
    n = 24

    async def one(client, i):
        req = {"prompt": f"Poem {i}:", "max_tokens": 6 + i % 5, "temperature": 0.7, "seed": i, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=req) as r:
            assert r.status_code == 200
            chunks = sse_chunks([line async for line in r.aiter_lines()])
        assert chunks[-1] == "[DONE]"
        return i, {c["id"] for c in chunks[:-1]}, "".join(c["choices"][0]["text"] for c in chunks[:-1])

    async def all_of_them():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n))), timeout=240)

    results = asyncio.run(all_of_them())
    ids = [next(iter(s)) for _, s, _ in results]
    assert all(len(s) == 1 for _, s, _ in results) and len(set(ids)) == n, "a stream mixed or repeated requests"
    for i, _, text in results[:6]:
        assert text == offline(model, f"Poem {i}:", max_tokens=6 + i % 5, temperature=0.7, seed=i)
    wait_idle(llm)


def test_a_client_behind_the_engine_gets_its_newest_output_at_once():
    """Outputs are cumulative: of several that wait for a slow client only the newest is
    read (one event with every new token), never across an abort's None, a failure or a
    finished output."""
    import asyncio

    from gpulab.engine.engine import Completion, RequestOutput
    from gpulab.engine.server import Subscription, deliver, newest_outputs

    def out(tokens, finished=False):
        return RequestOutput("r", [1], [Completion(0, list(tokens), "length" if finished else None)], finished)

    a, b, c = out([97]), out([97, 98]), out([97, 98, 99], finished=True)
    assert newest_outputs([a, b, c]) == [c]
    failure = RuntimeError("engine failed")
    assert newest_outputs([a, failure, b]) == [a, failure, b]
    assert newest_outputs([a, None]) == [a, None]
    assert newest_outputs([c, a]) == [c, a] and newest_outputs([]) == []

    async def take_twice():
        sub = Subscription(asyncio.get_running_loop())
        deliver([(sub, a), (sub, b)])                     # a whole step's outputs, one call
        first = await sub.take()
        sub.put(c)                                        # from another thread: arrives later
        return first, await sub.take()

    assert asyncio.run(take_twice()) == ([a, b], [c])


class _InstantEngine:
    """An engine whose steps cost ``step_s`` and nothing else: one byte 'a' per step."""

    def __init__(self, step_s: float):
        self.groups, self.step_s = {}, step_s

    def has_unfinished(self):
        return bool(self.groups)

    def add_request(self, prompt, params, request_id):
        self.groups[request_id] = (params.max_tokens, [])

    def abort(self, request_id):
        self.groups.pop(request_id, None)

    def step(self):
        from gpulab.engine.engine import Completion, RequestOutput
        time.sleep(self.step_s)
        outs = []
        for rid, (n, tokens) in list(self.groups.items()):
            tokens.append(97)
            done = len(tokens) >= n
            outs.append(RequestOutput(rid, [1], [Completion(0, list(tokens), "length" if done else None)], done))
            if done:
                del self.groups[rid]
        return outs


def test_stream_interval_spaces_events_and_loses_no_text():
    """With an interval longer than a step, the steps in between go out as one event: fewer
    events than tokens, the same text; 0 gives an event per step. Bad intervals are refused."""
    from gpulab.engine.server import create_app

    def stream(interval):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(create_app(_InstantEngine(0.002), stream_interval=interval),
                                            host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=srv.run, daemon=True).start()
        while not srv.started:
            time.sleep(0.01)
        try:
            texts = []
            body = {"prompt": "hi", "max_tokens": 30, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        texts.append(json.loads(line[6:])["choices"][0]["text"])
            return texts
        finally:
            srv.should_exit = True

    spaced = stream(0.05)
    assert "".join(spaced) == "a" * 30 and len(spaced) < 15
    every = stream(0.0)
    assert "".join(every) == "a" * 30 and len(every) > len(spaced)
    for bad in (-0.1, 2.0, "10ms"):
        with pytest.raises(ValueError, match="stream_interval"):
            create_app(_InstantEngine(0.0), stream_interval=bad)


# -- the engine in a process of its own (EngineProcess) ---------------------------------------------
def test_engine_process_reports_a_failed_start_and_a_death():
    from gpulab.engine.server import EngineProcess, build_llm
    with pytest.raises(RuntimeError, match="unknown model 'nope'"):
        EngineProcess(functools.partial(build_llm, "nope")).start()
    with pytest.raises(ValueError, match="not both"):
        create_app(LLM(TernaryTransformer(TINY).pack(), EngineConfig(**CONFIG)), make_llm=tiny_engine)
    engine = EngineProcess(tiny_engine).start()
    assert engine.alive() and engine.stats()["pages_total"] == CONFIG["num_blocks"]

    async def submit_then_kill():
        rid, sub = await engine.submit("Tyger", SamplingParams(max_tokens=200))
        engine.proc.kill()                         # the engine dies mid-request
        items = []
        while not any(isinstance(i, Exception) for i in items):
            items += await asyncio.wait_for(sub.take(), timeout=30)
        return items[-1]

    failure = asyncio.run(submit_then_kill())
    assert isinstance(failure, RuntimeError) and "stopped" in str(failure)
    engine.reader.join(timeout=10)
    assert not engine.alive()
