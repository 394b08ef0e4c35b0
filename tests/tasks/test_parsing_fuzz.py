"""Host-side parsers of model text never raise and stay linear: proposals, answers, inputs.

Hypothesis drives every parser with random and adversarial text; the executor is a fake (no processes), so
this file is fast. Pathological shapes the red team used are tested by name as well.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from populora_verl.config import PopuLoRAConfig
from populora_verl.step.task_env import TaskEnv
from populora_verl.tasks import parsing as P
from populora_verl.tasks.task import Task, identity_code_f_task
from populora_verl.tasks.verify import score_answer, validate_proposal, values_equal


class FakeExecutor:
    """Returns the first argument (or the input text) as the output: drives validation without processes."""

    def run(self, program, inputs, *, check_determinism=None):
        try:
            args, _ = P.literal_args(inputs)
            out = repr(args[0]) if args else inputs.strip()
        except P.ParseError:
            out = inputs.strip()
        return SimpleNamespace(ok=True, output=out, error=None)

    def run_many(self, jobs, *, check_determinism=None):
        return [self.run(p, i) for p, i in jobs]


CFG = PopuLoRAConfig()
EX = FakeExecutor()

# Pieces the parsers look for, glued in random order with random text: reaches the interesting paths often.
TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "```", "```python\n", "```input\n", "```message\n",
          "```output\n", "\n", "def f(x):\n    return x\n", "1+", "(", ")", "[", "]", "'", "\\", "\x00", "\x1b[2J",
          "\ud800", "<input>", "</input>", "# Input:", "the input is ", "f(", "lambda: 0", "*", "**", "=", ","]
texts = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=20)), max_size=40).map("".join)


def _envelope(body: str) -> str:
    return f"<think>plan</think>\n<answer>\n{body}\n</answer>"


def _never_raises(text: str) -> None:
    for fn in (P.check_format, P.normalise_response, P.fenced_blocks, P.unsafe_text, P.parse_literal,
               P.normalise_program):
        fn(text)
    for fn in (P.extract_answer, P.check_call_args, P.literal_args,
               lambda t: P.check_program(t, ["os"]), lambda t: P.extract_solver_payload(t, "code_i")):
        try:
            fn(text)
        except P.ParseError:
            pass
    P.is_value_expression(text)
    P.is_value_expression(text, as_args=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts)
def test_parsers_never_raise_on_model_text(text):
    _never_raises(text)
    _never_raises(_envelope(text))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.sampled_from(["code_i", "code_o", "code_f"]))
def test_validation_and_scoring_never_raise(text, task_type):
    program = identity_code_f_task() if task_type == "code_f" else None
    for response in (text, _envelope(text), _envelope(f"```python\n{text}\n```\n```input\n{text}\n```"),
                     _envelope(f"```input\n{text}\n```\n```input\n{text}1\n```\n```message\n{text}\n```")):
        res = validate_proposal(response, task_type, EX, CFG, program=program)
        if res.task is not None:
            _task_is_prompt_safe(res.task)
        task = Task(type=task_type, program="def f(a):\n    return a\n", input="1", output="1",
                    inputs=["1", "2"], outputs=["1", "2"], num_visible=1)
        score_answer(task, response, EX, CFG)


def _task_is_prompt_safe(task: Task) -> None:
    for text in [task.program, task.input, task.output, task.message, *task.inputs, *task.outputs]:
        text.encode("utf-8")
        assert P.unsafe_text(text) is None, text


@settings(max_examples=200, deadline=None)
@given(texts)
def test_fence_and_format_scanners_match_the_reference_regexes(text):
    # The regexes they replace (quadratic on adversarial text, fine on small random text).
    fence = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
    fmt = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
    assert P.fenced_blocks(text) == [(m.group(1).lower(), m.group(2)) for m in fence.finditer(text)]
    assert P.check_format(text) == (fmt.match(text.lstrip()) is not None)


LONG_SUM = "+".join(["1"] * 1200)
DEEP = "[" * 5000 + "]" * 5000


def test_long_flat_expression_in_a_code_f_input_is_invalid_not_an_exception():
    blocks = "".join(f"```input\n{LONG_SUM}+{i}\n```\n" for i in range(CFG.tasks.num_inputs))
    response = _envelope(blocks + "```message\nsum\n```")
    lenient = PopuLoRAConfig()
    lenient.tasks.code_f_rule = "lenient"
    for cfg in (CFG, lenient):
        res = validate_proposal(response, "code_f", EX, cfg, program=identity_code_f_task())
        assert res.status == "invalid", (cfg.tasks.code_f_rule, res)
    env = TaskEnv(CFG, executor=EX)
    assert env.validate_many([("code_f", response, {"program": identity_code_f_task()}, "t", 0)]) == [
        (None, "invalid", "input")]
    for text in (LONG_SUM, DEEP, f"f({LONG_SUM})", "(" * 300 + ")" * 300):
        _never_raises(text)
        _never_raises(_envelope(f"```python\ndef f(x):\n    return {text}\n```\n```input\n{text}\n```"))
        for t in ("code_i", "code_o"):
            validate_proposal(_envelope(f"```python\ndef f(x):\n    return x\n```\n```input\n{text}\n```"), t, EX, CFG)


def test_parsing_is_linear_on_adversarial_text():
    # Quadratic before: 60k backticks cost seconds. 300k characters of each shape must be instant.
    for text in ("`" * 300_000, "```\n" * 75_000, "<answer>" * 37_500, "</think> <answer>" * 17_000,
                 "<input>" * 40_000):
        t = time.perf_counter()
        P.fenced_blocks(text)
        P.check_format("<think>" + text)
        try:
            P.extract_answer("<think></think><answer>" + text, max_chars=10**6)
        except P.ParseError:
            pass
        P._tagged(text, "input")
        assert time.perf_counter() - t < 2.0, text[:20]


def test_responses_over_the_configured_length_are_format_errors():
    cfg = PopuLoRAConfig()
    cfg.tasks.max_response_chars = 1000
    long = _envelope("```python\ndef f(x):\n    return x\n```\n```input\n1\n```" + " " * 2000)
    assert validate_proposal(long, "code_o", EX, cfg).status == "format_error"
    task = Task(type="code_o", program="def f(a):\n    return a\n", input="1", output="1")
    assert score_answer(task, _envelope("1" + " " * 2000), EX, cfg).status == "format_error"


def test_outputs_and_inputs_must_be_plain_data():
    class Forging(FakeExecutor):
        def run(self, program, inputs, *, check_determinism=None):
            return SimpleNamespace(ok=True, output="A()", error=None)

    prop = _envelope("```python\ndef f(x):\n    return x\n```\n```input\n1\n```")
    assert validate_proposal(prop, "code_o", Forging(), CFG).status == "invalid"
    for bad_input in ("A()", "lambda: 1", "1 + 1", "[x for x in 'ab']", "*[1]"):
        prop = _envelope(f"```python\ndef f(x):\n    return x\n```\n```input\n{bad_input}\n```")
        assert validate_proposal(prop, "code_o", EX, CFG).status == "invalid", bad_input
    prop = _envelope("```python\ndef f(x):\n    return x\n```\n```input\n'a', [1, (2, 3)], k={'b': None}\n```")
    assert validate_proposal(prop, "code_o", EX, CFG).status == "valid"


def test_control_characters_never_reach_a_task():
    for raw in ("'\x00'", "'\x1b[31mred'", "'\ud800'"):
        prop = _envelope(f"```python\ndef f(x):\n    return x\n```\n```input\n{raw}\n```")
        assert validate_proposal(prop, "code_o", EX, CFG).status == "invalid", repr(raw)
    prop = _envelope("```python\ndef f(x):\n    return '\x1b[2J'\n```\n```input\n1\n```")
    assert validate_proposal(prop, "code_o", EX, CFG).status == "invalid"


def test_values_compare_structurally_without_custom_eq():
    assert values_equal(None, [("[1, 2]", "[1,2]", True), ("{1, 2}", "{2, 1}", True), ("1", "1.0", True)]) == [
        True, True, True]
    # An object with its own __eq__ never gets built: forged answers are simply unequal.
    assert values_equal(None, [("[1, 2]", "type('A', (), {'__eq__': lambda s, o: True})()", True),
                               ("3", "__import__('os')", True), ("[1, 2]", "[1, 2", True)]) == [
        False, False, False]
