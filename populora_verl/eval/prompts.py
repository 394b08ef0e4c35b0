"""Benchmark prompts (chat messages). Rendering through a tokenizer's chat template happens in the backends."""

from __future__ import annotations

from typing import Any

from populora_verl.eval.data import Item

__all__ = ["MATH_INSTRUCTION", "CODE_INSTRUCTION", "messages_for", "render_prompt"]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# EvalPlus's instruction for chat models.
CODE_INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
LCB_STDIN = (
    "Read the inputs from stdin, solve the problem and write the answer to stdout (do not directly test on "
    "the sample inputs). Enclose your code within delimiters as follows.\n```python\n# YOUR CODE HERE\n```"
)
LCB_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose your code within "
    "delimiters."
)


def messages_for(item: Item) -> list[dict[str, str]]:
    """Chat messages for one item: code = EvalPlus instruction + the function prompt; math = question + CoT line."""
    if item.kind == "math":
        return [{"role": "user", "content": f"{item.question.strip()}\n{MATH_INSTRUCTION}"}]
    gold = item.gold
    if gold.get("dataset") == "lcb":
        fmt = (
            f"{LCB_STARTER}\n```python\n{gold['starter_code'].rstrip()}\n```" if gold.get("starter_code") else LCB_STDIN
        )
        body = (
            f"You will be given a question (problem specification) and will generate a correct Python program "
            f"that matches the specification and passes all tests.\n\nQuestion: {item.question.strip()}\n\n"
            f"### Format: {fmt}\n\n### Answer: (use the provided format with backticks)"
        )
        return [{"role": "user", "content": body}]
    return [{"role": "user", "content": f"{CODE_INSTRUCTION}\n```python\n{item.question.strip()}\n```"}]


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The tokenizer's chat template with the generation prompt; a plain "User:/Assistant:" layout without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return text + "Assistant:"
