"""The history drafter (rollout.drafters.history) inside vLLM, as a `custom_class` proposer.

vLLM 0.32 builds a `speculative_config = {"method": "custom_class", "model": "module.Class"}`
drafter from the VllmConfig in its worker process and calls, every decoding step,
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`, which
returns each row's draft token ids (an empty list: no draft for that row). Its drafts carry no
probabilities, so vLLM's rejection sampler treats them as point masses, as specrl's verifier does.

What the proposer does not get is which request a row holds or where its prompt ends. So the
engine (rollout.vllm_engine.VLLMEngine) tells the worker, through `collective_rpc`, the prompts of
each generate() call before it runs (`history_begin`) and the finished answers after it
(`history_add`). A row's request is recognised by its content: a row whose token count shrank, or
whose last known token changed, holds a new request, whose prompt is the longest prompt of the
call that its tokens start with.

The EAGLE-3 head and this proposer cannot share one vLLM engine: vLLM takes one speculative method,
and a custom class is handed token ids only (not the target's hidden states EAGLE-3 reads), so the
hybrid runs on the embedded engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollout.drafters.history import HistoryConfig, HistoryStore

METHOD = "custom_class"
CLASS_PATH = "rollout.vllm_history.HistoryVLLMProposer"


@dataclass
class _Row:
    request_id: int
    prompt: list[int]
    tokens: list[int]  # the answer so far
    n: int  # tokens of the row (prompt + answer) when last seen


class HistoryVLLMProposer:
    """rollout.drafters.history's drafter as vLLM's custom proposer (built by vLLM in its worker)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.store = HistoryStore(HistoryConfig())
        self.prompts: dict[int, set[tuple[int, ...]]] = {}  # prompt length -> this call's prompts
        self.rows: dict[int, _Row] = {}
        self._next_id = 0

    def load_model(self, *args, **kwargs) -> None:  # no model
        pass

    # -- what the engine tells the worker (collective_rpc) ----------------------------------
    def begin(self, prompts: list[list[int]], config: dict | None = None) -> None:
        if config is not None and HistoryConfig(**config) != self.store.config:
            self.store = HistoryStore(HistoryConfig(**config))
        self.store.begin_call()
        self.prompts = {}
        for p in prompts:
            self.prompts.setdefault(len(p), set()).add(tuple(p))
        self.rows = {}

    def add(self, answers: list[tuple[list[int], list[int]]]) -> None:
        from rollout.protocol import Trajectory

        self.store.add_rollout([Trajectory(prompt_ids=p, token_ids=t, logprobs=None, finish_reason="stop")
                                for p, t in answers])

    # -- vLLM's call -------------------------------------------------------------------------
    def _row(self, i: int, row) -> _Row | None:
        n = len(row)
        known = self.rows.get(i)
        if known is not None and n >= known.n and int(row[known.n - 1]) == (known.tokens or known.prompt)[-1]:
            known.tokens.extend(int(t) for t in row[known.n:])
            known.n = n
            return known
        for length in sorted(self.prompts, reverse=True):  # a new request: find its prompt
            if length < n and tuple(int(t) for t in row[:length]) in self.prompts[length]:
                self._next_id += 1
                self.rows[i] = _Row(self._next_id, [int(t) for t in row[:length]],
                                    [int(t) for t in row[length:]], n)
                return self.rows[i]
        self.rows.pop(i, None)
        return None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n >= self.max_model_len:
                drafts.append([])
                continue
            st = self._row(i, token_ids_cpu[i, :n])
            if st is None:
                drafts.append([])
                continue
            self.store.observe([st])
            drafts.append(self.store.draft(st.request_id, self.k).tokens)
        return drafts


def _drafter(worker):
    drafter = getattr(worker.model_runner, "drafter", None)
    if not isinstance(drafter, HistoryVLLMProposer):
        raise RuntimeError(f"the vLLM worker's drafter is {type(drafter).__name__}, not the history proposer")
    return drafter


def history_begin_in_worker(worker, prompts, config=None) -> None:
    _drafter(worker).begin(prompts, config)


def history_add_in_worker(worker, answers) -> None:
    _drafter(worker).add(answers)
