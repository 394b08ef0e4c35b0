"""populora_verl.eval on CPU: graders fed known-right / known-wrong answers, the sandbox against hostile code,
the LCB loader on a file written here, and an end-to-end HF evaluation of base + 2 random adapters."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

from populora_verl.eval.code_grader import check_candidate, compute_expected, extract_code
from populora_verl.eval.data import BENCHMARKS, MATH_BENCHMARKS, load_benchmark, resolve_data_dir
from populora_verl.eval.lcb import LCBFormatError, check_lcb, decode_private_tests, load_lcb_items, stdout_matches
from populora_verl.eval.math_grader import extract_answer, extract_boxed, math_equal, score_math
from populora_verl.eval.sandbox import SandboxLimits, run_program

from _shared import DATA as TEST_DATA

# A few real items per benchmark, in the release formats (tests/data/benchmarks/README.md), so the tests run the
# same on every machine, whatever benchmark copy it has.
DATA = resolve_data_dir(TEST_DATA / "benchmarks")


@pytest.fixture(autouse=True)
def _fixture_benchmarks(monkeypatch):
    monkeypatch.setenv("POPULORA_BENCHMARKS", str(DATA))
FAST = SandboxLimits(task_timeout_s=10.0, exec_timeout_s=5.0, memory_mb=1024)


def _item(bench: str, task_id: str):
    items = [i for i in load_benchmark(bench) if i.id == task_id]
    assert items, task_id
    return items[0]


# --- code graders ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("expected")


@pytest.mark.parametrize("task_id,broken", [
    ("HumanEval/0", "def has_close_elements(numbers, threshold):\n    return False\n"),
    # Off by one on the boundary: right on base tests of the sorted kind, wrong elsewhere.
    ("HumanEval/2", "def truncate_number(number):\n    return number - int(number) + 1e-3\n"),
])
def test_humaneval_plus_canonical_passes_broken_fails(task_id, broken, cache_dir):
    item = _item("humaneval_plus", task_id)
    exp = compute_expected(item.gold, cache_dir=cache_dir)
    assert exp.error is None and len(exp.values) == len(item.gold["base_input"]) + len(item.gold["plus_input"])
    good = check_candidate(item.gold, item.gold["prompt"] + item.gold["canonical_solution"], exp, limits=FAST)
    assert good.base_pass and good.plus_pass, good
    bad = check_candidate(item.gold, broken, exp, limits=FAST)
    assert not bad.plus_pass and "wrong output" in bad.error


def test_humaneval_32_find_zero_uses_root_oracle(cache_dir):
    item = _item("humaneval_plus", "HumanEval/32")
    exp = compute_expected(item.gold, cache_dir=cache_dir)
    canonical = check_candidate(item.gold, item.gold["prompt"] + item.gold["canonical_solution"], exp, limits=FAST)
    assert canonical.plus_pass, canonical  # evalplus 0.3.1 fails this one (PR #201); we must not
    # The canonical root nudged by 1e-15 (where it stays a root): not equal to the expected float, still a root within atol, so only
    # the |poly(x)| <= atol oracle accepts it.
    body = item.gold["canonical_solution"].replace(
        "return x", "return x + 1e-15 if abs(poly(xs, x + 1e-15)) <= 1e-6 else x")
    assert body != item.gold["canonical_solution"]
    nudged = check_candidate(item.gold, item.gold["prompt"] + body, exp, limits=FAST)
    assert nudged.plus_pass, nudged
    wrong = check_candidate(item.gold, "def find_zero(xs):\n    return 0.5\n", exp, limits=FAST)
    assert not wrong.base_pass and not wrong.plus_pass
    assert not check_candidate(item.gold, "def find_zero(xs):\n    return 'x'\n", exp, limits=FAST).plus_pass


def test_mbpp_plus_canonical_passes_broken_fails(cache_dir):
    item = _item("mbpp_plus", "Mbpp/2")  # tuple inputs (deserialised) and the set-equality oracle
    exp = compute_expected(item.gold, cache_dir=cache_dir)
    assert check_candidate(item.gold, item.gold["canonical_solution"], exp, limits=FAST).plus_pass
    # Same elements in another order and container: accepted by the set-equality oracle.
    reordered = "def similar_elements(a, b):\n    return sorted(set(a) & set(b), reverse=True)\n"
    assert check_candidate(item.gold, reordered, exp, limits=FAST).plus_pass
    broken = "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n"
    assert not check_candidate(item.gold, broken, exp, limits=FAST).base_pass
    # Cached expected outputs are reused and give the same verdict.
    assert compute_expected(item.gold, cache_dir=cache_dir).values == exp.values


def test_extract_code_prefers_entry_point_block_and_handles_truncation():
    text = "Here:\n```python\nimport os\n```\nand\n```python\ndef foo(x):\n    return x\n```\n"
    assert extract_code(text, "foo").startswith("def foo")
    assert extract_code("```python\ndef foo(x):\n    return", "foo") == "def foo(x):\n    return"
    assert extract_code("def foo(): pass", "foo") == "def foo(): pass"


# --- sandbox -----------------------------------------------------------------------------------------------------


def test_sandbox_contains_hostile_programs(tmp_path):
    marker = tmp_path / "pwned"
    loop = run_program("def f(x):\n    while True:\n        pass\n", [[1]], entry_point="f", time_limits=[0.5],
                       wall_timeout_s=5, limits=FAST)
    assert loop.rows[0]["s"] == "timeout"
    hang_at_import = run_program("while True:\n    pass\n", [[1]], entry_point="f", wall_timeout_s=2, limits=FAST)
    assert hang_at_import.error is not None and not hang_at_import.rows
    shell = run_program(f"import os\ndef f(x):\n    return os.system('touch {marker}')\n", [[1]], entry_point="f",
                        wall_timeout_s=5, limits=FAST)
    assert shell.rows[0]["s"] == "error" and not marker.exists()
    bomb = run_program("def f(x):\n    return len(bytearray(8 * 1024 ** 3))\n", [[1]], entry_point="f",
                       wall_timeout_s=5, limits=FAST)
    assert bomb.rows[0]["s"] == "error" and "MemoryError" in bomb.rows[0]["e"]
    typed = run_program("def f(x):\n    return (x, {1, 2}, {(1, 2): b'a'}, 2 ** 2000, float('nan'), 1j)\n", [[3]],
                        entry_point="f", wall_timeout_s=5, limits=FAST)
    from populora_verl.eval.sandbox import decode_value

    v = decode_value(typed.rows[0]["v"])
    assert v[:4] == (3, {1, 2}, {(1, 2): b"a"}, 2 ** 2000) and v[4] != v[4] and v[5] == 1j


# --- math graders ------------------------------------------------------------------------------------------------


def test_extract_boxed_and_answer():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}+1}") == "x^{2}+1"
    assert extract_boxed(r"\boxed 7.") == "7."
    assert extract_answer("The answer is 42.") == "42"
    assert extract_answer("we get 3 then 1,234") == "1234"
    assert extract_answer("") is None


@pytest.mark.parametrize("bench", MATH_BENCHMARKS)
def test_math_benchmarks_right_and_wrong(bench):
    items = load_benchmark(bench, limit=2)
    assert len(items) == 2 and BENCHMARKS[bench].kind == "math"
    for it in items:
        ok, pred = score_math(f"Reasoning...\nSo the answer is $\\boxed{{{it.gold}}}$.", it.gold)
        assert ok, (bench, it.id, it.gold, pred)
        wrong = "-98765" if it.gold.strip() != "-98765" else "3"
        assert not score_math(f"Therefore \\boxed{{{wrong}}}", it.gold)[0], (bench, it.gold)
        assert not score_math("no answer here", it.gold)[0]


def test_math_equal_equivalences():
    assert math_equal("025", "25") and math_equal("27", "27.0") and math_equal("0.5", r"\frac{1}{2}")
    assert math_equal(r"\dfrac{3}{4}", r"\frac{3}{4}") and math_equal("1,000", "1000")
    assert math_equal(r"(1,8,19), (2,7,13)", r"(1,8,19), (2,7,13)")
    assert math_equal(r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)")
    assert not math_equal("26", "27") and not math_equal(None, "1") and not math_equal("x+1", "x+2")


# --- LiveCodeBench -------------------------------------------------------------------------------------------------


def _b64(obj) -> str:
    return base64.b64encode(zlib.compress(json.dumps(obj).encode())).decode()


def _lcb_file(tmp_path: Path, private) -> Path:
    rows = [
        {"question_id": "abc001_a", "question_title": "Sum", "question_content": "Read a and b, print a+b.",
         "platform": "atcoder", "difficulty": "easy", "contest_date": "2024-09-01T00:00:00", "starter_code": "",
         "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
         "private_test_cases": private, "metadata": "{}"},
        {"question_id": "lc-1", "question_title": "Twice", "question_content": "Return 2*x.", "platform": "leetcode",
         "difficulty": "easy", "contest_date": "2024-10-01T00:00:00",
         "starter_code": "class Solution:\n    def twice(self, x: int) -> int:\n        ",
         "public_test_cases": json.dumps([{"input": "3", "output": "6", "testtype": "functional"}]),
         "private_test_cases": json.dumps([{"input": "-4", "output": "-8", "testtype": "functional"}]),
         "metadata": json.dumps({"func_name": "twice"})},
    ]
    p = tmp_path / "lcb.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_lcb_loader_and_grading(tmp_path):
    private = _b64([{"input": "10 -3\n", "output": "7\n", "testtype": "stdin"}])
    items = load_lcb_items(_lcb_file(tmp_path, private))
    assert [i.id for i in items] == ["abc001_a", "lc-1"] and len(items[0].gold["tests"]) == 2
    assert items[1].gold["testtype"] == "functional" and items[1].gold["func_name"] == "twice"
    stdin_ok = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert check_lcb(items[0].gold, stdin_ok) == (True, None)
    assert not check_lcb(items[0].gold, "a, b = map(int, input().split())\nprint(a - b)\n")[0]
    func_ok = "class Solution:\n    def twice(self, x):\n        return 2 * x\n"
    assert check_lcb(items[1].gold, func_ok) == (True, None)
    assert not check_lcb(items[1].gold, "class Solution:\n    def twice(self, x):\n        return x + 3\n")[0]
    assert stdout_matches("1.0000000001\n", "1.0") and not stdout_matches("1 2", "1")
    # Through the registry, from a path.
    assert len(load_benchmark("livecodebench", path=tmp_path / "lcb.jsonl")) == 2


def test_lcb_rejects_pickle(tmp_path):
    payload = base64.b64encode(zlib.compress(pickle.dumps(json.dumps([{"input": "1", "output": "1"}])))).decode()
    with pytest.raises(LCBFormatError, match="pickle"):
        decode_private_tests(payload)
    with pytest.raises(LCBFormatError, match="pickle"):
        load_lcb_items(_lcb_file(tmp_path, payload))
    items = load_lcb_items(_lcb_file(tmp_path, payload), on_pickle="public_only")
    assert items[0].meta["private_skipped"] and len(items[0].gold["tests"]) == 1


# --- end to end: HF backend, base + 2 random adapters -----------------------------------------------------------------


def _tiny_model(root: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x\n", "Please reason step by step \\boxed{42}",
                             "```python\nprint(1)\n```"] * 5, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = root / "tiny"
    hf_tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def _random_adapters(model_path: Path, root: Path, n: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for k in range(n):
        torch.manual_seed(100 + k)
        base = AutoModelForCausalLM.from_pretrained(model_path)
        peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 2.0)  # large enough that greedy tokens differ from the base model
        d = root / f"adapter{k}"
        peft.save_pretrained(d)
        out.append(d)
    return out


def test_end_to_end_hf_base_and_two_adapters(tmp_path, capsys):
    from populora_verl.eval.cli import eval_main

    model = _tiny_model(tmp_path)
    a0, a1 = _random_adapters(model, tmp_path, 2)
    out = tmp_path / "out"
    lcb = _lcb_file(tmp_path, _b64([{"input": "2 2\n", "output": "4\n", "testtype": "stdin"}]))
    rc = eval_main(["--model", str(model), "--adapters", f"t0={a0}", f"s0={a1}", "--benchmarks", "all",
                    "--lcb-path", str(lcb), "--limit", "2", "--max-new-tokens", "6", "--backend", "hf",
                    "--cache-dir", str(tmp_path / "cache"), "--task-timeout", "10", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in results["members"]] == ["base", "t0", "s0"]
    assert set(results["benchmarks"]) == set(BENCHMARKS)
    for m in ("base", "t0", "s0"):
        for b in BENCHMARKS:
            s = results["scores"][m][b]
            assert s["n"] == 2 and 0.0 <= s["pass@1"] <= 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * len(BENCHMARKS)
    by = {m: [s["completion"] for s in samples if s["member"] == m] for m in ("base", "t0", "s0")}
    assert by["base"] != by["t0"] and by["t0"] != by["s0"]  # adapters really are applied per member
    assert (out / "eval.md").read_text().count("|") > 20 and (out / "eval.csv").is_file()
    printed = capsys.readouterr().out
    assert "population mean" in printed and "HumanEval+" in printed


def test_vllm_backend_routes_every_member_through_one_engine(tmp_path, monkeypatch):
    """VLLMBackend's wiring against a stand-in vLLM (the real one runs on the GPU, BENCHMARKS.md §3): one engine
    with max_loras = #adapters and the largest rank, one LoRARequest per (member, prompt) with a distinct int id,
    base rows without an adapter in their own generate call, outputs mapped back to the right member."""
    import sys
    import types

    from populora_verl.eval.backends import Member, VLLMBackend

    calls = []

    class FakeLLM:
        def __init__(self, **kw):
            calls.append(("init", kw))

        def get_tokenizer(self):
            return lambda text, add_special_tokens=False: {"input_ids": [len(text)]}

        def generate(self, prompts, params, lora_request=None, use_tqdm=False):
            calls.append(("generate", lora_request))
            reqs = lora_request or [None] * len(prompts)
            out = []
            for p, r in zip(prompts, reqs, strict=True):
                text = f"{r.lora_name}#{r.lora_int_id}@{r.lora_path}" if r else "base"
                out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"{text}|{p['prompt_token_ids']}")]))
            return out

    class FakeLoRARequest:
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, lambda **kw: kw
    lora_mod, req_mod = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    req_mod.LoRARequest = FakeLoRARequest
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora_mod)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", req_mod)

    dirs = {}
    for name, r in (("t0", 8), ("s0", 16)):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": r}))
        dirs[name] = str(d)
    members = [Member("base", None, "base"), Member("t0", dirs["t0"], "teacher"), Member("s0", dirs["s0"], "student")]
    backend = VLLMBackend("/model", members, max_new_tokens=7)
    init = calls[0][1]
    assert init["enable_lora"] and init["max_loras"] == 2 and init["max_lora_rank"] == 16
    out = backend.generate(["ab", "abcd"], members)
    assert out["base"] == ["base|[2]", "base|[4]"]
    assert out["t0"] == [f"t0#1@{dirs['t0']}|[2]", f"t0#1@{dirs['t0']}|[4]"]
    assert out["s0"] == [f"s0#2@{dirs['s0']}|[2]", f"s0#2@{dirs['s0']}|[4]"]
    gens = [c[1] for c in calls if c[0] == "generate"]
    assert gens[0] is None and all(r is not None for r in gens[1])  # base alone; every adapter row names its LoRA

    # An engine started before its adapters exist (populora-eval --wait): sized by slots and rank, adapters later.
    calls.clear()
    early = VLLMBackend("/model", [Member("base", None, "base")], max_new_tokens=7, lora_slots=2, max_lora_rank=16)
    assert calls[0][1]["enable_lora"] and calls[0][1]["max_loras"] == 2 and calls[0][1]["max_lora_rank"] == 16
    out = early.generate(["ab"], members)
    assert out["s0"] == [f"s0#2@{dirs['s0']}|[2]"]
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 32}))
    with pytest.raises(ValueError, match="LoRA slots"):
        early.prepare([Member("x", dirs["t0"])])
    one_slot = VLLMBackend("/model", [], lora_slots=1, max_lora_rank=16)
    with pytest.raises(ValueError, match="max LoRA rank 16"):
        one_slot.prepare([Member("big", str(big))])


def test_warm_cache_fills_the_expected_outputs_the_evaluation_then_reads(tmp_path, monkeypatch):
    """populora-eval --warm-cache (no model): the canonical outputs are cached, and grading later runs none of them."""
    from populora_verl.eval import cli, code_grader
    from populora_verl.eval.evaluate import expected_outputs, load_items

    cache = tmp_path / "cache"
    assert cli.eval_main(["--warm-cache", "--benchmarks", "humaneval_plus", "--limit", "2",
                          "--cache-dir", str(cache), "--workers", "1"]) == 0
    assert len([p for p in cache.rglob("*") if p.is_file()]) == 2

    def no_run(*a, **k):  # a cache miss would run the canonical solution again
        raise AssertionError("canonical solution re-run despite the warm cache")

    monkeypatch.setattr(code_grader, "run_program", no_run)
    got = expected_outputs(load_items(["humaneval_plus"], limit=2), cache_dir=cache, workers=1)
    assert len(got) == 2 and all(e.error is None and e.values for e in got.values())


def test_wait_starts_the_model_first_and_reads_the_adapters_file_when_it_appears(tmp_path, monkeypatch):
    """--wait: the model loads, then the adapters file is awaited (written here after the load, as the learning
    run's driver writes it once the stop step's checkpoint exists), and its members are evaluated with the base."""
    import threading

    from populora_verl.eval import backends, cli

    model = _tiny_model(tmp_path)
    (a0,) = _random_adapters(model, tmp_path, 1)
    listing, out = tmp_path / "adapters.txt", tmp_path / "out"
    order = []
    real_build = backends.build_backend

    def build(*a, **k):
        order.append(("model", listing.exists()))
        backend = real_build(*a, **k)
        threading.Timer(0.5, lambda: listing.write_text(f"# members at step 4\narm@4.t0={a0}\n")).start()
        return backend

    monkeypatch.setattr(backends, "build_backend", build)
    rc = cli.eval_main(["--model", str(model), "--adapters-file", str(listing), "--wait", "30", "--backend", "hf",
                        "--benchmarks", "humaneval_plus", "--limit", "1", "--max-new-tokens", "4",
                        "--cache-dir", str(tmp_path / "cache"), "--task-timeout", "10", "--out", str(out)])
    assert rc == 0 and order == [("model", False)]  # the model was up before the file existed
    results = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in results["members"]] == ["base", "arm@4.t0"]


@pytest.mark.parametrize("extra, message", [
    (["--wait", "5"], "--wait needs --adapters-file"),
    (["--wait", "5", "--adapters-file", "x.txt", "--backend", "vllm"], "--max-loras and --max-lora-rank"),
    (["--wait", "0", "--adapters-file", "x.txt"], "--wait must be > 0"),
    (["--wait", "5", "--adapters-file", "x.txt", "--kv-cache-gib", "0"], "--kv-cache-gib must be > 0"),
    (["--adapters", "x", "--kv-cache-gib", "-1"], "--kv-cache-gib must be > 0"),  # also without --wait
])
def test_wait_mistakes_fail_before_loading_in_one_line(tmp_path, extra, message, capsys, monkeypatch):
    from populora_verl.eval import cli

    monkeypatch.setattr("populora_verl.checks.vllm_missing", lambda: None)  # the vLLM flags' own checks
    model = _tiny_model(tmp_path)
    assert cli.eval_main(["--model", str(model), "--benchmarks", "humaneval_plus", "--out", str(tmp_path / "o"),
                          *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("Traceback" in line for line in err)


def test_wait_gives_up_after_its_timeout(tmp_path, monkeypatch):
    from populora_verl.eval import cli

    with pytest.raises(SystemExit, match="did not appear within --wait 0.2 s"):
        cli._wait_for(tmp_path / "never.txt", 0.2, poll_s=0.05)


def test_vllm_engine_options_reach_the_engine(tmp_path, monkeypatch):
    """--kv-cache-gib, --max-loras and --max-lora-rank go to the vLLM engine as its fixed KV cache and LoRA slots."""
    from populora_verl.eval import backends, cli

    seen = {}

    class Stop(Exception):
        pass

    def build(name, model, members, **kw):
        seen.update(kw, name=name)
        raise Stop

    monkeypatch.setattr(backends, "build_backend", build)
    monkeypatch.setattr("populora_verl.checks.vllm_missing", lambda: None)
    model = _tiny_model(tmp_path)
    assert cli.eval_main(["--model", str(model), "--backend", "vllm", "--benchmarks", "humaneval_plus",
                          "--out", str(tmp_path / "o"), "--adapters-file", str(tmp_path / "a.txt"), "--wait", "5",
                          "--max-loras", "4", "--max-lora-rank", "16", "--kv-cache-gib", "8"]) == 1
    assert seen["name"] == "vllm" and seen["lora_slots"] == 4 and seen["max_lora_rank"] == 16
    assert seen["extra"] == {"kv_cache_memory_bytes": 8 * 2**30}
