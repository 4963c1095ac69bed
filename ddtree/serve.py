"""An OpenAI-compatible HTTP server over one target/drafter pair: `python -m ddtree serve` (docs/serving.md).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both streamed as server-sent events
with "stream": true), GET /health. Requests decode one at a time, in arrival order, on one decoding thread fed
by a bounded queue: a request that finds the queue full is answered 429 at once; a client that disconnects has
its decoding stopped (or, still queued, never started). Bad requests get OpenAI-style JSON errors with status 400.

The request fields read: max_tokens (or max_completion_tokens), temperature, top_p, seed, stop, n (1 only),
stream, stream_options.include_usage, and the extensions top_k and "ddtree": {"method": "ar" | "dflash" |
"ddtree" | "ddtree:N" | "ddtree:auto", "budget": N | "auto", "block_size": N, "return_token_ids": bool}.
Responses carry `usage` and a "ddtree" object with the step statistics (method, budget, tau, steps, ...).
Fields whose effect is not implemented (logprobs, tools, penalties, logit_bias, n > 1, ...) are refused with
400 rather than ignored; other unknown fields are ignored, as OpenAI clients send some by default.

The HTTP layer (FastAPI/Starlette, uvicorn) is only a wire: the decoding is pair.stream(), whose greedy output
is token-identical to pair.generate()."""
import asyncio  # no `from __future__ import annotations`: FastAPI reads the handlers' annotations
import json
import math
import queue
import sys
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from . import api
from .base.config import ConfigError, SamplingParams
from .base.options import load_options_from
from .models.loading import resolve_device
from .engine.method_spec import MethodSpec

INSTALL_HINT = 'pip install "ddtree[serve]"'
MAX_STOPS = 4  # as the OpenAI API
SERVED_METHODS = ("ar", "dflash", "ddtree")  # the pair's own methods (not the benchmark's baselines)
# Request fields whose effect this server does not implement: refused (400) when set to anything but their
# default, so that a client never silently gets another decoding than the one it asked for.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
               "tool_choice": (None, "none"), "function_call": (None, "none"), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1),
               "echo": (None, False), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
               "repetition_penalty": (None, 1, 1.0)}


class RequestError(Exception):
    """An error answered with an OpenAI-style JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# --- request parsing (no HTTP here) ----------------------------------------------------------------------------
@dataclass
class Defaults:
    """The server's decoding defaults (the command line's flags), used where a request leaves a field out."""
    method: str = "ddtree"
    budget: int | str | None = None
    block_size: int | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Decoding:
    """One parsed request: the prompt and pair.stream()'s arguments."""
    prompt: object
    chat: bool
    kwargs: dict
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be between {lo} and {hi}, got {value!r}", param=name)
    return value


def parse_request(body, chat: bool, defaults: Defaults) -> Decoding:
    """A /v1/chat/completions (chat=True) or /v1/completions body, checked: a RequestError (400) names the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"{name} is not supported by this server (ddtree); leave it out", param=name,
                               code="unsupported_parameter")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError(f"n must be 1 (one choice per request), got {n!r}", param="n",
                           code="unsupported_parameter")
    if chat:
        prompt = _messages(body.get("messages"))
    else:
        prompt = _completion_prompt(body.get("prompt"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", defaults.max_tokens, 1, 1 << 20, integer=True)
    temperature = _number(body, "temperature", defaults.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", defaults.top_p, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be above 0", param="top_p")
    top_k = _number(body, "top_k", defaults.top_k, -1, 1 << 30, integer=True)
    seed = _number(body, "seed", None, -(1 << 63), (1 << 64) - 1, integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    if stop is not None and len(stop) > MAX_STOPS:
        raise RequestError(f"stop takes at most {MAX_STOPS} strings, got {len(stop)}", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    ext = body.get("ddtree") or {}
    if not isinstance(ext, dict):
        raise RequestError('"ddtree" must be an object: {"method": ..., "budget": ...}', param="ddtree")
    unknown = set(ext) - {"method", "budget", "block_size", "return_token_ids"}
    if unknown:
        raise RequestError(f'unknown "ddtree" field(s) {sorted(unknown)}; known: method, budget, block_size, '
                           "return_token_ids", param="ddtree")
    method = ext.get("method", defaults.method)
    if not isinstance(method, str):
        raise RequestError(f"ddtree.method must be a string (ar, dflash, ddtree, ddtree:N), got {method!r}",
                           param="ddtree.method")
    if method.split(":")[0] not in SERVED_METHODS:
        raise RequestError(f"ddtree.method {method!r}: the server decodes with ar, dflash, ddtree, ddtree:N or "
                           "ddtree:auto", param="ddtree.method")
    budget = ext.get("budget", defaults.budget if "method" not in ext else None)
    block_size = ext.get("block_size", defaults.block_size)
    kwargs = dict(method=method, budget=budget, block_size=block_size, temperature=float(temperature),
                  top_p=float(top_p), top_k=0 if top_k == -1 else top_k, max_new_tokens=max_tokens, seed=seed,
                  chat=chat, stop=stop or None)
    return Decoding(prompt, chat, kwargs, stream, bool(options.get("include_usage")),
                    bool(ext.get("return_token_ids")))


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role and a content", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _completion_prompt(prompt):
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt  # token ids
    raise RequestError("prompt must be a non-empty string or list of token ids (one prompt per request)",
                       param="prompt")


FINISH = {"max_new_tokens": "length", "context_limit": "length"}


def finish_reason(stats) -> str:
    return FINISH.get(stats.stop_reason, "stop")


def step_stats(result, decoding: Decoding) -> dict:
    """The response's "ddtree" extension: the method that ran, its budget and the step statistics."""
    s = result.stats
    out = {"method": s.method, "budget": s.budget, "block_size": s.block_size, "tau": round(s.tau, 4),
           "steps": s.steps, "new_tokens": s.new_tokens, "seconds": round(s.seconds, 4),
           "tokens_per_second": round(s.tokens_per_second, 2),
           "time_to_first_token": round(s.time_to_first_token, 4), "stop_reason": s.stop_reason,
           "stop_match": s.stop_match, "drafter": s.drafter}
    if decoding.return_token_ids:
        out.update(prompt_token_ids=list(result.prompt_ids), token_ids=list(result.token_ids))
    return out


def usage(result) -> dict:
    prompt, completion = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- the decoding thread ---------------------------------------------------------------------------------------
@dataclass
class Job:
    """One request's decoding: the decoding thread emits ("piece", text), then ("done", result) or
    ("error", exception) or ("cancelled", None) into `events`, on the server's event loop."""
    decoding: Decoding
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is going down
            pass


class Engine:
    """The pair and the one thread that decodes with it, fed by a bounded queue."""

    def __init__(self, pair, max_queue: int = 16):
        self.pair = pair
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max(1, max_queue))
        self.counts = {"served": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.running = False
        self._thread = threading.Thread(target=self._work, name="ddtree-decoder", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise RequestError(f"the server is busy: {self.jobs.maxsize} requests are waiting to decode; retry "
                               "later", status=429, code="queue_full", kind="rate_limit_exceeded") from None

    def close(self) -> None:
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.running = True
            try:
                self._run(job)
            finally:
                self.running = False

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # its client left while it waited
            self.counts["cancelled"] += 1
            return job.emit("cancelled")
        d = job.decoding
        try:
            stream = self.pair.stream(d.prompt, **d.kwargs)
            pieces = iter(stream)
            for piece in pieces:
                if job.cancelled.is_set():
                    pieces.close()  # ends the decoding generator: no further steps
                    self.counts["cancelled"] += 1
                    return job.emit("cancelled")
                job.emit("piece", piece)
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                return job.emit("cancelled")
            self.counts["served"] += 1
            job.emit("done", stream.result)
        except ConfigError as e:  # a request the pair refuses (a bad method, stop, prompt, ...): the client's error
            self.counts["failed"] += 1
            job.emit("error", RequestError(str(e)))
        except Exception as e:  # noqa: BLE001 - a bug or a resource error: logged here, answered 500 without detail
            self.counts["failed"] += 1
            print(f"ddtree serve: decoding failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            job.emit("error", RequestError(f"internal error while decoding ({type(e).__name__}); see the server log",
                                           status=500, kind="server_error", code="internal_error"))


# --- HTTP ------------------------------------------------------------------------------------------------------
def _require_stack():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the server needs FastAPI and uvicorn ({e.name} is missing): {INSTALL_HINT}") from None


def create_app(pair, model_name: str | None = None, defaults: Defaults | None = None, max_queue: int = 16):
    """The FastAPI app serving `pair`. model_name: the id /v1/models lists and responses carry (default: the
    pair's name). A request's "model" field is not checked against it: one pair per server."""
    _require_stack()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    defaults = defaults or Defaults()
    name = model_name or pair.name or "ddtree"
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    engine = Engine(pair, max_queue)
    app = FastAPI(title="ddtree", description="OpenAI-compatible server over a ddtree pair", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.engine = engine

    def error_response(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(str(e.detail), status=e.status_code, kind=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return error_response(RequestError(f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        print(f"ddtree serve: {request.url.path} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return error_response(RequestError(f"internal error ({type(e).__name__}); see the server log", status=500,
                                           kind="server_error", code="internal_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "queued": engine.jobs.qsize(), "decoding": engine.running,
                **engine.counts}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "ddtree"}]}

    async def read_body(request: Request):
        try:
            return json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None

    async def next_event(job: Job, request: Request):
        """The job's next event; while waiting (queued or decoding), a client that has gone cancels it."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return ("cancelled", None)

    async def complete(request: Request, chat: bool):
        decoding = parse_request(await read_body(request), chat, defaults)
        job = Job(decoding, asyncio.get_running_loop())
        engine.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": name}
        first = await next_event(job, request)  # errors the pair raises before decoding are still answered 400
        if first[0] == "error":
            raise first[1]
        if first[0] == "cancelled":
            return JSONResponse({}, status_code=499)  # nobody is listening
        if decoding.stream:
            return StreamingResponse(sse(job, first, base, decoding, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces, event = [], first
        while event[0] == "piece":
            pieces.append(event[1])
            event = await next_event(job, request)
        if event[0] == "error":
            raise event[1]
        if event[0] == "cancelled":
            return JSONResponse({}, status_code=499)
        result = event[1]
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat else
                  {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = finish_reason(result.stats)
        return {**base, "choices": [choice], "usage": usage(result), "ddtree": step_stats(result, decoding)}

    async def sse(job: Job, first, base: dict, decoding: Decoding, chat: bool):
        chunk = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choices, **extra) -> str:
            return f"data: {json.dumps({**chunk, 'choices': choices, **extra})}\n\n"

        def delta(text: str | None, finish=None, role: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
                return {"index": 0, "delta": d, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        try:
            if chat:
                yield event([delta(None, role=True)])
            item = first
            while item[0] == "piece":
                yield event([delta(item[1])])
                item = await job.events.get()
            if item[0] == "done":
                result = item[1]
                yield event([delta(None, finish_reason(result.stats))], ddtree=step_stats(result, decoding))
                if decoding.include_usage:
                    yield event([], usage=usage(result))
            elif item[0] == "error":
                yield f"data: {json.dumps(item[1].body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the response task is cancelled) or the stream ended: stop decoding
            job.cancelled.set()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def serve(pair, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          defaults: Defaults | None = None, max_queue: int = 16, log_level: str = "info") -> None:
    """Serve `pair` until interrupted (Ctrl-C)."""
    _require_stack()
    import uvicorn

    app = create_app(pair, model_name, defaults, max_queue)
    print(f"ddtree serve: {model_name or pair.name} on http://{host}:{port}/v1 (OpenAI API; Ctrl-C stops)",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def main(args) -> int:
    """`python -m ddtree serve`: the settings and the stack checked, then the pair loaded (once), then served."""
    try:
        _require_stack()  # before the slow load
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {args.port}")
        if args.max_queue < 1:
            raise ConfigError(f"--max-queue must be at least 1, got {args.max_queue}")
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        MethodSpec.parse(args.method, args.budget, resolve_device(args.device))
        SamplingParams(args.temperature, args.top_p, args.top_k)
        pair = api.load(**load_options_from(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    defaults = Defaults(args.method, args.budget, args.block_size, args.max_new_tokens, args.temperature, args.top_p,
                        args.top_k)
    serve(pair, args.host, args.port, args.served_model_name, defaults, args.max_queue)
    return 0
