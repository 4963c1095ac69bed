"""Command line: `python -m ddtree generate ...`, `python -m ddtree compare ...`, `python -m ddtree chat` and
`python -m ddtree serve` (an OpenAI-compatible server: ddtree/serve.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import api
from .bench.compare import compare as run_compare
from .base.config import ConfigError, SamplingParams, check_int
from .base.options import add_model_args, load_options_from
from .models.loading import resolve_device
from .engine.method_spec import DEFAULT_BUDGET, SYNTAX, MethodSpec, parse_methods
from .serve import main as serve_main
from .engine.stops import check_stop
from .train.cli import main as train_main


def _decode_args(p: argparse.ArgumentParser, template_optional: bool = True) -> None:
    p.add_argument("--budget", help=f"a bare ddtree's draft nodes per step, or 'auto' (adaptive; from a verify-cost "
                                    f"curve measured once per machine; default: auto with the context lookup on a "
                                    f"CPU, {DEFAULT_BUDGET} on a GPU)")
    p.add_argument("--block-size", type=int, help="drafter block size (default: the drafter's own)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    if template_optional:
        p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--stop", action="append", type=_unescape, metavar="TEXT",
                   help="end the generation before this text (repeatable; \\n, \\t and \\\\ are read as newline, "
                        "tab and backslash); the text ends before it")
    p.add_argument("--stop-token-id", action="append", type=int, metavar="ID",
                   help="end the generation at this token id, beside the model's EOS (repeatable)")


def _unescape(text: str) -> str:
    """A --stop value with \\n, \\t and \\\\ read as newline, tab and backslash (a shell passes them literally)."""
    escapes = {"n": "\n", "t": "\t", "\\": "\\"}
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in escapes:
            out.append(escapes[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # the training recipe has its own command line
        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m ddtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="decode one prompt and print the text and statistics")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--method", default="ddtree", help="ar, dflash, ddtree, ddtree:N or ddtree:auto (default: ddtree)")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--json", action="store_true", help="print the result as one JSON object")
    gen.add_argument("--stream", action="store_true", help="print the text as it is decoded")
    add_model_args(gen)
    _decode_args(gen)

    cmp = sub.add_parser("compare", help="run several methods on the same prompts; check them against ar")
    cmp.add_argument("prompts", nargs="+", help="prompt texts")
    cmp.add_argument("--methods", default="ar,dflash,ddtree", help=f"comma-separated: {SYNTAX}")
    cmp.add_argument("--seed", type=int, default=0)
    add_model_args(cmp)
    _decode_args(cmp)

    chat = sub.add_parser("chat", help="an interactive chat: each answer streamed, with its tau and tok/s; "
                                       "'exit', end of input (Ctrl-D) or Ctrl-C ends it")
    chat.add_argument("--method", default="ddtree", help="ar, dflash, ddtree, ddtree:N or ddtree:auto (default: ddtree)")
    chat.add_argument("--seed", type=int)
    chat.add_argument("--system", help="a system message to start the conversation with")
    add_model_args(chat)
    _decode_args(chat, template_optional=False)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the pair (docs/serving.md); "
                                       'needs pip install "ddtree[serve]"')
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    srv.add_argument("--served-model-name", help="the model id /v1/models lists (default: the target's name)")
    srv.add_argument("--max-queue", type=int, default=16,
                     help="requests that may wait to decode; one more is answered 429 (default: %(default)s)")
    srv.add_argument("--method", default="ddtree", help="the default method of a request without a \"ddtree\" "
                                                        "field: ar, dflash, ddtree, ddtree:N, ddtree:auto")
    srv.add_argument("--budget", help="the default budget of a bare ddtree (default: auto with the context lookup on "
                                      "a CPU)")
    srv.add_argument("--block-size", type=int, help="drafter block size (default: the drafter's own)")
    srv.add_argument("--temperature", type=float, default=0.0, help="a request's default (default: %(default)s)")
    srv.add_argument("--top-p", type=float, default=1.0)
    srv.add_argument("--top-k", type=int, default=0)
    srv.add_argument("--max-new-tokens", type=int, default=256, help="a request's default max_tokens")
    add_model_args(srv)

    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_main(args)  # FastAPI and uvicorn (an optional extra) are imported when it starts
    try:
        device = resolve_device(args.device)  # a bare ddtree's default budget depends on it
        if args.command in ("generate", "chat"):  # bad method specs and stops fail before the model loads
            method = MethodSpec.parse(args.method, args.budget, device)
        else:
            methods = parse_methods(args.methods, None if args.budget is None else [args.budget], device)
        stops = dict(stop=list(check_stop(args.stop)), stop_token_ids=args.stop_token_id)
        if args.command == "generate" and args.stream and args.json:
            raise ConfigError("--stream prints text as it comes and --json one object at the end: choose one")
        pair = api.load(**load_options_from(args))
        common = dict(block_size=args.block_size, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, max_new_tokens=args.max_new_tokens, **stops)
        if args.command == "chat":
            return chat_loop(pair, method, args.seed, args.system, common)
        common["chat"] = not args.no_chat
        if args.command == "generate":
            if args.stream:
                stream = pair.stream(args.prompt, method=method, seed=args.seed, **common)
                for piece in stream:
                    print(piece, end="", flush=True)
                print()
                res = stream.result
            else:
                res = pair.generate(args.prompt, method=method, seed=args.seed, **common)
            s = res.stats
            if args.json:
                print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": s.as_dict()}))
                return 0
            if not args.stream:
                print(res.text)
            print(f"\n[{s.method}{f' budget {s.budget}' if s.budget is not None else ''}] {s.new_tokens} tokens in "
                  f"{s.seconds:.2f}s = {s.tokens_per_second:.1f} tok/s, tau {s.tau:.2f}, "
                  f"TTFT {s.time_to_first_token * 1000:.0f} ms, stop: {stop_text(s)}, attention: "
                  f"{s.attention_backend}, backend: {s.backend}, drafter: {s.drafter or '-'}", file=sys.stderr)
            stages = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in s.stage_seconds.items())
            print(f"stages: {stages}", file=sys.stderr)
        else:
            result = run_compare(pair, args.prompts, methods=methods, seed=args.seed, **common)
            return 0 if result.ok else 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`generate --stream | head -c 10`): stop quietly
        return _stdout_gone()
    return 0


def _stdout_gone() -> int:
    """stdout's reader has closed the pipe: point stdout at /dev/null, so that the interpreter's last flush does
    not report the pipe again ("Exception ignored ... BrokenPipeError"), and end with 0 (what was read is whole)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file behind stdout (a test's capture): nothing to flush
        pass
    return 0


def stop_text(stats) -> str:
    """What ended a generation: its stop reason, with the stop string or token id that matched."""
    return stats.stop_reason + ("" if stats.stop_match is None else f" {stats.stop_match!r}")


def chat_loop(pair, method: MethodSpec, seed, system, decoding: dict) -> int:
    """Read a line, answer it (streamed), repeat: the whole conversation goes through the chat template each
    turn. After each answer, stderr gets its method, tau and tok/s. 'exit' or 'quit', end of input or Ctrl-C
    at the prompt ends it; Ctrl-C during an answer drops that turn."""
    if not getattr(pair.tokenizer, "chat_template", None):
        raise ConfigError("chat needs a target whose tokenizer has a chat template; use `generate --no-chat` here")
    # the settings are checked once, here: a ConfigError in a turn below is that turn's own (its text), not fatal
    SamplingParams(decoding["temperature"], decoding["top_p"], decoding["top_k"])
    check_int("max_new_tokens", decoding["max_new_tokens"], 1)
    messages = [{"role": "system", "content": system}] if system else []
    print(f"ddtree chat: {pair.name}, method {method.label}; 'exit' or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except (RuntimeError, ValueError, OSError):  # stdin closed or gone ("input(): lost sys.stdin"): no more input
            print("\n[no input: stdin is closed]", file=sys.stderr)
            return 0
        if line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        try:
            messages, ids = fit_context(pair, messages, line, decoding["max_new_tokens"])
        except ConfigError as e:  # this message alone cannot be answered: the conversation goes on without it
            print(f"[{e}; not sent, the conversation is kept]", file=sys.stderr, flush=True)
            continue
        stream = pair.stream(ids, method=method, seed=seed, **decoding)
        try:
            for piece in stream:
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print("\n[answer interrupted; not kept in the conversation]", file=sys.stderr)
            continue
        s = stream.result.stats
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": stream.result.text}]
        print()
        print(f"[{method.label}] {s.new_tokens} tokens, tau {s.tau:.2f}, {s.tokens_per_second:.1f} tok/s, "
              f"stop: {stop_text(s)}", file=sys.stderr, flush=True)


def fit_context(pair, messages: list[dict], line: str, max_new_tokens: int) -> tuple[list[dict], list[int]]:
    """(the conversation to keep, the prompt's token ids) for a new user message `line`: the oldest turns (a user
    message and its answer) are dropped, the system message kept, until the prompt leaves max_new_tokens of room in
    the target's context, with a notice on stderr; a ConfigError when the message alone does not fit the context."""
    context = pair.target.cfg.max_position_embeddings
    first = 1 if messages and messages[0]["role"] == "system" else 0
    kept = list(messages)
    ids = pair.encode(kept + [{"role": "user", "content": line}])
    while len(ids) + max_new_tokens > context and len(kept) > first:
        del kept[first:first + 2]
        ids = pair.encode(kept + [{"role": "user", "content": line}])
    if len(ids) >= context:
        raise ConfigError(f"this message makes a prompt of {len(ids)} tokens{' with the system message' * first}, "
                          f"and the target's context holds {context}: send a shorter one")
    if dropped := (len(messages) - len(kept)) // 2:
        print(f"[context: the oldest {dropped} turn{'s' * (dropped > 1)} dropped to fit the target's {context}-token "
              f"context{' (the system message kept)' * first}; {(len(kept) - first) // 2} kept]", file=sys.stderr,
              flush=True)
    return kept, ids
