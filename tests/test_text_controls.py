"""vLLM's text controls on chat and completions, through the session's served app: special tokens
left out of the text by default (`skip_special_tokens`), each token's log-probability entry still
there and aligned with the text (their texts join to it, their offsets point into it);
`spaces_between_special_tokens`; `include_stop_str_in_output`; `min_tokens` (stop strings and
stop tokens held back; the engine's side: tests/test_structured_lane.py). (`ignore_eos` and
`stop_token_ids`: tests/test_api_surface.py.)

The shipped model writes its template's `<|im_start|>` often (a chat answer begins with it, a
completion of `<|endoftext|>` repeats it). Greedy throughout."""

from __future__ import annotations

import pytest

RAY_MARK = pytest.mark.ray
MODEL = "mtplx-tiny-py"
USER = [{"role": "user", "content": "def add(a, b):"}]
SPECIAL = "<|im_start|>"


def _chat(client, **extra):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2, **extra)
    return r.choices[0], r.usage


@RAY_MARK
def test_chat_text_has_no_special_token_unless_asked(client, serve_app):
    import anthropic

    from conftest import TEST_API_KEY

    kept, usage = _chat(client, extra_body={"skip_special_tokens": False})
    assert kept.message.content.startswith(SPECIAL + "assistant\n")        # the answer
    skipped, usage_skipped = _chat(client)
    assert SPECIAL not in skipped.message.content
    assert skipped.message.content == kept.message.content[len(SPECIAL):]
    # the same tokens, counted and listed alike; each entry's text as the text has it
    assert usage_skipped.completion_tokens == usage.completion_tokens == 12
    for choice in (kept, skipped):
        entries = choice.logprobs.content
        assert len(entries) == 12 and "".join(e.token for e in entries) == choice.message.content
        assert bytes(b for e in entries for b in e.bytes).decode() == choice.message.content
    assert skipped.logprobs.content[0].token == "" and skipped.logprobs.content[0].bytes == []
    assert kept.logprobs.content[0].token == SPECIAL
    # streamed, and on the Anthropic route (the same path)
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(deltas) == skipped.message.content
    ac = anthropic.Anthropic(base_url=serve_app.base, api_key=TEST_API_KEY, max_retries=0, timeout=60)
    msg = ac.messages.create(model=MODEL, messages=USER, max_tokens=12, extra_body={"temperature": 0})
    assert msg.content[0].text == skipped.message.content


@RAY_MARK
def test_completion_logprobs_stay_aligned_with_the_text(client):
    def complete(**extra):
        r = client.completions.create(model=MODEL, prompt="<|endoftext|>", max_tokens=10, temperature=0, logprobs=1,
                                      **extra)
        return r.choices[0]

    kept = complete(extra_body={"skip_special_tokens": False})
    assert kept.text.count(SPECIAL) >= 2
    skipped = complete()
    assert SPECIAL not in skipped.text and skipped.text == kept.text.replace(SPECIAL, "")
    for choice in (kept, skipped):
        lp = choice.logprobs
        assert len(lp.tokens) == 10 and "".join(lp.tokens) == choice.text
        assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(10)]
        assert all(choice.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
    # spaces_between_special_tokens: a fast tokenizer never puts a space between special tokens
    spaced = complete(extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": True})
    unspaced = complete(extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False})
    assert spaced.text == unspaced.text == kept.text and SPECIAL + SPECIAL in kept.text


@RAY_MARK
def test_include_stop_str_in_output(client, http):
    def complete(**extra):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "import os\n", "max_tokens": 24,
                                                "temperature": 0, "stop": ["path"], **extra})
        assert r.status_code == 200, r.text
        return r.json()

    cut, kept = complete(), complete(include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + "path"
    assert cut["choices"][0]["stop_reason"] == kept["choices"][0]["stop_reason"] == "path"
    assert cut["usage"]["completion_tokens"] == kept["usage"]["completion_tokens"]
    assert kept["choices"][0]["finish_reason"] == "stop"
    chat = [client.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, temperature=0, stop=["codecs"],
                                           extra_body=extra).choices[0].message.content
            for extra in ({}, {"include_stop_str_in_output": True})]
    assert chat[1] == chat[0] + "codecs"
    for field, value in (("skip_special_tokens", "yes"), ("include_stop_str_in_output", 1),
                         ("spaces_between_special_tokens", None)):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@RAY_MARK
def test_min_tokens_holds_stop_strings_and_tokens_back(http):
    def complete(**extra):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "import os\n", "max_tokens": 24,
                                                "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

    whole, _ = complete(ignore_eos=True)
    cut, k = complete(stop=["path"])
    assert whole.startswith(cut + "path") and k < 20
    # the first "path" is within the minimum: the text runs past it, to the next or to max_tokens
    held, n = complete(stop=["path"], min_tokens=k + 2)
    assert held.startswith(cut + "path") and n >= k + 2
    # stop tokens the greedy text writes early are held back too
    stop_ids = http.post("/tokenize", json={"model": MODEL, "prompt": whole}).json()["tokens"][1:6]
    early, k = complete(stop_token_ids=stop_ids)
    held, n = complete(stop_token_ids=stop_ids, min_tokens=k + 3)
    assert k <= 8 and n >= k + 3 and held.startswith(early)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_a_completions_text_prompt_gets_the_tokenizers_special_tokens_unless_asked_not_to():
    """vLLM's `add_special_tokens` (default true on completions), as mlx-lm's server encodes a
    completion: a tokenizer that adds a BOS (Gemma's; without it Gemma repeats its prompt) gets it
    on a text prompt; token-id prompts are as sent. The shipped tokenizer, given a BOS here."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from mtplx.api.openai import CompletionRequest, encode_prompt
    from mtplx.models.loader import SHIPPED_MODEL

    shipped = AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))
    bos = shipped.convert_tokens_to_ids("<|endoftext|>")
    backend = Tokenizer.from_str(shipped.backend_tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", bos)])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend)
    plain = shipped.encode("def add(a, b):", add_special_tokens=False)
    assert encode_prompt(with_bos, "def add(a, b):") == [bos] + plain
    assert encode_prompt(with_bos, "def add(a, b):", add_special_tokens=False) == plain
    assert encode_prompt(with_bos, [5, 6]) == [5, 6]
    assert CompletionRequest(model=MODEL, prompt="x").add_special_tokens is True
    assert CompletionRequest(model=MODEL, prompt="x", add_special_tokens=False).add_special_tokens is False
