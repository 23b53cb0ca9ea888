#!/usr/bin/env python3
"""Drive kvfleet's OpenAI-compatible API with the official `openai` client and check the counts.

Run by `tests/tests/openai.rs` against a real coordinator and worker:

    python3 tests/openai_client.py --base-url http://127.0.0.1:PORT/v1

For chat and completions, streaming and not, each request asks for R reasoning and A answer
tokens (`extra_body` kvfleet_* fields); the script checks that the responses parse, that R
reasoning and A answer tokens arrive (one chunk each when streaming), and that `usage` reports
completion_tokens == R + A with reasoning_tokens == R. A token limit bounds reasoning + answer
together (OpenAI's `max_completion_tokens` semantics): a limit below R + A cuts the output to the
limit with finish_reason "length". With `--api-key KEY` (a coordinator started with that key) it
also checks that a wrong key and no key get OpenAI's 401 errors. Exits 0 when all pass, 1
otherwise. Needs `pip install openai`.
"""

import argparse
import sys
import time

import openai


def extra(obj, name):
    """An extension field of a response object (the client keeps unknown fields as extras)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def check_usage(usage, r, a, where):
    check(usage is not None, f"{where}: no usage")
    check(usage.completion_tokens == r + a, f"{where}: completion_tokens {usage.completion_tokens} != {r}+{a}")
    details = usage.completion_tokens_details
    check(details is not None, f"{where}: no completion_tokens_details")
    check(details.reasoning_tokens == r, f"{where}: reasoning_tokens {details.reasoning_tokens} != {r}")
    check(usage.total_tokens == usage.prompt_tokens + r + a, f"{where}: total_tokens {usage.total_tokens}")


def chat_stream(client, model, r, a):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Explain KV-cache migration in one paragraph."}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kvfleet_reasoning_tokens": r, "kvfleet_answer_tokens": a},
    )
    reasoning_chunks = content_chunks = 0
    finish = usage = None
    arrivals = []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            rc = extra(delta, "reasoning_content")
            if rc:
                check(content_chunks == 0, "chat stream: reasoning token after an answer token")
                reasoning_chunks += 1
                arrivals.append(time.monotonic())
            if delta.content:
                content_chunks += 1
                arrivals.append(time.monotonic())
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    check(reasoning_chunks == r, f"chat stream: {reasoning_chunks} reasoning_content chunks, want {r}")
    check(content_chunks == a, f"chat stream: {content_chunks} content chunks, want {a}")
    check(finish == "stop", f"chat stream: finish_reason {finish!r}")
    check_usage(usage, r, a, "chat stream")
    return arrivals[-1] - arrivals[0]


def chat_whole(client, model, r, a):
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        extra_body={"kvfleet_reasoning_tokens": r, "kvfleet_answer_tokens": a},
    )
    msg = resp.choices[0].message
    check(msg.role == "assistant", f"chat: role {msg.role!r}")
    check(len(msg.content.split()) == a, f"chat: content has {len(msg.content.split())} tokens, want {a}")
    reasoning = extra(msg, "reasoning_content") or ""
    check(len(reasoning.split()) == r, f"chat: reasoning_content has {len(reasoning.split())} tokens, want {r}")
    check(resp.choices[0].finish_reason == "stop", f"chat: finish_reason {resp.choices[0].finish_reason!r}")
    check_usage(resp.usage, r, a, "chat")


def completion_stream(client, model, r, a):
    stream = client.completions.create(
        model=model,
        prompt="The quick brown fox",
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kvfleet_reasoning_tokens": r, "kvfleet_answer_tokens": a},
    )
    text_chunks = reasoning_chunks = 0
    text = ""
    finish = usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                text_chunks += 1
                text += choice.text
            if extra(choice, "reasoning_content"):
                reasoning_chunks += 1
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    check(text_chunks == a, f"completion stream: {text_chunks} text chunks, want {a}")
    check(len(text.split()) == a, f"completion stream: text has {len(text.split())} tokens, want {a}")
    check(reasoning_chunks == r, f"completion stream: {reasoning_chunks} reasoning chunks, want {r}")
    check(finish == "stop", f"completion stream: finish_reason {finish!r}")
    check_usage(usage, r, a, "completion stream")


def completion_whole(client, model, r, a):
    # max_tokens counts reasoning + answer; the answer is asked longer than what the limit leaves
    # after reasoning: cut to it, finish_reason "length".
    resp = client.completions.create(
        model=model,
        prompt="The quick brown fox",
        max_tokens=r + a,
        extra_body={"kvfleet_reasoning_tokens": r, "kvfleet_answer_tokens": a + 5},
    )
    choice = resp.choices[0]
    check(len(choice.text.split()) == a, f"completion: text has {len(choice.text.split())} tokens, want {a}")
    check(choice.finish_reason == "length", f"completion: finish_reason {choice.finish_reason!r}")
    check_usage(resp.usage, r, a, "completion")


def chat_limit_inside_reasoning(client, model, r, a):
    # max_completion_tokens below the reasoning length: the output is exactly the limit, all but
    # its last token reasoning (kvfleet keeps one answer token), finish_reason "length".
    limit = max(r // 2, 2)
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "think hard"}],
        max_completion_tokens=limit,
        extra_body={"kvfleet_reasoning_tokens": r, "kvfleet_answer_tokens": a},
    )
    check(resp.choices[0].finish_reason == "length", f"chat limit: finish_reason {resp.choices[0].finish_reason!r}")
    check(len(resp.choices[0].message.content.split()) == 1, "chat limit: one answer token")
    check_usage(resp.usage, limit - 1, 1, "chat limit")


def authentication(base_url, model, key):
    """A wrong key and no key: OpenAI's 401 errors; the right key (the main client) works."""
    wrong = openai.OpenAI(base_url=base_url, api_key=key + "-wrong", max_retries=0, timeout=60)
    try:
        wrong.models.list()
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"wrong key: status {e.status_code}")
        check(e.code == "invalid_api_key", f"wrong key: code {e.code!r}")
        check(e.type == "invalid_request_error", f"wrong key: type {e.type!r}")
        check("Incorrect API key provided" in e.message, f"wrong key: message {e.message!r}")
        check(key not in e.message, f"wrong key: the message shows the key unmasked: {e.message!r}")
    else:
        raise AssertionError("wrong key: no error")
    # The client refuses to run without a key: build one, then omit its Authorization header.
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"Authorization": openai.Omit()},
        )
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"no key: status {e.status_code}")
        check(e.code is None, f"no key: code {e.code!r}")
        check("You didn't provide an API key" in e.message, f"no key: message {e.message!r}")
    else:
        raise AssertionError("no key: no error")


def errors(client, model):
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"unknown model: status {e.status_code}")
    else:
        raise AssertionError("unknown model: no error")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"negative max_tokens: status {e.status_code}")
        check("max_tokens" in str(e), f"negative max_tokens: the error does not name the field: {e}")
    else:
        raise AssertionError("negative max_tokens: no error")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--reasoning", type=int, default=12)
    ap.add_argument("--answer", type=int, default=8)
    ap.add_argument("--api-key", default=None, help="the key the server requires (default: none)")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "unused", max_retries=0, timeout=120)
    models = client.models.list().data
    check(len(models) == 1, f"models: {models}")
    model = models[0].id
    r, a = args.reasoning, args.answer
    span = chat_stream(client, model, r, a)
    print(f"ok chat stream: {r} reasoning + {a} answer chunks over {span:.3f} s")
    chat_whole(client, model, r, a)
    print("ok chat")
    completion_stream(client, model, r, a)
    print("ok completion stream")
    completion_whole(client, model, r, a)
    print("ok completion (max_tokens cut, finish_reason length)")
    chat_limit_inside_reasoning(client, model, r, a)
    print("ok chat (max_completion_tokens inside reasoning, finish_reason length)")
    if args.api_key:
        authentication(args.base_url, model, args.api_key)
        print("ok authentication (wrong key and no key: 401)")
    errors(client, model)
    print("ok errors")
    print(f"openai {openai.__version__}: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
