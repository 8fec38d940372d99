"""The `specrl` commands as dataclasses: one per command, its fields the command's flags.

A field is declared with `flag`: its help text, default, bounds and choices, its type from the
annotation. specrl.cli builds each subcommand's argparse parser from these fields, then makes
the command from the parsed values: `__post_init__` checks the rules between flags (the one
place they are checked, before any work), and `call()` gives the arguments of the command's
function (specrl.cli.COMMANDS[KEY]); a command class's docstring is its line in the command
list. Constants behind heavy imports (model limits, preset names) are named as "module:NAME" and
looked up when the parser is built, so importing this module stays cheap.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

DEFAULT_PRESET = "quick"
REAL_PRESET = "real"  # the preset family of the real model (specrl.presets, experiments.drift)
RL_PRESETS = "specrl.presets:RL_PRESETS"
DRIFT_PRESETS = "experiments.drift:DRIFT_PRESETS"
MAX_RL_STEPS = "specrl.presets:MAX_RL_STEPS"
MAX_BATCH = "rollout.engine:MAX_BATCH"
MAX_SPEC_DEPTH = "rollout.drafters:MAX_SPEC_DEPTH"
MAX_TREE_BUDGET = "rollout.drafters:MAX_TREE_BUDGET"
MOE_DISPATCHES = "target_training.model:MOE_DISPATCHES"

TASK_HELP = ("a built-in task (arith, sort; word and champ: worked problems for a real model) or a local task file: .jsonl (one JSON object per line), .json (JSON lines or one array of objects) or .parquet, "
             "with string fields 'prompt' and 'answer' (exact-match reward on the text after the last 'ans ', "
             "else the whole completion) and an optional 'split' ('train', or one of heldout/test/eval/validation/"
             "valid/val; without it a stable hash of the prompt holds out 1 prompt in 8)")
PRESET_HELP = f"run preset (default: {DEFAULT_PRESET}, or {REAL_PRESET} with --model)"


def resolve(target: str):
    """The object a "module:name" string names, importing its module."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _value(v):
    """A bound or choice list, looked up if it is named as "module:NAME"."""
    return resolve(v) if isinstance(v, str) else v


# -- flag types: bounds checked where the flag is parsed, so argparse's message names the flag ---
def _int_in(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}" if hi is not None
                                             else f"must be >= {lo}, got {v}")
        return v
    parse.bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    return parse


def int_list(most: int):
    """A flag type: a comma-separated list of positive integers, each at most `most`."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
        if max(values) > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {max(values)}")
        return values
    parse.bounds = f"comma-separated, each 1..{most}"
    return parse


def _temperature(text: str) -> float:
    from rollout.protocol import SamplingParams

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    try:
        SamplingParams(temperature=v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("temperature ")) from None
    return v


_temperature.bounds = "finite, >= 0"


def _seed(text: str) -> int:
    from specrl.rl_setup import check_seed

    try:
        v = int(text)
        check_seed(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--seed ") if str(e).startswith("--seed")
                                         else f"must be an integer, got {text!r}") from None
    return v


def _name_list(text: str) -> list[str]:
    """Comma-separated names (the command checks each against its own list before any work)."""
    return [a.strip() for a in text.split(",") if a.strip()]


_name_list.bounds = "comma-separated"


# -- fields as flags ---------------------------------------------------------------------------
def flag(default=MISSING, help: str = "", *, lo: int | None = None, hi: int | str | None = None,
         most: int | str | None = None, choices: tuple | str | None = None, parse=None,
         metavar: str | None = None, nargs: str | None = None, folder: bool = False):
    """A dataclass field that is a command-line flag: `--name-with-dashes`, with `help` as its
    --help text. Without a default it is required. An int is bounded by [lo, hi] (hi None: no
    upper bound); a tuple of ints is a comma-separated list, each in 1..most; `choices` overrides
    a Literal's; `parse` replaces the parsing the annotation implies; `nargs` takes several
    values; `folder` marks an output folder, checked to be one before any work. `hi`, `most` and
    `choices` may be named as "module:NAME", looked up when the parser is built."""
    meta = {"help": help, "lo": lo, "hi": hi, "most": most, "choices": choices, "parse": parse,
            "metavar": metavar, "nargs": nargs, "folder": folder}
    return field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    """The flag of a field, as typed on the command line."""
    return "--" + f.name.replace("_", "-")


def _check_folder(flag: str, path: Path | None) -> None:
    """A folder argument must be a folder or creatable as one: its nearest existing ancestor
    must be a folder (else mkdir fails later with NotADirectoryError or FileExistsError)."""
    if path is None:
        return
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        where = "" if p == Path(path) else f" ({p} is a file)"
        raise ValueError(f"{flag} {path} is not a folder{where}")


@dataclass(kw_only=True)
class Command:
    """A command line of one command; subclasses declare its flags as fields."""
    KEY: ClassVar[str]  # its function in specrl.cli.COMMANDS
    SWITCH: ClassVar[str | None] = None  # a variant's flag: set, the command line runs this class

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.metadata.get("folder"):
                _check_folder(flag_name(f), getattr(self, f.name))

    def call(self) -> tuple[tuple, dict]:
        """The positional and keyword arguments of the command's function."""
        raise NotImplementedError


@dataclass(kw_only=True)
class Run(Command):
    """A command on a run preset and a task, trained and cached here."""
    preset: str | None = flag(None, PRESET_HELP, choices=RL_PRESETS)
    model: str | None = flag(None, f"a real pretrained model instead of a toy MoE trained here: smollm2-135m (the "
                                   f".[real] extra; selects the preset {REAL_PRESET}, whose task is word)",
                             metavar="NAME")
    out: Path = flag(help="output folder", folder=True)
    seed: int = flag(0, "random seed", parse=_seed)
    cache_dir: Path | None = flag(None, "where SFT warm starts and offline drafts are cached (default ~/.cache/specrl "
                                        "or $SPECRL_CACHE)", folder=True)
    task: str | None = flag(None, TASK_HELP + " (default: the preset's, arith for the toy presets)")

    def __post_init__(self) -> None:
        """--preset and --task from --model where they are not given; a real model with another
        model's preset is refused."""
        super().__post_init__()
        if self.model is not None:
            from target_training.real_models import real_model

            real_model(self.model)  # an unknown name fails before anything is loaded
        self.preset = self.preset or (REAL_PRESET if self.model else DEFAULT_PRESET)
        preset = self._run_preset()
        if self.model is not None and preset.model != self.model:
            raise ValueError(f"--model {self.model} runs with a preset of that model ({REAL_PRESET}); "
                             f"--preset {self.preset} is the toy model {preset.model!r}")
        self.task = self.task or preset.task

    def _run_preset(self):
        from specrl.presets import get_preset

        return get_preset(self.preset)

    def _common(self) -> dict:
        return {"seed": self.seed, "cache_dir": self.cache_dir}

    def _task_preset_out(self) -> tuple:
        return self.task, self.preset, self.out


STEPS_HELP = "GRPO steps (default: the preset's)"
Engine = Literal["embedded", "vllm"]


def device_flag():
    """--device of the commands that run the RL loop (specrl.rl_setup.resolve_device)."""
    return flag("auto", "where the policy, its trainer, the draft and the embedded engine run: auto (a CUDA GPU "
                        "where torch sees one and the engine is embedded, else the CPU), cpu, cuda or cuda:N; the SFT "
                        "warm start and the offline draft's cache are the CPU's either way", metavar="DEVICE")


def check_device(command: Command) -> None:
    """The --device of `command` on its --engine, before any work (one line naming the problem)."""
    from specrl.rl_setup import resolve_device

    resolve_device(command.device, command.engine)


@dataclass(kw_only=True)
class TrainRL(Run):
    """SFT warm start + GRPO on a verifiable task"""
    KEY = "train-rl"
    steps: int | None = flag(None, STEPS_HELP, lo=1, hi=MAX_RL_STEPS)
    resume: bool = flag(False, "continue the run in --out from its last checkpoint")
    no_progress: bool = flag(False, "no progress bar")
    spec: Literal["off", "frozen", "online"] = flag(
        "off", "speculative rollouts: off, with the offline draft frozen, or co-trained online")
    drafter: Literal["eagle3", "history", "hybrid"] = flag(
        "eagle3", "who drafts: the EAGLE-3 head; history: the group's siblings and earlier answers to the same "
                  "prompt (no model; with --spec frozen); hybrid: per row, whichever promises more")
    engine: Engine = flag("embedded", "rollout engine: specrl's embedded PyTorch engine, or vLLM (installed "
                                       "separately)")
    reproducible: bool = flag(False, "fix every speculation and co-training decision at the start instead of "
                                     "timing it: the preset's chain at every step, draft updates by count; two "
                                     "runs with one seed, or a run and its resume, then train alike")
    device: str = device_flag()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_device(self)
        if self.drafter != "eagle3" and self.spec == "off":
            raise ValueError(f"--drafter {self.drafter} needs --spec frozen or online")
        if self.drafter == "history" and self.spec == "online":
            raise ValueError("--drafter history has no draft to train: use --spec frozen (or --drafter hybrid)")
        if self.drafter == "hybrid" and self.engine != "embedded":
            raise ValueError("--drafter hybrid runs on the embedded engine (vLLM takes one speculative method)")

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "resume": self.resume, "steps": self.steps,
                                         "progress": not self.no_progress, "spec": self.spec,
                                         "engine": self.engine, "drafter": self.drafter,
                                         "reproducible": self.reproducible, "device": self.device}


@dataclass(kw_only=True)
class TrainDraft(Run):
    """train the starting EAGLE-3 draft offline on a policy's rollouts"""
    KEY = "train-draft"
    policy: Path | None = flag(None, "policy checkpoint folder (e.g. RUN/ckpt); default: the preset's SFT warm start")

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "policy_path": self.policy}


@dataclass(kw_only=True)
class Drift(Run):
    """the drift experiment: plain / frozen / online / reference drafts as GRPO moves the policy"""
    KEY = "drift"
    preset: str | None = flag(None, PRESET_HELP, choices=DRIFT_PRESETS)
    no_progress: bool = flag(False, "no progress bar")
    reference_every: int | None = flag(None, "retrain the reference draft at every N-th evaluation point (0: at the "
                                             "end only; default: the preset's, every point for full)",
                                       lo=0, metavar="N")
    engine: Engine = flag("embedded", "rollout and evaluation engine (vllm: installed separately; arms decode "
                                       "greedily)")
    steps: int | None = flag(None, STEPS_HELP + "; fewer shortens the run (a reduced run: say so when quoting it)",
                             lo=1, hi=MAX_RL_STEPS)
    async_staleness: tuple[int, ...] | None = flag(
        None, "the asynchronous variant inside AReaL's loop (areal installed: tests/lanes/areal.sh), one run per "
              "staleness bound, e.g. 0 1 4 (0: synchronous); frozen and online arms only",
        lo=0, hi=64, nargs="+", metavar="ETA")
    async_windows: tuple[Literal["wait", "between"], ...] = flag(
        ("wait",), "(--async-staleness) where the draft trains: while the trainer waits for its batch, and/or after "
                   "the policy update", nargs="+")
    deep_target: str | None = flag(None, "after the run, the same speed-against-batch sweep on this model preset's "
                                         "SFT policy and offline draft, e.g. speed (a 12-layer target); '' for none "
                                         "(default: the preset's, speed for full)", metavar="PRESET")
    train_every: int | None = flag(None, "the online draft trains in one burst every N RL steps (1: at every "
                                         "step's boundary; default: the preset's co-training configuration)",
                                   lo=1, hi=99, metavar="N")
    device: str = device_flag()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_device(self)

    def _run_preset(self):
        return resolve(DRIFT_PRESETS)[self.preset].rl

    def call(self) -> tuple[tuple, dict]:
        return (self.preset, self.out), {**self._common(), "task": self.task, "progress": not self.no_progress,
                                         "reference_every": self.reference_every, "engine": self.engine,
                                         "rl_steps": self.steps, "deep_target": self.deep_target,
                                         "train_every": self.train_every, "device": self.device}


@dataclass(kw_only=True)
class AsyncDrift(Drift):
    """the drift experiment's asynchronous variant, inside AReaL's loop"""
    KEY = "drift --async-staleness"
    SWITCH = "async_staleness"

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.engine != "embedded" or self.deep_target is not None or self.reference_every is not None
                or self.train_every is not None):
            raise ValueError("--async-staleness runs the embedded engine without reference, deep target or bursts; "
                             "drop --engine, --reference-every, --deep-target and --train-every")
        if self.device != "auto" and not self.device.startswith("cpu"):
            raise ValueError("--async-staleness runs on the CPU (AReaL's loop here); drop --device")

    def call(self) -> tuple[tuple, dict]:
        return (self.preset, self.out), {**self._common(), "task": self.task,
                                         "staleness": tuple(self.async_staleness), "rl_steps": self.steps,
                                         "draft_windows": tuple(self.async_windows)}


def _batches(default: tuple[int, ...] = (1, 4, 16), help: str = "batch sizes"):
    return flag(default, help, most=MAX_BATCH)


def _temperature_flag():
    return flag(0.0, "sampling temperature (0: greedy)", parse=_temperature)


@dataclass(kw_only=True)
class BenchGenerate(Run):
    """plain generation tokens/s per batch size"""
    KEY = "bench generate"
    batches: tuple[int, ...] = _batches()

    def call(self) -> tuple[tuple, dict]:
        return (*self._task_preset_out(), self.batches), self._common()


@dataclass(kw_only=True)
class BenchSpeed(Run):
    """plain vs chain, tree and adaptive speculative decoding per batch size, with the bound; sweeps
    with --gammas and --tree-budgets"""
    KEY = "bench speed"
    batches: tuple[int, ...] = _batches()
    gammas: tuple[int, ...] | None = flag(None, "chain lengths, one chain arm each; the adaptive arm picks among "
                                                "1..the longest (default: the preset's chain length, 4 for quick and "
                                                "6 for speed)", most=MAX_SPEC_DEPTH)
    tree_budgets: tuple[int, ...] | None = flag(None, "draft tokens per tree, one tree arm each (depth 4, top-4; "
                                                      "default 12; embedded only)", most=MAX_TREE_BUDGET)
    temperature: float = _temperature_flag()
    repeats: int | None = flag(None, "timed calls per arm and batch, after a warm-up (default: 5 embedded, 3 vllm); "
                                     "the best is reported, the bound's parts pool all of them", lo=1, hi=100)
    prompts_per_batch: int = flag(3, "requests per batch slot: batch B decodes B * N prompts, so the engine refills "
                                     "each slot N - 1 times and ends with a partial-batch tail",
                                  lo=1, hi=64, metavar="N")
    moe_dispatch: str = flag("exact", "(embedded) how the target's MoE runs decode and verify blocks: exact (bitwise "
                                      "the training dispatch) or dense (every expert on every token at small blocks: "
                                      "no host read, equal to exact to rounding)", choices=MOE_DISPATCHES)
    compile_forwards: bool = flag(False, "(embedded) compile the target's small decode/verify blocks into static "
                                         "graphs (torch.compile, eager fallback; the draft stays eager); each engine "
                                         "decodes the prompts once untimed first")
    engine: Engine = flag("embedded", "embedded: plain/chain/tree/adaptive on specrl's engine; vllm: vLLM plain vs "
                                       "EAGLE-3 vs the embedded engine (greedy, one chain length)")
    online_draft: Path | None = flag(None, "(--engine vllm) a draft folder to time beside the offline draft, e.g. a "
                                           "drift run's", metavar="DIR")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine == "vllm":
            if self.moe_dispatch != "exact" or self.compile_forwards:
                raise ValueError("--moe-dispatch and --compile-forwards are options of the embedded engine; "
                                 "drop them with --engine vllm")
            if self.temperature != 0.0:
                raise ValueError("--engine vllm benchmarks greedy decoding only (its rows check token identity, "
                                 "which sampled speculation on vLLM keeps in law only); drop --temperature")
            if self.tree_budgets is not None:
                raise ValueError("--tree-budgets: --engine vllm runs chains only; drop it")
            if self.gammas is not None and len(self.gammas) != 1:
                raise ValueError("--gammas: --engine vllm times one chain length; give one")
        elif self.online_draft is not None:
            raise ValueError("--online-draft needs --engine vllm")

    def call(self) -> tuple[tuple, dict]:
        options = {"moe_dispatch": self.moe_dispatch, "compile_forwards": self.compile_forwards}
        return (*self._task_preset_out(), self.batches), {
            **self._common(), "engine": self.engine, "gammas": self.gammas, "tree_budgets": self.tree_budgets,
            "temperature": self.temperature, "repeats": self.repeats, "prompts_per_batch": self.prompts_per_batch,
            "online_draft_dir": self.online_draft, "engine_options": options if self.engine == "embedded" else None}


@dataclass(kw_only=True)
class BenchProfile(Run):
    """where plain and chain-speculative engine steps spend their time"""
    KEY = "bench profile"
    batches: tuple[int, ...] = _batches()
    temperature: float = _temperature_flag()
    moe_dispatch: str = flag("exact", "as for bench speed", choices=MOE_DISPATCHES)
    compile_forwards: bool = flag(False, "as for bench speed")

    def call(self) -> tuple[tuple, dict]:
        options = {"moe_dispatch": self.moe_dispatch, "compile_forwards": self.compile_forwards}
        return (*self._task_preset_out(), self.batches), {**self._common(), "temperature": self.temperature,
                                                          "engine_options": options}


@dataclass(kw_only=True)
class BenchOverlap(Run):
    """RL step time with no draft training, sequential and overlapped co-training"""
    KEY = "bench overlap"
    timed_steps: int = flag(8, "timed RL steps per arm", lo=1, hi=MAX_RL_STEPS)
    warmup: int = flag(2, "untimed RL steps per arm before them", lo=0)
    block: int = flag(4, "consecutive RL steps per arm before the next arm's turn", lo=1)
    phases: bool = flag(False, "instead: a rollout alone, with draft updates in line, and with them overlapped, per "
                               "batch size")
    batches: tuple[int, ...] = _batches((1, 4, 16, 64), "(--phases) rollout batch sizes")
    updates: int = flag(2, "(--phases) draft updates per rollout", lo=1)

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "steps": self.timed_steps, "warmup": self.warmup,
                                         "block": self.block}


@dataclass(kw_only=True)
class BenchOverlapPhases(BenchOverlap):
    """a rollout alone, with draft updates in line, and with them overlapped, per batch size"""
    KEY = "bench overlap --phases"
    SWITCH = "phases"

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "batches": self.batches, "updates": self.updates}


@dataclass(kw_only=True)
class BenchPrecision(Run):
    """speculative against plain decoding, token by token, in fp32 and bf16 (greedy and coupled sampling)"""
    KEY = "bench precision"
    prompts: int = flag(256, "held-out prompts", lo=1, hi=100_000)
    batch: int = flag(16, "engine batch size", lo=1, hi=1024)

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "n_prompts": self.prompts, "batch": self.batch}


@dataclass(kw_only=True)
class BenchUpdate(Run):
    """one GRPO policy update on the preset's first rollout batch: logits at every position against the answer
    positions only, fp32 against bf16; seconds, log-prob gaps and the weight change"""
    KEY = "bench update"
    repeats: int = flag(3, "timed updates per arm (the first left out when more than one)", lo=1, hi=100)

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "repeats": self.repeats}


@dataclass(kw_only=True)
class BenchReal(Command):
    """plain decoding of a real pretrained model on the embedded engine (fp32, bf16) against HF generate, per
    batch size"""
    KEY = "bench real"
    model: str = flag("smollm2-135m", "a real model (target_training.real_models)")
    out: Path = flag(help="output folder", folder=True)
    cache_dir: Path | None = flag(None, "where the converted model is cached (default ~/.cache/specrl or "
                                        "$SPECRL_CACHE)", folder=True)
    batches: tuple[int, ...] = _batches((1, 8, 32))
    max_new_tokens: int = flag(64, "new tokens per sequence", lo=1, hi=4096)
    repeats: int = flag(3, "timed repeats per batch size", lo=1)
    no_hf: bool = flag(False, "leave out the HF generate arm")
    eagle3: bool = flag(False, "also EAGLE-3 chains in fp32 with the model's offline draft (trained once on its own "
                               "answers, cached)")
    draft_steps: int | None = flag(None, "(--eagle3) offline draft training steps", lo=1, hi=1_000_000)
    gamma: int = flag(4, "(--eagle3) chain length", lo=1, hi=MAX_SPEC_DEPTH)
    dtypes: tuple[str, ...] = flag(("fp32", "bf16"), "embedded engine dtypes: fp32, bf16", parse=_name_list)
    engine: Engine = flag("embedded", "vllm: also vLLM in fp32, plain and (--eagle3) EAGLE-3 with the same draft")

    def __post_init__(self) -> None:
        super().__post_init__()
        from target_training.real_models import real_model

        real_model(self.model)  # an unknown name fails before anything is loaded
        bad = [d for d in self.dtypes if d not in ("fp32", "bf16")]
        if bad or not self.dtypes:
            raise ValueError(f"--dtypes: choose from fp32, bf16 (got {','.join(self.dtypes)})")
        if self.eagle3 and "fp32" not in self.dtypes:
            raise ValueError("--eagle3 speculates in fp32: include fp32 in --dtypes")

    def call(self) -> tuple[tuple, dict]:
        return (self.model, self.out), {"batches": self.batches, "max_new_tokens": self.max_new_tokens,
                                        "repeats": self.repeats, "hf": not self.no_hf, "cache_dir": self.cache_dir,
                                        "eagle3": self.eagle3, "draft_steps": self.draft_steps, "gamma": self.gamma,
                                        "dtypes": tuple(self.dtypes), "engine": self.engine}


@dataclass(kw_only=True)
class BenchRL(Run):
    """the whole RL step with speculation off, frozen and online, arms taking turns in segments of steps; split
    into rollout, update, co-training and the rest"""
    KEY = "bench rl"
    engine: Engine = flag("embedded", "rollout engine")
    arms: tuple[str, ...] = flag(
        ("off", "frozen", "online"),
        "comma-separated arms: off, frozen, online, online-unpriced (draft updates not priced by the rollout time "
        "speculation saves), online-unpriced-N (N updates every step), online-every-N (the budget's updates in one burst every N steps), online-zN (held-out gains counted less N standard errors), frozen-fixed and online-fixed (the preset's chain at every step, no adaptive "
        "controller), off-b (a second off run: the noise floor), frozen-b (a second frozen run: the noise floor of "
        "a ratio between speculating arms), history (drafts from the group's siblings and "
        "earlier answers, no model), history-sib / history-past (siblings only / earlier answers only), hybrid "
        "(history or the online EAGLE-3 chain per row), hybrid-tree (both chains as two branches of one verified "
        "tree)", parse=_name_list)
    prompt_pool: int | None = flag(None, "training prompts the steps sample from (default: the preset's); a small "
                                         "pool revisits prompts sooner, as epochs do", lo=1)
    steps: int | None = flag(None, "RL steps per arm (default: the preset's bench_steps, 20 for most)", lo=1,
                             hi=MAX_RL_STEPS)
    segment: int = flag(5, "consecutive RL steps per arm before the next arm's turn", lo=1)
    warmup: int = flag(1, "first steps left out of the medians", lo=0)
    vllm_schedule: bool = flag(False, "(--engine vllm) speculate by batch size, from speed-ups measured on vLLM "
                                      "first (default: the preset's chain at every step)")
    device: str = device_flag()
    report_unfinished: bool = flag(False, "run nothing: summarize the whole segments every arm of the unfinished "
                                          "run in --out completed (killed or out of time) into "
                                          "summary-unfinished.json; give the run's --preset/--model, --arms, "
                                          "--segment and --engine")
    report_again: bool = flag(False, "run nothing: summarize the finished run in --out again, from the steps its "
                                     "arms saved, with this code (figures its report gained since) into "
                                     "summary-again.json; give the run's --preset/--model, --arms, --segment and "
                                     "--engine")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_device(self)

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {**self._common(), "engine": self.engine, "arms": self.arms,
                                         "steps": self.steps, "segment": self.segment, "warmup": self.warmup,
                                         "vllm_schedule": self.vllm_schedule, "prompt_pool": self.prompt_pool,
                                         "device": self.device}


@dataclass(kw_only=True)
class BenchRLReport(BenchRL):
    """the report of a bench rl run that stopped before its end, from the steps its arms completed"""
    KEY = "bench rl --report-unfinished"
    SWITCH = "report_unfinished"

    def __post_init__(self) -> None:
        Run.__post_init__(self)  # no --device check: nothing runs

    def call(self) -> tuple[tuple, dict]:
        return self._task_preset_out(), {"engine": self.engine, "arms": self.arms, "segment": self.segment,
                                         "warmup": self.warmup, "prompt_pool": self.prompt_pool}


@dataclass(kw_only=True)
class BenchRLReportAgain(BenchRLReport):
    """a finished bench rl run summarized again, from the steps its arms saved, with this code"""
    KEY = "bench rl --report-again"
    SWITCH = "report_again"


# The command line: each (sub)command's name, the class whose fields are its flags, then its
# variants (subclasses run instead when their SWITCH flag is set); "bench" groups the benchmarks.
COMMAND_LINE = {
    "train-rl": (TrainRL,),
    "train-draft": (TrainDraft,),
    "drift": (Drift, AsyncDrift),
    "bench": {
        "generate": (BenchGenerate,),
        "speed": (BenchSpeed,),
        "profile": (BenchProfile,),
        "overlap": (BenchOverlap, BenchOverlapPhases),
        "precision": (BenchPrecision,),
        "update": (BenchUpdate,),
        "real": (BenchReal,),
        "rl": (BenchRL, BenchRLReport, BenchRLReportAgain),
    },
}
BENCH_HELP = "benchmarks that print and save JSON (see `specrl bench`)"


def command_help(cls: type[Command]) -> str:
    """A command's one-line help in the command list: its class docstring."""
    return " ".join(cls.__doc__.split())


def flag_options(cls: type[Command]) -> list[tuple[str, dict]]:
    """(flag, argparse add_argument options) for each field of `cls`, in field order."""
    import typing

    hints = typing.get_type_hints(cls)
    return [(flag_name(f), _options(f, hints[f.name])) for f in dataclasses.fields(cls)]


def _options(f: dataclasses.Field, hint) -> dict:
    import types
    import typing

    meta = f.metadata
    opts = {"help": meta["help"]}
    if meta["metavar"] is not None:
        opts["metavar"] = meta["metavar"]
    if f.default is MISSING:
        opts["required"] = True
    else:
        opts["default"] = f.default
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None: unset is None
    if hint is bool:
        return {**opts, "action": "store_true"}
    many = typing.get_origin(hint) is tuple
    elem = typing.get_args(hint)[0] if many else hint
    if typing.get_origin(elem) is Literal:
        opts["choices"] = list(typing.get_args(elem))
    if meta["choices"] is not None:
        opts["choices"] = list(_value(meta["choices"]))
    if meta["parse"] is not None:
        opts["type"] = meta["parse"]
    elif elem is int and many and meta["nargs"] is None:
        opts["type"] = int_list(_value(meta["most"]))
    elif elem is int:
        opts["type"] = _int_in(meta["lo"], _value(meta["hi"]))
    elif elem is Path:
        opts["type"] = Path
    elif elem is not str and "choices" not in opts:
        raise TypeError(f"{flag_name(f)}: no flag type for {hint}")
    if meta["nargs"] is not None:
        opts["nargs"] = meta["nargs"]
        if isinstance(f.default, tuple):
            opts["default"] = list(f.default)  # argparse keeps a list default as given
    elif many and isinstance(f.default, tuple):
        opts["default"] = ",".join(map(str, f.default))  # as typed: argparse parses it, --help shows it
    return opts


def command_class(classes: tuple[type[Command], ...], values: dict) -> type[Command]:
    """The class a parsed command line runs: the first variant whose switch is set, else the base."""
    base, *variants = classes
    return next((v for v in variants if values.get(v.SWITCH) not in (None, False)), base)


def from_flags(classes: tuple[type[Command], ...], values: dict) -> Command:
    """The command of a parsed command line (flag values by field name); its __post_init__
    checks the rules between the flags."""
    return command_class(classes, values)(**{f.name: values[f.name] for f in dataclasses.fields(classes[0])})
