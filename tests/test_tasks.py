"""Task tests: deterministic disjoint splits, exact rewards, style formats, file tasks."""
from __future__ import annotations

import json
import random

import pytest

from target_training.tasks import (HELDOUT_EVERY, final_integer, ArithTask, Example, JsonlTask, SortTask, TaskError,
                                   TASKS, get_task)
from target_training.tokenizer import CharTokenizer

BUILTIN = ["arith", "sort"]  # the toy tasks of the char tokenizer; the worked problems are tested below
WORKED = ["word", "champ"]


@pytest.fixture(params=BUILTIN)
def task(request):
    return get_task(request.param)


# --- splits -----------------------------------------------------------------------
def test_examples_are_deterministic(task):
    a = task.examples("train", 50, seed=7)
    assert a == task.examples("train", 50, seed=7)
    assert a != task.examples("train", 50, seed=8)
    assert len(a) == 50 and all(isinstance(e, Example) for e in a)


def test_splits_are_disjoint(task):
    train = {task.problem_key(e) for e in task.examples("train", 3000, seed=0)}
    heldout = task.examples("heldout", 400, seed=0)
    assert all(task.split_of(e) == "heldout" for e in heldout)
    assert not train & {task.problem_key(e) for e in heldout}
    # The split is a property of the problem, not of the seed it was drawn with.
    assert all(task.split_of(e) == "train" for e in task.examples("train", 200, seed=123))


def test_heldout_fraction(task):
    rng = random.Random(0)
    drawn = [task.sample(rng) for _ in range(8000)]
    share = sum(task.split_of(e) == "heldout" for e in drawn) / len(drawn)
    assert abs(share - 1 / HELDOUT_EVERY) < 0.03


def test_commuted_problems_share_a_split():
    arith = ArithTask()
    for e in arith.examples("heldout", 50, seed=1):
        a, b = e.meta["a"], e.meta["b"]
        swapped = Example(f"{b}+{a}=", e.answer, {"a": b, "b": a})
        assert arith.split_of(swapped) == "heldout"
    sort = SortTask()
    for e in sort.examples("heldout", 50, seed=1):
        values = list(reversed(e.meta["values"]))
        shuffled = Example("sort " + " ".join(map(str, values)) + ":", e.answer, {"values": values})
        assert sort.split_of(shuffled) == "heldout"


@pytest.mark.parametrize("split,n", [("test", 5), ("validation", 5), ("train", 0), ("heldout", -1)])
def test_bad_split_or_count(task, split, n):
    with pytest.raises(ValueError):
        task.examples(split, n, seed=0)


# --- reference completions ----------------------------------------------------------
def test_every_style_gets_full_reward_and_fits(task):
    tok = CharTokenizer()
    assert task.rare_style in task.styles
    for split in ("train", "heldout"):
        for e in task.examples(split, 300, seed=2):
            for style in task.styles:
                c = task.completion(e, style)
                assert task.parse_answer(c) == e.answer
                assert task.is_correct(e, c)
                assert task.reward(e, c) == 1.0
                assert len(e.prompt + c) <= 96
                assert "<eos>" not in c
                tok.encode(e.prompt + c)  # raises on any character outside the alphabet


def test_worst_case_lengths():
    arith, sort = ArithTask(), SortTask()
    big = Example("9999+9999=", "19998", {"a": 9999, "b": 9999})
    values = [99] * 7
    longest = Example("sort " + " ".join(map(str, values)) + ":", " ".join(map(str, values)), {"values": values})
    for t, e in ((arith, big), (sort, longest)):
        assert max(len(e.prompt + t.completion(e, s)) for s in t.styles) <= 96


def test_arith_documented_format():
    t = ArithTask()
    e = Example("347+586=", "933", {"a": 347, "b": 586})
    assert t.completion(e, "steps") == "7+6=13;4+8+1=13;3+5+1=9;ans 933"
    assert t.completion(e, "cols") == "(7 6:13)(4 8 1:13)(3 5 1:9)=933"
    short = Example("95+7=", "102", {"a": 95, "b": 7})
    assert t.completion(short, "steps") == "5+7=12;9+0+1=10;ans 102"
    assert t.completion(short, "cols") == "(5 7:12)(9 0 1:10)=102"


def test_arith_digit_range_is_respected():
    t = ArithTask(min_digits=2, max_digits=2)
    for e in t.examples("train", 200, seed=0):
        assert 10 <= e.meta["a"] <= 99 and 10 <= e.meta["b"] <= 99
        assert int(e.answer) == e.meta["a"] + e.meta["b"]
    with pytest.raises(TaskError):
        ArithTask(min_digits=3, max_digits=2)


def test_sort_documented_format():
    t = SortTask()
    e = Example("sort 42 7 19 3:", "3 7 19 42", {"values": [42, 7, 19, 3]})
    assert t.completion(e, "plain") == "3 7 19 42"
    assert t.completion(e, "steps") == "m3;m7;m19;m42;ans 3 7 19 42"
    with pytest.raises(TaskError, match="no style"):
        t.completion(e, "fancy")


def test_sft_completion_follows_style_weights(task):
    e = task.examples("train", 1, seed=0)[0]
    rare = task.completion(e, task.rare_style)
    rng = random.Random(0)
    draws = [task.sft_completion(e, rng) for _ in range(4000)]
    share = sum(d == rare for d in draws) / len(draws)
    assert abs(share - task.styles[task.rare_style] / sum(task.styles.values())) < 0.03
    assert draws[:50] == [task.sft_completion(e, r) for r in [random.Random(0)] for _ in range(50)]


# --- rewards for wrong answers -------------------------------------------------------
def test_arith_wrong_answers_get_less_than_one():
    t = ArithTask()
    for e in t.examples("train", 100, seed=4):
        wrong = str(int(e.answer) + 1)
        for c in (f"ans {wrong}", t.completion(e, "steps")[: -len(e.answer)] + wrong):
            assert t.reward(e, c) < 0.5 and not t.is_correct(e, c)  # partial credit only
        for c in (t.completion(e, "cols") + ";", "", "ans", e.answer + " 1"):
            assert t.reward(e, c) == 0.0 and not t.is_correct(e, c)  # unparseable


def test_arith_partial_credit_counts_digits_from_the_units():
    t = ArithTask()
    e = Example("347+586=", "933", {"a": 347, "b": 586})
    assert t.reward(e, "ans 933") == 1.0
    assert t.reward(e, "ans 934") == pytest.approx(0.5 * 2 / 3)  # tens and hundreds right
    assert t.reward(e, "ans 33") == pytest.approx(0.5 * 2 / 3)  # a missing leading digit
    assert t.reward(e, "ans 111") == 0.0


def test_sort_partial_credit():
    t = SortTask()
    e = Example("sort 42 7 19 3:", "3 7 19 42", {"values": [42, 7, 19, 3]})
    assert t.reward(e, "3 7 42 19") == pytest.approx(0.25)  # 2 of 4 positions
    assert t.reward(e, "ans 3 7 19") == pytest.approx(0.5 * 3 / 4)  # a missing element
    assert t.reward(e, "3 7 19 42 50") == pytest.approx(0.5 * 4 / 5)  # an extra element
    assert t.reward(e, "42 19 7 3") == 0.0
    assert t.reward(e, "3 7 x 42") == 0.0 and t.parse_answer("3 7 x 42") is None
    for ex in t.examples("train", 100, seed=5):
        got = list(reversed(ex.answer.split()))
        if got != ex.answer.split():
            assert t.reward(ex, " ".join(got)) < 0.5


# --- format bonus -----------------------------------------------------------------
@pytest.mark.parametrize("name", BUILTIN)
def test_format_bonus_only_for_correct_rare_style(name):
    plain, bonus = get_task(name), get_task(name, format_bonus=0.25)
    common = next(s for s in bonus.styles if s != bonus.rare_style)
    for e in bonus.examples("train", 100, seed=6):
        rare = bonus.completion(e, bonus.rare_style)
        assert plain.reward(e, rare) == 1.0
        assert bonus.reward(e, rare) == 1.25
        assert bonus.reward(e, " " + rare + " ") == 1.25
        assert bonus.reward(e, bonus.completion(e, common)) == 1.0
        # Break one step while leaving the final answer right: the bonus goes away.
        i = next(k for k, ch in enumerate(rare) if ch.isdigit())
        assert i < len(rare) - len(e.answer)
        broken = rare[:i] + str((int(rare[i]) + 1) % 10) + rare[i + 1:]
        assert bonus.parse_answer(broken) == e.answer
        assert bonus.reward(e, broken) == 1.0
        # Right format, wrong answer: no bonus and no correctness reward.
        wrong = rare[: -len(e.answer)] + e.answer[:-1] + str((int(e.answer[-1]) + 1) % 10)
        assert bonus.reward(e, wrong) < 1.0


# --- file tasks -------------------------------------------------------------------
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_task_hash_split(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": f"what is {i}+1?", "answer": i + 1} for i in range(80)])
    t = get_task(str(path))
    assert isinstance(t, JsonlTask)
    train, heldout = t.examples("train", 200, seed=0), t.examples("heldout", 5, seed=0)
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in heldout})
    assert len({e.prompt for e in train}) + len(t.rows["heldout"]) == 80
    assert train == t.examples("train", 200, seed=0)
    e = train[0]
    assert t.completion(e, "plain") == e.answer
    assert t.reward(e, e.answer) == 1.0 and t.reward(e, f"think; ans {e.answer}\n") == 1.0
    assert t.reward(e, e.answer + "0") == 0.0 and not t.is_correct(e, "")


def test_jsonl_task_split_column_and_custom_fields(tmp_path):
    rows = [{"q": f"q{i}", "a": f"x{i}", "split": "test" if i % 4 == 0 else "train"} for i in range(20)]
    t = JsonlTask(write_jsonl(tmp_path / "s.jsonl", rows), prompt_field="q", answer_field="a")
    assert len(t.rows["heldout"]) == 5 and len(t.rows["train"]) == 15
    assert all(int(e.prompt[1:]) % 4 == 0 for e in t.examples("heldout", 5, seed=1))


def test_parquet_task(tmp_path):
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": f"p{i}", "answer": str(i)} for i in range(30)]).to_parquet(str(path))
    t = get_task(str(path))
    e = t.examples("train", 3, seed=0)[0]
    assert t.reward(e, e.answer) == 1.0


def test_jsonl_task_errors(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        get_task(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "solution": "s"}])
    with pytest.raises(TaskError) as err:
        get_task(str(path))
    assert "no field 'answer'" in str(err.value) and "\n" not in str(err.value)
    path = write_jsonl(tmp_path / "split.jsonl", [{"prompt": "p", "answer": "a", "split": "dev2"}])
    with pytest.raises(TaskError, match="unknown split"):
        get_task(str(path))


def test_unknown_task_message():
    with pytest.raises(TaskError) as err:
        get_task("addition")
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith("unknown task 'addition'; choose from ['arith', 'champ', 'sort', 'word']")
    with pytest.raises(TaskError, match="bad arguments"):
        get_task("arith", digits=3)


@pytest.mark.parametrize("task_cls", [ArithTask, SortTask])
def test_format_bonus_rule_checks_shape_only(task_cls):
    t = task_cls(format_bonus=0.5, bonus_rule="format")
    for e in t.examples("train", 20, seed=2):
        rare = t.completion(e, t.rare_style)
        common = t.completion(e, [s for s in t.styles if s != t.rare_style][0])
        assert t.reward(e, rare) == pytest.approx(1.5)
        assert t.reward(e, common) == pytest.approx(1.0)
        wrong = rare[:-1] + str((int(rare[-1]) + 1) % 10)  # right shape, wrong final digit
        assert t.follows_rare_style(e, wrong) and t.reward(e, wrong) < 1.5
    with pytest.raises(TaskError, match="bonus_rule"):
        task_cls(bonus_rule="loose")


def test_rare_weight_sets_the_sft_style_mix():
    from target_training.tasks import ArithTask, TaskError, get_task

    task = get_task("arith", rare_weight=0.02)
    assert task.styles == pytest.approx({"steps": 0.98, "cols": 0.02})
    assert ArithTask().styles == {"steps": 0.9, "cols": 0.1}  # the class default is untouched
    for bad in (-0.1, 1.0):
        with pytest.raises(TaskError, match="rare_weight"):
            ArithTask(rare_weight=bad)


# --- worked problems for a real model (word, champ) ----------------------------------
def test_builtin_tasks_are_all_tested():
    assert sorted(BUILTIN + WORKED) == sorted(TASKS)


def test_final_integer_reads_the_stated_answer_else_the_last_number():
    assert final_integer("12 + 3 = 15, then 15 x 2 = 30. The answer is 30.") == "30"
    assert final_integer("The answer is 1,250 stamps, not 7.") == "1250"
    assert final_integer("So the answer is: -4") == "-4"
    assert final_integer("first 3, then 8 left") == "8"  # no stated answer: the last number
    assert final_integer("The answer is 5. Wait, the answer is 6.") == "6"
    assert final_integer("no number here") is None


@pytest.mark.parametrize("name", WORKED)
def test_worked_problems_reward_the_right_number_and_the_stated_form(name):
    task = get_task(name)
    for e in task.examples("train", 40, seed=3):
        ref = task.completion(e, next(iter(task.styles)))
        assert task.parse_answer(ref) == e.answer and task.is_correct(e, ref)
        assert task.reward(e, ref) == pytest.approx(1.2)  # right, and stated as asked
        wrong = str(int(e.answer) + 1)
        assert task.reward(e, f"I think it is {e.answer}... no, The answer is {wrong}.") == pytest.approx(0.2)
        assert task.reward(e, f"so {e.answer}") == pytest.approx(1.0)  # right but not in the asked form
        assert task.reward(e, "I do not know.") == 0.0
        assert "The answer is N." in e.prompt


@pytest.mark.parametrize("name", WORKED)
def test_worked_problem_splits_are_disjoint_and_deterministic(name):
    task = get_task(name)
    train = {task.problem_key(e) for e in task.examples("train", 200, seed=0)}
    held = {task.problem_key(e) for e in task.examples("heldout", 50, seed=0)}
    assert train and held and not train & held
    assert [e.prompt for e in task.examples("train", 10, seed=4)] == [e.prompt for e in task.examples("train", 10, seed=4)]


def test_word_problems_have_their_worked_steps():
    task = get_task("word", min_ops=3, max_ops=3)
    for e in task.examples("train", 100, seed=1):
        assert len(e.meta["steps"]) == 3
        # every step's equation holds and the last one's result is the answer
        for step in e.meta["steps"]:
            lhs, rhs = step.split(": ")[1].rstrip(".").split(" = ")
            assert eval(lhs.replace("x", "*").replace("/", "//")) == int(rhs)
        assert e.meta["steps"][-1].rstrip(".").endswith(f"= {e.answer}")
    with pytest.raises(TaskError, match="min_ops"):
        get_task("word", min_ops=3, max_ops=2)


def test_champ_keeps_the_integer_answers_of_the_installed_dataset():
    task = get_task("champ")
    rows = task.rows["train"] + task.rows["heldout"]
    assert len(rows) == 79  # of CHAMP's 270 problems, those whose answer is a whole number
    assert all(e.answer.lstrip("-").isdigit() for e in rows)


def test_champ_without_its_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "champ_dataset" else real(n, *a))
    with pytest.raises(TaskError, match=r"task champ needs the package champ-dataset, not installed: pip install"):
        get_task("champ")
