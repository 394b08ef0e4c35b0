"""Imported by the forkserver of :mod:`populora_verl.rollout.engine_preload` only: imports the modules named in
``POPULORA_PRELOAD_MODULES`` (comma-separated). Python's forkserver stops at any error but ImportError in its own
preload list; here no failure may stop it, since the engine core imports whatever is missing itself."""

import importlib
import os

for _name in filter(None, os.environ.get("POPULORA_PRELOAD_MODULES", "").split(",")):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S110 - a module that fails here is imported (and fails loudly) in the engine
        pass
