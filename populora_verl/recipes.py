"""Where the hydra recipes are: ``recipes/populora`` of a checkout, or the copy that the installed package carries.

``python -m populora_verl.recipes`` prints the folder, so a run from anywhere can name it::

    python -m verl.trainer.main_ppo --config-path "$(python -m populora_verl.recipes)" --config-name 2t2s ...

The recipes live in the repository's top-level ``recipes/`` folder; ``setup.py`` maps the package
``populora_verl._recipes`` onto that folder, so a wheel installs them as ``populora_verl/_recipes/populora``.
Standard library only: cheap to import, and it runs without torch or verl.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "populora_verl"
INSTALLED = "_recipes"  # the folder (package) name a wheel gives the top-level recipes/ folder (setup.py)
FAMILY = "populora"  # the recipe folder under recipes/


def checkout_recipes(package_dir: str | Path) -> Path | None:
    """``<checkout>/recipes/populora`` when ``package_dir`` (the ``populora_verl`` folder) sits in a checkout."""
    d = Path(package_dir).resolve().parent / "recipes" / FAMILY
    return d if d.is_dir() else None


def installed_recipes(package: str = PACKAGE) -> Path | None:
    """The recipes an installed ``package`` carries (``<package>/_recipes/populora``), found with importlib.resources;
    None when the package has none, or is not installed as plain files (a zip: hydra needs a folder)."""
    from importlib import resources  # only here: a checkout never needs it

    try:
        d = resources.files(package).joinpath(INSTALLED, FAMILY)
    except ModuleNotFoundError:
        return None
    return d if isinstance(d, Path) and d.is_dir() else None


def recipes_dir() -> Path:
    """The folder of the recipes (absolute, as hydra's ``--config-path`` wants): a checkout's ``recipes/populora``
    when this module runs from one (an editable install included), else the installed copy."""
    here = Path(__file__).resolve().parent
    found = checkout_recipes(here) or installed_recipes(PACKAGE)
    if found is None:
        raise FileNotFoundError(
            f"no recipes: neither {here.parent / 'recipes' / FAMILY} (a checkout) nor "
            f"{here / INSTALLED / FAMILY} (an installed package) is a folder; reinstall "
            f"{PACKAGE}, or pass --config-path <checkout>/recipes/{FAMILY}"
        )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args:
        print(
            "usage: python -m populora_verl.recipes  (prints the recipes folder, for hydra's --config-path)",
            file=sys.stderr,
        )
        return 0 if args[0] in ("-h", "--help") else 2
    try:
        print(recipes_dir())
    except FileNotFoundError as e:
        print(f"populora: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
