"""The OpenAI-compatible server (ddtree/serve.py), tested with the official `openai` client against a live
server on 127.0.0.1 over the embedded pair (loaded once for the module): responses and streams token-identical
to pair.generate for ar, dflash and ddtree, stops, bad input answered 400 in JSON, two clients at once, a client
that leaves mid-stream, 50 short requests with none lost, and a full queue answered 429."""
import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

import ddtree  # noqa: E402
from ddtree import serve  # noqa: E402
from ddtree.base.config import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in two sentences."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", **{"max_retries": 0, **kw})

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def pair():
    return ddtree.load()


@pytest.fixture(scope="module")
def live(pair):
    server = LiveServer(serve.create_app(pair, max_queue=8))
    yield server
    server.stop()


def ext(response) -> dict:
    """The response's "ddtree" extension (step statistics; token ids where asked)."""
    return response.model_extra["ddtree"]


def test_models_health_and_default_bind(live, pair, capsys):
    assert [m.id for m in live.client().models.list().data] == [pair.name]
    assert live.health()["status"] == "ok"
    from ddtree.cli import main

    assert main(["serve", "--port", "70000"]) == 2  # refused before any load
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "default: 127.0.0.1" in " ".join(capsys.readouterr().out.split())  # this machine only, unless told


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_greedy_chat_is_token_identical_to_generate(live, pair, method):
    ref = pair.generate(QUESTION, method=method, max_new_tokens=40)
    out = live.client().chat.completions.create(model=pair.name, messages=QUESTION, max_tokens=40, temperature=0,
                                                extra_body={"ddtree": {"method": method, "return_token_ids": True}})
    assert out.choices[0].message.content == ref.text
    stats = ext(out)
    assert stats["token_ids"] == ref.token_ids and stats["prompt_token_ids"] == ref.prompt_ids
    assert stats["method"] == method and stats["tau"] >= 1 and "budget" in stats
    assert out.usage.completion_tokens == len(ref.token_ids) and out.usage.prompt_tokens == len(ref.prompt_ids)
    assert out.choices[0].finish_reason == ("length" if ref.stats.stop_reason == "max_new_tokens" else "stop")
    # streamed: the same text, the statistics in the last chunk, usage after it
    chunks = list(live.client().chat.completions.create(
        model=pair.name, messages=QUESTION, max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"ddtree": {"method": method, "return_token_ids": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == out.choices[0].finish_reason
    assert ext(last)["token_ids"] == ref.token_ids
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_completions_streamed_and_not(live, pair):
    prompt = "The three primary colors are"
    ref = pair.generate(prompt, method="ddtree", max_new_tokens=24, chat=False)
    client = live.client()
    out = client.completions.create(model=pair.name, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"ddtree": {"return_token_ids": True}})
    assert out.choices[0].text == ref.text and ext(out)["token_ids"] == ref.token_ids
    assert out.usage.completion_tokens == len(ref.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=pair.name, prompt=prompt, max_tokens=24, stream=True) if c.choices)
    assert streamed == ref.text
    by_ids = client.completions.create(model=pair.name, prompt=ref.prompt_ids, max_tokens=24)  # token ids in
    assert by_ids.choices[0].text == ref.text


def test_stop_strings(live, pair):
    ref = pair.generate(QUESTION, method="ddtree", max_new_tokens=40)
    words = ref.text.split()
    assert len(words) > 4
    stop = " " + words[3]
    want = pair.generate(QUESTION, method="ddtree", max_new_tokens=40, stop=[stop])
    for stream in (False, True):
        out = live.client().chat.completions.create(model=pair.name, messages=QUESTION, max_tokens=40, stop=stop,
                                                    stream=stream)
        if stream:
            chunks = [c for c in out if c.choices]
            text, finish = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert text == want.text and stop not in text and finish == "stop"


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"),
    ({"temperature": 5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logprobs": True}, "logprobs"),
    ({"ddtree": {"method": "nope"}}, None),
    ({"ddtree": {"method": "llamacpp"}}, "ddtree.method"),
    ({"ddtree": {"budget": "many"}}, None),
    ({"ddtree": {"colour": 1}}, "ddtree"),
    ({"stop": [""]}, None),
])
def test_bad_requests_get_400_json(live, body, param):
    request = {"model": "m", "messages": QUESTION, "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(**{k: v for k, v in request.items() if k in ("model", "messages")},
                                              extra_body={k: v for k, v in request.items()
                                                          if k not in ("model", "messages")})
    error = e.value.body
    assert e.value.status_code == 400 and error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param
    assert "Traceback" not in json.dumps(error)


def test_malformed_bodies_and_unknown_routes(live):
    for content in (b"{not json", b"[1, 2]", b'"text"', "\udcff".encode("utf-8", "surrogatepass")):
        r = httpx.post(live.url + "/v1/chat/completions", content=content,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", content
    r = httpx.post(live.url + "/v1/completions", json={"prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(live.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_two_clients_at_once(live, pair):
    prompts = [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Name a colour."}]]
    refs = [pair.generate(p, method="ddtree", max_new_tokens=24).text for p in prompts]

    def ask(i):
        chunks = live.client().chat.completions.create(model="m", messages=prompts[i], max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, [0, 1])) == refs


def test_a_client_that_leaves_mid_stream_stops_its_decoding(live, pair):
    before = live.health()
    long = [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": long, "max_tokens": 2000, "stream": True,
                            "ddtree": {"method": "ar"}}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for _, line in zip(range(4), lines)]  # a few events, then hang up
        assert got[0].startswith("data: ")
    deadline = time.time() + 30
    while live.health()["cancelled"] == before["cancelled"]:
        assert time.time() < deadline, "the decoding of a departed client was not stopped"
        time.sleep(0.05)
    after = live.health()
    assert after["served"] == before["served"] and not after["decoding"]
    out = live.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=8)  # still serving
    assert out.choices[0].message.content


def test_fifty_short_requests_none_lost(live, pair):
    before = live.health()
    prompts = [f"Count: {i}," for i in range(50)]

    def ask(prompt):
        out = live.client().completions.create(model="m", prompt=prompt, max_tokens=3,
                                               extra_body={"ddtree": {"return_token_ids": True}})
        return prompt, out.choices[0].text, ext(out)["prompt_token_ids"]

    with ThreadPoolExecutor(6) as pool:  # under the queue's 8: nothing is refused
        results = list(pool.map(ask, prompts))
    assert len(results) == 50 and len({r[0] for r in results}) == 50
    for prompt, text, prompt_ids in results:  # each answer belongs to its own request
        assert prompt_ids == pair.tokenizer.encode(prompt)
    after = live.health()
    assert after["served"] - before["served"] == 50 and after["rejected"] == before["rejected"]


class SlowPair:
    """A stand-in pair whose every decoding waits for `release`: fills the queue deterministically."""
    name = "slow"

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def stream(self, prompt, **kw):
        pair = self

        class Stream:
            result = None

            def __iter__(self):
                pair.started.release()
                pair.release.wait(30)
                yield "ok"
                from ddtree.api import GenerationResult
                from ddtree.engine.stats import GenerationStats

                self.result = GenerationResult([1], "ok", GenerationStats("ar", None, None, 1, 1,
                                                                          stop_reason="eos"), [0])

        return Stream()


def test_a_full_queue_answers_429():
    slow = SlowPair()
    server = LiveServer(serve.create_app(slow, max_queue=1))
    try:
        client = server.client()
        ask = lambda: client.completions.create(model="slow", prompt="x", max_tokens=1)  # noqa: E731
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask)
            assert slow.started.acquire(timeout=10)  # decoding
            second = pool.submit(ask)
            deadline = time.time() + 10
            while server.health()["queued"] < 1:  # waiting in the queue
                assert time.time() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError) as e:
                ask()
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
            slow.release.set()
            assert first.result().choices[0].text == "ok" and second.result().choices[0].text == "ok"
    finally:
        slow.release.set()
        server.stop()


def test_missing_stack_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    with pytest.raises(ConfigError, match=r'pip install "ddtree\[serve\]"'):
        serve.create_app(object())
    from ddtree.cli import main

    assert main(["serve"]) == 2
    assert 'pip install "ddtree[serve]"' in capsys.readouterr().err
