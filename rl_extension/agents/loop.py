"""The agent loop: one coroutine per trajectory, generate -> parse a tool call -> run the tool ->
append its result as observation tokens -> generate again, until an answer, ``max_turns`` or the
token budget.

    loop = AgentLoop(TurnClient(rollout.generate_turns, world_size=2), tokenizer, TagFormat(),
                     {"calc": get_tool("calc")}, MultiTurnConfig(enable=True, tools=["calc"]))
    trajectories = await loop.run(prompts, max_new_tokens=64, sampling=Sampling(), seeds=[...])

Concurrency (``mode="concurrent"``): every trajectory is its own asyncio task. Its turns go to a
``TurnClient``, which sends them to the rollout group as they come (``group.method.submit``, an
awaitable ``GroupFuture``) — in one call with every other turn pending at that moment when the
engine serves one call at a time (HF), or each turn in a call of its own, answered as soon as it
is done, when the engine batches continuously (vLLM, ``max_in_flight=0``). While some trajectories wait on their tools the others
generate; the tool calls of different trajectories overlap. ``mode="lockstep"`` is the comparison:
turn by turn, all trajectories generate, then all their tool calls run and the next turn waits for
the slowest.

What may run at the same time: everything here runs on one event loop (tools in a thread pool when
they are sync); a loop and its client serve one ``run`` at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_extension.agents.formats import ToolCallFormat
from rl_extension.agents.tools import Tool, ToolResult, call_tool
from rl_extension.agents.turns import Sampling, TurnOutput, TurnRequest
from rl_extension.config import MultiTurnConfig

__all__ = ["AgentLoop", "Trajectory", "TurnClient"]


class TurnClient:
    """Sends turn requests to a rollout group's ``generate_turns`` and hands each caller its output.

    Args:
        submit: ``submit(requests)`` makes the group call and returns an awaitable of one list of
            outputs per rank (``group.generate_turns.submit``).
        world_size: the group's ranks (request ``route % world_size`` is served by that rank).
        max_in_flight: calls in flight at once; the requests arriving meanwhile wait and go out
            together in the next call. 1 suits an engine that serves one batch at a time (HF).
            0: no limit and no batching, every request is a call of its own, sent at once and
            answered as soon as it is done: for an engine that batches continuously (vLLM).
    """

    def __init__(
        self,
        submit: Callable[[list[TurnRequest]], Awaitable[list[list[TurnOutput]]]],
        world_size: int,
        max_in_flight: int = 1,
    ):
        self._submit = submit
        self.world_size = world_size
        self.max_in_flight = max_in_flight
        self._pending: list[tuple[TurnRequest, asyncio.Future]] = []
        self._in_flight = 0
        self._send_scheduled = False
        self.num_calls = 0  # group calls made (a statistic)

    async def generate(self, request: TurnRequest) -> TurnOutput:
        """One turn's output (waits while the turn is batched, sent and generated)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._schedule_send()
        return await future

    def _schedule_send(self) -> None:
        # Sending on the next pass of the loop lets every task that is ready now add its request
        # first: turns that become pending together go out in one call.
        if not self._send_scheduled:
            self._send_scheduled = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._send_scheduled = False
        if not self._pending or (self.max_in_flight and self._in_flight >= self.max_in_flight):
            return
        batches = [[p] for p in self._pending] if not self.max_in_flight else [self._pending]
        self._pending = []
        for batch in batches:
            self._in_flight += 1
            self.num_calls += 1
            asyncio.ensure_future(self._call(batch))

    async def _call(self, batch: list[tuple[TurnRequest, asyncio.Future]]) -> None:
        try:
            per_rank = await self._submit([request for request, _ in batch])
        except BaseException as exc:  # the group call failed: every turn in it fails alike
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            served = [iter(outputs) for outputs in per_rank]
            for request, future in batch:
                if not future.done():
                    future.set_result(next(served[request.route % self.world_size]))
        finally:
            self._in_flight -= 1
            self._schedule_send()


@dataclass
class Trajectory:
    """One prompt's conversation with its tools, as tokens.

    ``response_ids`` holds every token after the prompt: the model's turns (``mask`` 1) and the
    observations between them (``mask`` 0). ``finish_reason`` is ``answer`` (a turn without a
    call), ``max_turns`` (the last allowed turn still called a tool) or ``length`` (the token
    budget ran out).
    """

    prompt_ids: list[int]
    seed: int
    route: int = 0
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token: the policy version of its turn
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    finish_reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)


class AgentLoop:
    """Runs trajectories against a ``TurnClient`` and a set of tools.

    Args:
        client: where turns are generated.
        tokenizer: decodes turns, encodes observations.
        fmt: the tool-call format.
        tools: name -> Tool, the tools the model may call.
        config: max turns, observation length, tool timeout, parallel tools, mode.
    """

    def __init__(
        self,
        client: TurnClient,
        tokenizer: Any,
        fmt: ToolCallFormat,
        tools: dict[str, Tool],
        config: MultiTurnConfig,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.tools = tools
        self.config = config
        self._tool_slots: asyncio.Semaphore | None = None

    async def run(
        self,
        prompts: Sequence[list[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        seeds: Sequence[int],
    ) -> list[Trajectory]:
        """Run one trajectory per prompt; returns them in the prompts' order.

        Args:
            prompts: prompt token ids, unpadded.
            max_new_tokens: the budget of each response, tool observations included.
            sampling: how turns are sampled.
            seeds: one per prompt; turn k of trajectory i samples with a seed derived from seeds[i] and k.
        """
        limit = self.config.max_parallel_tools
        self._tool_slots = asyncio.Semaphore(limit) if limit else None
        # Routes spread the trajectories over the ranks; a trajectory keeps its rank from turn to
        # turn (an engine with a prefix cache then finds the trajectory's earlier turns there).
        trajectories = [
            Trajectory(list(p), seed=int(s), route=i) for i, (p, s) in enumerate(zip(prompts, seeds))
        ]
        if self.config.mode == "lockstep":
            await self._run_lockstep(trajectories, max_new_tokens, sampling)
        else:
            await asyncio.gather(*(self._run_one(t, max_new_tokens, sampling) for t in trajectories))
        return trajectories

    async def _run_one(self, t: Trajectory, max_new_tokens: int, sampling: Sampling) -> None:
        while not t.done:
            calls = self._add_turn(t, await self._generate(t, max_new_tokens, sampling), max_new_tokens)
            if calls:
                self._add_observation(t, await self._run_tools(calls), max_new_tokens)

    async def _run_lockstep(
        self, trajectories: list[Trajectory], max_new_tokens: int, sampling: Sampling
    ) -> None:
        active = list(trajectories)
        while active:
            outputs = await asyncio.gather(*(self._generate(t, max_new_tokens, sampling) for t in active))
            calls = [self._add_turn(t, out, max_new_tokens) for t, out in zip(active, outputs)]
            results = await asyncio.gather(
                *(self._run_tools(c) for c in calls)
            )  # the turn waits for its slowest
            for t, c, r in zip(active, calls, results):
                if c:
                    self._add_observation(t, r, max_new_tokens)
            active = [t for t in active if not t.done]

    # -- one turn ----------------------------------------------------------------------------

    def _generate(self, t: Trajectory, max_new_tokens: int, sampling: Sampling) -> Awaitable[TurnOutput]:
        budget = max_new_tokens - len(t.response_ids)
        if self.config.max_tokens_per_turn:
            budget = min(budget, self.config.max_tokens_per_turn)
        request = TurnRequest(
            token_ids=t.prompt_ids + t.response_ids,
            max_tokens=budget,
            seed=_turn_seed(t.seed, t.num_turns),
            sampling=sampling,
            route=t.route,
        )
        return self.client.generate(request)

    def _add_turn(self, t: Trajectory, out: TurnOutput, max_new_tokens: int) -> list:
        """Append a generated turn; return the tool calls to run (none when the trajectory ends here)."""
        t.response_ids += out.token_ids
        t.mask += [1] * len(out.token_ids)
        t.log_probs += out.log_probs or [0.0] * len(out.token_ids)
        t.versions += [out.policy_version] * len(out.token_ids)
        t.num_turns += 1
        calls = self.fmt.parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=False), self.tools)
        if not out.stopped and len(t.response_ids) >= max_new_tokens:
            t.finish_reason = "length"
        elif not calls:
            t.finish_reason = "answer" if out.stopped else "length"
        elif t.num_turns >= self.config.max_turns:
            t.finish_reason = "max_turns"
        else:
            t.num_tool_calls += len(calls)
            return calls
        return []

    async def _run_tools(self, calls: list) -> list[ToolResult]:
        return list(await asyncio.gather(*(self._run_tool(c) for c in calls)))

    async def _run_tool(self, call) -> ToolResult:
        if call.error:
            return ToolResult(f"error: {call.error}", True)
        async with self._tool_slots or contextlib.nullcontext():
            return await call_tool(
                self.tools.get(call.name),
                call.arguments,
                timeout_s=self.config.tool_timeout_s,
                name=call.name,
            )

    def _add_observation(self, t: Trajectory, results: list[ToolResult], max_new_tokens: int) -> None:
        t.num_tool_errors += sum(r.error for r in results)
        texts = [self._truncate(r.text) for r in results]
        ids = self.tokenizer(self.fmt.observation(texts), add_special_tokens=False)["input_ids"]
        room = max_new_tokens - len(t.response_ids)
        if len(ids) >= room:  # no room left for the model to answer
            ids, t.finish_reason = ids[:room], "length"
        t.response_ids += ids
        t.mask += [0] * len(ids)
        t.log_probs += [0.0] * len(ids)
        t.versions += t.versions[-1:] * len(ids)  # an observation carries the version of the turn that called

    def _truncate(self, text: str) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.config.max_observation_tokens
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit])


def _turn_seed(seed: int, turn: int) -> int:
    return (seed * 1_000_003 + turn * 7919) % (1 << 62)
