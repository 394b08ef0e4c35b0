"""The validity probe (populora_verl.bench.validity): failure reasons through the real validator and executor,
counts and solve rates of one setting from scripted model text, and the whole command on the HF engine with a
tiny model built here."""

from __future__ import annotations

import json

import pytest

from populora_verl.bench import validity as V
from populora_verl.config import PopuLoRAConfig
from populora_verl.tasks import validate_proposal


@pytest.fixture(scope="module")
def ex(executor_pool):
    return executor_pool.get(timeout_s=2.0, memory_mb=512, max_workers=2)


def io_answer(program: str, inp: str) -> str:
    return f"plan</think>\n<answer>\n```python\n{program}\n```\n```input\n{inp}\n```\n</answer>"


@pytest.mark.parametrize("text,task_type,expected", [
    ("I will write a program that", "code_o", "envelope: no </think>"),
    ("plan</think> some words", "code_o", "envelope: no <answer>"),
    ("plan</think>\n<answer>\n```python\ndef f(a):\n    return a\n```", "code_o", "envelope: <answer> not closed"),
    ("plan</think>\n<answer>\n```python\ndef f(a):\n    return a\n```\n</answer>", "code_o", "missing input block"),
    (io_answer("import random\ndef f(a):\n    return random.random()", "1"), "code_i", "banned import"),
    (io_answer("def f(a):\n    return 1 / 0", "1"), "code_o", "runtime error"),
    (io_answer("def f(a):\n    return (a", "1"), "code_o", "parse error"),
    (io_answer("def f(a):\n    while True:\n        a += 1", "1"), "code_o", "timeout"),
])
def test_failure_reason_through_the_validator(ex, text, task_type, expected):
    res = validate_proposal(text, task_type, ex, PopuLoRAConfig(), teacher="t", step=0)
    assert res.status != "valid"
    assert V.failure_reason(text, res.status, res.reason) == expected


def test_failure_reason_valid_and_unknown():
    assert V.failure_reason("x", "valid", "") is None
    # A reworded validator reason is kept verbatim rather than lost.
    assert V.failure_reason("x", "invalid", "the moon is full") == "other: the moon is full"


class ScriptedEngine:
    """Returns queued texts per generate call; records the prompts it was given."""

    def __init__(self, tokenizer, batches):
        self.tokenizer = tokenizer
        self.batches = list(batches)
        self.calls = []

    def generate(self, prompts, *, max_tokens, temperature, top_p, seed):
        self.calls.append(len(prompts))
        texts = self.batches.pop(0)
        texts = texts(len(prompts)) if callable(texts) else texts
        return [V.Generation(t, 10, t.startswith("cap")) for t in texts]


def test_run_setting_counts_and_solve_rates(ex, tmp_path):
    from populora_verl.local.tiny import build_tiny_tokenizer

    seed = tmp_path / "seed.jsonl"
    seed.write_text(json.dumps({"program": "def f(a):\n    return a + 1\n", "input": "1", "output": "2",
                                "type": "code_o"}) + "\n")
    proposals = [io_answer("def f(x):\n    return x * 2", "3"),          # valid, output 6
                 io_answer("def f(y):\n    return [y] * 2", "3"),        # valid, output [3, 3]
                 "cap: ran out of tokens before closing the think block",
                 io_answer("import random\ndef f(x):\n    return x", "3")]
    answer6 = "trace</think>\n<answer>\n```output\n6\n```\n</answer>"
    eng = ScriptedEngine(build_tiny_tokenizer(), [proposals, lambda n: [answer6] * n])
    res = V.run_setting(eng, V.Setting("m", "azr", 64, 1.0), types=["code_o"], proposals=4, student_n=3,
                        seed_file=str(seed), executor=ex, workers=2)
    r = res["types"]["code_o"]
    assert (r["proposals"], r["valid"], r["format_error"], r["invalid"], r["hit_cap"]) == (4, 2, 1, 1, 1)
    assert r["reasons"] == {"envelope: no </think>": 1, "banned import": 1}
    assert eng.calls == [4, (2 + 1) * 3]  # two valid tasks and one seed task, three answers each
    assert (r["solved_valid"], r["answers_valid"]) == (3, 6)  # "6" solves only the x * 2 task
    assert (r["solved_seed"], r["answers_seed"]) == (0, 3)
    table = V.render_table([res])
    assert "| m | azr | 64 | 1 | code_o | 2/4 (50%) | 1 | 1 |" in table


def test_encode_prompt_templates():
    from populora_verl.local.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}[U]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"
    raw = V.encode_prompt(tok, "User: hi\nAssistant: <think>", "azr", 4096)
    wrapped = V.encode_prompt(tok, "User: hi\nAssistant: <think>", "azr-in-chat", 4096)
    assert tok.decode(raw) == "User: hi\nAssistant: <think>"
    assert tok.decode(wrapped) == "[U]User: hi\nAssistant: <think>[A]"  # the comparison form: text in a chat turn
    assert len(V.encode_prompt(tok, "x " * 200, "azr", 16)) == 16


@pytest.mark.parametrize("template", ["azr", "chat"])
def test_a_template_name_means_what_training_sends(template):
    """The probe's ``azr`` / ``chat`` are the token ids training sends for ``tasks.prompt_template=azr`` / ``chat``
    (the proposer prompt of the population step, through training's own encoder), and the default is training's."""
    from populora_verl.config import load_config
    from populora_verl.local.tiny import build_tiny_tokenizer
    from populora_verl.step.task_env import TaskEnv
    from populora_verl.tasks.prompts import encode_prompt as training_encode

    assert V.build_parser().parse_args(["--model", "m"]).templates == [PopuLoRAConfig().tasks.prompt_template]
    assert set(V.TRAINING_TEMPLATES) == {"azr", "chat"} and "azr-raw" not in V.TEMPLATES
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<|u|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|a|>{% endif %}"
    cfg = load_config({"tasks": {"prompt_template": template}})
    assert V.build_config(template, None, {}).tasks.prompt_template == template
    import random

    env = TaskEnv(cfg)
    try:
        prompt, _meta = env.proposer_request("code_o", random.Random(0))
    finally:
        env.close()
    assert V.encode_prompt(tok, prompt, template, 10**6) == list(training_encode(tok, prompt))
    if template == "azr":  # the plain text, not wrapped in the chat template
        assert "<|u|>" not in tok.decode(V.encode_prompt(tok, prompt, template, 10**6))


def test_stop_token_ids_merge_generation_config():
    class Tok:
        eos_token_id = 5

    class Gen:
        eos_token_id = [7, 5]

    assert V.stop_token_ids(Tok(), Gen()) == [5, 7]
    assert V.stop_token_ids(Tok(), None) == [5]


def test_command_on_hf_engine_with_tiny_model(tmp_path, capsys):
    from populora_verl.local.tiny import build_tiny

    model, tok = build_tiny(seed=0)
    tok.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "out"
    seed = tmp_path / "seed.jsonl"
    seed.write_text(json.dumps({"program": "def f(a):\n    return a * 2\n", "input": "3", "output": "6"}) + "\n"
                    + json.dumps({"program": "def f(a):\n    return -a\n", "inputs": ["1", "2"], "outputs": ["-1", "-2"],
                                  "message": "negate"}) + "\n")
    rc = V.main(["--model", str(tmp_path / "tiny"), "--engine", "hf", "--templates", "chat", "azr",
                 "--seed-file", str(seed),
                 "--lengths", "8", "--temperatures", "1.0", "--proposals", "2", "--student-n", "1",
                 "--types", "code_o", "code_f", "--workers", "2", "--set", "populora.tasks.num_references=1",
                 "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["setting"]["template"] for r in data["results"]] == ["chat", "azr"]
    for res in data["results"]:
        for tt in ("code_o", "code_f"):
            r = res["types"][tt]
            assert r["proposals"] == 2
            assert r["valid"] + r["format_error"] + r["invalid"] == 2
            assert sum(r["reasons"].values()) == 2 - r["valid"]
            assert r["mean_tokens"] <= 8
        # every seed task of the probed types (one code_o, one code_f) gets one answer
        assert [res["types"][tt]["answers_seed"] for tt in ("code_o", "code_f")] == [1, 1] and res["seed_tasks"] == 2
    md = (out / "results.md").read_text()
    assert md.count("| tiny |") == 4
    assert "wrote" in capsys.readouterr().out


def test_bad_override_is_one_line(tmp_path, capsys):
    rc = V.main(["--model", "nowhere", "--engine", "hf", "--set", "populora.tasks.num_inputs=1",
                 "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "populora.tasks.num_inputs" in err and "\n" not in err


def test_model_without_chat_template_is_one_line(tmp_path, capsys):
    from populora_verl.local.tiny import build_tiny

    model, tok = build_tiny(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    rc = V.main(["--model", str(tmp_path / "tiny"), "--engine", "hf", "--templates", "chat", "--proposals", "1",
                 "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("populora_verl.bench.validity: error:") and "no chat template" in err and "(use azr)" in err
    assert not (tmp_path / "out").exists()  # nothing written for a setting that could not run
    assert V.main(["--model", str(tmp_path / "tiny"), str(tmp_path / "nowhere"), "--engine", "hf",
                   "--out", str(tmp_path / "o")]) == 2  # the second model is checked before the first one loads
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"populora_verl.bench.validity: error: --model {tmp_path / 'nowhere'}: no such directory"


def test_prompt_files_are_a_setting_dimension(tmp_path):
    """--prompt-files runs every setting once per wording (one engine), and a bad file fails before any model."""
    import json as _json

    good = tmp_path / "w.yaml"
    good.write_text("solve_code_o: |\n  Output of f for {input}?\n  ```python\n  {program}\n  ```\n", encoding="utf-8")
    bad = tmp_path / "bad.yaml"
    bad.write_text("solve_code_o: 'uses {nonsense}'\n", encoding="utf-8")
    assert V.main(["--model", str(tmp_path / "nowhere"), "--prompt-files", str(bad), "--out", str(tmp_path / "o")]) == 2
    settings = [V.Setting("m", "azr", 8, 1.0, f) for f in (None, str(good))]
    assert settings[1].label.endswith("w 8 T=1") and " w " in settings[1].label
    cfg = V.build_config("azr", None, {"tasks.prompt_file": str(good)})
    assert cfg.tasks.templates["solve_code_o"].startswith("Output of f")
    row = {"setting": {"model": "m", "template": "azr", "max_tokens": 8, "temperature": 1.0,
                       "prompt_file": str(good)}, "types": {}}
    assert _json.dumps(row) and V.render_table([row]).count("\n") == 2
