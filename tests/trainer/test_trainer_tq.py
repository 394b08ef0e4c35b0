"""The verl trainer's TransferQueue plumbing on a real local Ray cluster (no GPU, no vLLM).

``PopuLoRATrainer.step`` runs for real against a real TransferQueue (SimpleStorage, one storage unit): prompts go in
through verl's ``submit_batch_to_rollout`` (``_submit_batch_to_rollout`` on verl 0.9.1), a stand-in agent loop writes
trajectories exactly as verl's ``AgentLoopWorkerTQ._agent_loop_postprocess`` does (keys ``{uid}_{session}_0``),
verl's sync ``ReplayBuffer`` samples them, the trainer decodes them, balances each adapter's sub-batch (verl pads it
to the DP size in TQ), writes rm_scores / advantages / returns into TQ and hands each slot's batch to the (fake) actor
workers. Only the pieces that need GPUs are stand-ins: the population logic (``pop_step``), the agent loop's
generation and the actor workers.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

tq = pytest.importorskip("transfer_queue")
ray = pytest.importorskip("ray")
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402

from populora_verl.step import GenRequest, Sample  # noqa: E402

from _shared import compose_recipe  # noqa: E402

PARTITION = "train"
# Only a hang ends the wait for the cluster (a gloo group left in this process once made ray.init hang for good):
# its start takes 20 s on an idle 2-core machine and a few times that on a loaded one, far below this.
START_TIMEOUT_S = 900.0
# member id -> adapter slot (2 teachers, 2 students)
SLOTS = {"t0": 0, "t1": 1, "s0": 2, "s1": 3}
# samples per request: t0 odd so verl pads its slot's batch to the DP size (2) with a synthetic row in TQ
N = {"t0": 3, "t1": 2, "s0": 2, "s1": 3}
DP = 2
WORDS = ["<pad>", "<eos>", "def", "f", "x", "return", "answer", "is", "t0", "t1", "s0", "s1", "say", "prompt",
         "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]


# --- the cluster -------------------------------------------------------------------------------------------------


def _tq_config():
    """verl's own ``transfer_queue`` defaults (hydra, ppo_trainer) with one SimpleStorage unit for a 2-core box."""
    import verl

    cfg_dir = Path(verl.__file__).resolve().parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(cfg_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer",
                      overrides=["transfer_queue.enable=true",
                                 "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"])
    return OmegaConf.create(OmegaConf.to_container(cfg.transfer_queue, resolve=True))


def _start_cluster(conf, temp_dir: str, out: dict, ready: threading.Event, release: threading.Event) -> None:
    """Start Ray and TQ, set ``ready``, and, once started, wait for ``release``: Ray gives its head processes (GCS,
    raylet) a parent-death signal, which Linux sends when the *thread* that started them ends, so the thread lives as
    long as the cluster (a cluster whose thread had ended lost its GCS at once, and the driver aborted 60 s later)."""
    try:
        # Above the physical count: TQ's controller + storage actors deadlock on a 2-CPU Ray budget.
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
        tq.init(conf)
        out["ok"] = True
    except BaseException as e:  # reported by the fixture as the skip reason
        out["error"] = e
    finally:
        ready.set()
    if out.get("ok"):
        release.wait()


def _unavailable(reason: str) -> None:
    # A machine without a working local Ray skips these round trips; CI sets the variable, so that a change which
    # breaks Ray's start (it happened once, through a gloo group left in the test process) fails instead of
    # silently dropping the module.
    if os.environ.get("POPULORA_TESTS_REQUIRE_RAY") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def tq_cluster(ray_tmpdir):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        _unavailable("a Ray cluster is already running in this process; this module starts its own")
    conf = _tq_config()
    assert conf.backend.SimpleStorage.num_data_storage_units == 1
    out: dict = {}
    ready, release = threading.Event(), threading.Event()
    th = threading.Thread(target=_start_cluster, args=(conf, ray_tmpdir, out, ready, release), daemon=True)
    th.start()
    ready.wait(START_TIMEOUT_S)
    if not out.get("ok"):
        if not ready.is_set():
            # ray.init / tq.init still running in the daemon thread: shutting Ray down under it could hang too
            _unavailable(f"TransferQueue did not start within {START_TIMEOUT_S:.0f}s on a local Ray cluster")
        if ray.is_initialized():
            ray.shutdown()
        _unavailable(f"TransferQueue could not start on a local Ray cluster: {out.get('error')!r}")
    yield conf
    try:
        tq.close()
    finally:
        ray.shutdown()
        release.set()  # the starting thread may end now: the cluster it started is down
        th.join(60)


# --- stand-ins for the GPU parts ---------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _answer_text(adapter: str, session: int) -> str:
    # lengths differ per session so every batch is jagged, as real rollouts are
    return " ".join([adapter, "say"] + [str(d) for d in range(session + 1)])


class _AgentLoop:
    """Writes trajectories into TQ as verl's ``AgentLoopWorkerTQ`` does (status tags, ``{uid}_{session}_0`` keys,
    ``_agent_loop_postprocess`` fields), synchronously, so the replay buffer's first poll sees every group done."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.written: dict[str, dict] = {}  # key -> what the "engine" produced

    def generate_sequences(self, batch) -> None:
        from tensordict import NonTensorData, NonTensorStack

        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        for i in range(len(batch)):
            row = {}
            for k, v in batch.items():
                if isinstance(v, torch.Tensor):
                    row[k] = v[i]
                elif isinstance(v, NonTensorStack):
                    row[k] = v[i].data
                elif isinstance(v, NonTensorData):
                    row[k] = v.data
            uid, n = row["uid"], int(row.pop("__rollout_n__"))
            tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "running"})
            keys, fields, tags = [], [], []
            for session in range(n):
                adapter = row["populora"]["adapter"]
                text = _answer_text(adapter, session)
                prompt_ids = self.tok.encode(row["raw_prompt"][0]["content"], add_special_tokens=False)
                resp_ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
                # the trailing eos is masked out (as a tool/observation token would be): the reward must land on
                # the last *masked-in* token, not the last position
                mask = [1] * (len(resp_ids) - 1) + [0]
                prompts, responses = torch.tensor(prompt_ids), torch.tensor(resp_ids)
                input_ids = torch.cat([prompts, responses])
                field = {
                    "prompts": prompts, "responses": responses, "response_mask": torch.tensor(mask),
                    "rollout_log_probs": torch.full((len(resp_ids),), -0.5),
                    "num_turns": 2, "extra_fields": {"min_global_steps": row["global_steps"],
                                                     "max_global_steps": row["global_steps"]},
                    **row, "session_id": session,
                }
                field["loss_mask"] = field["response_mask"]
                field["input_ids"] = input_ids
                field["position_ids"] = torch.arange(input_ids.numel())
                key = f"{uid}_{session}_0"
                keys.append(key)
                fields.append(field)
                tags.append({"status": "success", "prompt_len": len(prompt_ids), "response_len": len(resp_ids),
                             "seq_len": len(prompt_ids) + len(resp_ids), "global_steps": row["global_steps"],
                             "min_global_steps": row["global_steps"], "max_global_steps": row["global_steps"]})
                self.written[key] = {"text": text, "n_tokens": len(resp_ids) - 1, "adapter": adapter}
            tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id=PARTITION)
            tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})


class _Workers:
    """The actor worker group: ``DP`` ranks; reads what a real worker would read from TQ and records it.

    A fused call (``populora_segments``) is cut the way verl's dispatch cuts it (``DP`` contiguous chunks) and each
    rank's chunk the way the real worker cuts it (``segment_bounds``), so ``updates`` records per slot the rows every
    rank saw, as for one call per slot."""

    def __init__(self):
        self._dispatch_info = {"actor": list(range(DP))}
        self.updates: list[dict] = []
        self.calls = {"compute_log_prob": 0, "update_actor": 0}

    def dispatch_info(self, mesh_name):  # a verl with WorkerGroup.dispatch_info (patches/0019) asks this
        return self._dispatch_info[mesh_name]

    def populora_bank_info(self):
        return [{"num_slots": 4, "slots": [{"slot": s, "lora_int_id": 1000 + s, "lora_name": f"{s}@v0"}
                                           for s in range(4)]}] + [None] * (DP - 1)

    def compute_log_prob(self, batch):
        self.calls["compute_log_prob"] += 1
        # the real worker writes full-sequence log-probs / entropy; verl's trainer then slices the responses
        data = tq.kv_batch_get(keys=list(batch.keys), partition_id=PARTITION, select_fields=["input_ids"])
        lens = [t.numel() for t in _rows(data["input_ids"])]
        nested = lambda fill: torch.nested.as_nested_tensor(  # noqa: E731
            [torch.full((n,), fill) for n in lens], layout=torch.jagged)
        from tensordict import TensorDict

        tq.kv_batch_put(keys=list(batch.keys), partition_id=PARTITION,
                        fields=TensorDict({"log_probs": nested(-0.25), "entropy": nested(1.0)}, batch_size=len(lens)))
        return batch

    def _per_slot(self, batch):
        """``[(slot, keys, tags, rank_shares, extra_info)]`` of one call, fused or not."""
        from populora_verl.workers import fused

        info = dict(batch.extra_info)
        keys, tags = list(batch.keys), list(batch.tags)
        if fused.SEGMENTS_KEY not in info:
            shares = [keys[a:b] for a, b in fused.rank_chunks(len(keys), DP)]
            return [(info["populora_adapter"], keys, tags, shares, info)]
        segs = fused.decode_segments(info.pop(fused.SEGMENTS_KEY))
        out = {s["slot"]: ([], [], [], dict(info, global_batch_size=s["size"], mini_batch_size=s["size"]))
               for s in segs}
        for a, b in fused.rank_chunks(len(keys), DP):
            for slot, lo, hi, _ in fused.segment_bounds(b - a, segs):
                out[slot][0].extend(keys[a + lo:a + hi])
                out[slot][1].extend(tags[a + lo:a + hi])
                out[slot][2].append(keys[a + lo:a + hi])
        return [(slot, k, t, sh, i) for slot, (k, t, sh, i) in out.items()]

    def update_actor(self, batch):
        self.calls["update_actor"] += 1
        fields = ["rm_scores", "advantages", "returns", "response_mask", "old_log_probs", "responses"]
        per_slot = {}
        for slot, keys, tags, shares, info in self._per_slot(batch):
            data = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=fields)
            self.updates.append({"slot": slot, "keys": keys, "tags": tags, "extra_info": info, "rank_shares": shares,
                                 "data": {f: _rows(data[f]) for f in fields}})
            per_slot[str(slot)] = {"pg_loss": [0.5 + slot]}
        if "populora_segments" in batch.extra_info:
            return {"metrics": {"populora_fused": per_slot}}
        return {"metrics": {"pg_loss": [0.5], "mfu": [0.1]}}


def _rows(t):
    from populora_verl.trainer.convert import field_rows as rows

    return rows(t)


def _reward(key_index: int) -> float:
    return 0.25 * (key_index + 1)


class _PopStep:
    """The population step's data flow (requests in, samples out) without its logic: every completion becomes a
    sample with a reward / advantage picked from its position, except s1's last answer, kept for estimation only."""

    def __init__(self):
        self.population = SimpleNamespace(members=[SimpleNamespace(id=m, slot=s) for m, s in SLOTS.items()])
        self.teacher_resp = self.student_resp = None

    def begin(self, step):
        return [GenRequest(m, "teacher", "code_i", f"prompt {m} say", N[m]) for m in ("t0", "t1")]

    def on_proposals(self, responses):
        self.teacher_resp = responses
        return [GenRequest(m, "student", "code_o", f"prompt {m} x", N[m]) for m in ("s0", "s1")]

    def on_answers(self, responses):
        self.student_resp = responses
        samples, i = [], 0
        for r in list(self.teacher_resp) + list(responses):
            for j, (text, ln, key) in enumerate(zip(r.texts, r.lengths, r.extra, strict=True)):
                if r.request.adapter == "s1" and j == r.request.n - 1:
                    key = None  # estimation-only: scored, never trained on
                samples.append(Sample(r.request.adapter, r.request.role, r.request.task_type, r.request.prompt, text,
                                      reward=_reward(i), advantage=-1.0 + 0.5 * i, length=ln, extra=key))
                i += 1
        return SimpleNamespace(samples=samples, metrics={"populora/fake/samples": float(len(samples))})


def _trainer(bare_trainer, tmp_path):
    from populora_verl.config import load_config

    cfg = compose_recipe("2t2s")
    with open_dict(cfg):
        cfg.trainer.default_local_dir = str(tmp_path / "ckpt")
    # verl's __init__ builds worker groups; the TQ path needs only these attributes
    t = bare_trainer(cfg, pcfg=load_config(cfg.populora), trainer_mode="sync", debug_probes=False, global_steps=1)
    t.tokenizer = _tokenizer()
    t.replay_buffer = t._build_replay_buffer()
    t.agent_loop_manager = _AgentLoop(t.tokenizer)
    t.actor_rollout_wg = _Workers()
    t.checkpoint_manager = SimpleNamespace(sleep_replicas=lambda: None)
    t.pop_step = _PopStep()
    t._end_step = lambda metrics: None  # stop file and evolution need a real population: tests/trainer/test_trainer.py
    return t


def _listed() -> dict:
    return (tq.kv_list(PARTITION) or {}).get(PARTITION, {})


# --- tests -------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_generate_round_trip_decodes_every_session(tq_cluster, tmp_path, bare_trainer):
    """prompts -> TQ -> agent loop -> replay buffer -> _fetch_responses: texts and masked lengths per key."""
    t = _trainer(bare_trainer, tmp_path)
    reqs = t.pop_step.begin(1)
    metrics: dict = {}
    responses, batch, masks = t._generate(reqs, "teacher", metrics)
    written = t.agent_loop_manager.written
    assert sorted(batch.keys) == sorted(written) and len(batch.keys) == N["t0"] + N["t1"]
    assert all(tag["status"] == "success" and tag["seq_len"] > 0 for tag in batch.tags)
    for r in responses:
        m = r.request.adapter
        assert r.texts == [_answer_text(m, s) for s in range(N[m])]  # session order, eos skipped
        assert r.lengths == [len(_answer_text(m, s).split()) for s in range(N[m])]  # masked tokens only
        assert [written[k]["adapter"] for k in r.extra] == [m] * N[m]
        assert [int(k.rsplit("_", 2)[1]) for k in r.extra] == list(range(N[m]))
    assert {k: int(v.sum()) for k, v in masks.items()} == {k: w["n_tokens"] for k, w in written.items()}
    assert metrics["populora/rollout/teacher/missing_sessions"] == 0
    assert metrics["populora/rollout/teacher/prompts"] == 2
    # the phase's time, split: handing prompts over, waiting for the trajectories, reading them back
    assert all(metrics[f"populora/rollout/teacher/{w}"] >= 0.0 for w in ("submit_s", "wait_s", "fetch_s"))
    # the sampled prompt markers are gone, the trajectories stay until the trainer clears them
    assert set(_listed()) == set(written)
    tq.kv_clear(keys=list(batch.keys), partition_id=PARTITION)
    assert _listed() == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fused_rpc", [True, False], ids=["fused", "per_adapter"])
def test_step_writes_signals_per_adapter_batch_and_clears(tq_cluster, tmp_path, fused_rpc, bare_trainer):
    """Both dispatch modes train every slot on exactly its adapter's rows, and each DP rank gets the same share of
    a slot's rows as a call of the slot's own would give it (compute matching is independent of fusing)."""
    from populora_verl.workers import fused

    t = _trainer(bare_trainer, tmp_path)
    t.fused_rpc = fused_rpc
    ended = []  # the end of the step (stop file, evolution): after the update, so verl's save that follows has it
    t._end_step = lambda m: ended.append(dict(t.actor_rollout_wg.calls))
    metrics: dict = {}
    out = t.step(metrics, {})
    calls = 1 if fused_rpc else len(SLOTS)
    assert t.actor_rollout_wg.calls == {"compute_log_prob": calls, "update_actor": calls}
    assert ended == [t.actor_rollout_wg.calls]
    wg, pop, written = t.actor_rollout_wg, t.pop_step, t.agent_loop_manager.written
    samples = pop.on_answers(pop.student_resp).samples  # same deterministic samples the step trained on
    by_key = {s.extra: s for s in samples if s.extra is not None}
    unused = [k for k in written if k not in by_key]
    assert len(unused) == 1 and written[unused[0]]["adapter"] == "s1"

    # one update per slot, slots ascending, each holding exactly its adapter's trained keys (+ verl's padding)
    assert [u["slot"] for u in wg.updates] == sorted(SLOTS.values())
    for u in wg.updates:
        member = next(m for m, s in SLOTS.items() if s == u["slot"])
        real = [k for k in u["keys"] if not k.startswith("pad")]
        pads = [k for k in u["keys"] if k.startswith("pad")]
        assert sorted(real) == sorted(k for k, s in by_key.items() if s.adapter == member)
        assert len(u["keys"]) % DP == 0
        assert len(pads) == (1 if member == "t0" else 0)
        assert all(tag.get("is_padding") for k, tag in zip(u["keys"], u["tags"]) if k.startswith("pad"))
        assert u["extra_info"]["global_batch_size"] == u["extra_info"]["mini_batch_size"] == len(u["keys"])
        assert u["rank_shares"] == [u["keys"][a:b] for a, b in fused.rank_chunks(len(u["keys"]), DP)]
        assert len({len(sh) for sh in u["rank_shares"]}) == 1  # every rank runs the same forwards for this slot
        d = u["data"]
        for i, k in enumerate(u["keys"]):
            rm, adv, ret, mask = d["rm_scores"][i], d["advantages"][i], d["returns"][i], d["response_mask"][i]
            assert rm.shape == adv.shape == ret.shape == mask.shape
            if k in by_key:
                s, n_tok = by_key[k], written[k]["n_tokens"]
                expect_rm = torch.zeros(mask.numel())
                expect_rm[n_tok - 1] = s.reward  # last masked-in token, not the trailing (masked) eos
                torch.testing.assert_close(rm.float(), expect_rm)
                torch.testing.assert_close(adv.float(), mask.float() * s.advantage)
                torch.testing.assert_close(ret.float(), mask.float() * s.reward)
                assert int(mask.sum()) == n_tok
                assert d["old_log_probs"][i].numel() == mask.numel()  # verl's old log-prob pass saw the same rows
            else:
                assert not rm.any() and not adv.any() and not ret.any() and not mask.any()

    # the returned batch is every slot's batch; the estimation-only key was cleared from TQ already
    assert sorted(out.keys) == sorted(k for u in wg.updates for k in u["keys"])
    listed = _listed()
    assert unused[0] not in listed
    assert set(out.keys) <= set(listed)
    # what fit() does after the step: rm_scores etc. were readable through the public TQ API too
    got = tq.kv_batch_get(keys=list(by_key), partition_id=PARTITION, select_fields=["rm_scores", "advantages"])
    for k, rm, adv in zip(by_key, _rows(got["rm_scores"]), _rows(got["advantages"]), strict=True):
        assert float(rm.sum()) == pytest.approx(by_key[k].reward)
        assert float(adv.max() if by_key[k].advantage >= 0 else adv.min()) == pytest.approx(by_key[k].advantage)
    tq.kv_clear(keys=list(out.keys), partition_id=PARTITION)
    assert _listed() == {}
    assert metrics["populora/fake/samples"] == float(len(samples))
    assert metrics["populora/s1/populora/samples"] == N["s1"] - 1
    assert metrics["populora/s1/actor/pg_loss"] == (0.5 + SLOTS["s1"] if fused_rpc else 0.5)


@pytest.mark.timeout(120)
def test_seeding_phase_runs_through_tq_on_a_fresh_lora_id_and_trains_nothing(tq_cluster, tmp_path, bare_trainer):
    """populora.buffer.seed_programs on verl: before step 1 the base-policy prompts go through TQ under the first
    member's LoRA id (lora_B is still zero), are validated by the real population step, then cleared from TQ; the
    seed set is written next to the checkpoints and begin() is allowed afterwards."""
    import json

    from populora_verl.config import load_config
    from populora_verl.step import PopulationStep
    from populora_verl.step.records import BASE_POLICY
    from populora_verl.tasks import Task

    t = _trainer(bare_trainer, tmp_path)
    t.pop_step = PopulationStep(load_config({"population": {"num_teachers": 2, "num_students": 2},
                                             "tasks": {"types": ["code_o"]},
                                             "buffer": {"seed_programs": 2, "seed_rounds": 3}}), executor=object())
    made = iter(range(100))

    def validate_many(items):  # every proposal "valid", each a new program
        return [(Task(type="code_o", program=f"def f(a):\n    return a + {next(made)}\n", input="1", output="2",
                      teacher="seed", step=0), "valid") for _ in items]

    t.pop_step.tasks.validate_many = validate_many
    rows = []
    real_submit = t._submit_rows
    t._submit_rows = lambda rs: (rows.extend(rs), real_submit(rs))[1]
    t.on_step_begin()
    assert t.pop_step.seeded and len(t.pop_step.seed_set) == 2
    assert rows and all(r["populora"]["adapter"] == BASE_POLICY and r["populora"]["lora_int_id"] == 1000
                        and r["populora"]["role"] == "seed" and r["populora"]["prompt_format"] == "text" for r in rows)
    assert _listed() == {}  # nothing of the seeding phase stays in TQ to be trained on
    saved = [json.loads(x) for x in (tmp_path / "ckpt" / "seed_tasks.jsonl").read_text().splitlines()]
    assert [d["program"] for d in saved] == [s.program for s in t.pop_step.seed_set]
    assert t.pop_step.begin(1)  # training may start


@pytest.mark.timeout(120)
def test_bypass_mode_checks_the_trainers_own_log_probs_against_vllms(tq_cluster, tmp_path, bare_trainer):
    """Under bypass_mode the old log-probs are vLLM's, so verl's rollout-vs-trainer metrics compare vLLM with itself
    (0.0 / Pearson 1.0 on every line). Every diagnostics.logprob_check_every steps the trainer runs its own log-prob
    pass on a few rows per adapter (before the update) and compares: here the worker's -0.25 against vLLM's -0.5."""
    import math

    t = _trainer(bare_trainer, tmp_path)
    with open_dict(t.config):
        t.config.algorithm.rollout_correction.bypass_mode = True
        t.config.actor_rollout_ref.rollout.calculate_log_probs = True
    t.pcfg.diagnostics.logprob_check_every, t.pcfg.diagnostics.logprob_check_rows = 5, 2
    t.fused_rpc = True
    for step, expect_check in ((4, False), (5, True)):
        t.global_steps = step
        t.actor_rollout_wg.calls["compute_log_prob"] = 0
        metrics: dict = {}
        out = t.step(metrics, {})
        checks = {k: v for k, v in metrics.items() if "/trainer_check/" in k}
        if not expect_check:
            # bypass: no old-log-prob call and no self-comparison reported
            assert t.actor_rollout_wg.calls["compute_log_prob"] == 0 and not checks
            assert not any("rollout_probs_diff" in k for k in metrics)
        else:
            assert t.actor_rollout_wg.calls["compute_log_prob"] == len(SLOTS)  # one small pass per adapter
            for member in SLOTS:
                assert metrics[f"populora/{member}/trainer_check/rows"] == 2.0
                diff = metrics[f"populora/{member}/trainer_check/rollout_probs_diff_mean"]
                assert diff == pytest.approx(math.exp(-0.25) - math.exp(-0.5), rel=1e-4)
        tq.kv_clear(keys=list(out.keys), partition_id=PARTITION)
    assert _listed() == {}


def test_the_request_load_balancer_started_early_takes_verls_servers(tq_cluster, monkeypatch):
    """The early balancer (verl's routing) as a real actor, started with no servers before the servers exist, then
    given them and put in place of the one verl created (populora_verl.rollout.early_agent_loop): a request routed
    by it reaches the server, and verl's is ended. vLLM is absent here, so its preload of the backend fails quietly,
    as it must."""
    from verl.workers.rollout.router import get_router_handle

    from populora_verl.rollout import early_agent_loop as early

    monkeypatch.setattr(early, "_STARTED", None)
    config = OmegaConf.create({"trainer": {"populora_early_agent_loop": True},
                               "actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}})
    assert early.start(config)  # no manager of ours named: the balancer only
    servers = {"10.0.0.1:8000": "server-0", "10.0.0.2:8000": "server-1"}  # handles are opaque to the balancer
    manager = SimpleNamespace(server_addresses=list(servers), server_handles=list(servers.values()),
                              global_load_balancer=get_router_handle(servers=servers))
    verls = manager.global_load_balancer
    killed = []
    real_kill = early.ray.kill
    monkeypatch.setattr(early.ray, "kill", lambda h: killed.append(h) or real_kill(h))
    assert early.adopt_load_balancer(manager)
    assert manager.global_load_balancer is not verls and killed == [verls]
    balancer = manager.global_load_balancer
    routed = {f"r{i}": ray.get(balancer.acquire_server.remote(request_id=f"r{i}")) for i in range(4)}
    assert {sid for sid, _ in routed.values()} == set(servers)  # least-loaded: unreleased requests spread over both
    assert all(servers[sid] == handle for sid, handle in routed.values())
    assert ray.get(balancer.acquire_server.remote(request_id="r0")) == routed["r0"]  # sticky: the same server again


def test_vllm_server_actors_started_early_are_taken_by_verls_replica(tq_cluster, monkeypatch):
    """The server actors started with the trainer's set-up (populora_verl.rollout.early_servers) as real actors: the
    first is up before verl asks for it, verl's creation call gets that very actor, built with verl's arguments; a
    call with other options gets a fresh actor under the same name (the waiting one ended, its name freed)."""
    from populora_verl.rollout import early_servers as es

    class Server(es.DeferredInit):  # defined here, so the actor's process gets it by value
        def __init__(self, *args, **kwargs):
            if es.defer(self, kwargs):
                return
            self.built = (args, kwargs)

        def get(self):
            return self.built

    monkeypatch.setattr(es, "_ACTIVE", None)
    config = compose_recipe("qwen1.5b_1gpu_2t2s", ["trainer.n_gpus_per_node=2"])
    early = es.start(config, server_class=lambda: Server)
    names = ["populora_vllm_server_0_0", "populora_vllm_server_1_0"]
    assert early is not None and early.names == names
    early._thread.join()
    waiting = early._actors[names[0]][0]
    ray.get(waiting.__ray_ready__.remote())  # its process runs before any replica exists
    node = ray.get_runtime_context().get_node_id()
    server_class = es.wrap(ray.remote(Server))
    first = server_class.options(**es.server_options(config, names[0], node)).remote(config="c", replica_rank=0)
    assert first._actor_id == waiting._actor_id == ray.get_actor(names[0])._actor_id
    assert ray.get(first.get.remote()) == ((), {"config": "c", "replica_rank": 0})
    other = {**es.server_options(config, names[1], node), "max_concurrency": 3}
    second = server_class.options(**other).remote(config="d")
    assert ray.get(second.get.remote()) == ((), {"config": "d"})
    assert second._actor_id == ray.get_actor(names[1])._actor_id  # verl's own, under the name
    assert es.finish().startswith("vLLM server actors: 1 of 2 started with the trainer's set-up and taken")
    for handle in (first, second):
        ray.kill(handle)
