"""The AZR task loop as AZR runs it: one prompt tokenization for both engines, prompts and the
``tasks.prompt_file``, solver batches, the seeding phase, per-adapter compute counts and teacher-only diagnostics."""

from __future__ import annotations

import asyncio
import types

import pytest

from populora_verl.config import load_config
from populora_verl.step import GenRequest

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from populora_verl.local.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --- item 2: the azr template is raw text in both engines ------------------------------------------------


async def _verl_prompt_ids(tokenizer, rows, monkeypatch):
    """Prompt ids as verl's agent loop builds them for our rows (the real PopuLoRAAgentLoop.run and its
    ct_build_initial_tokens; only the generation after the prompt is left out)."""
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from populora_verl.rollout.agent_loop import PopuLoRAAgentLoop

    async def prompt_only_run(self, sampling_params, **kwargs):
        ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        return types.SimpleNamespace(extra_fields={"prompt_ids": ids})

    monkeypatch.setattr(SingleTurnAgentLoop, "run", prompt_only_run)
    loop = PopuLoRAAgentLoop.__new__(PopuLoRAAgentLoop)
    loop.tokenizer = tokenizer
    loop.loop = asyncio.get_running_loop()
    loop.rollout_config = types.SimpleNamespace(prompt_length=100_000)
    loop.continuous_token_builder = create_continuous_token_builder(tokenizer, hf_model_type=None)
    outs = [await loop.run({}, raw_prompt=r["raw_prompt"], populora=r["populora"]) for r in rows]
    return [o.extra_fields["prompt_ids"] for o in outs]


@pytest.mark.parametrize("template", ["azr", "chat"])
async def test_same_prompt_token_ids_in_cpu_driver_and_verl_agent_loop(tokenizer, template, monkeypatch):
    from populora_verl.local.config import load_local_config
    from populora_verl.local.hf_engine import HFEngine
    from populora_verl.step.task_env import TaskEnv
    from populora_verl.tasks import identity_task
    from populora_verl.trainer import convert

    import numpy as np

    cfg = load_config({"tasks": {"prompt_template": template}})
    env = TaskEnv(cfg, executor=object())
    rng = np.random.default_rng(0)
    requests = [GenRequest("a0", "teacher", t, env.proposer_request(t, rng)[0], 1, {}) for t in cfg.tasks.types]
    requests.append(GenRequest("a0", "student", "code_o", env.solver_request(identity_task("code_o")), 1,
                               {"task": identity_task("code_o")}))
    engine = HFEngine.__new__(HFEngine)
    engine.tokenizer, engine.cfg = tokenizer, load_local_config({"max_prompt_tokens": 100_000})
    cpu_ids = [engine._encode(r.prompt) for r in requests]

    rows = convert.requests_to_rows(requests, {"a0": {"slot": 0, "lora_int_id": 1000, "lora_name": "0@v0"}}, 1)
    verl_ids = await _verl_prompt_ids(tokenizer, rows, monkeypatch)
    assert verl_ids == cpu_ids
    if template == "azr":
        # Raw text: the ids decode to the prompt itself, which ends by opening the think block; no chat wrapping.
        assert all(tokenizer.decode(ids) == r.prompt for ids, r in zip(cpu_ids, requests))
        assert all(r.prompt.endswith("Assistant: <think>") for r in requests)
        assert all(row["populora"]["prompt_format"] == "text" for row in rows)
    else:
        assert tokenizer.decode(cpu_ids[0]).startswith("<|user|>")


# --- item 3: prompts that keep AZR's pressure, and tasks.prompt_file ----------------------------------------

# Each requirement AZR's proposer prompts state, as a phrase our wording must carry (checked case-insensitively).
IO_REQUIREMENTS = {
    "entry function f": "function named `f`",
    "at least one parameter": "at least one argument",
    "returns a value": "returns a value",
    "nested helpers": "nested inside `f`",
    "classes and imports at the top": "custom classes are allowed and go at the top, together with every import",
    "nothing after the return": "anything written after it is cut off",
    "determinism": "deterministic",
    "no randomness / time / I/O / printing / logging / outside state":
        "randomness, dates or clocks, files or the network, printing or logging, or any state outside",
    "10 s budget": "10 seconds",
    "state tracking across transformations": "keeping track of state",
    "multi-step reasoning": "long chain of reasoning",
    "several transformations": "several successive transformations",
    "data structures": "trees, heaps, stacks, queues or graphs",
    "algorithms": "dynamic programming, recursion, divide and conquer, greedy choices or backtracking",
    "must execute on the input": "execute on your input without errors",
    "different from the references": "different from every reference",
    "banned words even in comments": "even inside comments",
    "input not inside the program": "do not write the test input inside the program",
    "exactly one input": "exactly one input",
    "call-argument format, strings quoted": "strings are quoted",
    "plan first": "make a plan",
}
CODE_F_REQUIREMENTS = {
    "num_inputs inputs": "exactly 10 inputs",
    "diverse outputs": "varied set of outputs",
    "each input in its own block": "each in its own input block",
    "a message that helps": "message",
    "no code in the message": "must not contain the program",
    "message in any form": "coding question",
    "coverage of the input space": "whole input space",
    "inputs differ": "clearly different from one another",
    "challenging but not impossible": "challenging for the solver, but not impossible",
    "inputs must run": "run on the program without errors",
    "plan first": "make a plan",
    "subset shown (IQ test)": "intelligence test",
}


def test_default_proposer_prompts_carry_every_azr_requirement():
    from populora_verl.tasks import identity_task, proposer_prompt

    cfg = load_config({}).tasks
    refs = [identity_task("code_o")]
    for tt in ("code_o", "code_i"):
        q = proposer_prompt(tt, cfg, references=refs).lower()
        missing = [k for k, phrase in IO_REQUIREMENTS.items() if phrase.lower() not in q]
        assert not missing, (tt, missing)
        assert all(b in q for b in cfg.banned_keywords) and "'hello world'" in q
        assert "worked out by hand" not in q and "found by hand" not in q  # the old, easy-task pressure
    assert "hard to predict" in proposer_prompt("code_o", cfg, references=refs)
    assert "hard to invert" in proposer_prompt("code_i", cfg, references=refs)
    qf = proposer_prompt("code_f", cfg, program=refs[0]).lower()
    missing = [k for k, phrase in CODE_F_REQUIREMENTS.items() if phrase.lower() not in qf]
    assert not missing, missing


def test_prompt_file_replaces_templates_and_is_checked_at_start_up(tmp_path):
    from populora_verl.config import ConfigError
    from populora_verl.tasks import identity_task, proposer_prompt, solver_request

    good = tmp_path / "prompts.yaml"
    good.write_text(
        "propose_code_o: |\n  Make a hard program. Banned: {banned_keywords}.\n  {references}\n"
        "reference: \"<snippet_{index}>{program}|{input}|{output}</snippet_{index}>\"\n"
        "solve_code_o: \"Deduce f({input}) for {{the}} snippet:\\n{program}\"\n")
    cfg = load_config({"tasks": {"prompt_file": str(good)}}).tasks
    q = proposer_prompt("code_o", cfg, references=[identity_task("code_o")])
    assert q.startswith("Make a hard program. Banned: logging, random")
    assert "<snippet_1>def f(a):\n    return a|'Hello world'|'Hello world'</snippet_1>" in q
    s = solver_request(identity_task("code_o"), cfg)
    assert "Deduce f('Hello world') for {the} snippet:\ndef f(a):" in s and s.endswith("Assistant: <think>")
    # Names the file leaves out keep our wording.
    assert "exactly 10 inputs" in proposer_prompt("code_f", cfg, program=identity_task("code_o"))

    def err(text: str, suffix: str = ".yaml") -> str:
        f = tmp_path / f"bad{suffix}"
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config({"tasks": {"prompt_file": str(f)}})
        msg = str(e.value)
        assert msg.startswith("populora.tasks.prompt_file: ") and "\n" not in msg, msg
        return msg

    assert "unknown placeholder {snippet}" in err("solve_code_o: 'Run {snippet} on {input} {program}'")
    assert "'solve_code_o'" in err("solve_code_o: 'Run {snippet} on {input} {program}'")
    assert "lacks the placeholder {input}" in err("solve_code_o: 'Run {program}'")
    assert "unknown template 'propose_code_x'" in err("propose_code_x: '{references}'")
    assert "bad placeholder {}" in err("azr_wrapper: 'Q: {} {question}'")
    assert "literal braces" in err("azr_wrapper: 'Q: {question} }'")
    assert "format spec" in err("azr_wrapper: '{question!r}'")
    assert "unknown placeholder {nope}" in err('{"pair": "{input} {output} {nope}"}', ".json")
    assert "no such file" in err_missing(tmp_path)


def err_missing(tmp_path) -> str:
    from populora_verl.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config({"tasks": {"prompt_file": str(tmp_path / "absent.yaml")}})
    return str(e.value)


# --- item 5: solver batches as AZR ----------------------------------------------------------------------------

from _shared import GOOD_PROPOSAL, RIGHT, answer_with, small_step_config  # noqa: E402


def test_single_agent_trains_on_max_new_buffer_batch_not_on_estimation(executor):
    """AZR's solver batch: buffer tasks, the last step's proposals first, n = 1; the n = student_n estimation
    answers give s̄ (the proposer's reward) but are not trained on."""
    from populora_verl.step import PopulationStep

    cfg = small_step_config(2, population={"mode": "single_agent"}, buffer={"student_mix": "max_new"},
                            rollout={"buffer_task_n": 1}, rewards={"train_on_estimation_rollouts": False})
    ps = PopulationStep(cfg, executor=executor, seed=0)
    for step in (1, 2):
        reqs = ps.begin(step)
        sreqs = ps.on_proposals(answer_with(reqs, lambda r, k: GOOD_PROPOSAL))
        est = [r for r in sreqs if r.meta["source"] == "teacher"]
        buf = [r for r in sreqs if r.meta["source"] == "buffer"]
        assert [r.n for r in est] == [4, 4] and len(buf) == 2 and all(r.n == 1 for r in buf)
        if step == 1:  # only the identity seed is buffered: AZR pads the batch by repeating it
            assert all("Hello world" in r.prompt for r in buf)
        else:  # step 1's valid proposal (x + 1) is the newest task: it comes first
            assert "return x + 1" in buf[0].prompt and buf[0].meta["task"].step == 1
        res = ps.on_answers(answer_with(sreqs, lambda r, k: RIGHT if k < 2 else "no"))
        trained = res.updates["a0"]
        assert [s.role for s in trained].count("teacher") == 2
        assert sorted(s.meta["source"] for s in trained if s.role == "student") == ["buffer", "buffer"]
        # s̄ still comes from the 4 estimation answers per task: 2 of 4 right -> 1 - 0.5.
        assert max(s.reward for s in trained if s.role == "teacher") == pytest.approx(0.5)


def test_fallback_stands_in_for_each_missing_valid_task(executor):
    """student_mix=fallback: a teacher with 1 valid task of 2 leaves its student 1 buffer task, so every student
    answers proposals_per_type x teacher_n tasks per type (today's code gave a buffer task only when none was
    valid)."""
    from populora_verl.step import PopulationStep

    ps = PopulationStep(small_step_config(2), executor=executor, seed=0)
    reqs = ps.begin(1)
    pairs = dict(ps._pairs)
    sreqs = ps.on_proposals(answer_with(reqs, lambda r, k: GOOD_PROPOSAL if r.meta.get("i", 0) == 0 and
                                    r is [q for q in reqs if q.adapter == r.adapter][0] else "garbage"))
    for teacher in ("t0", "t1"):
        mine = [r for r in sreqs if r.adapter == pairs[teacher]]
        assert sorted(r.meta["source"] for r in mine) == ["buffer", "teacher"], teacher
    ps.on_answers(answer_with(sreqs, lambda r, k: RIGHT))


def test_student_mix_names_its_choices():
    from populora_verl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^populora.buffer.student_mix: must be one of \['fallback', 'max_new'\]"):
        load_config({"buffer": {"student_mix": "uniform"}})
    with pytest.raises(ConfigError, match=r"^populora.buffer.student_mix: must be a string"):
        load_config({"buffer": {"student_mix": True}})  # the old boolean
    with pytest.raises(ConfigError, match="populora.rollout.buffer_task_n"):
        load_config({"rollout": {"buffer_task_n": 0}})


# --- item 11: diagnostics count teacher-written programs only ---------------------------------------------------


def test_complexity_and_coverage_leave_out_code_f_programs(executor):
    """A valid code_f proposal carries a buffer program the teacher was shown: only the code_o program counts."""
    from populora_verl.step import PopulationStep

    cfg = small_step_config(2, population={"mode": "single_agent"},
                            tasks={"types": ["code_o", "code_f"], "num_inputs": 2}, rollout={"proposals_per_type": 1})
    ps = PopulationStep(cfg, executor=executor, seed=0)
    reqs = ps.begin(1)
    code_f = "ok</think>\n<answer>\n```input\n'a'\n```\n```input\n2\n```\n```message\nsame back\n```\n</answer>"
    sreqs = ps.on_proposals(answer_with(reqs, lambda r, k: GOOD_PROPOSAL if r.task_type == "code_o" else code_f))
    assert sorted(r.task_type for r in sreqs if r.meta["source"] == "teacher") == ["code_f", "code_o"]
    res = ps.on_answers(answer_with(sreqs, lambda r, k: RIGHT))
    assert res.metrics["populora/validity/a0"] == 1.0
    assert res.metrics["populora/complexity/num_programs"] == 1.0
    assert ps.diagnostics.archive.num_tasks == 1


# --- item 7: compute matching by what is trained, on the CPU driver's logged counts -----------------------------


@pytest.fixture(scope="module")
def tiny():
    from populora_verl.local.tiny import build_tiny

    return build_tiny(seed=0)


def _driver(tiny, run_dir, *extra):
    import copy

    from populora_verl.local.__main__ import build_configs, parse_args
    from populora_verl.local.driver import LocalDriver

    args = parse_args(["--run-dir", str(run_dir), "-q", "--steps", "1", "populora.rollout.max_new_tokens=8",
                       "populora.tasks.types=[code_o]",
                       "local.tensorboard=false", "populora.diagnostics.plots=false", *extra])
    cfg, local = build_configs(args)
    return LocalDriver(cfg, local, run_dir, model=copy.deepcopy(tiny[0]), tokenizer=tiny[1])


def _run_driver(tiny, run_dir, *extra):
    import json

    d = _driver(tiny, run_dir, *extra)
    try:
        d.run()
    finally:
        d.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return d.cfg, rows[-1]


def test_single_agent_recipe_rule_matches_a_population_member_on_logged_counts(tiny, tmp_path):
    """Population 2T+2S on code_o (teacher: 2 x 1 = 2 proposals; student: 2 tasks x 3 answers = 6): mean member 4.
    The single agent as the azr_single_agent recipe sets it (max_new, one answer per buffer task, estimation not
    trained): 2 proposals + 2 buffer answers = 4, one update each."""
    from populora_verl.step import planned_trajectories

    pop_cfg, pop = _run_driver(tiny, tmp_path / "pop", "populora.rollout.student_n=3")
    one_cfg, one = _run_driver(tiny, tmp_path / "one", "--single-agent", "populora.rollout.student_n=3",
                               "populora.buffer.student_mix=max_new", "populora.rollout.buffer_task_n=1",
                               "populora.rewards.train_on_estimation_rollouts=false")
    traj = {k.split("/")[2]: v for k, v in pop.items() if k.startswith("populora/compute/") and
            k.endswith("/trajectories")}
    assert traj == {"t0": 2.0, "t1": 2.0, "s0": 6.0, "s1": 6.0, "member_mean": 4.0}
    for m, planned in (("t0", 2.0), ("t1", 2.0), ("s0", 6.0), ("s1", 6.0)):  # the plan per adapter, as realised
        assert pop[f"populora/compute/{m}/planned"] == pop[f"populora/compute/{m}/realised"] == planned
    assert one["populora/compute/a0/planned"] == one["populora/compute/a0/realised"] == 4.0
    assert pop["populora/compute/max_plan_deviation"] == one["populora/compute/max_plan_deviation"] == 0.0
    assert planned_trajectories(pop_cfg) == planned_trajectories(one_cfg) == 4.0
    assert one["populora/compute/a0/trajectories"] == pop["populora/compute/member_mean/trajectories"] == 4.0
    assert one["populora/compute/a0/updates"] == pop["populora/compute/member_mean/updates"] == 1.0
    # Estimation answers are generated (s̄ for the proposer's reward) but not trained on: 2 + 2 x 3 for valid
    # proposals (the random model rarely writes one) + 2.
    assert one["populora/compute/a0/generated"] in (4.0, 7.0, 10.0)
    for row, m in ((pop, "s0"), (one, "a0")):  # tokens: the response tokens of the trained trajectories
        tokens = row[f"populora/compute/{m}/tokens"]
        assert row[f"populora/compute/{m}/trajectories"] <= tokens <= 8 * row[f"populora/compute/{m}/trajectories"]
        assert tokens == row[f"populora/train/{m}/tokens"]


# --- item 6: the seeding phase ---------------------------------------------------------------------------------


def _seed_script(requests, texts_by_request):
    """Scripted proposals for the seeding rounds: every other one valid, each valid one a new program."""
    out = []
    for req, texts in zip(requests, texts_by_request):
        k = _seed_script.counter = getattr(_seed_script, "counter", 0) + 1
        if k % 2:
            out.append(["no idea"] * len(texts))
        elif req.task_type == "code_f":
            blocks = "".join(f"```input\n{k * 10 + i}\n```\n" for i in range(4))
            out.append([f"ok</think>\n<answer>\n{blocks}```message\nsame back\n```\n</answer>"] * len(texts))
        else:
            prog = f"def f(x):\n    return x + {k}\n"
            out.append([f"plan</think>\n<answer>\n```python\n{prog}```\n```input\n{k}\n```\n</answer>"] * len(texts))
    return out


def test_seeding_phase_fills_buffers_from_the_base_model_and_is_reusable(tiny, tmp_path, monkeypatch):
    import json

    from populora_verl.local.hf_engine import HFEngine
    from populora_verl.step import PopulationStep
    from populora_verl.step.records import BASE_POLICY
    from populora_verl.tasks import load_seed_file

    seen = []
    real_generate = HFEngine.generate

    def generate(self, requests, slot_of, seed):
        out = real_generate(self, requests, slot_of, seed)  # the real model, so "__base__" really runs
        if requests and requests[0].adapter == BASE_POLICY:
            seen.append([(r.adapter, slot_of(r.adapter), r.role, r.task_type) for r in requests])
            for resp, texts in zip(out, _seed_script(requests, [o.texts for o in out])):
                resp.texts = texts
        return out

    monkeypatch.setattr(HFEngine, "generate", generate)
    _seed_script.counter = 0
    cfg, row = _run_driver(tiny, tmp_path / "a", "populora.tasks.types=[code_o,code_i,code_f]",
                           "populora.buffer.seed_programs=3", "populora.buffer.seed_rounds=5")
    assert len(seen) >= 2 and all(a == BASE_POLICY and s == "__base__" and role == "seed"
                                  for rnd in seen for a, s, role, _ in rnd)
    assert sorted({t for _, _, _, t in seen[0]}) == ["code_f", "code_i", "code_o"]
    assert row["populora/seeding/io_programs"] == 3.0 and row["populora/seeding/code_f_tasks"] == 3.0
    assert 0.0 < row["populora/seeding/valid_rate"] < 1.0
    assert row["populora/seeding/rounds"] == float(len(seen))
    seed_file = tmp_path / "a" / "seed_tasks.jsonl"
    lines = [json.loads(x) for x in seed_file.read_text().splitlines()]
    assert len(lines) == 6 and sum("inputs" in d for d in lines) == 3
    seeds = load_seed_file(seed_file)
    assert sorted(t.type for t in seeds) == ["code_f"] * 3 + ["code_i"] * 3 + ["code_o"] * 3

    # Reuse: the saved set seeds a new run through buffer.seed_file, with no seeding round.
    seen.clear()
    ps = PopulationStep(load_config({"buffer": {"seed_file": str(seed_file), "seed_programs": 3}}))
    assert ps.seeded and ps.seed_begin() == []
    assert {t.program for t in ps.tasks.buffers["code_i"]} == {t.program for t in seeds if t.type == "code_i"}
    d = _driver(tiny, tmp_path / "b", f"populora.buffer.seed_file={seed_file}", "populora.buffer.seed_programs=3")
    try:
        assert d.seed_buffers() == 0 and seen == [] and not (tmp_path / "b" / "seed_tasks.jsonl").exists()
    finally:
        d.close()


def test_step_refuses_to_start_before_seeding():
    from populora_verl.step import PopulationStep

    ps = PopulationStep(load_config({"buffer": {"seed_programs": 2, "seed_rounds": 1}}), executor=object())
    with pytest.raises(RuntimeError, match="seeding"):
        ps.begin(1)
    requests = ps.seed_begin()
    assert len(requests) == 4 and {r.n for r in requests} == {1}  # 2 io + 2 code_f prompts
    ps.tasks.validate_many = lambda items: [(None, "format_error")] * len(items)
    ps.seed_on_proposals([["junk"] for _ in requests])
    assert ps.seed_begin() == [] and ps.seeded  # rounds spent: training starts with the identity seeds
    assert ps.begin(1)


def test_seeding_requests_route_to_a_fresh_lora_id_on_verl():
    from populora_verl.step import GenRequest
    from populora_verl.step.records import BASE_POLICY
    from populora_verl.trainer import convert

    table = {"t0": {"slot": 0, "lora_int_id": 1000, "lora_name": "0@v0"},
             "s0": {"slot": 1, "lora_int_id": 1001, "lora_name": "1@v0"}}
    rows = convert.requests_to_rows([GenRequest(BASE_POLICY, "seed", "code_o", "p", 1, {})],
                                    convert.with_base_policy(table, "t0"), 1)
    assert rows[0]["populora"]["lora_int_id"] == 1000 and rows[0]["populora"]["role"] == "seed"
    with pytest.raises(KeyError):
        convert.with_base_policy(table, "zz")
