"""Verifiable tasks: problems generated locally, answers checked exactly.

Why these tasks: RL on the MoE policy needs rewards that are cheap, exact and
deterministic, and problems that can be generated offline in any quantity. Each task
also has reference completions in two *styles* that carry the same information in
different surface forms: a common one (most of the SFT data) and a rare one. An
optional `format_bonus` rewards the rare style, so an experiment can make the policy
drift from one style to the other and watch how speculative drafters cope with the
shift in the token distribution.

Splits: a problem is held out when a stable hash of its canonical key falls in one
bucket out of `HELDOUT_EVERY`. The key ignores surface order where the answer does
not depend on it (a+b and b+a, permutations of one multiset), so no held-out answer
is ever seen in training. Sampling is seeded per (task, split, seed) with
`random.Random(str)`, which does not depend on PYTHONHASHSEED.

With default settings every prompt + completion fits in 96 characters, and every
character is in the built-in `CharTokenizer` alphabet.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_EVERY = 8  # 1 problem in 8 is held out
SPLITS = ("train", "heldout")
MAX_ATTEMPTS_PER_EXAMPLE = 1000


class TaskError(ValueError):
    """A task name, file, field or argument is invalid (one-line message)."""


@dataclass
class Example:
    prompt: str
    answer: str  # canonical final answer
    meta: dict = field(default_factory=dict)


def stable_bucket(key: str, buckets: int = HELDOUT_EVERY) -> int:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % buckets


def split_of_key(key: str) -> str:
    return "heldout" if stable_bucket(key) == 0 else "train"


def _check_split_request(split: str, n: int) -> None:
    if split not in SPLITS:
        raise TaskError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not isinstance(n, int) or n <= 0:
        raise TaskError(f"number of examples must be a positive integer, got {n!r}")


def seeded_cycle(pool: list[Example], n: int, key: str) -> list[Example]:
    """`n` items of a fixed `pool` in an order seeded by `key`, reshuffled at each pass through it."""
    rng = random.Random(key)
    out: list[Example] = []
    while len(out) < n:
        order = list(range(len(pool)))
        rng.shuffle(order)
        out.extend(pool[i] for i in order[: n - len(out)])
    return out


class Task:
    """Base class. Subclasses define sampling, reference completions and answer parsing."""

    name = "task"
    styles: dict[str, float] = {}
    rare_style: str | None = None

    rare_format: "re.Pattern | None" = None  # the rare style's shape, step values unchecked

    def __init__(self, format_bonus: float = 0.0, bonus_rule: str = "exact", rare_weight: float | None = None):
        if bonus_rule not in ("exact", "format"):
            raise TaskError(f"bonus_rule must be 'exact' or 'format', got {bonus_rule!r}")
        self.format_bonus = float(format_bonus)
        self.bonus_rule = bonus_rule
        if rare_weight is not None:  # share of the rare style in the SFT data
            if self.rare_style is None or not 0.0 <= rare_weight < 1.0:
                raise TaskError(f"rare_weight must lie in [0, 1) and the task needs a rare style, got {rare_weight!r}")
            common = [s for s in self.styles if s != self.rare_style]
            self.styles = {**{s: (1.0 - rare_weight) / len(common) for s in common}, self.rare_style: rare_weight}

    # --- problems -----------------------------------------------------------------
    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def problem_key(self, example: Example) -> str:
        """Canonical identity of a problem, used for the train/held-out split."""
        return example.prompt

    def split_of(self, example: Example) -> str:
        return split_of_key(f"{self.name}|{self.problem_key(example)}")

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` problems of `split`, the same for the same seed (repeats are possible)."""
        _check_split_request(split, n)
        rng = random.Random(f"{self.name}/{split}/{seed}")
        out: list[Example] = []
        for _ in range(n * MAX_ATTEMPTS_PER_EXAMPLE):
            ex = self.sample(rng)
            if self.split_of(ex) == split:
                out.append(ex)
                if len(out) == n:
                    return out
        raise TaskError(f"task {self.name!r} could not draw {n} {split} problems; its settings allow too few")

    # --- completions --------------------------------------------------------------
    def check_style(self, style: str) -> None:
        if style not in self.styles:
            raise TaskError(f"task {self.name!r} has no style {style!r}; choose from {sorted(self.styles)}")

    def completion(self, example: Example, style: str) -> str:
        """Reference completion text in `style`, without any end-of-sequence token."""
        raise NotImplementedError

    def sft_completion(self, example: Example, rng) -> str:
        """A reference completion in a style drawn by weight (`rng` needs `.random()`)."""
        names = list(self.styles)
        weights = [self.styles[s] for s in names]
        point = rng.random() * sum(weights)
        for style, weight in zip(names, weights):
            point -= weight
            if point < 0:
                return self.completion(example, style)
        return self.completion(example, names[-1])

    # --- scoring ------------------------------------------------------------------
    def parse_answer(self, completion: str) -> str | None:
        raise NotImplementedError

    def answer_score(self, example: Example, parsed: str | None) -> float:
        """Score of a parsed answer in [0, 1]; exact match by default."""
        return 1.0 if parsed is not None and parsed == example.answer else 0.0

    @staticmethod
    def partial_credit(got: list, want: list) -> float:
        """Half credit times the share of positions that agree (over the longer list), so a
        wrong answer with more right parts earns more, and only the exact answer earns 1."""
        if got == want:
            return 1.0
        right = sum(g == w for g, w in zip(got, want))
        return 0.5 * right / max(len(got), len(want), 1)

    def follows_rare_style(self, example: Example, completion: str) -> bool:
        """True when the completion is the rare style with every step right.

        The steps of a style are fully determined by the problem, so "exact format,
        all steps correct" is the same as equality with the reference completion.
        """
        if self.rare_style is None:
            return False
        if self.bonus_rule == "format":  # shape only: a checkable step format
            return self.rare_format is not None and self.rare_format.fullmatch(completion.strip()) is not None
        return completion.strip() == self.completion(example, self.rare_style)

    def reward(self, example: Example, completion: str) -> float:
        score = self.answer_score(example, self.parse_answer(completion))
        if self.format_bonus and self.follows_rare_style(example, completion):
            score += self.format_bonus
        return score

    def is_correct(self, example: Example, completion: str) -> bool:
        return self.parse_answer(completion) == example.answer


# --- addition ---------------------------------------------------------------------
class ArithTask(Task):
    """Multi-digit addition with one worked step per column, least significant first.

    Prompt `347+586=`. Both styles list, per column, the two digits, the carry in
    (only when it is 1) and the column sum:
      steps (common): `7+6=13;4+8+1=13;3+5+1=9;ans 933`
      cols  (rare):   `(7 6:13)(4 8 1:13)(3 5 1:9)=933`
    A shorter operand contributes 0 digits to its missing columns.
    """

    name = "arith"
    styles = {"steps": 0.9, "cols": 0.1}
    rare_style = "cols"
    _final = re.compile(r"(?:ans |=)(\d+)$")

    rare_format = re.compile(r"(\(\d \d( \d)?:\d+\))+=\d+")

    def __init__(self, min_digits: int = 2, max_digits: int = 4, format_bonus: float = 0.0, bonus_rule: str = "exact",
                 rare_weight: float | None = None):
        super().__init__(format_bonus, bonus_rule, rare_weight)
        if not (isinstance(min_digits, int) and isinstance(max_digits, int) and 1 <= min_digits <= max_digits <= 9):
            raise TaskError(f"arith needs 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10 ** digits - 1)

    def sample(self, rng: random.Random) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        return Example(prompt=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})

    def problem_key(self, example: Example) -> str:
        a, b = example.meta["a"], example.meta["b"]
        return f"{min(a, b)}+{max(a, b)}"

    @staticmethod
    def columns(a: int, b: int) -> list[tuple[int, int, int, int]]:
        """(digit of a, digit of b, carry in, column sum) for each column, units first."""
        width = max(len(str(a)), len(str(b)))
        cols, carry = [], 0
        for i in range(width):
            da, db = (a // 10 ** i) % 10, (b // 10 ** i) % 10
            total = da + db + carry
            cols.append((da, db, carry, total))
            carry = total // 10
        return cols

    def completion(self, example: Example, style: str) -> str:
        self.check_style(style)
        cols = self.columns(example.meta["a"], example.meta["b"])
        if style == "steps":
            parts = [f"{da}+{db}" + (f"+{c}" if c else "") + f"={t}" for da, db, c, t in cols]
            return ";".join(parts) + f";ans {example.answer}"
        parts = ["(" + " ".join(str(d) for d in (da, db, c)[: 3 if c else 2]) + f":{t})" for da, db, c, t in cols]
        return "".join(parts) + f"={example.answer}"

    def parse_answer(self, completion: str) -> str | None:
        """The digits after the final `ans ` or `=`, which must end the completion."""
        match = self._final.search(completion.strip())
        return match.group(1) if match else None

    def answer_score(self, example: Example, parsed: str | None) -> float:
        """1 for the exact sum; else partial credit per digit, aligned from the units digit."""
        if parsed is None:
            return 0.0
        return self.partial_credit(list(parsed[::-1]), list(example.answer[::-1]))


# --- sorting ----------------------------------------------------------------------
class SortTask(Task):
    """Sort a short list of small integers ascending.

    Prompt `sort 42 7 19 3:`.
      plain (common): `3 7 19 42`
      steps (rare):   `m3;m7;m19;m42;ans 3 7 19 42`  (mX: X is the minimum of what is left)
    Reward: 1 for the exact sorted list, else 0.5 * the fraction of positions right
    (over the longer of the two lists), plus the optional rare-style bonus.
    """

    name = "sort"
    styles = {"plain": 0.9, "steps": 0.1}
    rare_style = "steps"
    _numbers = re.compile(r"\d+( \d+)*")

    rare_format = re.compile(r"m\d+(;m\d+)*;ans \d+( \d+)*")

    def __init__(self, min_len: int = 4, max_len: int = 7, max_value: int = 99, format_bonus: float = 0.0,
                 bonus_rule: str = "exact"):
        super().__init__(format_bonus, bonus_rule)
        if not (isinstance(min_len, int) and isinstance(max_len, int) and 1 <= min_len <= max_len <= 16):
            raise TaskError(f"sort needs 1 <= min_len <= max_len <= 16, got {min_len}, {max_len}")
        if not isinstance(max_value, int) or not 1 <= max_value <= 999:
            raise TaskError(f"sort needs 1 <= max_value <= 999, got {max_value!r}")
        self.min_len, self.max_len, self.max_value = min_len, max_len, max_value

    def sample(self, rng: random.Random) -> Example:
        values = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len))]
        prompt = "sort " + " ".join(map(str, values)) + ":"
        return Example(prompt=prompt, answer=" ".join(map(str, sorted(values))), meta={"values": values})

    def problem_key(self, example: Example) -> str:
        return example.answer  # the sorted multiset: all its orderings share a split

    def completion(self, example: Example, style: str) -> str:
        self.check_style(style)
        if style == "plain":
            return example.answer
        picks = ";".join(f"m{v}" for v in sorted(example.meta["values"]))
        return f"{picks};ans {example.answer}"

    def parse_answer(self, completion: str) -> str | None:
        """The list after the last `ans `, else the whole completion; None if not a list."""
        text = completion.strip()
        if "ans " in text:
            text = text.rsplit("ans ", 1)[1].strip()
        return text if self._numbers.fullmatch(text) else None

    def answer_score(self, example: Example, parsed: str | None) -> float:
        if parsed is None:
            return 0.0
        return self.partial_credit([int(t) for t in parsed.split()], [int(t) for t in example.answer.split()])


# --- user data --------------------------------------------------------------------
HELDOUT_NAMES = {"heldout", "test", "eval", "validation", "valid", "val"}


class JsonlTask(Task):
    """Prompt/answer pairs from a local JSONL or Parquet file, scored by exact match.

    The answer is the text after the last `ans ` marker, or the whole stripped
    completion. The split comes from a `split` column when the file has one
    ("train", or one of HELDOUT_NAMES), else from a stable hash of the prompt.
    """

    styles = {"plain": 1.0}
    rare_style = None

    def __init__(self, path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 split_field: str = "split", format_bonus: float = 0.0):
        super().__init__(format_bonus)
        self.path = Path(path)
        self.name = self.path.name
        self.rows = self._load(prompt_field, answer_field, split_field)

    def _load(self, prompt_field: str, answer_field: str, split_field: str) -> dict[str, list[Example]]:
        kind = "parquet" if self.path.suffix == ".parquet" else "json"
        if not self.path.is_file():
            raise TaskError(f"task file {str(self.path)!r} does not exist")
        self._check_text(kind)
        import datasets

        bars_were_on = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a small local file needs no progress bar
        try:
            ds = datasets.load_dataset(kind, data_files=str(self.path), split="train")
        except Exception as e:  # noqa: BLE001 - report any reader failure on one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TaskError(f"cannot read task file {str(self.path)!r}: {first}") from None
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        for needed in (prompt_field, answer_field):
            if needed not in ds.column_names:
                raise TaskError(f"task file {str(self.path)!r} has no field {needed!r}; fields: {ds.column_names}")
        has_split = split_field in ds.column_names
        rows: dict[str, list[Example]] = {s: [] for s in SPLITS}
        for i, rec in enumerate(ds):
            ex = Example(prompt=str(rec[prompt_field]), answer=str(rec[answer_field]).strip(), meta={"row": i})
            split = self._split_label(rec[split_field], i) if has_split else self.split_of(ex)
            rows[split].append(ex)
        return rows

    def _check_text(self, kind: str) -> None:
        """Name an empty file, or the first JSONL line that is not a JSON object, before the
        `datasets` reader sees it (its own errors name neither the file nor the line)."""
        if kind == "parquet":
            if self.path.stat().st_size == 0:
                raise TaskError(f"task file {str(self.path)!r} is empty")
            return
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TaskError(f"task file {str(self.path)!r} is not UTF-8 text (byte {e.start})") from None
        if not text.strip():
            raise TaskError(f"task file {str(self.path)!r} is empty: it needs one JSON object per line")
        if self.path.suffix != ".jsonl":
            return
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"task file {str(self.path)!r} line {i} is not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(row, dict):
                raise TaskError(f"task file {str(self.path)!r} line {i} is not a JSON object")

    def split_of(self, example: Example) -> str:
        return split_of_key(example.prompt)  # not the file name: renaming keeps the split

    def _split_label(self, value, row: int) -> str:
        label = str(value).strip().lower()
        if label == "train":
            return "train"
        if label in HELDOUT_NAMES:
            return "heldout"
        raise TaskError(f"task file {str(self.path)!r} row {row} has unknown split {value!r}")

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` rows of `split` in a seeded order, cycling through the rows if n is larger."""
        _check_split_request(split, n)
        pool = self.rows[split]
        if not pool:
            raise TaskError(f"task file {str(self.path)!r} has no {split} rows")
        return seeded_cycle(pool, n, f"{self.name}/{split}/{seed}")

    def completion(self, example: Example, style: str) -> str:
        self.check_style(style)
        return example.answer

    def parse_answer(self, completion: str) -> str | None:
        text = completion.strip()
        if "ans " in text:
            text = text.rsplit("ans ", 1)[1]
        return text.strip() or None


# --- worked problems for a real model ---------------------------------------------------
ANSWER_LINE = "End with the sentence 'The answer is N.' where N is a whole number."
_ANSWER_IS = re.compile(r"answer is\D{0,12}?(-?\d[\d,]*)", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d[\d,]*")


def final_integer(completion: str) -> str | None:
    """The final answer of a worked solution: the number after the last "answer is", else the
    last number in the text (commas dropped); None when there is none."""
    found = _ANSWER_IS.findall(completion) or _INTEGER.findall(completion)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value if re.fullmatch(r"-?\d+", value) else None


class WorkedProblemTask(Task):
    """Problems a pretrained chat model answers in prose. Reward: 1 when the final number
    (`final_integer`) is the answer, plus `format_credit` when the answer is stated in the asked
    form ("The answer is N"), so that GRPO has a signal while the model is still mostly wrong
    (the format reward of reasoning RL)."""

    def __init__(self, format_credit: float = 0.2, **kw):
        super().__init__(**kw)
        if not 0.0 <= format_credit <= 1.0:
            raise TaskError(f"format_credit must lie in [0, 1], got {format_credit!r}")
        self.format_credit = float(format_credit)

    def parse_answer(self, completion: str) -> str | None:
        return final_integer(completion)

    def reward(self, example: Example, completion: str) -> float:
        stated = _ANSWER_IS.search(completion) is not None
        return super().reward(example, completion) + (self.format_credit if stated else 0.0)


class WordTask(WorkedProblemTask):
    """Multi-step arithmetic word problems in plain English, for a pretrained chat model: a
    starting count and 2 to `max_ops` events (buying, giving away, multiplying, sharing out
    evenly), each a step of reasoning; the reward is the verifier's check of the final number
    (`final_integer`, with WorkedProblemTask's format credit). A real model answers them in prose
    of tens to hundreds of tokens. The
    reference completion (style "steps") is the worked solution, one sentence per event."""

    name = "word"
    styles = {"steps": 1.0}
    NAMES = ("Sam", "Maria", "Lena", "Omar", "Priya", "Tom", "Aiko", "Diego")
    ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stamps", "stickers", "cookies")

    def __init__(self, min_ops: int = 2, max_ops: int = 4, **kw):
        if not 1 <= min_ops <= max_ops <= 8:
            raise TaskError(f"word task needs 1 <= min_ops <= max_ops <= 8, got {min_ops}, {max_ops}")
        super().__init__(**kw)
        self.min_ops, self.max_ops = min_ops, max_ops

    def sample(self, rng: random.Random) -> Example:
        who, thing = rng.choice(self.NAMES), rng.choice(self.ITEMS)
        value = rng.randint(5, 60)
        story, steps = [f"{who} has {value} {thing}."], []
        for _ in range(rng.randint(self.min_ops, self.max_ops)):
            kind = rng.choice(("buy", "give", "times", "share") if value >= 4 else ("buy", "times"))
            if kind == "buy":
                n = rng.randint(2, 40)
                story.append(f"Then {who} gets {n} more.")
                steps.append(f"After getting {n} more: {value} + {n} = {value + n}.")
                value += n
            elif kind == "give":
                n = rng.randint(1, value - 1)
                story.append(f"Then {who} gives away {n}.")
                steps.append(f"After giving away {n}: {value} - {n} = {value - n}.")
                value -= n
            elif kind == "times":
                n = rng.randint(2, 4)
                story.append(f"Then the number of {thing} grows to {n} times as many.")
                steps.append(f"{n} times as many: {value} x {n} = {value * n}.")
                value *= n
            else:
                parts = [d for d in range(2, 7) if value % d == 0]
                if not parts:
                    n = rng.randint(2, 40)
                    story.append(f"Then {who} gets {n} more.")
                    steps.append(f"After getting {n} more: {value} + {n} = {value + n}.")
                    value += n
                    continue
                n = rng.choice(parts)
                story.append(f"Then {who} shares them equally among {n} friends and keeps one share.")
                steps.append(f"One of {n} equal shares: {value} / {n} = {value // n}.")
                value //= n
        prompt = " ".join(story) + f" How many {thing} does {who} have at the end? Solve it step by step. {ANSWER_LINE}"
        return Example(prompt=prompt, answer=str(value), meta={"steps": steps})

    def completion(self, example: Example, style: str) -> str:
        self.check_style(style)
        return " ".join(example.meta["steps"]) + f" The answer is {example.answer}."


class ChampTask(WorkedProblemTask):
    """The problems of CHAMP (Mao, Kim and Zhou 2024; the `champ-dataset` package, MIT) whose
    answer is a whole number: 79 of its 270 competition problems, read from the installed
    package's data file (the package is not imported). Reward as for WordTask. Hard for a small
    model; a long-answer task."""

    name = "champ"
    styles = {"solution": 1.0}
    PACKAGE, DISTRIBUTION, DATA = "champ_dataset", "champ-dataset", "dataset_files/v0.json"

    def __init__(self, **kw):
        super().__init__(**kw)
        import importlib.util

        found = importlib.util.find_spec(self.PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise TaskError(f"task champ needs the package {self.DISTRIBUTION}, not installed: "
                            f"pip install --no-deps {self.DISTRIBUTION}==1.0.0")
        path = Path(list(found.submodule_search_locations)[0]) / self.DATA
        problems = json.loads(path.read_text())["problems"]
        self.rows: dict[str, list[Example]] = {split: [] for split in SPLITS}
        for key, row in sorted(problems.items()):
            answer = row["_answer"].strip()
            if re.fullmatch(r"-?\d+", answer):
                steps = " ".join(step["_text"] for step in row["solution"]["steps"])
                ex = Example(prompt=f"{row['_text']} Solve it step by step. {ANSWER_LINE}", answer=answer,
                             meta={"id": key, "solution": steps})
                self.rows[split_of_key(f"{self.name}|{key}")].append(ex)

    def problem_key(self, example: Example) -> str:
        return example.meta["id"]

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` problems of `split` in a seeded order, cycling through them if n is larger."""
        _check_split_request(split, n)
        pool = self.rows[split]
        return seeded_cycle(pool, n, f"{self.name}/{split}/{seed}")

    def completion(self, example: Example, style: str) -> str:
        self.check_style(style)
        return f"{example.meta['solution']} The answer is {example.answer}."


# --- registry ---------------------------------------------------------------------
TASKS: dict[str, type[Task]] = {"arith": ArithTask, "sort": SortTask, "word": WordTask, "champ": ChampTask}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def get_task(name: str, **kwargs) -> Task:
    """A built-in task by name, or a JsonlTask for a path ending in .jsonl/.json/.parquet."""
    if str(name).endswith(FILE_SUFFIXES):
        return JsonlTask(name, **kwargs)
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose from {sorted(TASKS)} or a .jsonl/.json/.parquet file")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise TaskError(f"bad arguments for task {name!r}: {e}") from None
