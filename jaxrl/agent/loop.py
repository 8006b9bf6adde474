"""The multi-turn rollout: the model generates, its tool calls run, the results go back through the chat template,
until a turn makes no call, a turn limit is reached or the response token budget is spent (verl's tool agent loop,
on any :class:`jaxrl.rollout.base.RolloutEngine`).

Each turn re-prefills every unfinished conversation (prompt + everything so far) through ``engine.generate``: the
engine's KV cache is not kept between turns (``multi_turn/prefill_tokens`` counts what that costs). Every turn
asks the engine for the full budget ``R`` of new tokens (one compiled shape per prompt-width bucket, not one per
remaining budget) and keeps what fits; the sampler stops when every row has hit a stop token. One response
row ``[R]`` holds all turns back to back: model tokens (``response_mask`` 1, their rollout log-probs) and the
tool / user tokens between them (mask 0, log-prob 0), so only model tokens are trained.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from jaxrl.agent.chat import ChatCodec, as_messages
from jaxrl.agent.tool_parser import parse_tool_calls
from jaxrl.agent.tools import Tool, ToolResult
from jaxrl.rollout.base import RolloutOutput, SamplingParams

_PROMPT_BUCKET = 32


@dataclass(frozen=True)
class MultiTurnSettings:
    """``actor_rollout_ref.rollout.multi_turn``: limits of one conversation.

    Attributes:
      max_assistant_turns: model turns per response; None = only the token budget limits them.
      max_user_turns: environment (user) messages per response; None = unlimited (token budget).
      max_parallel_calls: tool calls run per model turn (further calls get an error message).
      max_tool_response_length: characters of one tool result kept (longer ones are cut).
      tool_response_truncate_side: ``"left"`` keeps the start, ``"right"`` the end, ``"middle"`` both ends.
      format: the tool-call format (``"hermes"``).
    """

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters on ``side`` (verl's ``tool_response_truncate_side``)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


@dataclass
class _Row:
    ctx: list[int]  # prompt + response so far: what the next turn prefills
    prompt_len: int
    row: dict
    env: object = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0
    finish: str = ""
    done: bool = False


@dataclass
class MultiTurnOutput:
    """A multi-turn rollout: ``output`` (as any engine's, ``R == max_new_tokens``), ``env_rewards`` ``[N]`` float32
    (summed environment rewards, 0 without an environment) and ``metrics`` (``multi_turn/*``)."""

    output: RolloutOutput
    env_rewards: np.ndarray
    metrics: dict[str, float]


class AgentLoop:
    """Runs multi-turn rollouts with tools (and optionally an environment) on a rollout engine.

    Args:
      engine: a :class:`~jaxrl.rollout.base.RolloutEngine`; it must accept prompts up to
        ``max_prompt_length + max_new_tokens`` tokens (the conversation so far). Its ``eos_token_ids`` (when it has
        them) and the params' ``stop_token_ids`` tell a finished turn.
      tokenizer: the policy's Hugging Face tokenizer (chat template, decode).
      tools: the tools the model may call (:mod:`jaxrl.agent.tool_config`).
      settings: :class:`MultiTurnSettings`.
      max_prompt_length: longest first prompt (with the tool schemas) in tokens.
      env_factory: ``None`` or a callable giving a fresh :class:`jaxrl.agent.env.Environment` per row.
      pad_token_id: pads the output arrays (default: the tokenizer's).
    """

    def __init__(self, engine, tokenizer, tools: list[Tool], settings: MultiTurnSettings, *,
                 max_prompt_length: int, env_factory=None, pad_token_id: int | None = None):
        self.engine = engine
        self.tok = tokenizer
        self.tools = {t.name: t for t in tools}
        self.settings = settings
        self.max_prompt_length = int(max_prompt_length)
        self.env_factory = env_factory
        self.pad = int(tokenizer.pad_token_id if pad_token_id is None else pad_token_id)
        self.codec = ChatCodec(tokenizer, [t.schema for t in tools])
        eos = getattr(engine, "eos_token_ids", None)
        if eos is None:
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.eos_ids = {int(e) for e in eos}

    def first_prompts(self, rows: list[dict], prompt_key: str) -> list[list[int]]:
        """The first prompt ids of each row (its ``prompt_key`` messages + the tools).

        Raises:
          ValueError: a prompt that is not chat messages, or one longer than ``max_prompt_length`` with the tools
            (names the row and the lengths).
        """
        out = []
        for i, r in enumerate(rows):
            ids = self.codec.prompt_ids(as_messages(r.get(prompt_key)))
            if len(ids) > self.max_prompt_length:
                raise ValueError(f"prompt {i} has {len(ids)} tokens with the tool schemas, more than "
                                 f"data.max_prompt_length={self.max_prompt_length}; raise it or shorten the prompts")
            out.append(ids)
        return out

    def run(self, rows: list[dict], params: SamplingParams, *, prompt_key: str = "prompt",
            rng_seed: int | None = None) -> MultiTurnOutput:
        """``params.n`` multi-turn responses for each data row.

        Args:
          rows: the data rows (``rows[i][prompt_key]``: a string or chat messages).
          params: sampling settings; ``max_new_tokens`` is the response budget ``R`` over all turns (model and
            tool tokens together).
          rng_seed: the round's seed (default ``params.seed``); turn ``t`` samples with ``seed + t``.

        Returns:
          :class:`MultiTurnOutput`: ``prompt_ids`` ``[N, P]`` (left-padded, ``P`` the longest first prompt rounded
          up to 32), ``response_ids`` / ``response_mask`` / ``rollout_log_probs`` ``[N, R]``,
          ``response_attention_mask`` ``[N, R]`` (1 on model and tool / user tokens: what the trainer's forward
          attends to), ``prompt_index`` ``[N]`` (rows ``i*n .. i*n+n-1`` from row ``i``).
        """
        n, budget = params.n, params.max_new_tokens
        seed = params.seed if rng_seed is None else int(rng_seed)
        prompts = self.first_prompts(rows, prompt_key)
        states = []
        for i, p in enumerate(prompts):
            for _ in range(n):
                env = None
                if self.env_factory is not None:
                    env = self.env_factory()
                    env.reset(rows[i])
                states.append(_Row(ctx=list(p), prompt_len=len(p), row=rows[i], env=env))
        turn_params = dataclasses.replace(params, n=1)
        stops = self.eos_ids | set(params.stop_token_ids)
        m = {"gen_calls": 0, "prefill_tokens": 0, "tool_time_s": 0.0, "tool_wall_s": 0.0, "gen_s": 0.0}
        turn = 0
        while True:
            active = [s for s in states if not s.done]
            if not active:
                break
            t0 = time.perf_counter()
            out = self.engine.generate([s.ctx for s in active], turn_params,
                                       rng_seed=(seed + turn) % 2**32)
            m["gen_s"] += time.perf_counter() - t0
            m["gen_calls"] += 1
            m["prefill_tokens"] += sum(len(s.ctx) for s in active)
            turn += 1
            pending = []  # (state, calls)
            for k, s in enumerate(active):
                valid = out.response_mask[k].astype(bool)
                gen = out.response_ids[k][valid].tolist()
                lp = out.rollout_log_probs[k][valid].tolist()
                room = budget - len(s.ids)
                gen, lp = gen[:room], lp[:room]
                self._append(s, gen, 1, lp)
                s.assistant_turns += 1
                stopped = bool(gen) and gen[-1] in stops
                if len(s.ids) >= budget or not stopped:
                    self._finish(s, "budget")
                    continue
                text = self.tok.decode(gen[:-1], skip_special_tokens=False)
                _, calls = parse_tool_calls(text, self.settings.format)
                limit = self.settings.max_assistant_turns
                if not calls and s.env is None:
                    self._finish(s, "no_call")
                elif limit is not None and s.assistant_turns >= limit:
                    self._finish(s, "turn_limit")  # verl: no tool runs after the last allowed model turn
                elif calls:
                    pending.append((s, calls, gen[-1]))
                else:
                    self._env_step(s, text, gen[-1], budget)
            if pending:
                t0 = time.perf_counter()
                results = self._run_tools([c for _, calls, _ in pending for c in
                                           calls[: self.settings.max_parallel_calls]])
                m["tool_wall_s"] += time.perf_counter() - t0
                it = iter(results)
                for s, calls, last in pending:
                    msgs = []
                    for j, call in enumerate(calls):
                        if j < self.settings.max_parallel_calls:
                            res = next(it)
                            s.tool_calls += 1
                            s.tool_errors += int(res.error)
                            m["tool_time_s"] += res.seconds
                        else:
                            res = ToolResult(f"Error: at most {self.settings.max_parallel_calls} tool calls per "
                                             "turn; this call was not run.", error=True)
                            s.tool_errors += 1
                        text = truncate_text(res.text, self.settings.max_tool_response_length,
                                             self.settings.tool_response_truncate_side)
                        msgs.append({"role": "tool", "content": text})
                    self._append_observation(s, self.codec.turn_ids(msgs, last), budget)
        return MultiTurnOutput(self._arrays(states, n, budget), np.asarray([s.env_reward for s in states],
                                                                            np.float32), self._metrics(states, m))

    # ------------------------------------------------------------------ helpers
    def _append(self, s: _Row, ids: list[int], mask: int, logp: list[float] | None = None) -> None:
        s.ids += ids
        s.ctx += ids
        s.mask += [mask] * len(ids)
        s.logp += logp if logp is not None else [0.0] * len(ids)

    def _append_observation(self, s: _Row, ids: list[int], budget: int) -> None:
        room = budget - len(s.ids)
        self._append(s, ids[:room], 0)
        if len(ids) >= room:  # no room left for another model token
            self._finish(s, "budget")

    def _finish(self, s: _Row, reason: str) -> None:
        s.done, s.finish = True, reason

    def _env_step(self, s: _Row, text: str, last: int, budget: int) -> None:
        obs, reward, done = s.env.step(text)
        s.env_reward += float(reward)
        limit = self.settings.max_user_turns
        if done:
            self._finish(s, "env_done")
        elif limit is not None and s.user_turns >= limit:
            self._finish(s, "turn_limit")
        else:
            s.user_turns += 1
            self._append_observation(s, self.codec.turn_ids([{"role": "user", "content": str(obs)}], last), budget)

    def _run_one(self, call) -> ToolResult:
        t0 = time.perf_counter()
        if call.error is not None:
            res = ToolResult(f"Error: {call.error}", error=True)
        elif call.name not in self.tools:
            res = ToolResult(f"Error: no tool named {call.name!r}; available: {', '.join(self.tools)}", error=True)
        else:
            try:
                res = self.tools[call.name].execute(call.arguments)
            except Exception as e:  # a user tool's bug must not end the run: the model sees the error
                res = ToolResult(f"Error: tool {call.name} failed: {type(e).__name__}: {e}", error=True)
        res.seconds = time.perf_counter() - t0
        return res

    def _run_tools(self, calls) -> list[ToolResult]:
        if len(calls) <= 1:
            return [self._run_one(c) for c in calls]
        with ThreadPoolExecutor(max_workers=min(8, len(calls))) as pool:
            return list(pool.map(self._run_one, calls))

    def _arrays(self, states: list[_Row], n: int, budget: int) -> RolloutOutput:
        rows = len(states)
        longest = max(s.prompt_len for s in states)
        width = -(-longest // _PROMPT_BUCKET) * _PROMPT_BUCKET
        prompt_ids = np.full((rows, width), self.pad, np.int32)
        prompt_mask = np.zeros((rows, width), np.int32)
        ids = np.full((rows, budget), self.pad, np.int32)
        mask = np.zeros((rows, budget), np.int32)
        logp = np.zeros((rows, budget), np.float32)
        attn = np.zeros((rows, budget), np.int32)
        for i, s in enumerate(states):
            prompt_ids[i, width - s.prompt_len:] = s.ctx[: s.prompt_len]
            prompt_mask[i, width - s.prompt_len:] = 1
            k = len(s.ids)
            ids[i, :k], mask[i, :k], logp[i, :k], attn[i, :k] = s.ids, s.mask, s.logp, 1
        index = np.repeat(np.arange(rows // n, dtype=np.int32), n)
        return RolloutOutput(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=mask,
                             rollout_log_probs=logp, prompt_index=index, response_attention_mask=attn)

    def _metrics(self, states: list[_Row], m: dict) -> dict[str, float]:
        turns = np.asarray([s.assistant_turns for s in states], np.float32)
        calls = np.asarray([s.tool_calls for s in states], np.float32)
        out = {
            "multi_turn/num_turns/mean": float(turns.mean()), "multi_turn/num_turns/max": float(turns.max()),
            "multi_turn/num_turns/min": float(turns.min()),
            "multi_turn/user_turns/mean": float(np.mean([s.user_turns for s in states])),
            "multi_turn/tool_calls": float(calls.sum()), "multi_turn/tool_calls/mean": float(calls.mean()),
            "multi_turn/tool_errors": float(sum(s.tool_errors for s in states)),
            "multi_turn/tool_time_s": float(m["tool_time_s"]), "multi_turn/tool_wall_s": float(m["tool_wall_s"]),
            "multi_turn/gen_calls": float(m["gen_calls"]), "multi_turn/prefill_tokens": float(m["prefill_tokens"]),
            "multi_turn/gen_s": float(m["gen_s"]),
        }
        for reason in ("no_call", "turn_limit", "budget", "env_done"):
            out[f"multi_turn/finish/{reason}"] = float(sum(s.finish == reason for s in states))
        return out


def build_agent_loop(mt_cfg, engine, tokenizer, *, max_prompt_length: int) -> AgentLoop:
    """The :class:`AgentLoop` of a run's ``actor_rollout_ref.rollout.multi_turn`` section.

    Raises:
      FileNotFoundError: no tool-config file at ``tool_config_path``.
      jaxrl.agent.tool_config.ToolConfigError: a bad tool-config YAML or ``env_class``.
      jaxrl.sandbox.SandboxUnavailableError: a Python tool and no working bubblewrap.
    """
    from jaxrl.agent.tool_config import load_env_class, load_tools

    tools = load_tools(mt_cfg.tool_config_path) if mt_cfg.tool_config_path else []
    env_factory = None
    if mt_cfg.env_class:
        cls = load_env_class(mt_cfg.env_class)
        env_config = dict(mt_cfg.env_config or {})
        env_factory = lambda: cls(env_config)  # noqa: E731
    settings = MultiTurnSettings(
        max_assistant_turns=mt_cfg.max_assistant_turns, max_user_turns=mt_cfg.max_user_turns,
        max_parallel_calls=mt_cfg.max_parallel_calls, max_tool_response_length=mt_cfg.max_tool_response_length,
        tool_response_truncate_side=mt_cfg.tool_response_truncate_side, format=mt_cfg.format,
    )
    return AgentLoop(engine, tokenizer, tools, settings, max_prompt_length=max_prompt_length,
                     env_factory=env_factory)
