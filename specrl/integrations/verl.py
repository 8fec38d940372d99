"""specrl inside veRL (volcengine/verl 0.9.1) with the SGLang rollout, in veRL's own terms.

Why: veRL launches SGLang itself from `actor_rollout_ref.rollout.engine_kwargs.sglang`, returns
one `AgentLoopOutput` per trajectory (with a free-form `extra_fields` dict), and syncs the policy
into the rollout through `update_weights(weights, **kwargs)`. specrl needs one hook at each of
those places, and nothing else in veRL:

- `engine_kwargs` / `hydra_overrides`: the EAGLE-3 server arguments, derived by
  `rollout.sglang_args.sglang_server_args` from specrl's SpecConfig (model_path left to
  veRL's `actor_rollout_ref.model.path`).
- `spec_extra_fields` / `merge_extra_fields` / `spec_metrics`: veRL 0.9.1 already carries
  speculative counters in `extra_fields` under `SPEC_DECODE_EXTRA_KEYS` (`spec_num_draft_tokens`,
  `spec_num_accepted_tokens`, `spec_num_verify_steps`), adds them up over the turns of a
  multi-turn loop, and logs `rollout/spec_accept_rate` and `rollout/spec_accept_length` as
  per-request means (`verl.trainer.ppo.ray_trainer.compute_spec_decode_metrics`). specrl fills
  the same keys with the same meaning, read by `parse_spec_meta` from whatever names the SGLang
  version reports (veRL 0.9.1's own SGLang server reads `spec_accept_token_num` /
  `spec_draft_token_num`, which sglang 0.5.23 no longer sends), and logs its token-weighted
  figures under `rollout/specrl_*` names that do not collide with veRL's.
- `TargetRoutedEngine` + `DraftCarryingWeightSync`: veRL 0.9.1's SGLang adapter
  (`AsyncHttpServerAdapter.update_weights_from_tensor`) sends `serialized_named_tensors`,
  `load_format` and `flush_cache` only, so on sglang 0.5.23 its policy sync has selector "all"
  and reaches the draft. `TargetRoutedEngine` wraps the rollout's adapter so the sync is sent with
  `selector="target"` inside a begin/end session; the wrapper then pushes the freshest draft with
  `SGLangEngine.push_draft` (selector "draft"), so every sync leaves the engine with the current
  policy *and* the current draft.

Checked against the installed verl 0.9.1 in the verl lane (tests/test_upstream_verl.py); verl's
`AsyncHttpServerAdapter` itself imports sglang, so the wrapper is tested against a stand-in with
its `_make_async_request` method (tests/test_verl_contract.py). See docs/integrations/verl.md.
"""
from __future__ import annotations

import base64
import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

from rollout.protocol import accept_length
from rollout.sglang_args import sglang_server_args
from rollout.sglang_meta import parse_spec_meta
from rollout.sglang_weights import check_policy_sync
from rollout.drafters import SpecConfig

# veRL 0.9.1's names (verl.experimental.agent_loop.tool_agent_loop.SPEC_DECODE_EXTRA_KEYS)
EXTRA_KEYS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_steps")
OVERRIDE_PREFIX = "+actor_rollout_ref.rollout.engine_kwargs.sglang."


def engine_kwargs(draft_path: str, spec: SpecConfig, *, algorithm: str = "EAGLE3", cpu_backup: bool = True,
                  extra: Mapping | None = None) -> dict:
    """`actor_rollout_ref.rollout.engine_kwargs` for SGLang with specrl's draft."""
    args = sglang_server_args("<set by actor_rollout_ref.model.path>", draft_path, spec, algorithm=algorithm,
                              cpu_backup=cpu_backup, extra=extra)
    args.pop("model_path")
    return {"sglang": args}


def hydra_overrides(kwargs: Mapping) -> list[str]:
    """Command-line overrides for veRL's hydra config (`+` adds keys the default config lacks)."""
    out = []
    for key, value in kwargs["sglang"].items():
        text = "true" if value is True else "false" if value is False else str(value)
        out.append(f"{OVERRIDE_PREFIX}{key}={text}")
    return out


def spec_extra_fields(meta_info: Mapping | None) -> dict:
    """veRL's counters for AgentLoopOutput.extra_fields (empty when SGLang did not speculate):
    draft tokens proposed, draft tokens accepted, verify steps of one request."""
    stats = parse_spec_meta(meta_info)
    if stats is None:
        return {}
    return {"spec_num_draft_tokens": stats.drafted, "spec_num_accepted_tokens": stats.accepted,
            "spec_num_verify_steps": stats.verify_steps}


def merge_extra_fields(extra: Mapping, turn: Mapping) -> dict:
    """extra_fields after one more turn of a multi-turn agent loop (counters add up, as veRL's
    ToolAgentLoop does)."""
    out = dict(extra)
    for k in EXTRA_KEYS:
        if k in turn:
            out[k] = int(out.get(k, 0)) + int(turn[k])
    return out


def spec_metrics(extra_fields: Iterable[Mapping]) -> dict:
    """Batch metrics from the trajectories' extra_fields.

    `rollout/spec_accept_rate` and `rollout/spec_accept_length` have veRL's meaning: per-request
    ratios averaged over requests (a request with a zero denominator counts as 0.0), equal to
    veRL's `compute_spec_decode_metrics` on the same requests. `rollout/specrl_*` are specrl's
    token-weighted figures (totals over the batch), which long responses dominate. Requests
    without counters are left out; a request with only some of the three is refused."""
    rows = []
    for e in extra_fields:
        present = [k for k in EXTRA_KEYS if k in e]
        if present and len(present) != len(EXTRA_KEYS):
            raise ValueError(f"extra_fields has {present} but not all of {EXTRA_KEYS}")
        if present:
            rows.append(tuple(int(e[k]) for k in EXTRA_KEYS))
    if not rows:
        return {}
    n = len(rows)
    drafted, accepted, verify = (sum(col) for col in zip(*rows))
    return {"rollout/spec_accept_rate": sum(a / d if d > 0 else 0.0 for d, a, _ in rows) / n,
            "rollout/spec_accept_length": sum(accept_length(a, v) for _, a, v in rows) / n,
            "rollout/specrl_accept_rate_token_weighted": accepted / drafted if drafted else 0.0,
            "rollout/specrl_accept_length_token_weighted": accept_length(accepted, verify),
            "rollout/specrl_verify_steps": verify}


def guarded_policy_stream(weights: Iterable, *, isolated: bool) -> Iterator:
    """Yield the policy's (name, tensor) pairs, refusing any the draft would load (checked before
    the tensor is handed on, so nothing reaches the engine past the first offending name)."""
    for name, tensor in weights:
        check_policy_sync([name], isolated=isolated)
        yield name, tensor


class TargetRoutedEngine:
    """Wraps veRL 0.9.1's `AsyncHttpServerAdapter` (an SGLang rollout's `_engine`) so the policy
    sync reaches the target runner only: every `update_weights_from_tensor` carries
    `selector="target"`, and `begin`/`end` open and close the weight-update session sglang 0.5.23
    requires. Everything else is delegated to the wrapped adapter.

        rollout._engine = TargetRoutedEngine(rollout._engine)      # once, after veRL builds it
    """

    def __init__(self, engine):
        self._inner = engine

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def update_weights_from_tensor(self, req):
        body = {"serialized_named_tensors": [base64.b64encode(t).decode("ascii") if isinstance(t, bytes) else t
                                             for t in req.serialized_named_tensors],
                "load_format": req.load_format, "flush_cache": req.flush_cache, "selector": "target"}
        return await self._inner._make_async_request("update_weights_from_tensor", body)

    async def begin(self):
        return _ok(await self._inner._make_async_request("begin_weight_update", {"selector": "target"}), "begin")

    async def end(self):
        return _ok(await self._inner._make_async_request("end_weight_update", {}), "end")


def _ok(reply, what: str):
    if isinstance(reply, Mapping) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {what}_weight_update failed: {reply.get('message')}")
    return reply


class DraftCarryingWeightSync:
    """Wrap a veRL rollout's `update_weights` so the policy sync never touches the draft and the
    newest draft follows every sync.

        rollout._engine = routed = TargetRoutedEngine(rollout._engine)
        sync = DraftCarryingWeightSync(rollout.update_weights, engine, latest_draft, routed=routed)
        await sync.update_weights(weights, **kwargs)     # where veRL calls rollout.update_weights

    `latest_draft()` returns (draft or its SGLang-named tensors, version) or None; it is pushed
    after the policy when its version is new. With `routed` (a TargetRoutedEngine) the policy
    sync runs inside a selector="target" session; without it the sync is un-routed and every name
    the EAGLE-3 loader would take into the draft is refused before it reaches the engine."""

    def __init__(self, update_policy: Callable[..., Awaitable | None], engine, latest_draft: Callable[[], tuple | None],
                 *, routed: TargetRoutedEngine | None = None):
        self.update_policy, self.engine, self.latest_draft = update_policy, engine, latest_draft
        self.routed = routed
        self.pushed_version: int | None = None
        self.log: list[str] = []

    async def update_weights(self, weights, **kwargs) -> None:
        stream = guarded_policy_stream(weights, isolated=self.routed is not None)
        if self.routed is not None:
            await self.routed.begin()
        try:
            result = self.update_policy(stream, **kwargs)
            if inspect.isawaitable(result):
                await result
        finally:
            if self.routed is not None:
                await self.routed.end()
        self.log.append("policy")
        latest = self.latest_draft()
        if latest is not None and latest[1] != self.pushed_version:
            draft, version = latest
            self.engine.push_draft(draft, version)
            self.pushed_version = version
            self.log.append(f"draft-{version}")
