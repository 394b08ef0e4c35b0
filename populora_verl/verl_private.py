"""Every private verl name the plugin relies on, and every runtime patch it applies: the one list.

Three checks read it (pure data: importing this module imports only the standard library):

* ``tests/project/test_verl_signatures.py`` pins each :data:`PRIVATE` entry against the installed verl (the name is
  still defined where recorded; a method keeps its recorded arguments) and scans the package source to prove the list
  complete: every method of a verl subclass that overrides a private verl member, every private attribute read,
  written or called on a verl class or object, and every private name imported from verl must be listed here, and
  nothing listed may be gone from the code. A verl upgrade therefore fails in one place that names them all.
* ``tests/project/test_verl_integration_doc.py`` checks that docs/verl-integration.md lists exactly the names and
  runtime patches here, each with the patch of ``patches/`` that removes it: its two tables are :func:`render_doc`'s,
  rewritten in place by ``python -m populora_verl.verl_private``.
* ``removed_by`` must name a file of ``patches/`` (or be empty: no upstream change proposed yet).
* ``series_api``: the public verl API the plugin takes instead when the installed verl has it (detected by
  ``populora_verl/verl_compat.py``); empty where the private path stays with the series applied. Each such private
  path calls ``verl_compat.private_path(<name or module>)`` first, which raises under ``POPULORA_VERL_PUBLIC_ONLY=1``:
  ``tests/patches/test_series_public_only.py`` runs the verl-facing tests that way against verl with the series.

``owner`` is the defining file relative to the ``verl`` package, with ``:Class`` for a class member.
``uses`` pairs a kind with the plugin module: ``override`` (a method of a verl subclass replaces verl's), ``use``
(an attribute read, written or called), ``import`` (a private module-level name imported) or ``relies`` (not named in
our code, but our code depends on it: kept in the list so that the drift test pins it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PrivateName",
    "RuntimePatch",
    "PRIVATE",
    "RUNTIME_PATCHES",
    "VERL_VERSION",
    "DOC",
    "REGENERATE",
    "runtime_patch_table",
    "private_name_table",
    "render_doc",
    "main",
]

#: The verl release the names and signatures below were recorded against.
VERL_VERSION = "0.9.1"

TRAINER = "trainer/ppo/v1/trainer_base.py:PPOTrainer"
VLLM_SERVER = "workers/rollout/vllm_rollout/vllm_async_server.py:vLLMHttpServer"


@dataclass(frozen=True)
class PrivateName:
    name: str
    owner: str
    uses: tuple[tuple[str, str], ...]
    why: str
    removed_by: str = ""
    #: ``ast.unparse`` of the method's arguments in verl (methods only).
    signature: str | None = None
    #: the public API used instead where verl has it (the series applied); empty: still used then
    series_api: str = ""


@dataclass(frozen=True)
class RuntimePatch:
    #: plugin module that applies it
    module: str
    #: what it changes at run time
    target: str
    why: str
    removed_by: str = ""
    #: on in a default run (False: opt-in through an environment variable or a config key)
    default: bool = True
    #: the public API used instead where verl has it (the series applied); empty: still applied then
    series_api: str = ""


PRIVATE: tuple[PrivateName, ...] = (
    # --- trainer (PopuLoRATrainer over verl's V1 PPOTrainerSync) ------------------------------------------------
    PrivateName(
        "_build_replay_buffer",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"), ("use", "populora_verl.trainer.trainer")),
        "overridden to set the buffer's poll interval from trainer.populora_poll_interval_s (verl builds it with "
        "a fixed 2 s); defined only where verl lacks the config key. Used to rebuild the buffer after trainer_mode "
        "is reset to sync (verl built the async buffer for the unknown mode name; with PPOTrainer.is_async, 0007, "
        "this use is skipped)",
        "0011-trainer-replay-buffer-poll-interval.patch",
        "self",
        "trainer.v1.sampler.poll_interval, set by the trainer's __init__",
    ),
    PrivateName(
        "_init_resource_pool_mgr",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"),),
        "swaps the actor role's worker class for PopuLoRAActorRolloutRefWorker (verl hard-codes "
        "ray.remote(ActorRolloutRefWorker)); defined only where verl lacks the config key",
        "0004-trainer-worker-class-from-config.patch",
        "self",
        "actor_rollout_ref.worker_class, set by the trainer's __init__",
    ),
    PrivateName(
        "_init_dataloader",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"),),
        "no dataset: the population step makes every prompt; sets the step counts verl derives from it; defined "
        "only where verl lacks PPOTrainer.uses_dataset",
        "0012-trainer-without-dataset.patch",
        "self",
        "PopuLoRATrainer.uses_dataset = False (PPOTrainer.uses_dataset)",
    ),
    PrivateName(
        "_validate",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"),),
        "no validation set (members are evaluated with populora-eval); defined only where verl lacks "
        "PPOTrainer.uses_dataset",
        "0012-trainer-without-dataset.patch",
        "self",
        "PopuLoRATrainer.uses_dataset = False (verl skips validation without a validation set)",
    ),
    PrivateName(
        "_get_required_batch_multiple",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"),),
        "one PPO mini-batch is a slot's whole batch, so only the data-parallel split needs divisibility; defined "
        "only where verl lacks the public stages",
        "0018-trainer-public-step-stages.patch",
        "self, dp_size: int",
        "PPOTrainer.get_required_batch_multiple, overridden by the trainer",
    ),
    PrivateName(
        "_add_prompts_to_generate",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"),),
        "verl's refill hook (the replay buffer's refill_fn) resubmits the phase's evicted groups instead of reading "
        "a dataloader; defined only where verl lacks the public hook, and forwards to the trainer's "
        "add_prompts_to_generate",
        "0020-trainer-public-prompt-submission.patch",
        "self, num_prompts: int",
        "PPOTrainer.add_prompts_to_generate, overridden by the trainer",
    ),
    PrivateName(
        "_submit_batch_to_rollout",
        TRAINER,
        (("use", "populora_verl.trainer.generation"),),
        "puts each phase's prompt rows into TransferQueue the way verl's loop does",
        "0020-trainer-public-prompt-submission.patch",
        "self, batch: TensorDict",
        "PPOTrainer.submit_batch_to_rollout",
    ),
    PrivateName(
        "_balance_batch",
        TRAINER,
        (("use", "populora_verl.trainer.training"),),
        "balances each slot's batch over the data-parallel ranks as verl would",
        "0018-trainer-public-step-stages.patch",
        "self, batch: KVBatchMeta, metrics, logging_prefix='global_seqlen', keep_minibatch=False",
        "PPOTrainer.balance_batch",
    ),
    PrivateName(
        "_compute_old_log_prob",
        TRAINER,
        (("use", "populora_verl.trainer.training"),),
        "verl's old-log-prob pass (with its bypass mode), run on the slots' batch",
        "0018-trainer-public-step-stages.patch",
        "self, batch: KVBatchMeta, metrics: dict",
        "PPOTrainer.compute_old_log_prob",
    ),
    PrivateName(
        "_update_actor",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"), ("use", "populora_verl.trainer.training")),
        "one PPO mini-batch per slot: repeats verl's extra_info block with the slot's size as the mini-batch (the "
        "fused update sends the same block); defined only where verl lacks the public stages",
        "0018-trainer-public-step-stages.patch",
        "self, batch: KVBatchMeta, metrics: dict",
        "PPOTrainer.update_actor, with get_actor_update_extra_info overridden (the slot's size as the mini-batch, "
        "verl's other keys kept; the fused update sends the same)",
    ),
    PrivateName(
        "_save_checkpoint",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"), ("use", "populora_verl.trainer.hooks")),
        "overridden only where verl lacks PPOTrainer.on_save_checkpoint (0008 removes the override): the "
        "population, step state and bank are written before verl's own save (evolution runs at the end of step, so "
        "fit's save after it holds the evolved population). Called by on_step_end where verl lacks "
        "PPOTrainer.save_checkpoint (0015 removes the call), to save the step at which a stop file ends the run, "
        "which verl decided not to save before the step ran",
        "0015-trainer-public-save.patch",
        "self",
        "PPOTrainer.on_save_checkpoint (the override) and PPOTrainer.save_checkpoint (the stop file's save)",
    ),
    PrivateName(
        "_load_checkpoint",
        TRAINER,
        (("override", "populora_verl.trainer.trainer"),),
        "overridden only where verl lacks PPOTrainer.before_load_checkpoint or on_load_checkpoint: builds the "
        "adapter bank and picks the newest checkpoint that passes its checks before verl's load, then restores the "
        "bank and population after it (0008 removes the second half, 0021 the first)",
        "0021-trainer-before-load-hook.patch",
        "self",
        "PPOTrainer.before_load_checkpoint and PPOTrainer.on_load_checkpoint",
    ),
    PrivateName(
        "_dispatch_info",
        "single_controller/base/worker_group.py:WorkerGroup",
        (("use", "populora_verl.trainer.training"),),
        "the actor mesh's data-parallel size, to lay out the fused update's rows as verl's dispatch splits them",
        "0019-worker-group-public-dispatch-info.patch",
        series_api="WorkerGroup.dispatch_info",
    ),
    PrivateName(
        "_query_dispatch_info",
        "single_controller/base/worker.py:Worker",
        (("use", "populora_verl.trainer.training"),),
        "fills _dispatch_info when no dispatch has run yet (called on the worker group)",
        "0019-worker-group-public-dispatch-info.patch",
        "self, mesh_name: str",
        "WorkerGroup.dispatch_info (which queries the workers once)",
    ),
    # --- rollout: registries ------------------------------------------------------------------------------------
    PrivateName(
        "_ROLLOUT_REGISTRY",
        "workers/rollout/base.py",
        (("import", "populora_verl.rollout"),),
        "registers the trainer-side ServerAdapter of the populora_vllm backend (verl has no register "
        "function for it) and checks the registration",
        "0006-rollout-register-helper.patch",
        series_api="register_rollout, is_rollout_class_registered",
    ),
    PrivateName(
        "_registry",
        "workers/rollout/replica.py:RolloutReplicaRegistry",
        (("use", "populora_verl.rollout"),),
        "checks that populora_vllm is registered (RolloutReplicaRegistry has register and get only)",
        "0006-rollout-register-helper.patch",
        series_api="RolloutReplicaRegistry.is_registered",
    ),
    PrivateName(
        "_agent_loop_registry",
        "experimental/agent_loop/agent_loop.py",
        (("use", "populora_verl.rollout"),),
        "checks whether populora_agent is registered (verl's register overwrites silently)",
        "0006-rollout-register-helper.patch",
        series_api="is_agent_loop_registered",
    ),
    # --- rollout: the populora_vllm backend -----------------------------------------------------------------------
    PrivateName(
        "_preprocess_engine_kwargs",
        VLLM_SERVER,
        (("override", "populora_verl.rollout.routing"),),
        "reads max_loras / max_cpu_loras before verl forces max_loras=1, and builds the live-adapter registry; "
        "defined only where verl forces it",
        "0001-vllm-configurable-max-loras.patch",
        "self, engine_kwargs: dict",
        "rollout.engine_kwargs.vllm.max_loras, passed to vLLM by vLLMHttpServer.launch_server (the registry is "
        "sized from the same keys in the server's launch_server)",
    ),
    PrivateName(
        "_get_worker_extension_cls",
        VLLM_SERVER,
        (("override", "populora_verl.rollout.vllm_server"),),
        "loads PopuLoRAWorkerExtension (per-id weight sync) into vLLM's workers; defined only where verl's "
        "extension loads every adapter under its fixed id",
        "0003-vllm-multi-adapter-weight-sync.patch",
        "self",
        "verl's own extension, update_weights_from_ipc(lora_int_id, lora_name); the server retires old ids through "
        "vLLM's remove_lora",
    ),
    PrivateName(
        "_disaggregation_role",
        VLLM_SERVER,
        (("use", "populora_verl.rollout.vllm_server"),),
        "refuses prefill/decode disaggregation, whose path would drop the request's adapter",
        "0002-vllm-per-request-lora.patch",
        series_api="rollout.disaggregation.enabled (config): the prefill/decode path forwards generate(lora=...), "
        "but the backend's replica launches no prefill/decode servers, so the setting is still refused",
    ),
    PrivateName(
        "_get_server_name_prefix",
        "workers/rollout/vllm_rollout/vllm_async_server.py:vLLMReplica",
        (("override", "populora_verl.rollout.vllm_server"),),
        "verl's ServerAdapter finds the server as '<rollout.name>_server...' while vLLMReplica names it "
        "'vllm_...'; the plugin keeps a backend of its own (its server holds the live-adapter registry and retires "
        "old ids, which verl's does not), so it must rename its servers",
        "0023-vllm-server-name-from-rollout-name.patch",
        "self",
        series_api="none needed: the replica names its servers after rollout.name, as ServerAdapter looks them up",
    ),
    PrivateName(
        "_get_server_name_prefix",
        "workers/rollout/vllm_rollout/vllm_rollout.py:ServerAdapter",
        (("relies", "populora_verl.rollout.vllm_server"),),
        "the trainer side's half of the server name above",
        "0023-vllm-server-name-from-rollout-name.patch",
        "self",
        series_api="none needed: verl's two halves agree on the server name",
    ),
    PrivateName(
        "_update_weights",
        "workers/rollout/vllm_rollout/utils.py:vLLMColocateWorkerExtension",
        (("override", "populora_verl.rollout.vllm_extension"),),
        "loads each adapter under its own LoRA id instead of verl's fixed id 123 (PopuLoRAWorkerExtension is "
        "defined only where verl's extension lacks the id)",
        "0003-vllm-multi-adapter-weight-sync.patch",
        "self, weights: list[tuple[str, torch.Tensor]], peft_config: dict, base_sync_done: bool",
        "vLLMColocateWorkerExtension.update_weights_from_ipc(lora_int_id, lora_name), one transfer per adapter",
    ),
    PrivateName(
        "_cap_text_prompt_length",
        "experimental/agent_loop/agent_loop.py:AgentLoopBase",
        (("use", "populora_verl.rollout.agent_loop"),),
        "a plain-text prompt (prompt_format=text) is capped to the prompt length as verl caps a chat prompt",
        "0013-agent-loop-public-prompt-cap.patch",
        "self, prompt_ids: list[int]",
        "AgentLoopBase.cap_text_prompt_length",
    ),
    # --- reward manager -------------------------------------------------------------------------------------------
    PrivateName(
        "_class_initialized",
        "experimental/reward_loop/reward_manager/base.py:RewardManagerBase",
        (("use", "populora_verl.reward.manager"),),
        "verl's own pattern for init_class (its managers do the same); reset_class clears it for tests; used only "
        "where verl lacks RewardManagerBase.setup_class",
        "0016-reward-manager-class-setup.patch",
        series_api="RewardManagerBase.setup_class, reset_class",
    ),
)


RUNTIME_PATCHES: tuple[RuntimePatch, ...] = (
    RuntimePatch(
        "populora_verl.workers.logprobs",
        "logprobs_from_logits in verl.utils.torch_functional and verl.workers.engine.fsdp.transformer_impl",
        "without flash-attn verl falls back to a per-token Python loop (27x slower per micro-batch); the "
        "worker module rebinds the name to a chunked computation, only where verl would take that loop "
        "(POPULORA_LOGPROBS=verl keeps verl's)",
        "0010-chunked-logprob-fallback.patch",
        series_api="verl's own chunked fallback (logprobs_from_logits_chunked)",
    ),
    RuntimePatch(
        "populora_verl.rollout.routing",
        "vLLMHttpServer.engine (wrapped in LoraRoutingEngine)",
        "verl's generate sends the fixed LoRA id 123; the wrapper substitutes the request's adapter",
        "0002-vllm-per-request-lora.patch",
        series_api="vLLMHttpServer.generate(lora=...)",
    ),
    RuntimePatch(
        "populora_verl.rollout.agent_loop",
        "AgentLoopBase.server_manager (wrapped in LoraInjectingClient)",
        "verl's single-turn loop does not forward a prompt field to generate; the wrapper adds the prompt's adapter",
        "0002-vllm-per-request-lora.patch",
        series_api="SingleTurnAgentLoop forwards the prompt field lora to generate",
    ),
    RuntimePatch(
        "populora_verl.rollout.weight_sync",
        "the VERL_RAY_JOB_ID environment variable of the vLLM server",
        "verl names the weight-sync socket after the Ray job id, which every fresh local Ray cluster "
        "numbers alike; trainers with their own clusters on one host shared a socket and hung",
        "0005-weight-sync-socket-unique-per-host.patch",
        series_api="get_weight_sync_job_id",
    ),
    RuntimePatch(
        "populora_verl.rollout.server_adapter",
        "ServerAdapter.zmq_handle (the trainer's socket path)",
        "the sender's half of the same fix",
        "0005-weight-sync-socket-unique-per-host.patch",
        series_api="get_weight_sync_job_id (verl's own ServerAdapter is registered)",
    ),
    RuntimePatch(
        "populora_verl.rollout.engine_ports",
        "the VLLM_PORT environment variable of the vLLM server (without vLLM's own data parallelism)",
        "vLLM picks its engine's rendezvous port by binding and closing a throwaway socket, so the engines of "
        "replicas starting together on one node could be handed the same port and fail with EADDRINUSE; each "
        "replica's engine searches from a block of its own (the user's VLLM_PORT stays the base)",
        "0017-vllm-engine-port-per-replica.patch",
        series_api="get_port_block_start (verl's server sets each replica's VLLM_PORT)",
    ),
    RuntimePatch(
        "populora_verl.trainer.trainer",
        "PPOTrainer.trainer_mode (reset to 'sync' after __init__)",
        "verl treats every trainer_mode other than 'sync' as async (async replay buffer, TransferQueue "
        "checkpoints, generation batch 1), so a registered sync trainer must rename its mode",
        "0007-trainer-declares-async.patch",
        series_api="PPOTrainer.is_async",
    ),
    RuntimePatch(
        "populora_verl.workers.resident_engine",
        "the class of verl's FSDP engine instance (engine.__class__ becomes a subclass)",
        "resident adapters (adapter_layout=resident) route each micro-batch's rows to their slot's LoRA "
        "inside verl's forward, backward and optimizer step; only where verl lacks EngineConfig.engine_class or the "
        "run did not name the resident engine there",
        "0022-engine-class-from-config.patch",
        series_api="EngineConfig.engine_class: actor_rollout_ref.actor.fsdp_config.engine_class, set by the "
        "trainer's __init__ to ResidentFSDPEngineWithLMHead, which verl builds",
    ),
    RuntimePatch(
        "populora_verl.workers.resident_engine",
        "prepare_micro_batches in verl.workers.engine.fsdp.transformer_impl (rebound during the resident engine's "
        "forward_backward_batch)",
        "verl's balanced micro-batches scatter each slot's rows, so every micro-batch runs the loss and the LoRA "
        "linears for many slots; the resident engine keeps each slot's rows together, with the same micro-batch "
        "count on every data-parallel rank (POPULORA_RESIDENT_MICRO_BATCHES=verl keeps verl's)",
        "0014-engine-micro-batch-hook.patch",
        series_api="FSDPEngine.prepare_micro_batches, overridden by the resident engine",
    ),
    RuntimePatch(
        "populora_verl.workers.lora_forward",
        "peft.tuners.lora.Linear.forward",
        "a leaner LoRA forward for benchmarks (POPULORA_LORA_FORWARD); PEFT, not verl",
        "",
        default=False,
    ),
)


# --- docs/verl-integration.md ---------------------------------------------------------------------------------------

#: The document with the two generated tables (in a source checkout; pass another path to :func:`main`).
DOC = Path(__file__).resolve().parent.parent / "docs" / "verl-integration.md"
#: The command that rewrites the tables in place.
REGENERATE = "python -m populora_verl.verl_private"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _short(module: str) -> str:
    return module.removeprefix("populora_verl.")


def _removed_by(patch: str) -> str:
    return f"`{patch}`" if patch else "none yet"


def _with_series(api: str) -> str:
    return f"public: {api}" if api else "still used"


def runtime_patch_table() -> list[str]:
    """The runtime-patch table of docs/verl-integration.md, one line per row (header and rule first)."""
    lines = [
        _row(
            ("plugin module", "what it changes at run time", "why", "default", "removed by", "with the series applied")
        ),
        "|---|---|---|---|---|---|",
    ]
    for rp in RUNTIME_PATCHES:
        default = "on" if rp.default else "opt-in"
        cells = (f"`{_short(rp.module)}`", rp.target, rp.why, default, _removed_by(rp.removed_by))
        lines.append(_row((*cells, _with_series(rp.series_api))))
    return lines


def private_name_table() -> list[str]:
    """The private-name table of docs/verl-integration.md, one line per row (header and rule first)."""
    lines = [
        _row(("private name", "defined in verl", "our use (module)", "why", "removed by", "with the series applied")),
        "|---|---|---|---|---|---|",
    ]
    for e in PRIVATE:
        uses = "; ".join(f"{kind} ({_short(module)})" for kind, module in e.uses)
        lines.append(
            _row((f"`{e.name}`", f"`{e.owner}`", uses, e.why, _removed_by(e.removed_by), _with_series(e.series_api)))
        )
    return lines


def _table_block(tag: str) -> re.Pattern[str]:
    """A generated table between its markers: the opening marker, the table, the closing marker."""
    return re.compile(
        rf"(<!-- {tag}: generated from populora_verl/verl_private\.py -->\n)(.*?)(\n<!-- /{tag} -->)", re.S
    )


def render_doc(text: str) -> str:
    """``text`` (docs/verl-integration.md) with its generated tables replaced by :func:`runtime_patch_table` and
    :func:`private_name_table`; everything outside the markers is kept as it is. Raises :class:`ValueError` where a
    table's markers are missing or repeated."""
    for tag, lines in (("runtime-patches", runtime_patch_table()), ("private-names", private_name_table())):
        table = "\n".join(lines)
        text, found = _table_block(tag).subn(lambda m, table=table: m.group(1) + table + m.group(3), text)
        if found != 1:
            raise ValueError(
                f"expected one <!-- {tag}: generated from populora_verl/verl_private.py --> table, found {found}"
            )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m populora_verl.verl_private [--check] [PATH]``: rewrite the generated tables of PATH
    (docs/verl-integration.md) in place; ``--check`` only reports whether they are current (exit status 1 if not)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=REGENERATE, description="Regenerate docs/verl-integration.md's tables from populora_verl/verl_private.py."
    )
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help="the document (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the tables are stale")
    args = parser.parse_args(argv)
    text = args.path.read_text(encoding="utf-8")
    rendered = render_doc(text)
    if rendered == text:
        print(f"{args.path}: up to date")
        return 0
    if args.check:
        print(f"{args.path}: stale; run {REGENERATE}")
        return 1
    args.path.write_text(rendered, encoding="utf-8")
    print(f"{args.path}: tables rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
