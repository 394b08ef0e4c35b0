"""Plain helpers the test modules import (conftest.py puts this folder on sys.path).

Fixtures live in conftest.py; what is here is needed outside a test's arguments: in module-level helpers and in
values a module builds at import time.
"""

from __future__ import annotations

from pathlib import Path

# Paths from here, never from a test module's own __file__: the modules sit one folder down (tests/<area>/), and
# a later move of a module must not change what these name.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"
RECIPES = REPO / "recipes" / "populora"


def compose_recipe(name: str, overrides=(), *, hydra_config: bool = False):
    """The recipe ``name`` composed by hydra as ``verl.trainer.main_ppo --config-path recipes/populora`` would.

    ``hydra_config``: keep the ``hydra`` node (callbacks and the like), which a plain compose drops."""
    # Imported here: some modules skip themselves when hydra is missing, which they can only do before this runs.
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=name, overrides=list(overrides), return_hydra_config=hydra_config)
