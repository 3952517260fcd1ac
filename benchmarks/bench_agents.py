"""The agent loop: concurrent trajectories against lockstep turns, with a tool that takes 50 ms.

One round is one rollout step: 16 prompts x 8 samples = 128 trajectories of up to 4 turns (up to 8
tokens each) on a 2-rank rollout group (the tiny 4-layer, 128-wide model, process backend); every
turn but the last calls ``sandbox``, an async tool that answers after 50 ms (a remote sandbox's
round trip). Rollout samples/s is 128 / the round's time. The cases, side by side:

- lockstep, one tool call at a time: turn by turn, all trajectories generate, then their calls run
  one after another (``multi_turn.mode=lockstep``, ``max_parallel_tools=1``);
- lockstep: turn by turn, a turn's calls run at once and the next turn waits for the slowest
  (``mode=lockstep``);
- concurrent: each trajectory goes at its own pace (``mode=concurrent``): while some wait on the
  tool the others' turns are generated (the default);
- concurrent, a tool that answers at once: the same turns and calls without the 50 ms, i.e. the
  generation alone, the least time any loop could take (what bounds concurrent vs lockstep).

Each engine gets its group: ``hf`` (pending turns batched into each generate call) and, where vLLM
is installed, ``vllm`` (turns join the engine's running batch as they come).

    .venv/bin/python -m pytest benchmarks/bench_agents.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

import spmdcall as sc
from rl_extension.agents import FORMATS, AgentRollout, ToolCall, ToolCallFormat, tool
from rl_extension.config import ModelConfig, MultiTurnConfig, RolloutConfig
from rl_extension.models import build_tiny_model, load_tokenizer
from rl_extension.roles import ROLLOUTS
from spmdcall.data import DataProto

PROMPTS, SAMPLES, MAX_TURNS, TOKENS_PER_TURN = 16, 8, 4, 8
TOOL_S = 0.05
ROUNDS = 3
# Issue 28: the concurrent loop at least 3x the samples/s of the lockstep loop, 128 trajectories a step.
TARGET_RATIO = 1 / 3
ENGINES = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])


@tool(description="A remote sandbox's round trip: answers after 50 ms.")
async def sandbox(code: str) -> str:
    await asyncio.sleep(TOOL_S)
    return "ok"


@tool(description="The same call answered at once.")
async def instant(code: str) -> str:
    return "ok"


class EveryTurnCalls(ToolCallFormat):
    """Every turn (the random model writes no calls) is a call of ``sandbox`` with the turn's text."""

    name = "bench_every_turn"
    tool = "sandbox"

    def parse(self, text, tools):
        return [ToolCall(self.tool, {"code": text})]

    def render_call(self, name, arguments):
        return arguments["code"]

    def observation(self, results):
        return "".join(f"<result>{r}</result>" for r in results)


class EveryTurnCallsInstant(EveryTurnCalls):
    name = "bench_every_turn_instant"
    tool = "instant"


FORMATS[EveryTurnCalls.name] = EveryTurnCalls
FORMATS[EveryTurnCallsInstant.name] = EveryTurnCallsInstant


def _rollout(engine: str, **multi_turn) -> RolloutConfig:
    multi_turn = {"tools": ["sandbox"], "format": EveryTurnCalls.name, **multi_turn}
    return RolloutConfig(
        name=engine,
        n=SAMPLES,
        max_new_tokens=MAX_TURNS * (TOKENS_PER_TURN + 16),
        kv_cache_memory_bytes=64 << 20,
        multi_turn=MultiTurnConfig(
            enable=True,
            max_turns=MAX_TURNS,
            max_tokens_per_turn=TOKENS_PER_TURN,
            **multi_turn,
        ),
    )


@pytest.fixture(scope="module", params=ENGINES)
def rollout_group(request, tmp_path_factory):
    engine = request.param
    path = build_tiny_model(tmp_path_factory.mktemp("bench_agents") / "tiny")
    worker = sc.ClassWithInitArgs(
        ROLLOUTS[engine], ModelConfig(path=path), _rollout(engine), model_path=path, tokenizer_path=path
    )
    with sc.WorkerGroup(sc.ResourcePool([2]), worker, backend="process", name=f"bench_agents_{engine}") as wg:
        yield engine, wg, load_tokenizer(path)


def _prompts(tokenizer) -> DataProto:
    texts = [f"{100000 + 7919 * i}+{300000 + 104729 * i}=" for i in range(PROMPTS)]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.full((PROMPTS, width), tokenizer.pad_token_id)
    mask = torch.zeros((PROMPTS, width), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x) :], mask[row, width - len(x) :] = torch.tensor(x), 1
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
        {"uid": np.array([f"p{i}" for i in range(PROMPTS)], dtype=object)},
    )


CASES = {
    "lockstep, one tool call at a time": {"mode": "lockstep", "max_parallel_tools": 1},
    "lockstep": {"mode": "lockstep"},
    "concurrent": {"mode": "concurrent"},
    "concurrent, a tool that answers at once": {
        "mode": "concurrent",
        "tools": ["instant"],
        "format": EveryTurnCallsInstant.name,
    },
}


BASELINES = {label: "lockstep" for label in CASES if label.startswith("concurrent")}
BASELINES["lockstep"] = "lockstep, one tool call at a time"


@pytest.mark.parametrize("label", list(CASES))
def test_agent_loop(case, rollout_group, label):
    engine, wg, tokenizer = rollout_group
    group = f"8{'ab'[ENGINES.index(engine)]}. agent loop, 128 trajectories, 50 ms tool, {engine}"
    baseline = BASELINES.get(label)
    bench = case(
        group,
        f"{engine}: {label}",
        baseline=f"{engine}: {baseline}" if baseline else None,
        target_ratio=TARGET_RATIO if label == "concurrent" else None,
    )
    agent = AgentRollout(
        wg, tokenizer, _rollout(engine, **CASES[label]), max_in_flight=ROLLOUTS[engine].TURN_CALLS_IN_FLIGHT
    )
    prompts = _prompts(tokenizer)
    out = agent.generate(prompts)  # warm-up, and a check that every trajectory used the tool
    assert out.non_tensor_batch["num_tool_calls"].min() >= 1, out.non_tensor_batch["num_tool_calls"]
    bench.extra_info["tool_calls_per_round"] = int(out.non_tensor_batch["num_tool_calls"].sum())
    bench.extra_info["group_calls_per_round"] = agent.client.num_calls
    try:
        bench.pedantic(agent.generate, args=(prompts,), rounds=ROUNDS, warmup_rounds=0)
    finally:
        agent.close()
