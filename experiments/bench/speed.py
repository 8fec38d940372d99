"""`specrl bench speed`: speculative decoding against plain decoding, per batch size.

Every arm decodes the same prompts, timed in turns (`common.timed_generate_interleaved`); every
speculative row checks that its tokens equal the yardstick's and carries the bound's parts
measured on the engine's own steps (MEASUREMENT), so a row that misses a speed-up says why.
The engine is how the arms are built and where their step costs come from; the measurement
(`measure_batch`) is one:

  EmbeddedArms  specrl's embedded engine, fresh engines per batch size: plain, chains of each
                length in `gammas`, trees of each budget in `tree_budgets`, and the longest
                chain under the speculation controller ("adaptive", plain decoding where
                speculation does not pay); costs from the step profiler (rollout.profile)
  VLLMArms      vLLM plain, vLLM EAGLE-3 chains from the offline draft (and from another draft
                folder, `online_draft`), and the embedded engine without speculation on the
                same model, greedy; costs from vLLM's own steps (rollout.vllm_profile)

vLLM batch sizes: a vLLM engine's batch limit is fixed when it starts, and a start costs tens of
seconds on a CPU, so one engine per arm serves every batch size and is fed the prompts in
consecutive groups of `batch` (`common.Grouped`); the embedded arm gets the same groups.

The speed sweeps over chain length and tree budget are the same command with lists:

    specrl bench speed --preset quick --out runs/speed --batches 1,4,16,64 --gammas 1,2,4,6 --tree-budgets 4,8,16
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from experiments.bench.common import (Grouped, model_summary, preset_chain_length, profiled_run, repeat_ratios,
                                      save_summary, speed_setup, timed_generate_interleaved)
from rollout.drafters import DrafterSpec
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import same_tokens, summarize_spec_stats

# How each figure of a speed row is measured; written into every embedded speed summary.
MEASUREMENT = {
    "tokens_per_s": "generated tokens / wall seconds of one EmbeddedEngine.generate() call on the row's prompts, "
                    "best of the timed repeats after one warm-up call; engines of one batch size take turns "
                    "within each repeat, the order rotating by one per repeat (on CPU with the step profiler "
                    "attached, see target_step_s; on CUDA without)",
    "accept_length": "tokens emitted per verify step (accepted drafts + the target's own), over all sequences",
    "alpha": "accepted / drafted draft tokens",
    "target_step_s": "lower quartile (25th percentile, robust to OS preemption) of the wall time of the target's forward in the plain engine's real decode steps "
                     "(EmbeddedEngine._decode_step on the row's prompts, steps with every slot busy and no "
                     "admitted prompt riding along), rollout.profile: on CPU from the timed repeats "
                     "themselves, pooled (a profiler mark there is one clock read, so the bound's parts come "
                     "from the very calls whose speed-up is reported); on CUDA, where a mark synchronises the "
                     "device, from one extra profiled run",
    "verify_s": "lower quartile of the wall time of the target's verify forward in the speculative engine's real steps "
                "(EmbeddedEngine._spec_step: real drafted tokens, so the experts a real block wakes), same step selection",
    "draft_step_s": "lower quartile of the draft time of a real speculative step (the forward over the pending target features, "
                    "then the chain or tree steps, with their sampling) divided by the drafted depth gamma",
    "c": "draft_step_s / target_step_s",
    "verify_cost": "verify_s / target_step_s",
    "bound": "accept_length / (verify_cost + gamma * c) (docs/design.md section 4): the speed-up if the loop around "
             "the forwards cost nothing",
    "efficiency": "speedup / bound",
    "bound_median": "the bound from the medians of the same step samples instead of their lower quartiles "
                    "(target_step_s_median, verify_s_median, draft_step_s_median): how much the choice of "
                    "statistic moves the bound (a forward's spread is partly real work, which experts a block "
                    "wakes and how long its context is, and partly preemption)",
    "speedup_median": "median over the timed repeats of the per-repeat ratio of this row's tokens/s to plain's "
                      "(the two calls of a repeat run seconds apart, so a slow spell of the machine hits both)",
    "speedup_repeats": "each timed repeat's tokens/s over plain's in the same repeat, in repeat order",
    "efficiency_median": "speedup_median / bound_median: the efficiency with medians on both sides",
    "efficiency_paired": "median over the timed repeats of (that repeat's speed-up over plain) / (the bound from "
                         "the medians of that repeat's own step samples, both arms): numerator and denominator "
                         "come from the same two calls, seconds apart, so a slow spell of the machine moves both; "
                         "null where the profiler did not ride along the timed calls (CUDA)",
    "profile": "mean seconds per step of each phase (rollout.profile) over the profiled full-batch steps "
               "(the same steps as target_step_s)",
    "efficiency_factors": "efficiency as a product of three factors (experiments.bench.speed.efficiency_factors): "
                          "timed speed-up over the speed-up the full-batch steps' mean times imply (the cost of "
                          "admissions and the partial-batch tail), that over the speed-up their forwards' mean "
                          "times imply (the loop around the forwards), that over the bound (mean vs lower "
                          "quartile)",
}

# The same for vLLM rows (VLLMArms).
VLLM_MEASUREMENT = {
    **{k: MEASUREMENT[k] for k in ("accept_length", "alpha", "c", "verify_cost", "bound", "efficiency",
                                   "bound_median", "speedup_median", "efficiency_median")},
    "tokens_per_s": "generated tokens / wall seconds of one generate() call over the row's prompts fed in groups of "
                    "`batch` (Grouped), best of the timed repeats after one warm-up call; the arms take turns "
                    "within each repeat; vLLM started once per arm before any timing",
    "target_step_s": "lower quartile of the wall time of vLLM's target forward (GPUModelRunner._model_forward in the "
                     "worker) over exactly `batch` tokens in the plain engine: full-batch decode steps, from one "
                     "extra timed run (rollout.vllm_profile)",
    "verify_s": "the same for the speculative engine's forwards over batch * (gamma + 1) tokens: full-batch verify steps",
    "draft_step_s": "lower quartile of the drafter's proposal per step (propose_draft_token_ids: its forward over the "
                    "newly accepted tokens, then the chain) divided by gamma",
    "identical_to_plain": "greedy tokens equal vLLM plain's on every prompt",
    "identical_to_vllm_plain": "(embedded-plain row) greedy tokens equal vLLM plain's on every prompt",
}


# -- the bound's parts -----------------------------------------------------------------------
def engine_step_costs(plain_prof, spec_prof, batch: int, gamma: int, call: int | None = None) -> dict:
    """The bound's parts from real engine steps (see MEASUREMENT): target step, verify forward
    and draft step, each the lower quartile (rollout.profile.low_quartile) and the median over the profiled
    runs' full-batch steps without a fused prefill (of one timed call with `call`, else of all).
    Rows with no such step (a batch larger than the prompts) get None."""
    from rollout.profile import bound_costs

    plain = plain_prof.select("plain", batch, call=call)
    spec = [r for r in spec_prof.select("spec", batch, call=call) if r.gamma == gamma]
    return bound_costs([r.phases["forward"] for r in plain], [r.phases["verify_forward"] for r in spec],
                       [r.phases.get("draft", 0.0) / gamma for r in spec],
                       {"plain_steps": len(plain), "spec_steps": len(spec)})


def step_profile(prof, batch: int) -> dict:
    """Where the steps' time goes: phase breakdown of the full-batch steps of a profiled run."""
    from rollout.profile import PLAIN_PHASES, SPEC_PHASES, phase_breakdown

    out = {}
    for kind, phases in (("plain", PLAIN_PHASES), ("spec", SPEC_PHASES)):
        recs = prof.select(kind, batch)
        if recs:
            out[kind] = phase_breakdown(recs, phases)
    return out


def efficiency_factors(row: dict, plain_profile: dict) -> dict | None:
    """Efficiency (speedup / bound) as the product of three factors, from the full-batch steps'
    mean phase times (`step_profile`): the timed speed-up over the speed-up those steps imply
    (what the steps outside them cost: admissions with their prefill, the partial-batch tail),
    that over the speed-up their forwards alone imply (the loop around the forwards), and that
    over the bound (mean against lower-quartile forward times). None without the profiles."""
    spec, plain = row["profile"].get("spec"), plain_profile.get("plain")
    if spec is None or plain is None or row["bound"] is None:
        return None
    tau = row["accept_length"]
    steps = tau * plain["step_s"] / spec["step_s"]
    forwards = tau * plain["phase_s"]["forward"] / (spec["phase_s"]["verify_forward"] + spec["phase_s"]["draft"])
    return {"outside_full_batch_steps": row["speedup"] / steps, "loop_around_forwards": steps / forwards,
            "mean_over_quartile": forwards / row["bound"]}


def speedup_bound(accept_length: float, verify_cost: float, c: float, gamma: int) -> float:
    """docs/design.md section 4: accept_length / (verify_cost + gamma * c), the speed-up if the loop
    around the forwards cost nothing (MEASUREMENT["bound"])."""
    return accept_length / (verify_cost + gamma * c)


def spec_row(batch: int, spec_cfg, timed: dict, plain_timed: dict, costs: dict, profile: dict,
             per_repeat_costs: list[dict] | None = None) -> dict:
    """One speculative row: speed against plain, acceptance, the bound from measured costs
    (pooled over the repeats: `costs`; each repeat's own: `per_repeat_costs`, for the paired
    efficiency)."""
    same = same_tokens(timed["trajectories"], plain_timed["trajectories"])
    agg = summarize_spec_stats(t.spec for t in timed["trajectories"])
    ratios = repeat_ratios(timed, plain_timed)
    speedups = {"": timed["tokens_per_s"] / plain_timed["tokens_per_s"], "_median": statistics.median(ratios)}
    paired = None
    if per_repeat_costs and all(c["c_median"] is not None for c in per_repeat_costs):
        paired = statistics.median(
            r / speedup_bound(agg["accept_length"], c["verify_cost_median"], c["c_median"], spec_cfg.gamma)
            for r, c in zip(ratios, per_repeat_costs))
    bounds = {}
    for suffix, speedup in speedups.items():
        bound = eff = None
        if costs["c"] is not None:
            bound = speedup_bound(agg["accept_length"], costs[f"verify_cost{suffix}"], costs[f"c{suffix}"],
                                  spec_cfg.gamma)
            eff = speedup / bound
        bounds.update({f"bound{suffix}": bound, f"efficiency{suffix}": eff})
    speedup = speedups[""]
    return {"batch": batch, "mode": spec_cfg.mode, "gamma": spec_cfg.gamma,
            "tree_budget": spec_cfg.tree_budget if spec_cfg.mode == "tree" else None,
            "tokens_per_s": timed["tokens_per_s"], "speedup": speedup, "speedup_median": speedups["_median"],
            "speedup_repeats": ratios,
            "accept_length": agg["accept_length"],
            "alpha": agg["accept_rate"], **bounds, "efficiency_paired": paired, "identical_to_plain": same, **costs,
            "profile": profile}


# -- arms: the engine-specific part ------------------------------------------------------------
@dataclass
class Arm:
    """One engine a speed row times. The first arm of a batch is the yardstick (plain)."""
    engine: object  # generate(prompts, params) -> trajectories
    kind: Literal["plain", "spec", "adaptive", "compare"] = "plain"  # compare: another plain engine vs the yardstick
    spec: object = None  # the SpecConfig of a "spec" or "adaptive" arm
    label: str | None = None  # the row's "arm", where one benchmark times several engines
    controller: object = None  # an "adaptive" arm's speculation controller


@dataclass
class StepParts:
    """What an arm's steps measured: the bound's parts of a speculative arm (pooled over the
    repeats, and per repeat where the profiler rode along the timed calls), and the phase
    profile (None where the engine gives none)."""
    costs: dict | None = None
    profile: dict | None = None
    per_repeat: list[dict] | None = None


def adaptive_controller(gammas):
    """The speculation controller over chains of `gammas` (plain decoding where they do not pay)."""
    from specrl.config import ControllerConfig
    from specrl.controller import SpeculationController

    return SpeculationController(ControllerConfig(gammas=tuple(gammas)))


class EmbeddedArms:
    """Plain decoding and every speculative configuration on specrl's embedded engine, fresh
    engines at each batch size. With `adaptive_gammas`, also the longest chain under the
    controller, whose statistics are warmed on `warm_prompts` (other prompts) before any
    timing. Every engine gets `engine_options` (EngineConfig fields: moe_dispatch,
    compile_forwards); with compiled forwards, each engine first decodes the prompts once
    untimed, compiling every shape it meets. The bound's parts come from the step profiler on
    the timed calls' own steps (on CUDA, where a profiler mark synchronises, from one extra
    profiled run per arm)."""
    engine = "embedded"
    measurement = MEASUREMENT

    def __init__(self, policy, draft, spec_cfgs, *, adaptive_gammas=None, engine_options: dict | None = None):
        self.policy, self.draft, self.spec_cfgs = policy, draft, list(spec_cfgs)
        self.adaptive_gammas, self.engine_options = adaptive_gammas, engine_options or {}

    def notes(self) -> dict:
        return {"engine_options": self.engine_options}

    def build(self, batch: int, prompts, params, warm_prompts=None) -> dict[object, Arm]:
        config = EngineConfig(max_batch=batch, **self.engine_options)
        engines = {"plain": EmbeddedEngine(self.policy, config)}
        for i, scfg in enumerate(self.spec_cfgs):
            engines[i] = EmbeddedEngine(self.policy, config, drafter=DrafterSpec(draft=self.draft, spec=scfg))
        adaptive, controller = self.adaptive_gammas, None
        if adaptive:
            controller = self._adaptive(engines)
        if config.compile_forwards:  # compile every shape the timed calls (and the controller's warm-up) meet
            for name, engine in engines.items():
                for batch_prompts in ([prompts, warm_prompts] if name == "adaptive" else [prompts]):
                    engine.generate(batch_prompts, params, request_ids=range(len(batch_prompts)))
            if adaptive:  # a fresh controller: steps that compiled would have misled it
                controller = self._adaptive(engines)
        if adaptive:
            for _ in range(2):
                engines["adaptive"].generate(warm_prompts, params, request_ids=range(len(warm_prompts)))
        arms = {"plain": Arm(engines["plain"])}
        arms.update({i: Arm(engines[i], "spec", scfg) for i, scfg in enumerate(self.spec_cfgs)})
        if adaptive:
            arms["adaptive"] = Arm(engines["adaptive"], "adaptive", self._adaptive_config(), controller=controller)
        return arms

    def _adaptive_config(self):
        return max((c for c in self.spec_cfgs if c.mode == "chain"), key=lambda c: c.gamma)

    def _adaptive(self, engines: dict):
        """(Re)install the longest chain under a fresh controller in engines["adaptive"]; returns the controller."""
        controller = adaptive_controller(self.adaptive_gammas)
        engine = engines.setdefault("adaptive", EmbeddedEngine(self.policy, engines["plain"].config))
        engine.install_draft(DrafterSpec(draft=self.draft, spec=self._adaptive_config()), controller)
        return controller

    @staticmethod
    def _in_turns(arms) -> bool:
        return arms["plain"].engine.device.type == "cpu"  # a CUDA mark synchronises the device: profile apart there

    def profiled_in_turns(self, arms) -> list:
        return [name for name, a in arms.items() if a.kind != "adaptive"] if self._in_turns(arms) else []

    def step_parts(self, arms, timed, prompts, params, batch: int, repeats: int) -> dict[object, StepParts]:
        in_timed = self._in_turns(arms)
        profiled = [name for name, a in arms.items() if a.kind != "adaptive"]
        profs = {name: timed[name]["profiler"] if in_timed else profiled_run(arms[name].engine, prompts, params)[1]
                 for name in profiled}
        parts = {"plain": StepParts(profile=step_profile(profs["plain"], batch))}
        for name in profiled[1:]:
            gamma = arms[name].spec.gamma
            per_repeat = ([engine_step_costs(profs["plain"], profs[name], batch, gamma, call=r) for r in range(repeats)]
                          if in_timed else None)
            parts[name] = StepParts(engine_step_costs(profs["plain"], profs[name], batch, gamma),
                                    step_profile(profs[name], batch), per_repeat)
        return parts

    def close(self) -> None:
        pass


class VLLMArms:
    """vLLM plain ("vllm-plain", the yardstick), vLLM EAGLE-3 chains of `gamma` ("vllm-eagle3",
    and "vllm-online" with another draft) and specrl's embedded engine without speculation
    ("embedded-plain"): one live engine per arm (`engines`, as `start` makes them) serves
    every batch size, fed in groups of `batch`. The bound's parts come from one run of each
    vLLM arm under the step timers after the timed ones."""
    engine = "vllm"
    measurement = VLLM_MEASUREMENT

    def __init__(self, engines: dict, gamma: int):
        self.engines, self.gamma = engines, gamma

    @classmethod
    def start(cls, policy, draft, gamma: int, max_batch: int, online_draft=None) -> "VLLMArms":
        """One engine per arm (vLLM starts on first use)."""
        from rollout.drafters import SpecConfig
        from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        cfg = VLLMEngineConfig(max_batch=max_batch)
        engines = {"vllm-plain": VLLMEngine(policy, cfg),
                   "vllm-eagle3": VLLMEngine(policy, cfg, drafter=DrafterSpec(draft=draft, spec=SpecConfig(gamma=gamma)))}
        if online_draft is not None:
            engines["vllm-online"] = VLLMEngine(policy, cfg, drafter=DrafterSpec(draft=online_draft, spec=SpecConfig(gamma=gamma)))
        engines["embedded-plain"] = EmbeddedEngine(policy, EngineConfig(max_batch=max_batch))
        return cls(engines, gamma)

    def notes(self) -> dict:
        return {"gamma": self.gamma}

    def build(self, batch: int, prompts, params, warm_prompts=None) -> dict[str, Arm]:
        from rollout.drafters import SpecConfig

        def kind(name):
            return "plain" if name == "vllm-plain" else "compare" if name == "embedded-plain" else "spec"

        return {name: Arm(Grouped(e, batch), kind(name), SpecConfig(gamma=self.gamma) if kind(name) == "spec" else None,
                          label=name) for name, e in self.engines.items()}

    def profiled_in_turns(self, arms) -> list:
        return []

    def step_parts(self, arms, timed, prompts, params, batch: int, repeats: int) -> dict[str, StepParts]:
        from rollout.vllm_profile import StepTimer, vllm_step_costs

        timers = {}
        for name, arm in arms.items():
            if name.startswith("vllm"):
                with StepTimer(self.engines[name]) as timers[name]:
                    arm.engine.generate(prompts, params, request_ids=range(len(prompts)))
        return {name: StepParts(vllm_step_costs(timers["vllm-plain"], timers[name], batch, self.gamma), {})
                for name, arm in arms.items() if arm.kind == "spec"}

    def close(self) -> None:
        for e in self.engines.values():
            e.shutdown()


# -- the measurement ----------------------------------------------------------------------------
def measure_batch(arm_set, prompts, params, batch: int, *, repeats: int = 3, warm_prompts=None) -> list[dict]:
    """Every arm of `arm_set` (EmbeddedArms or VLLMArms) at one batch size, on the same prompts:
    timed in turns, the bound's parts measured on the arms' own steps (`arm_set.step_parts`).
    One row per arm, the yardstick (plain) first."""
    arms = arm_set.build(batch, prompts, params, warm_prompts)
    timed = timed_generate_interleaved({name: a.engine for name, a in arms.items()}, prompts, params, repeats,
                                       profile=arm_set.profiled_in_turns(arms))
    parts = arm_set.step_parts(arms, timed, prompts, params, batch, repeats)
    yard = next(iter(arms))
    plain = timed[yard]
    rows = []
    for name, arm in arms.items():
        r, label = timed[name], ({"arm": arm.label} if arm.label else {})
        if name == yard:
            profile = parts[name].profile if name in parts else None
            row = {"batch": batch, "mode": "plain", **label, "tokens_per_s": plain["tokens_per_s"], "speedup": 1.0,
                   "others_busy_cores": plain.get("others_busy_cores"),  # over every arm's timed calls
                   **({} if profile is None else {"profile": profile})}
        elif arm.kind == "spec":
            p = parts[name]
            row = spec_row(batch, arm.spec, r, plain, p.costs, p.profile, p.per_repeat)
            if "profile" in rows[0]:
                row["efficiency_factors"] = efficiency_factors(row, rows[0]["profile"])
            row.update(label)
        elif arm.kind == "adaptive":
            agg = summarize_spec_stats(t.spec for t in r["trajectories"])
            controller = arm.controller
            bucket = controller.summary()["buckets"].get(controller.bucket_of(batch), {})
            row = {"batch": batch, "mode": "adaptive", **label, "gamma": None,
                   "gammas": list(arm_set.adaptive_gammas),
                   "tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / plain["tokens_per_s"],
                   "accept_length": agg["accept_length"], "alpha": agg["accept_rate"],
                   "identical_to_plain": same_tokens(r["trajectories"], plain["trajectories"]),
                   "controller_gamma": bucket.get("gamma")}
        else:  # another plain engine against the yardstick
            row = {"batch": batch, "mode": "plain", **label, "tokens_per_s": r["tokens_per_s"],
                   "speedup": r["tokens_per_s"] / plain["tokens_per_s"],
                   f"identical_to_{yard.replace('-', '_')}": same_tokens(r["trajectories"], plain["trajectories"])}
        rows.append(row)
    return rows


def _fmt(v, spec: str = ".2f") -> str:
    return "" if v is None else (str(v) if isinstance(v, (bool, str)) else format(v, spec))


def format_row(row: dict) -> str:
    arm = f"{row['arm']} " if "arm" in row else ""  # rows of several engines name theirs
    if row["mode"] == "plain":
        return f"{arm}batch {row['batch']:>3} plain: {row['tokens_per_s']:8.1f} tok/s  x{row.get('speedup', 1.0):.2f}"
    tag = (f"adaptive g={row.get('controller_gamma')}" if row["mode"] == "adaptive"
           else f"{row['mode']} g={row['gamma']}" + (f" n={row['tree_budget']}" if row.get("tree_budget") else ""))
    return (f"{arm}batch {row['batch']:>3} {tag:>14}: {row['tokens_per_s']:8.1f} tok/s  x{row['speedup']:.2f}  "
            f"tau {_fmt(row.get('accept_length'))}  alpha {_fmt(row.get('alpha'))}  c {_fmt(row.get('c'), '.3f')}  "
            f"verify {_fmt(row.get('verify_cost'))}  bound {_fmt(row.get('bound'))}  eff {_fmt(row.get('efficiency'))}  "
            f"(medians: x{_fmt(row.get('speedup_median'))} bound {_fmt(row.get('bound_median'))} "
            f"eff {_fmt(row.get('efficiency_median'))}, paired eff {_fmt(row.get('efficiency_paired'))})  "
            f"identical {_fmt(row.get('identical_to_plain'))}"
            + ("  eff = " + " x ".join(f"{k} {v:.3f}" for k, v in row["efficiency_factors"].items())
               if row.get("efficiency_factors") else ""))


TABLE_COLUMNS = (("batch", "d"), ("mode", "s"), ("tokens_per_s", ".1f"), ("speedup", ".2f"), ("accept_length", ".2f"),
                 ("alpha", ".2f"), ("c", ".3f"), ("verify_cost", ".2f"), ("bound", ".2f"), ("efficiency", ".2f"),
                 ("speedup_median", ".2f"), ("bound_median", ".2f"), ("efficiency_median", ".2f"),
                 ("efficiency_paired", ".2f"), ("identical_to_plain", "s"))


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (the README's form)."""
    head = ["batch", "mode", "tokens/s", "speedup", "tau", "alpha", "c", "verify", "bound", "eff", "speedup (median)",
            "bound (median)", "eff (median)", "eff (paired)", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for key, spec in TABLE_COLUMNS:
            v = r.get(key)
            if key == "mode" and r["mode"] == "adaptive":
                v = f"adaptive (g={r.get('controller_gamma')})"
            elif key == "mode" and r["mode"] != "plain":
                v = f"{r['mode']} g={r['gamma']}" + (f" n={r['tree_budget']}" if r.get("tree_budget") else "")
            if key == "mode" and "arm" in r:
                v = f"{r['arm']} ({v})"
            cells.append(_fmt(v, spec) if not isinstance(v, str) else v)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spec_configs(gammas, tree_budgets, tree_depth: int, tree_topk: int) -> list:
    """Chains of each length in `gammas`, then trees of each budget in `tree_budgets`."""
    from rollout.drafters import SpecConfig

    chains = [SpecConfig(mode="chain", gamma=g) for g in gammas]
    trees = [SpecConfig(mode="tree", gamma=tree_depth, tree_topk=tree_topk, tree_budget=n) for n in tree_budgets]
    return chains + trees


def bench_speed(task_name: str, preset_name: str, out_dir, batches: list[int], *, engine: str = "embedded",
                seed: int = 0, cache_dir=None, gammas=None, tree_budgets=None, tree_depth: int = 4,
                tree_topk: int = 4, prompts_per_batch: int = 3, temperature: float = 0.0, repeats: int | None = None,
                engine_options: dict | None = None, online_draft_dir=None, plots: bool = True, log=print) -> dict:
    """The speed table (module docstring) at every batch size, each row logged as it comes, saved
    as DIR/summary.json (with the plots of experiments.plots) and printed as a Markdown table.
    Chain lengths default to the preset's (`RunPreset.cotrain.spec`) and tree budgets to 12;
    the adaptive arm chooses among 1..the longest chain, its controller warmed on prompts the
    timed runs do not use. `repeats` defaults to 5 on the embedded engine and 3 on vLLM; vLLM
    runs one greedy chain length, no trees."""
    gammas = list(gammas or [preset_chain_length(preset_name)])
    if engine == "vllm":
        from rollout.vllm_engine import require_vllm

        require_vllm()  # one line naming the fix, before the policy is built
        if len(gammas) != 1 or tree_budgets or engine_options or temperature != 0.0:
            raise ValueError("--engine vllm times greedy chains of one length: give one --gamma and no "
                             "--tree-budgets, --moe-dispatch, --compile-forwards or --temperature")
    elif engine == "embedded":
        EngineConfig(**(engine_options or {}))  # a bad value fails before the expensive setup
        if online_draft_dir is not None:
            raise ValueError("--online-draft needs --engine vllm")
    else:
        raise ValueError(f"unknown engine {engine!r}; choose embedded or vllm")
    repeats = repeats or (3 if engine == "vllm" else 5)
    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, temperature)
    if engine == "vllm":
        online = None
        if online_draft_dir is not None:
            from draft_models.checkpoint import load_draft

            online = load_draft(online_draft_dir, policy).eval()
        arm_set = VLLMArms.start(policy, draft, gammas[0], max(batches), online)
        adaptive = None
    else:
        configs = spec_configs(gammas, (12,) if tree_budgets is None else tree_budgets, tree_depth, tree_topk)
        adaptive = tuple(range(1, max(gammas) + 1))
        arm_set = EmbeddedArms(policy, draft, configs, adaptive_gammas=adaptive, engine_options=engine_options)
    rows = []
    try:
        for b in batches:
            n = b * prompts_per_batch
            prompts = prompts_for(n)
            warm = prompts_for(2 * n)[n:] if adaptive else None
            new = measure_batch(arm_set, prompts, params, b, repeats=repeats, warm_prompts=warm)
            for row in new:
                log(format_row(row))
            rows += new
    finally:
        arm_set.close()
    summary = save_summary(out_dir, {"benchmark": "speed", "engine": engine, "task": task_name, "preset": preset_name,
                                     "temperature": temperature, "model": model_summary(policy, draft),
                                     "measurement": arm_set.measurement, "repeats": repeats,
                                     "prompts_per_batch": prompts_per_batch, **arm_set.notes(), "rows": rows})
    log(format_table(summary["rows"]))
    if plots:
        from experiments.plots import speed_plots

        speed_plots(out_dir)
    return summary


def headline(summary: dict) -> list[tuple[str, str]]:
    """The figures a speed run ends with: the best speculative row at each batch size."""
    out = []
    for b in sorted({r["batch"] for r in summary["rows"]}):
        spec = [r for r in summary["rows"] if r["batch"] == b and r["mode"] != "plain"]
        if spec:
            r = max(spec, key=lambda r: r["speedup"])
            tag = r.get("arm") or (f"adaptive (g={r.get('controller_gamma')})" if r["mode"] == "adaptive"
                                   else f"{r['mode']} g={r['gamma']}" + (f" n={r['tree_budget']}" if r.get("tree_budget")
                                                                          else ""))
            bound = "" if r.get("bound") is None else f", bound x{r['bound']:.2f}"
            out.append((f"batch {b}", f"best x{r['speedup']:.2f}: {tag} (accept length {_fmt(r.get('accept_length'))}"
                                      f"{bound})"))
    return out


__all__ = ["bench_speed", "measure_batch", "EmbeddedArms", "VLLMArms", "Arm", "MEASUREMENT", "VLLM_MEASUREMENT",
           "spec_row", "engine_step_costs", "step_profile", "format_row", "format_table", "headline"]
