"""specrl inside veRL (volcengine/verl) with the SGLang rollout.

Why: veRL launches SGLang itself from `actor_rollout_ref.rollout.engine_kwargs.sglang`, returns
one `AgentLoopOutput` per trajectory (with a free-form `extra_fields` dict), and syncs the policy
into the rollout through `update_weights(weights: Generator[(name, tensor)], **kwargs)`. specrl
needs one hook at each of those places, and nothing else in veRL:

- `engine_kwargs` / `hydra_overrides`: the EAGLE-3 server arguments, derived by
  `rollout.sglang_engine.sglang_server_args` from specrl's SpecConfig (model_path left to
  veRL's `actor_rollout_ref.model.path`).
- `spec_extra_fields` / `merge_extra_fields` / `spec_metrics`: SGLang's per-request counters,
  read by `parse_spec_meta`, carried in `AgentLoopOutput.extra_fields` (summed over the turns of
  a multi-turn loop) and reduced to `rollout/spec_accept_length` and `rollout/spec_accept_rate`.
- `DraftCarryingWeightSync`: wraps the rollout's weight update. The policy stream is checked
  name by name (`check_policy_sync`: no draft tensor may ride along; names the draft shares are
  refused unless the update is isolated with `disable_draft_model`), then the freshest draft is
  pushed with `SGLangEngine.push_draft`, so every sync leaves the engine with the current policy
  *and* the current draft.

Names used: `engine_kwargs.sglang.<ServerArgs field>` hydra overrides and
`AgentLoopOutput.extra_fields` as in veRL's agent loop (verl/experimental/agent_loop), and the
`update_weights(self, weights, **kwargs)` signature of veRL's rollout classes; see
docs/integrations/verl.md for what could not be run here.
"""
from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

from rollout.sglang_engine import check_policy_sync, parse_spec_meta, sglang_server_args
from rollout.speculative import SpecConfig

EXTRA_KEYS = ("spec_verify_ct", "spec_accepted_drafts", "spec_proposed_drafts", "spec_completion_tokens")
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
    """Counters for AgentLoopOutput.extra_fields (empty when SGLang did not speculate)."""
    stats = parse_spec_meta(meta_info)
    if stats is None:
        return {}
    return {"spec_verify_ct": stats.verify_steps, "spec_accepted_drafts": stats.accepted,
            "spec_proposed_drafts": stats.drafted,
            "spec_completion_tokens": int((meta_info or {}).get("completion_tokens") or 0)}


def merge_extra_fields(extra: Mapping, turn: Mapping) -> dict:
    """extra_fields after one more turn of a multi-turn agent loop (counters add up)."""
    out = dict(extra)
    for k in EXTRA_KEYS:
        if k in turn:
            out[k] = out.get(k, 0) + turn[k]
    return out


def spec_metrics(extra_fields: Iterable[Mapping]) -> dict:
    """Batch metrics from the trajectories' extra_fields (those without counters are skipped)."""
    rows = [e for e in extra_fields if "spec_verify_ct" in e]
    verify = sum(e["spec_verify_ct"] for e in rows)
    accepted = sum(e["spec_accepted_drafts"] for e in rows)
    drafted = sum(e["spec_proposed_drafts"] for e in rows)
    return {"rollout/spec_accept_length": (accepted + verify) / verify if verify else 0.0,
            "rollout/spec_accept_rate": accepted / drafted if drafted else 0.0,
            "rollout/spec_verify_steps": verify}


def guarded_policy_stream(weights: Iterable, *, isolated: bool) -> Iterator:
    """Yield the policy's (name, tensor) pairs, refusing any the draft would load (checked before
    the tensor is handed on, so nothing reaches the engine past the first offending name)."""
    for name, tensor in weights:
        check_policy_sync([name], isolated=isolated)
        yield name, tensor


class DraftCarryingWeightSync:
    """Wrap a veRL rollout's `update_weights` so the policy sync never touches the draft and the
    newest draft follows every sync.

        sync = DraftCarryingWeightSync(rollout.update_weights, engine, latest_draft, isolated=True)
        await sync.update_weights(weights, **kwargs)     # where veRL calls rollout.update_weights

    `latest_draft()` returns (draft or its SGLang-named tensors, version) or None; it is pushed
    after the policy when its version is new. `isolated` says the wrapped update sends
    `disable_draft_model` (SGLang then loads it into the target runner only)."""

    def __init__(self, update_policy: Callable[..., Awaitable | None], engine, latest_draft: Callable[[], tuple | None],
                 *, isolated: bool):
        self.update_policy, self.engine, self.latest_draft = update_policy, engine, latest_draft
        self.isolated = isolated
        self.pushed_version: int | None = None
        self.log: list[str] = []

    async def update_weights(self, weights, **kwargs) -> None:
        result = self.update_policy(guarded_policy_stream(weights, isolated=self.isolated), **kwargs)
        if inspect.isawaitable(result):
            await result
        self.log.append("policy")
        latest = self.latest_draft()
        if latest is not None and latest[1] != self.pushed_version:
            draft, version = latest
            self.engine.push_draft(draft, version)
            self.pushed_version = version
            self.log.append(f"draft-{version}")

