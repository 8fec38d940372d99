"""slime's rollout side for specrl: the custom generate function and `Sample.spec_info`.

Why a module of its own: `--custom-generate-function-path` runs in slime's rollout workers, which
need the SGLang client and the counter reader but none of the trainer-side pieces (Megatron
capture, the draft trainer). `generate(args, sample, sampling_params)` posts to the SGLang router,
fills tokens / response / rollout_log_probs / status and `sample.spec_info` (slime's
spec_accept_token_num / spec_draft_token_num / spec_verify_ct / completion_token_num), read with
`rollout.sglang_meta.parse_spec_meta` whatever the SGLang version. Re-exported by
`specrl.integrations.slime` (the path slime is given).
"""
from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Mapping

from rollout.sglang_engine import parse_spec_meta, tokens_and_logprobs

# Field names of slime's Sample.SpecInfo (the commit named in specrl/integrations/slime.py).
SPEC_INFO_FIELDS = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "completion_token_num")


def spec_info_delta(meta_info: Mapping) -> dict:
    """One response's counters in slime's SpecInfo shape (zeros when SGLang did not speculate)."""
    stats = parse_spec_meta(meta_info)
    completion = int(meta_info.get("completion_tokens") or 0)
    if stats is None:
        return dict.fromkeys(SPEC_INFO_FIELDS, 0) | {"completion_token_num": completion}
    return {"spec_accept_token_num": stats.accepted, "spec_draft_token_num": stats.drafted,
            "spec_verify_ct": stats.verify_steps, "completion_token_num": completion}


def add_spec_info(sample, meta_info: Mapping) -> None:
    """Accumulate into sample.spec_info (added, not replaced: partial rollouts resume a sample)."""
    for k, v in spec_info_delta(meta_info).items():
        setattr(sample.spec_info, k, getattr(sample.spec_info, k) + v)


_TOKENIZER = None


def register_tokenizer(tokenizer) -> None:
    """Use this tokenizer for sample.prompt (default: transformers AutoTokenizer of args.hf_checkpoint)."""
    global _TOKENIZER
    _TOKENIZER = tokenizer


def _prompt_ids(args, sample) -> list[int]:
    if sample.tokens:
        return list(sample.tokens)
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer  # lazy: only slime's own environment has it

        _TOKENIZER = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    if not isinstance(sample.prompt, str):
        raise ValueError("specrl's generate takes text prompts or pre-tokenized sample.tokens")
    return list(_TOKENIZER.encode(sample.prompt, add_special_tokens=False))


def _post_json(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode())


async def generate(args, sample, sampling_params: dict):
    """slime's custom generate function: one SGLang /generate call through the router."""
    status = type(sample).Status
    if sample.status not in (status.PENDING, status.ABORTED):
        raise ValueError(f"sample status is {sample.status}, expected PENDING or ABORTED")
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    ids = _prompt_ids(args, sample)
    params = dict(sampling_params)
    if sample.response_length:  # a resumed partial rollout: only the remaining budget
        params["max_new_tokens"] = params["max_new_tokens"] - sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = status.TRUNCATED
        return sample
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
    out = await asyncio.to_thread(_post_json, url, body, float(getattr(args, "specrl_http_timeout_s", 600.0)))
    meta = out.get("meta_info") or {}
    new_ids, logps = tokens_and_logprobs(meta, out.get("output_ids"))
    sample.tokens = ids + new_ids
    sample.response = (sample.response or "") + (out.get("text") or "")
    sample.response_length += len(new_ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + logps
    add_spec_info(sample, meta)
    if "weight_version" in meta:
        sample.weight_versions.append(meta["weight_version"])
    kind = (meta.get("finish_reason") or {}).get("type")
    sample.status = {"length": status.TRUNCATED, "abort": status.ABORTED, "stop": status.COMPLETED}.get(
        kind, status.COMPLETED)
    return sample
