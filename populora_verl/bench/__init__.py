"""Benchmarks: ``python -m populora_verl.bench.<name>``.

What users run: ``validity`` (can a model write valid tasks?), ``step_scaling`` and ``gpu_scaling`` (seconds per
step over configurations and GPUs), ``ceiling`` (plain vLLM generation for comparison), ``operators`` and
``retention_real`` (evolution operators), ``executor`` (sandbox throughput), ``selection_sim`` (PBT selection),
``logprob_paths`` and ``trace_summary`` (where a training step spends its time), ``engine_start`` (vLLM's start with
its compile cache off and on), ``startup`` (the trainer's start-up timeline per phase, N runs, A/B of one lever),
``plugin_import`` (what the plugin adds to ``import verl`` in each of a run's processes) and ``transfer_queue``
(TransferQueue's start and data path against its storage units). ``gpu_plan``, ``learning_run`` and ``progress``
drive long runs in the background on a GPU node (scripts/gpu/README.md).
"""
