"""Command line: `python -m ddtree generate ...`, `python -m ddtree compare ...` and `python -m ddtree chat`."""
from __future__ import annotations

import argparse
import json
import sys

from . import api
from .api import QUANTS
from .compare import compare as run_compare
from .config import ConfigError, add_arithmetic_args
from .loading import resolve_device
from .method_spec import DEFAULT_BUDGET, SYNTAX, MethodSpec, parse_methods
from .stops import check_stop
from .train.cli import main as train_main


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="DFlash drafter directory (default: the shipped drafter for the default target)")
    p.add_argument("--markov-head", action="store_true",
                   help="use the drafter's Markov head: each tree node's children from its own conditional "
                        "(ddtree/markov.py; DDTREE_MARKOV_HEAD=1 too)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", help="float32 or bfloat16 (default: bf16 on CUDA and on CPUs with bf16 units, else fp32)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"],
                   help="attention backend (default: triton on CUDA, sdpa elsewhere)")
    p.add_argument("--quant", choices=QUANTS,
                   help="gguf: run the target on its GGUF's own Q4_1 / Q8_0 blocks (CPU, float32 activations); "
                        "gguf-int8: the same blocks with int8 activations (llama.cpp's arithmetic)")
    add_arithmetic_args(p)
    p.add_argument("--backend", default="auto", choices=["auto", "own", "hf"],
                   help="target backend: own-code model (llama/qwen2/qwen3/mistral) or any Hugging Face causal LM "
                        "(default: own where it covers the architecture, else hf)")


def _decode_args(p: argparse.ArgumentParser, template_optional: bool = True) -> None:
    p.add_argument("--budget", help=f"a bare ddtree's draft nodes per step, or 'auto' (adaptive; from a verify-cost "
                                    f"curve measured once per machine; default: auto on a CPU, "
                                    f"{DEFAULT_BUDGET} on a GPU)")
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
    _model_args(gen)
    _decode_args(gen)

    cmp = sub.add_parser("compare", help="run several methods on the same prompts; check them against ar")
    cmp.add_argument("prompts", nargs="+", help="prompt texts")
    cmp.add_argument("--methods", default="ar,dflash,ddtree", help=f"comma-separated: {SYNTAX}")
    cmp.add_argument("--seed", type=int, default=0)
    _model_args(cmp)
    _decode_args(cmp)

    chat = sub.add_parser("chat", help="an interactive chat: each answer streamed, with its tau and tok/s; "
                                       "'exit', end of input (Ctrl-D) or Ctrl-C ends it")
    chat.add_argument("--method", default="ddtree", help="ar, dflash, ddtree, ddtree:N or ddtree:auto (default: ddtree)")
    chat.add_argument("--seed", type=int)
    chat.add_argument("--system", help="a system message to start the conversation with")
    _model_args(chat)
    _decode_args(chat, template_optional=False)

    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)  # a bare ddtree's default budget depends on it
        if args.command in ("generate", "chat"):  # bad method specs and stops fail before the model loads
            method = MethodSpec.parse(args.method, args.budget, device)
        else:
            methods = parse_methods(args.methods, None if args.budget is None else [args.budget], device)
        stops = dict(stop=list(check_stop(args.stop)), stop_token_ids=args.stop_token_id)
        if args.command == "generate" and args.stream and args.json:
            raise ConfigError("--stream prints text as it comes and --json one object at the end: choose one")
        pair = api.load(args.target, args.draft, args.device, args.dtype, args.attention, args.backend, args.quant,
                        args.cpu_kernel, not args.no_gguf_blocks, args.markov_head)
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
    messages = [{"role": "system", "content": system}] if system else []
    print(f"ddtree chat: {pair.name}, method {method.label}; 'exit' or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        stream = pair.stream(messages + [{"role": "user", "content": line}], method=method, seed=seed, **decoding)
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
