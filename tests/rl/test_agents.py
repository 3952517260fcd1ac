"""rl_extension.agents in one process: tools, tool-call formats, the agent loop on a scripted engine,
turn sampling, and the masks that keep tool tokens out of the loss, the KL and the entropy.

The loop's own tests drive it with a scripted client (no model): each trajectory's turns are given
in advance, so max_turns, the token budget, malformed calls and tool failures are exact. The group
tests (process and ray backends) are in test_agents_groups.py.

Run: python -m pytest tests/rl/test_agents.py -q
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from batches import build_small_model, prompt_batch
from repo_scripts import ROOT, load_script

from rl_extension.agents import (
    AgentLoop,
    QwenFormat,
    Sampling,
    TagFormat,
    ToolResult,
    TurnClient,
    TurnOutput,
    TurnRequest,
    call_tool,
    decode_turns,
    final_answer,
    format_for,
    get_tool,
    tool,
    trajectory_batch,
)
from rl_extension.agents.calc import calc_demonstration, tokenize_demonstration
from rl_extension.algorithms.core import agg_loss
from rl_extension.algorithms.kl import kl_penalty
from rl_extension.algorithms.policy_losses import compute_policy_loss
from rl_extension.config import MultiTurnConfig
from rl_extension.data.scorers import calc_score
from rl_extension.models import build_tiny_tokenizer, load_causal_lm, load_tokenizer
from rl_extension.roles.actor import response_log_probs
from rl_extension.roles.rollout import generate_responses

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), tools part.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    '{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}'
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@tool
async def slow_echo(text: str) -> str:
    """Echoes after a while (async)."""
    await asyncio.sleep(0.05)
    return text


@tool
def fails(x: str) -> str:
    """Always raises."""
    raise RuntimeError(f"bad input {x}")


@tool
async def hangs(x: str) -> str:
    """Never returns."""
    await asyncio.Event().wait()
    return x


@tool
def blocks(x: str) -> str:
    """A sync tool that takes longer than its timeout."""
    time.sleep(1.0)
    return x


@tool
def huge(x: str) -> str:
    """Returns far more than an observation may hold."""
    return "y" * 10_000


@tool
def add(a: int, b: int) -> int:
    """Two arguments (JSON calls only)."""
    return a + b


TOOLS = {name: get_tool(name) for name in ("calc", "slow_echo", "fails", "hangs", "blocks", "huge", "add")}


# -- tools -----------------------------------------------------------------------------------------


def test_tool_declaration_and_registry():
    assert get_tool("calc").fn("123456+654321") == "777777"
    assert get_tool("add").parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    assert get_tool("slow_echo").is_async and not get_tool("fails").is_async
    assert get_tool("rl_extension.agents.tools:calc") is get_tool("calc")
    assert get_tool("calc").schema()["function"]["name"] == "calc"
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        get_tool("nope")


def test_the_benchmarks_slow_calc_is_calc_with_a_long_tailed_latency(monkeypatch):
    """benchmarks/rl/slow_calc.py (the calc demo's async rows, #47): the model's ``calc`` calls reach
    it by name and get calc's answers, after lognormal delays of median 0.3 s, sigma 1; the
    registry's own calc stays as it is."""
    spec = f"{ROOT}/benchmarks/rl/slow_calc.py:calc"
    registered = get_tool("calc")
    slow = get_tool(spec)
    assert slow.name == "calc" and slow.is_async and slow is not registered
    assert get_tool("calc") is registered and not registered.is_async
    assert slow.schema() == registered.schema()
    delay = load_script("benchmarks/rl/slow_calc.py", "slow_calc").delay
    delays = sorted(delay() for _ in range(4000))
    assert 0.27 < delays[2000] < 0.33  # the median
    assert 2.4 < delays[3960] < 3.8  # the 99th percentile: 0.3 s x e^(2.33 sigma) = 3.1 s
    monkeypatch.setenv("SLOW_CALC_MEDIAN_S", "0.001")
    fast = get_tool(spec)  # the file is read again: the median from the environment
    result = asyncio.run(call_tool(fast, {"expression": "123456+654321"}, timeout_s=5))
    assert result == ToolResult("777777")


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("calc", {"expression": "2*(3+4)"}, "14"),
        ("slow_echo", {"text": "hi"}, "hi"),
        ("add", {"a": 2, "b": 3}, "5"),
        ("calc", {"expression": "1/0"}, "error: ZeroDivisionError: division by zero"),
        ("calc", {"expression": "__import__('os')"}, "error: ValueError: only numbers"),
        ("fails", {"x": "q"}, "error: RuntimeError: bad input q"),
        ("hangs", {"x": "q"}, "error: hangs timed out after 0.2 s"),
        ("blocks", {"x": "q"}, "error: blocks timed out after 0.2 s"),
        ("calc", {"expr": "1"}, "error: calc: missing argument(s) expression"),
        ("add", {"a": 1, "b": 2, "c": 3}, "error: add: unknown argument(s) c"),
        ("calc", ["1+1"], "error: calc: arguments must be a JSON object"),
        ("missing", {}, "error: unknown tool 'missing'"),
    ],
)
def test_every_call_gives_an_observation(name, arguments, expected):
    """Raising, hanging (async and sync), bad arguments, unknown tools: a message, never an exception."""
    start = time.monotonic()
    result = asyncio.run(call_tool(TOOLS.get(name), arguments, timeout_s=0.2, name=name))
    assert result.text.startswith(expected), result.text
    assert result.error == expected.startswith("error")
    assert time.monotonic() - start < 0.9  # a timeout does not wait for the tool


# -- formats ---------------------------------------------------------------------------------------


def test_tag_format_round_trip_and_malformed_calls():
    fmt = TagFormat()
    assert fmt.parse("plain answer 42", TOOLS) == []
    call = fmt.render_call("calc", {"expression": "1+2"})
    assert call == "<call>calc 1+2</call>"
    (parsed,) = fmt.parse(f"let me see {call}", TOOLS)
    assert (parsed.name, parsed.arguments, parsed.error) == ("calc", {"expression": "1+2"}, "")
    (two,) = fmt.parse(fmt.render_call("add", {"a": 1, "b": 2}), TOOLS)
    assert two.arguments == {"a": 1, "b": 2}
    assert fmt.parse('<call>add {"a": 1,</call>', TOOLS)[0].error.startswith("arguments are not valid JSON")
    assert fmt.parse("<call>add 1 2</call>", TOOLS)[0].error == "arguments must be a JSON object"
    assert fmt.parse("<call>calc 1+", TOOLS)[-1].error == "a <call> without its </call>"
    text = "<call>calc 1+2</call><result>3</result>3"
    assert [text[a:b] for a, b in fmt.observation_spans(text)] == ["<result>3</result>"]


def test_qwen_format_is_the_chat_template_of_qwen25(tokenizer):
    """A trajectory written by the loop in the qwen format is token for token what Qwen2.5's chat
    template renders for the same conversation (the model's turns end with <|im_end|>, its eos)."""
    tokenizer = build_tiny_tokenizer(model_max_length=4096)
    tokenizer.chat_template = QWEN25_TEMPLATE
    fmt = format_for(tokenizer, "auto")
    assert isinstance(fmt, QwenFormat)
    tools = [get_tool("calc").schema()]
    user = [{"role": "user", "content": "What is 123456+654321?"}]
    prompt = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    arguments = {"expression": "123456+654321"}
    turn1 = "Let me compute.\n" + fmt.render_call("calc", arguments) + "<|im_end|>"
    (call,) = fmt.parse(turn1, TOOLS)
    assert (call.name, call.arguments) == ("calc", arguments)
    observation = fmt.observation(["777777"])
    turn2 = "The sum is 777777.<|im_end|>"
    conversation = user + [
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [{"function": {"name": "calc", "arguments": arguments}}],
        },
        {"role": "tool", "content": "777777"},
        {"role": "assistant", "content": "The sum is 777777."},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert prompt + turn1 + observation + turn2 + "\n" == rendered
    ids = tokenizer(prompt + turn1 + observation + turn2, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"][:-1]
    assert [
        (turn1 + observation + turn2)[a:b] for a, b in fmt.observation_spans(turn1 + observation + turn2)
    ] == [observation]
    bad = fmt.parse('<tool_call>\n{"name": "calc", "arguments": {"expression": \n</tool_call>', TOOLS)
    assert bad[0].error.startswith("the call is not valid JSON")
    assert fmt.parse('<tool_call>\n["calc"]\n</tool_call>', TOOLS)[0].error.startswith("a call must be")
    # Two results of one turn come back in one user turn, as the template renders consecutive tool messages.
    two = conversation[:2] + [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    rendered_two = tokenizer.apply_chat_template(two, tools=tools, tokenize=False)
    assert rendered_two.endswith(fmt.observation(["1", "2"]).removesuffix("<|im_start|>assistant\n"))


def test_final_answer_and_calc_score():
    assert final_answer("<call>calc 1+2</call><result>3</result>3") == "3"
    assert final_answer("no tool 3") == "no tool 3"
    qwen_decoded = '<tool_call>\n{"name": "calc"}\n</tool_call>\nuser\n<tool_response>\n3\n</tool_response>\nassistant\n3'
    assert final_answer(qwen_decoded) == "3"
    assert calc_score("<call>calc 1+2</call><result>3</result>3", "3") == 1.0
    assert (
        calc_score("<call>calc 1+2</call><result>3</result>", "3") == 0.0
    )  # the tool's answer is not the model's
    assert calc_score(
        "<call>calc 1+2</call><result>3</result>3", "3", tool_call_penalty=0.1
    ) == pytest.approx(0.9)


def test_demonstrations_mask_the_tool_results(tokenizer):
    text = calc_demonstration("123456+654321=", TagFormat(), tokenizer.eos_token)
    assert text == "<call>calc 123456+654321</call><|endoftext|><result>777777</result>777777"
    ids, mask = tokenize_demonstration(tokenizer, text, TagFormat())
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    masked = "".join(tokenizer.decode([i], skip_special_tokens=False) for i, m in zip(ids, mask) if not m)
    assert masked == "<result>777777</result>"


# -- the loop, on a scripted engine ------------------------------------------------------------------


class Script:
    """A fake engine: trajectory ``route`` answers its turns from ``turns[route]`` (text), in order;
    records the calls it got and when."""

    def __init__(self, tokenizer, turns: list[list[str]], delay_s: float = 0.0):
        self.tokenizer, self.turns, self.delay_s = tokenizer, turns, delay_s
        self.calls: list[list[TurnRequest]] = []
        self.seen: dict[int, int] = {}

    async def submit(self, requests):
        self.calls.append(requests)
        await asyncio.sleep(self.delay_s)
        outputs = []
        for r in requests:
            k = self.seen.get(r.route, 0)
            self.seen[r.route] = k + 1
            ids = self.tokenizer(self.turns[r.route][k], add_special_tokens=False)["input_ids"][
                : r.max_tokens
            ]
            stopped = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
            outputs.append(TurnOutput(ids, [-0.5] * len(ids), stopped))
        return [outputs]


def _run(tokenizer, turns, *, max_new_tokens=80, delay_s=0.0, max_in_flight=1, **config):
    script = Script(tokenizer, turns, delay_s)
    cfg = MultiTurnConfig(enable=True, tools=list(TOOLS), tool_timeout_s=0.3, **config)
    client = TurnClient(script.submit, world_size=1, max_in_flight=max_in_flight)
    loop = AgentLoop(client, tokenizer, TagFormat(), TOOLS, cfg)
    prompts = [tokenizer(f"q{i}=", add_special_tokens=False)["input_ids"] for i in range(len(turns))]
    trajectories = asyncio.run(
        loop.run(prompts, max_new_tokens=max_new_tokens, sampling=Sampling(), seeds=range(len(turns)))
    )
    return trajectories, script


def _text(tokenizer, ids, mask, keep):
    return "".join(tokenizer.decode([i], skip_special_tokens=False) for i, m in zip(ids, mask) if m == keep)


EOS = "<|endoftext|>"


def test_loop_masks_tool_tokens_and_ends_each_way(tokenizer):
    trajectories, script = _run(
        tokenizer,
        [
            [f"<call>calc 1+2</call>{EOS}", f"3{EOS}"],  # answer after one call
            ["<call>calc 1+1</call>" + EOS] * 5,  # never answers: max_turns
            [f"<call>fails x</call><call>calc 2+2</call>{EOS}", f"4{EOS}"],  # two calls, one fails
            ["x" * 500],  # runs out of budget in its first turn
            [f"<call>add 1 2</call>{EOS}", f"<call>nope 1</call>{EOS}", f"<call>calc 1+{EOS}", f"?{EOS}"],
        ],
        max_turns=4,
        max_new_tokens=400,
    )
    answer, turns, two, long, malformed = trajectories
    assert (answer.finish_reason, answer.num_turns, answer.num_tool_calls, answer.num_tool_errors) == (
        "answer",
        2,
        1,
        0,
    )
    assert _text(tokenizer, answer.response_ids, answer.mask, 1) == f"<call>calc 1+2</call>{EOS}3{EOS}"
    assert _text(tokenizer, answer.response_ids, answer.mask, 0) == "<result>3</result>"
    assert answer.log_probs == [-0.5 if m else 0.0 for m in answer.mask]
    assert (turns.finish_reason, turns.num_turns, turns.num_tool_calls) == ("max_turns", 4, 3)
    assert (
        _text(tokenizer, two.response_ids, two.mask, 0)
        == "<result>error: RuntimeError: bad input x</result><result>4</result>"
    )
    assert (two.num_tool_calls, two.num_tool_errors) == (2, 1)
    assert (long.finish_reason, len(long.response_ids)) == ("length", 400)
    observations = _text(tokenizer, malformed.response_ids, malformed.mask, 0)
    assert "<result>error: arguments must be a JSON object</result>" in observations  # add takes 2 arguments
    assert observations.count("<result>error:") == 3
    assert "unknown tool 'nope'" in observations and "a <call> without its </call>" in observations
    assert malformed.finish_reason == "answer" and malformed.num_tool_errors == 3
    # Turns that became pending together went out together.
    assert len(script.calls[0]) == 5


def test_oversized_and_hanging_tools_and_the_budget(tokenizer):
    (big,), _ = _run(tokenizer, [[f"<call>huge x</call>{EOS}", f"ok{EOS}"]], max_observation_tokens=16)
    assert _text(tokenizer, big.response_ids, big.mask, 0) == "<result>" + "y" * 16 + "</result>"
    (hang,), _ = _run(tokenizer, [[f"<call>hangs x</call>{EOS}", f"ok{EOS}"]])
    assert "hangs timed out after 0.3 s" in _text(tokenizer, hang.response_ids, hang.mask, 0)
    assert big.finish_reason == hang.finish_reason == "answer"
    # An observation that does not fit the budget ends the trajectory at the budget.
    (cut,), _ = _run(tokenizer, [[f"<call>huge x</call>{EOS}"]], max_new_tokens=40, max_observation_tokens=64)
    assert (cut.finish_reason, len(cut.response_ids), cut.mask[-1]) == ("length", 40, 0)


def test_lockstep_and_concurrent_give_the_same_trajectories(tokenizer):
    turns = [[f"<call>slow_echo {i}</call>{EOS}", f"{i}{EOS}"] for i in range(6)] + [[f"direct{EOS}"]]
    concurrent, _ = _run(tokenizer, turns)
    lockstep, _ = _run(tokenizer, turns, mode="lockstep")
    assert [t.response_ids for t in concurrent] == [t.response_ids for t in lockstep]
    assert [t.mask for t in concurrent] == [t.mask for t in lockstep]


def test_concurrent_turns_overlap_the_tools_of_others(tokenizer):
    """While trajectory 0 waits on its slow tool, the others go on: its wait is not everyone's."""
    # `hangs` holds trajectory 0 for the whole tool timeout (0.3 s); calc returns at once.
    turns = [[f"<call>hangs a</call>{EOS}", f"a{EOS}"]] + [[f"<call>calc 1+1</call>{EOS}", f"2{EOS}"]] * 3
    _, script = _run(tokenizer, turns, delay_s=0.02)
    calls = [sorted(r.route for r in c) for c in script.calls]
    # First all four; then the fast ones' second turns (in one call or several, as their tools
    # finished on a loaded machine), none of them waiting for trajectory 0; then 0 alone.
    assert calls[0] == [0, 1, 2, 3] and calls[-1] == [0]
    assert sorted(r for c in calls[1:-1] for r in c) == [1, 2, 3]
    _, lockstep = _run(tokenizer, turns, delay_s=0.02, mode="lockstep")
    assert [sorted(r.route for r in c) for c in lockstep.calls] == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_a_continuous_engine_gets_every_turn_as_its_own_call(tokenizer):
    """max_in_flight=0 (vLLM): no batching, each turn is sent at once and answered on its own."""
    turns = [[f"<call>slow_echo a</call>{EOS}", f"a{EOS}"]] + [[f"<call>calc 1+1</call>{EOS}", f"2{EOS}"]] * 3
    batched, _ = _run(tokenizer, turns, delay_s=0.02)
    (*alone,), script = _run(tokenizer, turns, delay_s=0.02, max_in_flight=0)
    assert [len(c) for c in script.calls] == [1] * 8
    assert [t.response_ids for t in alone] == [t.response_ids for t in batched]


def test_trajectory_batch_columns(tokenizer):
    (t0, t1), _ = _run(tokenizer, [[f"<call>calc 1+2</call>{EOS}", f"3{EOS}"], [f"7{EOS}"]])
    prompts = prompt_batch(tokenizer, ["q0=", "q1="])
    batch = trajectory_batch(prompts, [t0, t1], 48, tokenizer.pad_token_id, log_probs=True)
    width = prompts.batch["input_ids"].shape[1]
    assert batch.batch["responses"].shape == (2, 48)
    assert batch.batch["response_mask"][0, : len(t0.mask)].tolist() == t0.mask
    assert batch.batch["attention_mask"][0, width:].sum() == len(t0.response_ids)  # observations attended
    assert batch.batch["response_mask"][0].sum() < len(t0.response_ids)  # ... but not trained on
    assert torch.equal(
        batch.batch["position_ids"][:, width:] - batch.batch["position_ids"][:, width - 1 : width],
        torch.arange(1, 49).expand(2, -1),
    )
    assert (batch.batch["rollout_log_prob"] != 0).sum() == batch.batch["response_mask"].sum()
    assert batch.non_tensor_batch["num_tool_calls"].tolist() == [1, 0]
    assert batch.non_tensor_batch["finish_reason"].tolist() == ["answer", "answer"]


# -- sampling turns with transformers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = build_small_model(tmp_path_factory.mktemp("agents") / "tiny")
    return load_causal_lm(path).eval(), load_tokenizer(path)


def test_decode_turns_is_hf_generate_when_greedy(small):
    model, tokenizer = small
    texts = ["12+34=", "hello world", "abc"]
    prompts = prompt_batch(tokenizer, texts)
    ref = generate_responses(
        model, prompts, max_new_tokens=10, eos_token_ids=[1], pad_token_id=0, do_sample=False
    )
    requests = [TurnRequest(tokenizer(t)["input_ids"], 10, 0, Sampling(greedy=True)) for t in texts]
    outputs = decode_turns(model, requests, stop_token_ids=[1], pad_token_id=0)
    for out, row in zip(outputs, ref.batch["responses"]):
        assert out.token_ids == row[: len(out.token_ids)].tolist()


def test_a_turn_samples_the_same_whatever_its_batch(small):
    model, tokenizer = small
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, log_probs=True)
    ids = [tokenizer(t)["input_ids"] for t in ("12+34=", "hello world", "a")]
    alone = decode_turns(model, [TurnRequest(ids[1], 16, 42, sampling)], stop_token_ids=[1], pad_token_id=0)[
        0
    ]
    batched = decode_turns(
        model,
        [
            TurnRequest(ids[0], 5, 7, sampling),
            TurnRequest(ids[1], 16, 42, sampling),
            TurnRequest(ids[2], 9, 3, sampling),
        ],
        stop_token_ids=[1],
        pad_token_id=0,
    )
    assert batched[1].token_ids == alone.token_ids
    assert batched[1].log_probs == pytest.approx(alone.log_probs, abs=1e-4)
    assert len(batched[0].token_ids) <= 5 and len(batched[2].token_ids) <= 9
    other = decode_turns(model, [TurnRequest(ids[1], 16, 43, sampling)], stop_token_ids=[1], pad_token_id=0)[
        0
    ]
    assert other.token_ids != alone.token_ids


# -- masks: no gradient through tool tokens ------------------------------------------------------------


def test_no_gradient_through_tool_tokens(small):
    """Policy loss, KL loss and entropy of a multi-turn batch: the logits at observation positions get
    exactly zero gradient, and garbage (inf, nan) in their advantages and log-probs changes nothing."""
    model, tokenizer = small
    (t0, t1), _ = _run(
        tokenizer, [[f"<call>calc 1+2</call>{EOS}", f"3{EOS}"], [f"<call>calc 5*5</call>{EOS}", f"25{EOS}"]]
    )
    batch = trajectory_batch(prompt_batch(tokenizer, ["q0=", "q1="]), [t0, t1], 48, tokenizer.pad_token_id)
    mask = batch.batch["response_mask"]
    observation = batch.batch["attention_mask"][:, -48:].bool() & ~mask.bool()
    assert observation.sum() > 10

    def loss_and_grad(garbage: float):
        model.zero_grad()
        logits_grad = {}
        handle = model.lm_head.register_full_backward_hook(lambda m, gi, go: logits_grad.update(g=go[0]))
        log_prob, entropy = response_log_probs(model, batch, with_entropy=True)
        fill = torch.where(observation, garbage, 0.0)
        advantages = torch.ones_like(log_prob) + fill
        old = log_prob.detach() - 0.1 + fill
        ref = log_prob.detach() + 0.2 + fill
        pg, *_ = compute_policy_loss(old, log_prob, advantages, mask, 0.2, 0.2, 3.0, "token-mean")
        kl = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), mask, "token-mean")
        loss = pg - 0.01 * agg_loss(entropy, mask, "token-mean") + 0.1 * kl
        loss.backward()
        handle.remove()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return loss.detach(), grads, logits_grad["g"]

    loss, grads, logits_grad = loss_and_grad(0.0)
    # logits_to_keep = response_len + 1: position j of the kept logits predicts response token j.
    predicting = logits_grad[:, :-1]
    assert predicting[observation].abs().max() == 0.0
    assert predicting[mask.bool()].abs().sum(-1).min() > 0
    for garbage in (float("inf"), float("nan"), 1e6):
        loss2, grads2, _ = loss_and_grad(garbage)
        assert torch.equal(loss, loss2) and torch.equal(grads, grads2)
    model.zero_grad()


def test_calc_tool_in_a_json_call_too():
    (call,) = TagFormat().parse('<call>calc {"expression": "6*7"}</call>', TOOLS)
    assert asyncio.run(call_tool(TOOLS[call.name], call.arguments, timeout_s=1)).text == "42"
    assert json.loads(json.dumps(get_tool("calc").schema()))["function"]["parameters"]["required"] == [
        "expression"
    ]
