"""0002: per-request LoRA. vLLM and SGLang are not installed here, so the servers cannot be started: the check runs the
patched methods themselves (parsed out of verl's files) on stand-in objects. Without vLLM this covers the
prefill/decode path forwarding ``lora`` to both legs, SGLang and TensorRT-LLM refusing the field, and the single-turn
agent loop passing a prompt's ``lora`` on; the adapter lookup inside vLLM's generate needs a GPU run."""

from __future__ import annotations

PATCH = "0002-vllm-per-request-lora.patch"

CHECK = """
import ast, asyncio, types, uuid
from pathlib import Path
from typing import Any, Optional

rollout = Path(verl.__file__).parent / "workers" / "rollout"

def methods(path, cls, *names):
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    ns = {"Optional": Optional, "Any": Any, "TokenOutput": object, "uuid": uuid, "torch": types.SimpleNamespace(Tensor=object)}
    found = [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name in names]
    assert len(found) == len(names), names
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), ns)
    return [ns[n] for n in names]

# vLLM, prefill/decode split: the prefill server dispatches, and both legs carry the request's adapter
generate, pd_dispatch = methods(rollout / "vllm_rollout" / "vllm_async_server.py", "vLLMHttpServer",
                                "generate", "_pd_dispatch")
calls = []

class Peer:
    class generate:
        @staticmethod
        async def remote(*args, **kwargs):
            calls.append(("decode", kwargs.get("lora")))
            return "tokens"

class Server:
    _disaggregation_role = "prefill"
    _pd_decode_peers = [Peer()]
    _disaggregation_kv_transfer_config = {"kv_connector": "NixlConnector"}
    def _select_decode_peer(self):
        return Peer()
    async def _pd_dispatch(self, *args, **kwargs):
        return await pd_dispatch(self, *args, **kwargs)
    async def generate(self, *args, **kwargs):
        if kwargs.get("kv_transfer_params") is None:
            return await generate(self, *args, **kwargs)
        calls.append(("prefill", kwargs.get("lora")))
        return types.SimpleNamespace(extra_fields={"kv_transfer_params": {"remote": 1}})

lora = {"lora_int_id": 1001, "lora_name": "1@v0"}
assert asyncio.run(Server().generate([1, 2, 3], {"max_tokens": 4}, "r0", lora=lora)) == "tokens"
assert calls == [("prefill", lora), ("decode", lora)], f"prefill/decode legs got {calls}"

# SGLang and TensorRT-LLM refuse the field in one line (before touching their engines)
for path, cls in ((rollout / "sglang_rollout" / "async_sglang_server.py", "SGLangHttpServer"),
                  (rollout / "trtllm_rollout" / "trtllm_async_server.py", "TRTLLMHttpServer")):
    (gen,) = methods(path, cls, "generate")
    try:
        asyncio.run(gen(object(), [1, 2], {}, "r1", lora=lora))
    except NotImplementedError as e:
        assert "vLLM rollout only" in str(e), e
    else:
        raise AssertionError(f"{cls} accepted a per-request lora")

# the single-turn agent loop passes a prompt's lora field to the server
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
src = Path(SingleTurnAgentLoop.__module__.replace(".", "/") + ".py")
text = (Path(verl.__file__).parent.parent / src).read_text()
assert 'kwargs.get("lora")' in text and "**lora_kwargs" in text
print("ok")
"""


def test_lora_reaches_both_pd_legs_and_other_backends_refuse_it(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK)
