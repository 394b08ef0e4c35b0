"""Replaces vLLM's CLI parsing inside verl's vLLM server module with a recorder, for patch checks that run verl's
``launch_server`` up to where vLLM would start. Read as text and run after _vllm_standin.py, like it; ``built`` holds
the arguments verl assembled for vLLM, and the parser reads them back as vLLM's would."""

import argparse

import verl.workers.rollout.vllm_rollout.vllm_async_server as server_mod

built = {}


def build_cli_args(args):  # verl's dict of vLLM arguments, recorded; the stand-in parser reads it back
    built.clear()
    built.update(args)
    return [f"--{k}" for k in args]


class Parser:  # vLLM's FlexibleArgumentParser
    def __init__(self, **kwargs):
        pass

    def add_subparsers(self, **kwargs):
        return None

    def parse_args(self, args):
        return argparse.Namespace(model_tag=args[1], subparser="serve", **built)


server_mod.build_cli_args_from_config = build_cli_args
server_mod.get_vllm_max_lora_rank = lambda rank: rank  # reads the ranks vLLM supports
server_mod.FlexibleArgumentParser = Parser
server_mod.vLLMHttpServer._get_cli_modules = lambda self: []
