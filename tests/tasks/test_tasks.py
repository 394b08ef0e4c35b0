"""AZR tasks end to end on CPU: parsing, static checks, prompts, validation and scoring through the real
sandboxed executor, buffers. No model: proposals and answers are hand-written text."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from populora_verl.config import PopuLoRAConfig, load_config
from populora_verl.tasks import (ParseError, Task, TaskBuffer, TaskBuffers, check_format, check_program,
                                 extract_answer, identity_code_f_task, identity_task, load_seed_file,
                                 proposer_prompt, proposer_request, render_prompt, score_answer, solver_prompt,
                                 solver_request, validate_proposal)
from populora_verl.tasks.parsing import check_call_args, extract_solver_payload, is_value_expression
from populora_verl.tasks.task import TRUNCATE_CHARS


@pytest.fixture(scope="module")
def ex(executor_pool):
    return executor_pool.get(timeout_s=2.0, memory_mb=512, max_workers=2)


@pytest.fixture(scope="module")
def cfg():
    return PopuLoRAConfig()


@pytest.fixture(scope="module")
def lenient():
    return load_config({"tasks": {"code_f_rule": "lenient"}})


def wrap(answer: str, think: str = "let me think") -> str:
    """A response as the model writes it after the prompt's 'Assistant: <think>'."""
    return f"{think}</think>\n<answer>\n{answer}\n</answer>"


def fence(tag: str, body: str) -> str:
    return f"```{tag}\n{body}\n```"


def io_proposal(program: str, inp: str) -> str:
    return wrap(fence("python", program) + "\n" + fence("input", inp))


# --- parsing -------------------------------------------------------------------------------------------------


def test_extract_answer_takes_last_block_and_checks_format():
    text = "reasoning <answer>not this</answer> more</think><answer>first</answer> junk <answer>last</answer>"
    # The envelope must start with the think block; the last <answer> pair wins.
    assert extract_answer(text) == "last"
    assert check_format("<think>x</think>  <answer>y</answer>")
    assert not check_format("<think>x</think> stray <answer>y</answer>")
    with pytest.raises(ParseError):
        extract_answer("no tags at all")
    with pytest.raises(ParseError):
        extract_answer("<think>x</think><answer>unclosed")
    with pytest.raises(ParseError):
        extract_answer("prefix outside</think>", think_prefilled=False)
    assert extract_answer("<think>a</think><answer> b </answer>", think_prefilled=False) == "b"


def test_solver_payload_fallbacks():
    assert extract_solver_payload(fence("output", "[1, 2]"), "code_o") == "[1, 2]"
    assert extract_solver_payload("<input>3, 4</input>", "code_i") == "3, 4"
    assert extract_solver_payload("# Input: 'abc'", "code_i") == "'abc'"
    assert extract_solver_payload("So the input is 7.", "code_i") == "7"
    assert extract_solver_payload("  42  ", "code_o") == "42"
    assert extract_solver_payload(fence("python", "def f(x):\n    return x"), "code_f").startswith("def f")
    with pytest.raises(ParseError):
        extract_solver_payload("   ", "code_o")


@pytest.mark.parametrize("code, reason", [
    ("import random\ndef f(a):\n    return a", "random"),
    ("from os import path\ndef f(a):\n    return a", "os.path"),
    ("import os\ndef f(a):\n    return os.environ.get(a)", "os.environ"),
    ("def f(a):\n    return __import__('time').time()", "time"),
    ("import datetime as d\ndef f(a):\n    return a", "datetime"),
    ("def f(a):\n    return input()", "input("),
    ("def f(a):\n    return a\ndef g(b):\n    return b", "exactly one"),
    ("def f():\n    return 1", "no positional"),
    ("def f(a):\n    return (", "syntax"),
    ("x = 1", "no top-level function"),
])
def test_static_checks_reject(code, reason):
    with pytest.raises(ParseError, match=reason.replace("(", r"\(")):
        check_program(code, PopuLoRAConfig().tasks.banned_keywords)


def test_entry_function_renamed_to_f_token_wise():
    code = "import math\n\ndef fact(n):\n    # fact stays in comments\n    s = 'fact'\n    return 1 if n < 2 else n * fact(n - 1)\n"
    out = check_program(code, ["random"])
    assert out.original_name == "fact"
    assert "def f(n):" in out.code and "n * f(n - 1)" in out.code
    assert "# fact stays in comments" in out.code and "s = 'fact'" in out.code
    # Solver programs may have helpers; the entry is the function named f.
    helper = "def helper(x):\n    return x + 1\n\ndef f(x):\n    return helper(x)\n"
    assert check_program(helper, [], single_function=False).original_name == "f"
    with pytest.raises(ParseError):
        check_program(helper, [], single_function=True)


def test_call_args_and_value_expressions():
    assert check_call_args(" 'abc', [1, 2] ") == "'abc', [1, 2]"
    for bad in ["1) or (2", "", "f(1)) + (2", "1; import os"]:
        with pytest.raises(ParseError):
            check_call_args(bad)
    assert is_value_expression("{'a': (1, -2.5), 'b': {1, 2}}")
    assert is_value_expression("Counter({'a': 2})") and is_value_expression("set()")
    assert is_value_expression("1, 'x', [None]", as_args=True)
    for forged in ["type('A', (), {'__eq__': lambda s, o: True})()", "(lambda: 1)()", "x.y", "__import__('os')",
                   "[i for i in range(3)]"]:
        assert not is_value_expression(forged)


# --- prompts -------------------------------------------------------------------------------------------------


def test_prompts_carry_the_required_information(cfg):
    refs = [identity_task("code_o")]
    q = proposer_prompt("code_o", cfg.tasks, references=refs)
    for needle in ["`f`", "at least one argument", "deterministic", "randomness", "printing", "import",
                   "```python", "```input", "'Hello world'", *cfg.tasks.banned_keywords]:
        assert needle in q, needle
    assert "output" in proposer_prompt("code_o", cfg.tasks) and "input" in proposer_prompt("code_i", cfg.tasks)
    qf = proposer_prompt("code_f", cfg.tasks, program=refs[0])
    assert f"exactly {cfg.tasks.num_inputs} inputs" in qf and "```message" in qf and "def f(a):" in qf
    with pytest.raises(ValueError):
        proposer_prompt("code_f", cfg.tasks)
    azr = render_prompt(q, "azr")
    assert azr.startswith("A conversation between User and Assistant") and azr.endswith("\nAssistant: <think>")
    assert "\nUser: Design a new Python program" in azr
    chat = render_prompt(q, "chat")
    assert chat[0]["role"] == "user" and "<answer>" in chat[0]["content"] and q in chat[0]["content"]
    with pytest.raises(ValueError):
        render_prompt(q, "other")


def test_solver_prompts_show_what_each_type_needs():
    t = Task(type="code_o", program="def f(a):\n    return a * 2\n", input="3", output="6")
    so = solver_prompt(t)
    assert "return a * 2" in so and "```input\n3\n```" in so and "```output\n..." in so and "\n6\n" not in so
    ti = Task(type="code_i", program=t.program, input="3", output="6")
    si = solver_prompt(ti)
    assert "```output\n6\n```" in si and "```input\n3\n```" not in si
    tf = identity_code_f_task()
    sf = solver_prompt(tf)
    assert tf.message in sf and "def f(a)" not in sf
    for inp, _ in tf.visible_pairs:
        assert inp in sf
    for inp, _ in tf.hidden_pairs:
        assert inp not in sf


# --- code_o ----------------------------------------------------------------------------------------------


def test_code_o_round_trip(ex, cfg):
    prog = "def double_all(xs):\n    return {k: v * 2 for k, v in xs.items()}"
    res = validate_proposal(io_proposal(prog, "{'a': 1, 'b': 2.5}"), "code_o", ex, cfg, teacher="t0", step=3)
    assert res.status == "valid", res.reason
    t = res.task
    assert t.output == "{'a': 2, 'b': 5.0}" and t.teacher == "t0" and t.step == 3
    assert "def f(xs):" in t.program
    r = cfg.rewards
    # Equal by value: key order, int/float equality and whitespace do not matter.
    for ans in ["{'a': 2, 'b': 5.0}", "{'b': 5.0, 'a': 2}", "{'a': 2.0, 'b': 5}"]:
        s = score_answer(t, wrap(fence("output", ans)), ex, cfg)
        assert (s.status, s.reward) == ("correct", r.correct), ans
    s = score_answer(t, wrap(fence("output", "{'a': 2, 'b': 5}")), ex, cfg)
    assert (s.status, s.reward) == ("correct", r.correct)
    s = score_answer(t, wrap(fence("output", "{'a': 2, 'b': 6.0}")), ex, cfg)
    assert (s.status, s.reward) == ("wrong", r.wrong_answer)
    # An object that claims equality with everything is not a value: wrong, not correct.
    forged = "type('A', (), {'__eq__': lambda s, o: True})()"
    assert score_answer(t, wrap(fence("output", forged)), ex, cfg).status == "wrong"
    s = score_answer(t, "I think the answer is 4", ex, cfg)
    assert (s.status, s.reward) == ("format_error", r.format_error)


def test_long_outputs_truncated_like_azr_in_prompts_only(ex, cfg):
    res = validate_proposal(io_proposal("def f(n):\n    return 'ab' * n", "1000"), "code_o", ex, cfg)
    assert res.valid
    assert len(res.task.output) == 2002  # the gold is whole: answers are judged on it
    shown = res.task.shown(res.task.output)
    assert len(shown) == TRUNCATE_CHARS and "..." in shown
    assert shown in solver_prompt(replace(res.task, type="code_i"))
    no_trunc = load_config({"executor": {"truncate_output": False}})
    res2 = validate_proposal(io_proposal("def f(n):\n    return 'ab' * n", "1000"), "code_o", ex, no_trunc)
    assert len(res2.task.output) == 2002 and res2.task.shown(res2.task.output) == res2.task.output


@pytest.mark.parametrize("program, inp, status", [
    ("import random\ndef f(a):\n    return random.random()", "1", "invalid"),          # banned import
    ("_calls = [0]\ndef f(a):\n    _calls[0] += 1\n    return a + _calls[0]", "1", "invalid"),  # nondeterministic
    ("def f(a):\n    return 1 / a", "0", "invalid"),                                      # raises
    ("def f(a):\n    while True:\n        pass", "1", "invalid"),                         # times out
    ("def f(a):\n    return a", "1) or (2", "invalid"),                                   # input escapes the call
])
def test_invalid_proposals(ex, cfg, program, inp, status):
    res = validate_proposal(io_proposal(program, inp), "code_o", ex, cfg)
    assert res.status == status, res.reason
    assert res.task is None


def test_malformed_proposals_are_format_errors(ex, cfg):
    for text in ["", "just text", wrap(fence("python", "def f(a):\n    return a")),  # no input block
                 wrap(fence("input", "1")), "<answer>" + fence("python", "def f(a): return a") + "</answer>"]:
        assert validate_proposal(text, "code_i", ex, cfg).status == "format_error", text


# --- code_i ----------------------------------------------------------------------------------------------


def test_code_i_any_reproducing_input_counts(ex, cfg):
    prog = "def f(a, b):\n    return sorted([a, b])"
    res = validate_proposal(io_proposal(prog, "3, 1"), "code_i", ex, cfg)
    assert res.valid and res.task.output == "[1, 3]"
    t = res.task
    assert score_answer(t, wrap(fence("input", "3, 1")), ex, cfg).status == "correct"
    assert score_answer(t, wrap(fence("input", "1, 3")), ex, cfg).status == "correct"   # a different input
    assert score_answer(t, wrap("<input>1, 3</input>"), ex, cfg).status == "correct"   # AZR fallback
    assert score_answer(t, wrap(fence("input", "2, 3")), ex, cfg).status == "wrong"
    assert score_answer(t, wrap(fence("input", "1")), ex, cfg).status == "wrong"       # f raises
    # Code that closes the call and returns the gold directly is not an input.
    assert score_answer(t, wrap(fence("input", "0, 0) if 0 else ([1, 3]")), ex, cfg).status == "wrong"
    assert score_answer(t, "no envelope", ex, cfg).status == "format_error"


# --- code_f ----------------------------------------------------------------------------------------------

PARITY = "def f(xs):\n    return [x for x in xs if x % 2 == 0]\n"


def code_f_proposal(inputs, message="keep some of the numbers"):
    return wrap("\n".join(fence("input", i) for i in inputs) + "\n" + fence("message", message))


def test_code_f_round_trip_scores_hidden_pairs(ex, cfg, lenient):
    program = Task(type="code_o", program=PARITY, input="[1, 2]", output="[2]")
    inputs = ["[1, 2, 3, 4]", "[]", "[5]", "[1,2,3,4]", "'oops'", "[10, 11]", "[6, 8]", "[7, 9, 12]", "[0]", "[3, 3]"]
    res = validate_proposal(code_f_proposal(inputs), "code_f", ex, lenient, program=program, teacher="t1")
    assert res.valid, res.reason
    t = res.task
    # Duplicate ("[1,2,3,4]") and failing ("'oops'") inputs dropped: 8 left, split 4 shown / 4 hidden.
    assert len(t.inputs) == 8 and t.num_visible == 4 and len(t.hidden_pairs) == 4
    assert t.outputs[0] == "[2, 4]" and t.message == "keep some of the numbers"
    good = "def keep_even(xs):\n    out = []\n    for x in xs:\n        if not x & 1:\n            out.append(x)\n    return out"
    s = score_answer(t, wrap(fence("python", good)), ex, cfg)
    assert (s.status, s.reward) == ("correct", cfg.rewards.correct), s.reason
    # Memorising the visible pairs does not solve the hidden ones.
    table = {i: o for i, o in t.visible_pairs}
    memo = "def f(xs):\n    table = " + "{" + ", ".join(f"str({i}): {o}" for i, o in table.items()) + "}\n    return table.get(str(xs), [])"
    assert score_answer(t, wrap(fence("python", memo)), ex, cfg).status == "wrong"
    # A returned object with a forged __repr__/__eq__ is compared as text, not as a value.
    forged = ("class A:\n    def __eq__(self, o):\n        return True\n"
              "    def __repr__(self):\n        return \"type('A', (), {'__eq__': lambda s, o: True})()\"\n\n"
              "def f(xs):\n    return A()")
    assert score_answer(t, wrap(fence("python", forged)), ex, cfg).status == "wrong"
    assert score_answer(t, wrap(fence("python", "import random\ndef f(xs):\n    return xs")), ex, cfg).status == "wrong"
    assert score_answer(t, wrap("def f(xs) return"), ex, cfg).status == "wrong"
    assert score_answer(t, "<answer>" + good, ex, cfg).status == "format_error"


def test_code_f_needs_enough_valid_inputs_and_a_message(ex, lenient):
    program = Task(type="code_o", program=PARITY, input="[1, 2]", output="[2]")
    res = validate_proposal(code_f_proposal(["'a'", "None", "[1]"]), "code_f", ex, lenient, program=program)
    assert res.status == "invalid" and "need 2" in res.reason
    no_msg = wrap(fence("input", "[1]") + fence("input", "[2]"))
    res = validate_proposal(no_msg, "code_f", ex, lenient, program=program)
    assert res.status == "format_error" and res.code == "message"  # told apart from missing input blocks
    no_inputs = wrap(fence("message", "Find the parity of each number."))
    assert validate_proposal(no_inputs, "code_f", ex, lenient, program=program).code == "blocks"


def test_code_f_azr_rule_needs_num_inputs_takes_the_last_and_rejects_any_failure(ex, cfg):
    """AZR's rule (the default): fewer than num_inputs input blocks is a format error, the last num_inputs are
    used, and one input that fails to run makes the whole proposal invalid."""
    assert cfg.tasks.code_f_rule == "azr" and cfg.tasks.num_inputs == 10
    program = Task(type="code_o", program=PARITY, input="[1, 2]", output="[2]")
    good = [f"[{i}, {i + 1}]" for i in range(10)]
    # Two leading drafts the model wrote while planning: AZR keeps the last ten blocks, so they are ignored.
    res = validate_proposal(code_f_proposal(["'draft'", "None"] + good), "code_f", ex, cfg, program=program)
    assert res.valid, res.reason
    assert res.task.inputs == good and res.task.num_visible == 5 and len(res.task.hidden_pairs) == 5
    short = validate_proposal(code_f_proposal(good[:9]), "code_f", ex, cfg, program=program)
    assert short.status == "format_error" and "need 10" in short.reason
    bad = validate_proposal(code_f_proposal(good[:9] + ["'oops'"]), "code_f", ex, cfg, program=program)
    assert bad.status == "invalid" and "oops" in bad.reason
    unparsable = validate_proposal(code_f_proposal(good[:9] + ["1, )"]), "code_f", ex, cfg, program=program)
    assert unparsable.status == "invalid"
    assert cfg.rewards.format_error == cfg.rewards.invalid_program == -1.0  # both are AZR's -1


def test_code_f_inputs_run_with_the_determinism_check(ex, cfg, lenient):
    """Each proposed input runs on the buffered program with the determinism check, under both rules: a
    program whose result changes between calls yields no gold (one run alone looks fine)."""
    counter = Task(type="code_o", program="_calls = [0]\ndef f(a):\n    _calls[0] += 1\n    return a + _calls[0]\n",
                   input="1", output="2")
    inputs = [str(i) for i in range(10)]
    strict = validate_proposal(code_f_proposal(inputs), "code_f", ex, cfg, program=counter)
    assert strict.status == "invalid" and "nondeterministic" in strict.reason, strict.reason
    loose = validate_proposal(code_f_proposal(inputs), "code_f", ex, lenient, program=counter)
    assert loose.status == "invalid" and "0 valid distinct inputs" in loose.reason, loose.reason
    # The check is what refuses it: with executor.check_determinism off the same proposal is valid.
    unchecked = load_config({"executor": {"check_determinism": False}})
    assert validate_proposal(code_f_proposal(inputs), "code_f", ex, unchecked, program=counter).valid


def test_code_f_identity_seed_is_solvable(ex, cfg):
    t = identity_code_f_task()
    assert t.num_visible == 3 and len(t.hidden_pairs) == 3
    assert score_answer(t, wrap(fence("python", "def f(a):\n    return a")), ex, cfg).correct
    assert not score_answer(t, wrap(fence("python", "def f(a):\n    return str(a)")), ex, cfg).correct
    empty = Task(type="code_f", program=t.program, message="nothing to check")
    assert score_answer(empty, wrap(fence("python", "def f(a):\n    return a")), ex, cfg).status == "wrong"


# --- fuzz: hostile text never raises ---------------------------------------------------------------------

_pieces = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "```", "```python\n", "```input\n",
                           "```output\n", "```message\n", "def f(a):\n    return a\n", "1, 2", "\n", "'x'", "(",
                           ")", "import random\n", "f(", "\x00", "…", "lambda: 0"])
_text = st.one_of(st.text(max_size=200), st.lists(st.one_of(_pieces, st.text(max_size=10)), max_size=25).map("".join))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text, task_type=st.sampled_from(["code_i", "code_o", "code_f"]))
def test_fuzz_never_raises(ex, cfg, text, task_type):
    program = identity_task("code_o")
    res = validate_proposal(text, task_type, ex, cfg, program=program)
    assert res.status in ("valid", "invalid", "format_error")
    task = identity_code_f_task() if task_type == "code_f" else identity_task(task_type)
    s = score_answer(task, text, ex, cfg)
    assert s.status in ("correct", "wrong", "format_error")
    assert s.reward in (cfg.rewards.correct, cfg.rewards.wrong_answer, cfg.rewards.format_error)


# --- buffers -------------------------------------------------------------------------------------------------


def _t(i: int, step: int = 0) -> Task:
    return Task(type="code_o", program=f"def f(a):\n    return a + {i}\n", input="1", output=str(1 + i), step=step)


def test_buffer_seed_dedup_fifo_and_filter():
    bufs = TaskBuffers()
    assert [len(bufs[t]) for t in ("code_i", "code_o", "code_f")] == [1, 1, 1]
    assert bufs["code_o"].tasks[0].program == "def f(a):\n    return a\n"
    assert bufs["code_f"].tasks[0].message == "Write a function that returns whatever you input"
    b = TaskBuffer("code_o", max_programs=3)
    assert b.add(_t(1)) and not b.add(_t(1))
    # Normalised program: comments and layout do not make a new task.
    assert not b.add(Task(type="code_o", program="def f(a):  # same\n    return (a + 1)\n", input=" 1", output="2"))
    for i in range(2, 6):
        b.add(_t(i))
    assert len(b) == 3 and b.evicted == 2 and [t.output for t in b] == ["4", "5", "6"]
    assert not b.add(_t(9), solve_rate=1.0, filter="non_one") and b.add(_t(9), solve_rate=0.5, filter="non_one")
    assert not b.add(_t(10), solve_rate=0.0, filter="non_extremes")
    with pytest.raises(ValueError):
        b.add(identity_task("code_i"))


def test_buffer_sampling_is_deterministic_and_checkpointable(tmp_path):
    bufs = TaskBuffers()
    for i in range(20):
        bufs.add(_t(i, step=i))
    pick = lambda rng: [t.id for t in bufs.references("code_o", 6, rng)]  # noqa: E731
    assert pick(np.random.default_rng(7)) == pick(np.random.default_rng(7))
    assert pick(random.Random(7)) == pick(random.Random(7))
    assert len(set(pick(np.random.default_rng(1)))) == 6
    assert len(bufs.references("code_i", 6, np.random.default_rng(0))) == 1  # fewer than K available
    batch = bufs["code_o"].max_new(4, np.random.default_rng(0), since_step=18)
    assert sorted(t.step for t in batch[:2]) == [18, 19] and len(batch) == 4 and all(t.step < 18 for t in batch[2:])
    # AZR pads a batch larger than the buffer by repeating tasks: always exactly n.
    assert len(bufs["code_i"].max_new(5, np.random.default_rng(0), since_step=0)) == 5
    assert TaskBuffer("code_o").max_new(3, np.random.default_rng(0), since_step=0) == []
    assert bufs.sample_program(np.random.default_rng(0)).type in ("code_i", "code_o")
    path = tmp_path / "buffers.json"
    bufs.save(path)
    again = TaskBuffers()
    again.load(path)
    assert again.state_dict() == bufs.state_dict()
    assert pick(np.random.default_rng(3)) == [t.id for t in again.references("code_o", 6, np.random.default_rng(3))]


def test_seed_file(tmp_path):
    path = tmp_path / "seed.jsonl"
    lines = [{"program": "def f(a):\n    return a * 3\n", "input": "2", "output": "6"},
             {"program": "def f(a):\n    return -a\n", "inputs": ["1", "2"], "outputs": ["-1", "-2"], "message": "m"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    tasks = load_seed_file(path)
    assert [t.type for t in tasks] == ["code_i", "code_o", "code_f"] and tasks[2].num_visible == 1
    bufs = TaskBuffers(load_config({"buffer": {"seed_file": str(path)}}).buffer)
    assert bufs["code_o"].tasks[0].output == "6" and bufs["code_f"].tasks[0].message == "m"
    path.write_text('{"input": "1"}\n')
    with pytest.raises(ValueError, match="seed.jsonl:1"):
        load_seed_file(path)


def test_shipped_seed_file_is_valid(ex, cfg):
    from importlib.resources import files

    path = files("populora_verl") / "data" / "azr_seed.jsonl"
    tasks = load_seed_file(str(path))
    assert tasks[0].program == identity_task().program
    io_tasks = [t for t in tasks if t.type == "code_o"]
    results = ex.run_many([(t.program, t.input) for t in io_tasks])
    assert [r.output for r in results] == [t.output for t in io_tasks]
    for t in io_tasks:
        check_program(t.program, cfg.tasks.banned_keywords)


def test_task_json_round_trip():
    t = identity_code_f_task()
    assert Task.from_json(t.to_json()) == t
    with pytest.raises(ValueError):
        Task.from_dict({"type": "code_x", "program": "x"})
    with pytest.raises(ValueError):
        Task(type="code_f", program="p", inputs=["1"], outputs=[])


def test_readme_worked_examples(ex, cfg, lenient):
    """The code_i and code_f worked examples of docs/tasks-and-rewards.md, as written there."""
    two_sum = ("def f(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n        if target - x in seen:\n"
               "            return (seen[target - x], i)\n        seen[x] = i\n    return None")
    t = validate_proposal(io_proposal(two_sum, "[2, 7, 11, 15], 9"), "code_i", ex, cfg).task
    assert t.output == "(0, 1)"
    got = [score_answer(t, wrap(fence("input", a)), ex, cfg).reward
           for a in ["[2, 7, 11, 15], 9", "[4, 5], 9", "[1, 2], 3", "[1, 2], 4", "0, 0) if 0 else ((0, 1)"]]
    assert got == [1.0, 1.0, 1.0, -0.5, -0.5]
    base3 = Task(type="code_o", program="def f(n):\n    digits = []\n    while n:\n        n, r = divmod(n, 3)\n"
                 "        digits.append(str(r))\n    return ''.join(reversed(digits)) or '0'\n", input="100", output="'10201'")
    inputs = ["0", "1", "2", "3", "8", "9", "27", "100", "3", "'ten'"]
    tf = validate_proposal(code_f_proposal(inputs, "Write the number in another base."), "code_f", ex, lenient,
                           program=base3).task
    assert tf.visible_pairs == [("0", "'0'"), ("1", "'1'"), ("2", "'2'"), ("3", "'10'")]
    assert tf.hidden_pairs == [("8", "'22'"), ("9", "'100'"), ("27", "'1000'"), ("100", "'10201'")]
    good = "def f(n):\n    if n == 0:\n        return '0'\n    s = ''\n    while n > 0:\n        s = str(n % 3) + s\n        n //= 3\n    return s"
    assert score_answer(tf, wrap(fence("python", good)), ex, cfg).reward == 1.0
    assert score_answer(tf, wrap(fence("python", "def f(n): return bin(n)[2:]")), ex, cfg).reward == -0.5


def test_prompt_requests_from_buffers(cfg):
    bufs = TaskBuffers()
    for i in range(10):
        bufs.add(_t(i))
    p1, prog = proposer_request("code_o", bufs, cfg.tasks, np.random.default_rng(0))
    p2, _ = proposer_request("code_o", bufs, cfg.tasks, np.random.default_rng(0))
    assert prog is None and p1 == p2 and len(re.findall(r"Reference \d+:", p1)) == cfg.tasks.num_references
    pf, prog = proposer_request("code_f", bufs, cfg.tasks, np.random.default_rng(0))
    assert prog is not None and prog.program in pf
    chat = load_config({"tasks": {"prompt_template": "chat"}}).tasks
    msgs = solver_request(identity_task("code_i"), chat)
    assert msgs[0]["role"] == "user" and "'Hello world'" in msgs[0]["content"]
