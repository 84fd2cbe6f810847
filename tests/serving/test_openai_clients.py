"""The server through the clients people use (issue 34): langchain-openai's `ChatOpenAI`
and `OpenAI` (completions) classes and the openai SDK, on the demo and on tiny random
checkpoints of a masked family (LLaDA) and a block-causal one (SDAR): log-probabilities,
n choices, lists of prompts, stop strings, streams, and the nulls langchain sends."""

from __future__ import annotations

import langchain_openai
import openai
import pytest
from server_runs import running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.testing.block_checkpoints import write_sdar

GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module", params=["demo", "llada", "sdar"])
def served(request, tmp_path_factory, llada_path):
    """(base URL, a prompt, the model's greedy answer to it) for each checkpoint."""
    path = {
        "demo": DEMO_MODEL_PATH,
        "llada": llada_path,
        "sdar": request.param == "sdar" and write_sdar(tmp_path_factory.mktemp("sdar")),
    }[request.param]
    argv = ["--model", str(path), "--port", "0", "--log-level", "WARNING"]
    with running_server(argv) as (httpd, _):
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        prompt = "357+468=" if request.param == "demo" else "Hello there"
        sdk = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        text = sdk.completions.create(model="default_model", prompt=prompt, **GREEDY).choices[0].text
        assert len(text) >= 2, text  # (the stop test below cuts it)
        yield url, prompt, text


def chat_model(url: str, **kw) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(
        model="default_model", base_url=url, api_key="x", max_retries=0, timeout=120, **{**GREEDY, **kw}
    )


def completions_model(url: str, **kw) -> langchain_openai.OpenAI:
    return langchain_openai.OpenAI(
        model="default_model", base_url=url, api_key="x", max_retries=0, timeout=120, **{**GREEDY, **kw}
    )


def test_chat_with_logprobs(served):
    url, prompt, _ = served
    message = chat_model(url, logprobs=True, top_logprobs=2).invoke(prompt)
    entries = message.response_metadata["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == message.content
    for entry in entries:
        ranked = [t["logprob"] for t in entry["top_logprobs"]]
        assert ranked == sorted(ranked, reverse=True) and len(ranked) == 2
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # (greedy: the position's best)


def test_chat_streams_the_same_answer(served):
    url, prompt, _ = served
    chat = chat_model(url)
    assert "".join(chunk.content for chunk in chat.stream(prompt)) == chat.invoke(prompt).content


def test_chat_n_choices(served):
    url, prompt, _ = served
    from langchain_core.messages import HumanMessage

    result = chat_model(url, n=3).generate([[HumanMessage(prompt)]])
    answers = [g.message.content for g in result.generations[0]]
    assert len(answers) == 3 and len(set(answers)) == 1  # (greedy: three copies of one answer)


def test_completions_class_and_a_list_of_prompts(served):
    """langchain's OpenAI class sends `logprobs: null` (a 400 before), and sends the
    prompts of one generate() call in one request (a list: a 400 before)."""
    url, prompt, text = served
    llm = completions_model(url)
    assert llm.invoke(prompt) == text
    other = "1+2=" if prompt.startswith("357") else "Good morning"
    alone = llm.invoke(other)
    result = llm.generate([prompt, other, prompt])
    assert [g[0].text for g in result.generations] == [text, alone, text]
    with_logprobs = completions_model(url, logprobs=1).generate([prompt]).generations[0][0]
    logprobs = with_logprobs.generation_info["logprobs"]
    assert "".join(logprobs["tokens"]) == with_logprobs.text == text
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]


def test_stop_strings_cut_the_answer_before_them(served):
    url, prompt, text = served
    stop = next(c for c in text[1:] if c.strip())  # a character the answer writes after its first
    cut = text[: text.index(stop)]
    assert chat_model(url).invoke(prompt, stop=[stop]).response_metadata["finish_reason"] == "stop"
    assert completions_model(url).invoke(prompt, stop=[stop]) == cut
    sdk = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    r = sdk.completions.create(model="default_model", prompt=prompt, stop=[stop], logprobs=0, **GREEDY)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert "".join(r.choices[0].logprobs.tokens) == cut
