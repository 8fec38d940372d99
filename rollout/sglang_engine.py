"""SGLang backend for the rollout protocol, with an EAGLE-3 draft that specrl keeps training.

Why this module exists: at scale, rollout runs in SGLang, not in the embedded engine. specrl then
needs four things from SGLang, and this is the one place that knows how to ask for them:

1. Launch arguments. `sglang_server_args` turns specrl's `SpecConfig` into SGLang's
   `ServerArgs` fields (`speculative_algorithm`, `speculative_num_steps`, ...) as a plain dict;
   `to_cli_args` renders it as `--flag value` (slime prefixes the same flags with `--sglang-`).
2. Acceptance statistics. SGLang reports per-request counters in `meta_info`, under names that
   changed across versions. `parse_spec_meta` reads all of them (slime and veRL adapters reuse
   it) and refuses contradictory numbers instead of logging a made-up accept length.
3. Trajectories. `/generate` with `return_logprob` gives the target's log-prob of every sampled
   token in `meta_info["output_token_logprobs"]` as `[logprob, token_id, text]` triples.
4. Weight updates that keep draft and policy apart. In SGLang an `update_weights_from_tensor`
   request without `disable_draft_model` goes to the speculative worker, which loads the *same*
   named tensors into the draft runner and then the target runner, each resolving names its own
   way. EAGLE-3's loader takes a name as is or with a `model.` prefix, so a policy's
   `lm_head.weight` / `model.norm.weight` land in the draft (the known failure where accept
   length silently fell to 1.0), and a draft's `lm_head.weight` lands in the target.
   `check_policy_sync` and `check_draft_push` encode those rules and refuse a request that would
   cross the line; the engine sends the policy with `disable_draft_model=True`.

The draft's file layout is `draft_models.checkpoint.save_draft` (SGLang's folder format) and its
tensor names are `draft_state_dict_for_sglang`; nothing here duplicates them.

Version notes (what the names were read from) are in docs/sglang.md.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_models.checkpoint import draft_state_dict_for_sglang, save_draft
from rollout.protocol import SamplingParams, SpecStats, Trajectory
from rollout.speculative import SpecConfig

SPEC_ALGORITHMS = ("EAGLE3", "EAGLE")
VOCAB_MAP_NAMES = ("d2t", "t2d")  # EAGLE-3 draft vocabulary maps (buffers, fixed for a run)


class SGLangArgsError(ValueError):
    """A speculative setting cannot be expressed as SGLang server arguments (one-line message)."""


class SpecMetaError(ValueError):
    """A meta_info payload carries malformed or contradictory speculative counters."""


class WeightIsolationError(ValueError):
    """A weight update would write policy tensors into the draft or draft tensors into the policy."""


# ---------------------------------------------------------------------------------------------
# 1. launch arguments
# ---------------------------------------------------------------------------------------------
def sglang_server_args(model_path: str, draft_path: str, spec: SpecConfig, *, algorithm: str = "EAGLE3",
                       cpu_backup: bool = True, extra: Mapping | None = None) -> dict:
    """SGLang `ServerArgs` fields for EAGLE speculation with specrl's draft.

    chain (gamma):  num_steps = gamma, eagle_topk = 1, num_draft_tokens = gamma + 1
    tree (gamma = depth, tree_topk, tree_budget):  num_steps = gamma, eagle_topk = tree_topk,
                    num_draft_tokens = tree_budget + 1 (SGLang counts the verified root token)
    `enable_draft_weights_cpu_backup` keeps the draft's weights across SGLang's memory release
    (RL engines release GPU memory during training; a draft without backup comes back empty).
    `extra` adds other ServerArgs fields; it may not override the derived speculative ones."""
    if not isinstance(spec, SpecConfig):
        raise SGLangArgsError(f"spec must be a rollout.speculative.SpecConfig, got {type(spec).__name__}")
    if algorithm not in SPEC_ALGORITHMS:
        raise SGLangArgsError(f"speculative algorithm must be one of {SPEC_ALGORITHMS}, got {algorithm!r}")
    for name, value in (("model_path", model_path), ("draft_path", draft_path)):
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            raise SGLangArgsError(f"{name} must be a non-empty path, got {value!r}")
    if spec.mode == "chain":
        topk, draft_tokens = 1, spec.gamma + 1
    else:
        if spec.tree_topk < 2:
            raise SGLangArgsError(f"tree mode needs tree_topk >= 2 (tree_topk=1 is a chain), got {spec.tree_topk}")
        most = spec.tree_topk + (spec.gamma - 1) * spec.tree_topk ** 2  # candidates SGLang can rank
        if spec.tree_budget > most:
            raise SGLangArgsError(f"tree_budget={spec.tree_budget} exceeds the {most} candidates a depth-"
                                  f"{spec.gamma}, top-{spec.tree_topk} tree offers")
        topk, draft_tokens = spec.tree_topk, spec.tree_budget + 1
    args = {
        "model_path": str(model_path),
        "speculative_algorithm": algorithm,
        "speculative_draft_model_path": str(draft_path),
        "speculative_num_steps": spec.gamma,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": draft_tokens,
        "enable_draft_weights_cpu_backup": bool(cpu_backup),
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not key.isidentifier():
            raise SGLangArgsError(f"extra server argument names must be identifiers, got {key!r}")
        if key in args and args[key] != value:
            raise SGLangArgsError(f"extra sets {key}={value!r}, which contradicts the derived {args[key]!r}")
        args[key] = value
    return args


def to_cli_args(args: Mapping, prefix: str = "--") -> list[str]:
    """Render server args as CLI flags: `speculative_num_steps=4` -> `--speculative-num-steps 4`.
    True is a bare flag, False and None are left out, lists become several values, dicts JSON."""
    out: list[str] = []
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise SGLangArgsError(f"server argument names must be identifiers, got {key!r}")
        flag = prefix + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out.append(flag)
            out.extend(str(v) for v in value)
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value)])
        elif isinstance(value, float) and not math.isfinite(value):
            raise SGLangArgsError(f"server argument {key} must be finite, got {value}")
        else:
            out.extend([flag, str(value)])
    return out


# ---------------------------------------------------------------------------------------------
# 2. speculative counters in meta_info
# ---------------------------------------------------------------------------------------------
VERIFY_KEY = "spec_verify_ct"
# Same quantity under the names of successive SGLang versions (newest first).
ACCEPT_KEYS = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
DRAFT_KEYS = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")
PER_POS_KEYS = ("spec_num_proposed_drafts_by_position", "spec_num_correct_drafts_by_position")
SPEC_KEYS = (VERIFY_KEY, *ACCEPT_KEYS, *DRAFT_KEYS, *HISTOGRAM_KEYS, *PER_POS_KEYS)


def _count(meta: Mapping, key: str) -> int:
    v = meta[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SpecMetaError(f"meta_info[{key!r}]={v!r} is not a non-negative integer")
    return v


def _counts(meta: Mapping, key: str) -> list[int]:
    v = meta[key]
    if not isinstance(v, (list, tuple)):
        raise SpecMetaError(f"meta_info[{key!r}] must be a list of counts, got {type(v).__name__}")
    return [_count({key: x}, key) for x in v]


def _agreed(meta: Mapping, keys: Sequence[str], read) -> tuple[str | None, object]:
    """The value under the first present key; every other present alias must agree."""
    found = [(k, read(meta, k)) for k in keys if k in meta and meta[k] is not None]
    for k, v in found[1:]:
        if v != found[0][1]:
            raise SpecMetaError(f"contradictory speculative counters: {found[0][0]}={found[0][1]} but {k}={v}")
    return found[0] if found else (None, None)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def parse_spec_meta(meta_info: Mapping | None) -> SpecStats | None:
    """SpecStats from one request's SGLang meta_info, or None when it carries no speculative counter.

    Reads every name SGLang has used: `spec_verify_ct`; accepted drafts as `spec_num_correct_drafts`
    / `spec_accepted_drafts` / `spec_accept_token_num`; proposed drafts as `spec_num_proposed_drafts`
    / `spec_proposed_drafts` / `spec_draft_token_num`; the per-step histogram
    `spec_correct_drafts_histogram` / `spec_accept_histogram`; per-position counts
    `spec_num_*_drafts_by_position`. Oldest servers report only `spec_verify_ct`: accepted is then
    completion_tokens - verify steps - 1 (the prefill token), proposed stays 0 (rate unknown).
    Per-position counts come from the by-position lists, else from the histogram (depth d is
    reached by every verify step, accepted by those that accepted more than d drafts).
    Raises SpecMetaError on malformed values or numbers that contradict each other."""
    if meta_info is None:
        return None
    if not isinstance(meta_info, Mapping):
        raise SpecMetaError(f"meta_info must be a JSON object, got {type(meta_info).__name__}")
    meta = meta_info
    if not any(k in meta and meta[k] is not None for k in SPEC_KEYS):
        return None
    if VERIFY_KEY not in meta or meta[VERIFY_KEY] is None:
        raise SpecMetaError(f"meta_info has speculative counters but no {VERIFY_KEY}")
    verify = _count(meta, VERIFY_KEY)
    completion = _count(meta, "completion_tokens") if meta.get("completion_tokens") is not None else None
    acc_key, accepted = _agreed(meta, ACCEPT_KEYS, _count)
    drf_key, drafted = _agreed(meta, DRAFT_KEYS, _count)
    hist_key, hist = _agreed(meta, HISTOGRAM_KEYS, _counts)
    if hist is not None and hist:
        if sum(hist) != verify:
            raise SpecMetaError(f"contradictory speculative counters: {hist_key} sums to {sum(hist)} verify steps "
                                f"but {VERIFY_KEY}={verify}")
        weighted = sum(k * n for k, n in enumerate(hist))
        if accepted is None:
            acc_key, accepted = hist_key, weighted
        elif weighted != accepted:
            raise SpecMetaError(f"contradictory speculative counters: {hist_key} implies {weighted} accepted "
                                f"drafts but {acc_key}={accepted}")
    if accepted is None:  # oldest servers: only the verify count
        accepted = max(0, completion - verify - 1) if completion is not None and verify else 0
    drafted = 0 if drafted is None else drafted
    if accepted > drafted and drf_key is not None:
        raise SpecMetaError(f"contradictory speculative counters: {acc_key}={accepted} exceeds {drf_key}={drafted}")
    if completion is not None and accepted > completion:
        raise SpecMetaError(f"contradictory speculative counters: {acc_key}={accepted} exceeds "
                            f"completion_tokens={completion}")
    rate = meta.get("spec_accept_rate")
    if rate is not None and drafted > 0 and not _close(float(rate), accepted / drafted):
        raise SpecMetaError(f"contradictory speculative counters: spec_accept_rate={rate} but "
                            f"{accepted}/{drafted} drafts were accepted")
    length = meta.get("spec_accept_length")
    if length is not None and verify > 0 and completion is not None and not _close(float(length), completion / verify):
        raise SpecMetaError(f"contradictory speculative counters: spec_accept_length={length} but "
                            f"completion_tokens/{VERIFY_KEY} = {completion}/{verify}")
    stats = SpecStats(verify_steps=verify, drafted=drafted, accepted=accepted)
    if all(k in meta and meta[k] is not None for k in PER_POS_KEYS):
        d_pos, a_pos = (_counts(meta, k) for k in PER_POS_KEYS)
        if len(d_pos) != len(a_pos) or any(a > d for a, d in zip(a_pos, d_pos)):
            raise SpecMetaError(f"contradictory speculative counters: per-position accepted {a_pos} vs proposed {d_pos}")
        if sum(d_pos) != drafted or sum(a_pos) != accepted:
            raise SpecMetaError(f"contradictory speculative counters: per-position sums {sum(a_pos)}/{sum(d_pos)} "
                                f"disagree with totals {accepted}/{drafted}")
        stats.drafted_per_pos, stats.accepted_per_pos = d_pos, a_pos
    elif hist:
        depth = len(hist) - 1
        stats.drafted_per_pos = [verify] * depth
        stats.accepted_per_pos = [sum(hist[d + 1:]) for d in range(depth)]
    return stats


# ---------------------------------------------------------------------------------------------
# 3. /generate outputs -> trajectories
# ---------------------------------------------------------------------------------------------
def sampling_params_for_sglang(params: SamplingParams) -> dict:
    """SGLang's sampling_params dict (top_k -1 disables it in SGLang; 0 does in specrl)."""
    return {"temperature": float(params.temperature), "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k > 0 else -1,
            "max_new_tokens": int(params.max_new_tokens), "stop_token_ids": list(params.stop_token_ids)}


def tokens_and_logprobs(meta_info: Mapping, output_ids: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
    """Token ids and target log-probs from meta_info["output_token_logprobs"] ([logprob, id, text])."""
    rows = meta_info.get("output_token_logprobs")
    if rows is None:
        raise ValueError("meta_info lacks output_token_logprobs: send the request with return_logprob=true")
    ids, lps = [], []
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) < 2 or row[0] is None:
            raise ValueError(f"output_token_logprobs[{i}]={row!r} is not a [logprob, token_id, ...] entry")
        lps.append(float(row[0]))
        ids.append(int(row[1]))
    if output_ids is not None and list(output_ids) != ids:
        raise ValueError(f"output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs ({len(ids)})")
    return ids, lps


def trajectory_from_output(prompt_ids: Sequence[int], output: Mapping, request_id: int = 0) -> Trajectory:
    meta = output.get("meta_info") or {}
    ids, lps = tokens_and_logprobs(meta, output.get("output_ids"))
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind not in ("stop", "length"):
        raise RuntimeError(f"request {request_id} ended with finish_reason {reason!r} (aborted or unfinished)")
    return Trajectory(prompt_ids=list(prompt_ids), token_ids=ids, logprobs=torch.tensor(lps, dtype=torch.float32),
                      finish_reason=kind, request_id=int(request_id), spec=parse_spec_meta(meta))


# ---------------------------------------------------------------------------------------------
# 4. keeping draft and policy weights apart
# ---------------------------------------------------------------------------------------------
def _strip_model(name: str) -> str:
    return name.removeprefix("model.")


def draft_owned(name: str) -> bool:
    """True for tensors only an EAGLE-3 draft has (fc, midlayer, vocabulary maps)."""
    n = _strip_model(name)
    return n == "fc.weight" or n.startswith("midlayer.") or any(m in name for m in VOCAB_MAP_NAMES)


def shared_with_draft(name: str) -> bool:
    """True for policy names SGLang's EAGLE-3 loader also resolves into the draft (its final norm
    and lm_head). Embeddings are not listed: the draft reads the target's own embedding."""
    return _strip_model(name) == "norm.weight" or name == "lm_head.weight"


def check_policy_sync(names: Iterable[str], *, isolated: bool) -> None:
    """Refuse a policy sync that could write into the draft.

    Draft-only tensors in a policy state dict are always refused (the policy and draft were
    merged somewhere upstream). Names the draft loader shares with the policy are allowed only
    when the request is `isolated` (sent with disable_draft_model, so only the target loads it)."""
    names = list(names)
    foreign = [n for n in names if draft_owned(n)]
    if foreign:
        raise WeightIsolationError(f"policy sync carries draft tensors {foreign[:4]}; push the draft separately")
    shared = [n for n in names if shared_with_draft(n)]
    if shared and not isolated:
        raise WeightIsolationError(f"policy sync would also overwrite the draft's {shared[:4]}: this server lacks "
                                   f"disable_draft_model routing (set SGLangEngineConfig.policy_isolation_flag)")


def check_draft_push(names: Iterable[str], target_names: Iterable[str] | None, *, routed: bool) -> list[str]:
    """Names of a draft push that the target would also load; raise unless the push is `routed`
    to the draft only. Unknown target names (None) cannot be proven safe and are refused too."""
    names = list(names)
    if routed:
        return []
    if target_names is None:
        raise WeightIsolationError("draft push: target parameter names unknown (sync the policy first or set "
                                   "SGLangEngine.target_param_names), cannot prove the target is untouched")
    target = set(target_names)
    return [n for n in names if n in target]


# ---------------------------------------------------------------------------------------------
# transports: a running server over HTTP, or an in-process sglang.Engine
# ---------------------------------------------------------------------------------------------
class HTTPTransport:
    """POST JSON to a running SGLang server or router (stdlib urllib, no extra dependency)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, endpoint: str, body: dict):
        req = urllib.request.Request(f"{self.base_url}/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read().decode() or "null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200]
            raise RuntimeError(f"SGLang {endpoint} failed: HTTP {e.code} {detail}") from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"SGLang {endpoint} unreachable at {self.base_url}: {e.reason}") from None


class InProcessTransport:
    """Calls the methods of an in-process `sglang.Engine` with the same bodies the HTTP API takes.
    Keyword arguments the installed Engine method does not accept are refused, not dropped: a
    missing `disable_draft_model` must not silently turn into a sync that reaches the draft."""

    def __init__(self, engine):
        self.engine = engine

    def call(self, endpoint: str, body: dict):
        body = dict(body)
        if endpoint == "update_weights_from_tensor":
            body["named_tensors"] = body.pop("named_tensors_local")
            body.pop("serialized_named_tensors", None)
        fn = getattr(self.engine, endpoint)
        accepted = inspect.signature(fn).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            unknown = sorted(set(body) - set(accepted))
            if unknown:
                raise WeightIsolationError(f"sglang.Engine.{endpoint} does not accept {unknown}")
        return fn(**body)


def default_serializer(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's own serialization for update_weights_from_tensor over HTTP (needs sglang)."""
    from sglang.srt.utils import MultiprocessingSerializer  # lazy: sglang is optional

    return MultiprocessingSerializer.serialize(named, output_str=True)


@dataclass
class SGLangEngineConfig:
    base_url: str | None = None  # a running server / router; None with SGLangEngine.launch
    timeout_s: float = 600.0
    tp_size: int = 1  # update_weights_from_tensor takes one serialized copy per TP rank
    flush_cache: bool = True
    # Request field that sends a policy sync to the target runner only. SGLang's
    # UpdateWeightsFromTensorReqInput has `disable_draft_model`; None for servers without it
    # (policy names the draft loader shares are then refused).
    policy_isolation_flag: str | None = "disable_draft_model"
    # Request field that sends an update to the draft runner only. Upstream SGLang has none as of
    # the versions read (docs/sglang.md); set it for a server that does (e.g. "draft_only").
    draft_route_flag: str | None = None
    # Without draft routing, draft names the target also has (lm_head.weight) are refused; True
    # holds them back instead (the engine keeps its old draft lm_head; see last_push_held).
    hold_shared_draft_names: bool = False
    draft_transport: str = "tensor"  # "tensor" (named tensors) or "disk" (export + update_weights_from_disk)
    export_dir: str | None = None  # disk transport: versioned draft folders go here
    load_format: str | None = None
    serializer: Callable[[list[tuple[str, torch.Tensor]]], str] | None = None

    def __post_init__(self) -> None:
        if self.draft_transport not in ("tensor", "disk"):
            raise ValueError(f"draft_transport must be 'tensor' or 'disk', got {self.draft_transport!r}")
        if self.draft_transport == "disk" and not self.export_dir:
            raise ValueError("draft_transport='disk' needs export_dir (a folder the server can read)")
        if self.tp_size <= 0 or self.timeout_s <= 0:
            raise ValueError("tp_size and timeout_s must be positive")


class SGLangEngine:
    """RolloutEngine over SGLang; see the module docstring for the weight isolation rules."""

    def __init__(self, config: SGLangEngineConfig | None = None, transport=None):
        self.config = cfg = config or SGLangEngineConfig()
        if transport is None:
            if not cfg.base_url:
                raise ValueError("SGLangEngine needs config.base_url or a transport (see SGLangEngine.launch)")
            transport = HTTPTransport(cfg.base_url, cfg.timeout_s)
        self.transport = transport
        self.in_process = isinstance(transport, InProcessTransport)
        self.target_param_names: set[str] | None = None  # learned from policy syncs
        self.draft_version: int | None = None
        self.policy_version: int | None = None
        self.last_push_held: list[str] = []
        self._vocab_maps: dict[str, torch.Tensor] | None = None

    @classmethod
    def launch(cls, server_args: Mapping, config: SGLangEngineConfig | None = None) -> "SGLangEngine":
        """Start an in-process `sglang.Engine(**server_args)` (sglang imported here, lazily)."""
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(f"SGLangEngine.launch needs the sglang package ({e}); or connect to a running "
                               f"server with SGLangEngineConfig(base_url=...)") from None
        return cls(config, InProcessTransport(sglang.Engine(**dict(server_args))))

    # -- rollout --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> list[Trajectory]:
        if capture_features:
            raise ValueError("SGLang does not return EAGLE-3 target features; capture them in the trainer's "
                             "log-prob forward (CoTrainConfig.feature_source='trainer')")
        if not prompts:
            return []
        ids = list(request_ids) if request_ids is not None else list(range(len(prompts)))
        if len(ids) != len(prompts):
            raise ValueError(f"{len(ids)} request_ids for {len(prompts)} prompts")
        body = {"input_ids": [list(map(int, p)) for p in prompts], "sampling_params": sampling_params_for_sglang(params),
                "return_logprob": True}
        out = self.transport.call("generate", body)
        outputs = out if isinstance(out, list) else [out]
        if len(outputs) != len(prompts):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [trajectory_from_output(p, o, r) for p, o, r in zip(prompts, outputs, ids)]

    # -- weights --------------------------------------------------------------------------
    def _tensor_body(self, named: list[tuple[str, torch.Tensor]], **fields) -> dict:
        body = {"load_format": self.config.load_format, "flush_cache": self.config.flush_cache, **fields}
        if self.in_process:
            body["named_tensors_local"] = named
        else:
            ser = (self.config.serializer or default_serializer)(named)
            body["serialized_named_tensors"] = [ser] * self.config.tp_size
        return body

    @staticmethod
    def _check(resp, what: str) -> None:
        ok = resp.get("success") if isinstance(resp, Mapping) else (resp[0] if isinstance(resp, tuple) else resp)
        if ok is not True:
            msg = resp.get("message") if isinstance(resp, Mapping) else resp
            raise RuntimeError(f"SGLang {what} failed: {msg}")

    def load_policy_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Policy sync after a trainer step: target runner only, never the draft."""
        names = list(state_dict)
        flag = self.config.policy_isolation_flag
        check_policy_sync(names, isolated=flag is not None)
        fields = {flag: True} if flag else {}
        if version is not None:
            fields["weight_version"] = str(version)
        named = [(n, t.detach()) for n, t in state_dict.items()]
        self._check(self.transport.call("update_weights_from_tensor", self._tensor_body(named, **fields)), "policy sync")
        self.target_param_names = set(names) | (self.target_param_names or set())
        self.policy_version = version

    def push_draft(self, draft, version: int) -> dict:
        """Hot-swap fresh draft weights into the engine (an Eagle3Draft, or its SGLang-named tensors
        for the tensor transport). The vocabulary maps d2t/t2d are never re-sent: SGLang copies its
        hot-token map once at start, so a changed map would be ignored; a change is refused."""
        weights = draft if isinstance(draft, Mapping) else draft_state_dict_for_sglang(draft)
        self._check_vocab_maps(weights)
        self.last_push_held = []
        route = self.config.draft_route_flag
        fields = {"weight_version": f"draft-{version}"}
        if route:
            fields[route] = True
        if self.config.draft_transport == "disk":
            if isinstance(draft, Mapping):
                raise ValueError("draft_transport='disk' needs the Eagle3Draft module (save_draft writes its config)")
            if not route:
                raise WeightIsolationError("update_weights_from_disk loads the folder into the target too unless the "
                                           "server routes it to the draft (set draft_route_flag)")
            folder = save_draft(draft, Path(self.config.export_dir) / f"draft-v{version}")
            body = {"model_path": str(folder), "load_format": self.config.load_format, **fields}
            self._check(self.transport.call("update_weights_from_disk", body), "draft push (disk)")
            sent = sorted(weights)
        else:
            named = {n: t for n, t in weights.items() if n not in VOCAB_MAP_NAMES}
            collide = check_draft_push(named, self.target_param_names, routed=bool(route))
            if collide and not self.config.hold_shared_draft_names:
                raise WeightIsolationError(f"draft push would also overwrite target tensors {collide[:4]}; set "
                                           f"draft_route_flag or hold_shared_draft_names")
            self.last_push_held = collide
            named = [(n, t.detach().cpu()) for n, t in named.items() if n not in collide]
            self._check(self.transport.call("update_weights_from_tensor", self._tensor_body(named, **fields)),
                        "draft push")
            sent = [n for n, _ in named]
        self.draft_version = version
        return {"version": version, "sent": sent, "held": list(self.last_push_held)}

    def _check_vocab_maps(self, weights: Mapping[str, torch.Tensor]) -> None:
        maps = {k: weights[k].detach().cpu() for k in VOCAB_MAP_NAMES if k in weights}
        if self._vocab_maps is None:
            self._vocab_maps = maps
            return
        for k, t in maps.items():
            old = self._vocab_maps.get(k)
            if old is not None and not torch.equal(old.to(t.dtype), t):
                raise WeightIsolationError(f"draft push changes the draft vocabulary map {k}; SGLang reads it once "
                                           f"at start: relaunch the engine with the new draft")
