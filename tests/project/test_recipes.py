"""Every recipe composes with hydra on top of verl's ppo_trainer and its populora.* section validates."""

import re

import pytest

hydra = pytest.importorskip("hydra")

from populora_verl.config import load_config  # noqa: E402

from _shared import compose_recipe  # noqa: E402

NAMES = ["1t1s", "2t2s", "4t4s", "8t8s", "azr_single_agent", "smoke_0.5b", "qwen1.5b_1gpu_2t2s", "qwen1.5b_1gpu_4t4s",
         "qwen1.5b_1gpu_single", "qwen1.5b_4gpu_4t4s"]


@pytest.mark.parametrize("name", NAMES)
def test_recipe_composes_and_validates(name):
    cfg = compose_recipe(name)
    assert cfg.trainer.use_v1 is True
    assert cfg.trainer.v1.trainer_mode == "populora"
    assert cfg.actor_rollout_ref.rollout.name == "populora_vllm"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "populora_agent"
    assert cfg.reward.reward_manager.name == "populora_code"
    assert cfg.algorithm.adv_estimator == "populora_trrpp"
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    pcfg = load_config(cfg.populora)
    if name in ("azr_single_agent", "qwen1.5b_1gpu_single"):
        assert pcfg.population.num_adapters == 1 and not pcfg.pbt.enabled
    else:
        sizes = re.search(r"(\d)t(\d)s", name)  # smoke_0.5b is 2T2S
        t, s = (int(sizes[1]), int(sizes[2])) if sizes else (2, 2)
        assert (pcfg.population.num_teachers, pcfg.population.num_students) == (t, s)


def test_paper_recipes_share_per_adapter_budget():
    """Compute matching by what is trained (docs/tasks-and-rewards.md): the single agent trains on as many
    trajectories per step as the mean population member, with one update and the same generation limits."""
    from populora_verl.step import check_compute_plan, planned_trajectories

    single = compose_recipe("azr_single_agent")
    base = load_config(single.populora)
    assert base.buffer.student_mix == "max_new" and base.rollout.buffer_task_n == 1
    assert not base.rewards.train_on_estimation_rollouts  # AZR: estimation answers are not trained on
    assert planned_trajectories(base) == 54.0
    assert base.buffer.seed_programs == 256  # AZR's seeding phase (64 x 4 base-model programs)
    for name in ["1t1s", "2t2s", "4t4s", "8t8s"]:
        cfg = compose_recipe(name)
        p = load_config(cfg.populora)
        assert planned_trajectories(p) == planned_trajectories(base), name
        assert p.tasks.types == base.tasks.types and p.rollout.student_n == base.rollout.student_n
        ar, sr = cfg.actor_rollout_ref, single.actor_rollout_ref
        assert ar.rollout.response_length == sr.rollout.response_length
        assert ar.actor.ppo_epochs == sr.actor.ppo_epochs and ar.model.lora_rank == sr.model.lora_rank


def test_bad_populora_override_fails_naming_the_key():
    from populora_verl.config import ConfigError

    cfg = compose_recipe("2t2s", ["populora.pbt.cull_fraction=2.0"])
    with pytest.raises(ConfigError, match=r"^populora\.pbt\.cull_fraction:"):
        load_config(cfg.populora)


def test_one_gpu_learning_run_arms_are_compute_matched():
    """The learning-run arms: same per-adapter trained trajectories (90), generation limits, LoRA, optimizer and seed
    source; the population evolves every 5 steps and checkpoints at every step a run may stop at; LoRA lr 1e-4 and
    teacher groups of >= 4 (settings that learned; 1e-5 or groups of 2 did not)."""
    from populora_verl.step import check_compute_plan, planned_trajectories
    from populora_verl.step.metrics import small_group_warning, teacher_group_size

    single, pop = compose_recipe("qwen1.5b_1gpu_single"), compose_recipe("qwen1.5b_1gpu_2t2s")
    ps, pp = load_config(single.populora), load_config(pop.populora)
    p4 = load_config(compose_recipe("qwen1.5b_1gpu_4t4s").populora)
    assert planned_trajectories(ps) == planned_trajectories(pp) == planned_trajectories(p4) == 90.0
    assert (p4.population.num_teachers, p4.population.num_students) == (4, 4)
    plan = check_compute_plan(p4)  # raises where a role's adapters could train unequal batches
    assert (plan.teacher, plan.student) == (30, 150)
    assert single.actor_rollout_ref.actor.optim.lr == 1e-4
    assert teacher_group_size(ps) == 15 and teacher_group_size(pp) == 10
    assert small_group_warning(ps) is None and small_group_warning(pp) is None
    assert ps.population.mode == "single_agent" and ps.rollout.buffer_task_n == 1
    assert not ps.rewards.train_on_estimation_rollouts and ps.buffer.student_mix == "max_new"
    assert ps.rollout.student_n == pp.rollout.student_n and ps.tasks == pp.tasks and ps.buffer.seed_programs > 0
    a, b = single.actor_rollout_ref, pop.actor_rollout_ref
    for key in ("model.lora_rank", "model.lora_alpha", "actor.optim.lr", "actor.ppo_epochs", "rollout.temperature"):
        from omegaconf import OmegaConf
        assert OmegaConf.select(a, key) == OmegaConf.select(b, key), key
    assert single.data.max_response_length == pop.data.max_response_length >= 1024
    assert pp.pbt.enabled and pp.pbt.interval_steps == pop.trainer.save_freq == 5 and pp.pbt.quiet_steps == 5
    assert pop.trainer.n_gpus_per_node == 1 and pop.algorithm.rollout_correction.bypass_mode


def test_every_populora_key_is_in_the_base_recipe_with_its_default():
    """Any populora.* key takes a plain override (hydra refuses keys a recipe does not list unless written with "+";
    the 2026-11-26 x2 proof lost a run to ``populora.pbt.min_age``). The base recipe lists each key with the
    dataclass default, except the documented AZR choice of a seeding phase."""
    import dataclasses

    from populora_verl.config import PopuLoRAConfig

    cfg = compose_recipe("4t4s")
    expected = PopuLoRAConfig(enable=True)  # a PopuLoRA run (docs/from-grpo.md)
    expected.buffer.seed_programs = 256  # AZR: 64 x 4 base-model programs before step 1
    assert load_config(cfg.populora) == expected
    assert cfg.populora.enable is True
    for section in dataclasses.fields(expected):
        if not dataclasses.is_dataclass(getattr(expected, section.name)):
            continue  # populora.enable, checked above
        keys = {f.name for f in dataclasses.fields(getattr(expected, section.name)) if not f.name.startswith("_")}
        assert keys <= set(cfg.populora[section.name]), (section.name, keys - set(cfg.populora[section.name]))
    for override in ["populora.pbt.min_age=0", "populora.pbt.final_quiet_steps=0", "populora.rollout.max_loras=16",
                     "populora.buffer.seed_file=/x.jsonl", "populora.pbt.operators={neftune: 1.0}"]:
        load_config(compose_recipe("2t2s", [override]).populora)  # composes without "+" and validates


def test_the_short_learning_run_overrides_stay_compute_matched():
    """The two-seed, 4-GPU learning run cut the batch so that 40 population steps fit
    30 minutes of one 4-GPU node (scripts/gpu/learning_run_4gpu.sh):
    2T2S at 4 proposals per type and 4 answers per task, the single agent at 5 per type: 30 trajectories per adapter
    in both, and teacher groups of 4 and 5."""
    from populora_verl.step import planned_trajectories
    from populora_verl.step.metrics import small_group_warning

    common = ["populora.rollout.student_n=4"]
    single = load_config(compose_recipe("qwen1.5b_1gpu_single",
                                        [*common, "populora.rollout.proposals_per_type=5"]).populora)
    pop = load_config(compose_recipe("qwen1.5b_1gpu_2t2s", [*common, "populora.rollout.proposals_per_type=4"]).populora)
    four = load_config(compose_recipe("qwen1.5b_1gpu_4t4s", [*common, "populora.rollout.proposals_per_type=4"]).populora)
    assert planned_trajectories(single) == planned_trajectories(pop) == planned_trajectories(four) == 30.0
    assert small_group_warning(single) is None and small_group_warning(pop) is None
    small = load_config(compose_recipe("qwen1.5b_1gpu_2t2s", ["populora.rollout.proposals_per_type=2"]).populora)
    assert "has 2 sample(s)" in small_group_warning(small)
    pooled = load_config(compose_recipe("qwen1.5b_1gpu_2t2s", ["populora.rollout.proposals_per_type=2",
                                                               "populora.advantage.group=subpop_task_role"]).populora)
    assert small_group_warning(pooled) is None  # two teachers' proposals share one group of 4


def test_the_4gpu_recipe_keeps_the_one_gpu_run_s_work_per_gpu():
    """qwen1.5b_4gpu_4t4s: the one-GPU 2T2S learning run's settings, its proposals per GPU, one replica per GPU."""
    one, four = compose_recipe("qwen1.5b_1gpu_2t2s"), compose_recipe("qwen1.5b_4gpu_4t4s")
    p1, p4 = load_config(one.populora), load_config(four.populora)

    def per_gpu(cfg, p):
        return p.population.num_teachers * len(p.tasks.types) * p.rollout.proposals_per_type / cfg.trainer.n_gpus_per_node

    assert four.trainer.n_gpus_per_node == 4 and four.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert per_gpu(four, p4) == per_gpu(one, p1)
    assert four.actor_rollout_ref.actor.optim.lr == one.actor_rollout_ref.actor.optim.lr
    assert p4.rollout.student_n == p1.rollout.student_n and p4.tasks == p1.tasks
