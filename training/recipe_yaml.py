"""Reading a recipe file (`--config RECIPE.yaml`) with a bound on what it may cost: at most
`MAX_RECIPE_BYTES`, no YAML aliases (nested aliases, a "billion laughs", name billions of
values in a few hundred bytes when walked), nesting at most `MAX_DEPTH` deep. The
scheduler reads job files and recipes with its own loader of the same bounds
(`scheduler.jobspec.reading`); train_grpo.py, which runs on a VM without the scheduler,
uses this one."""

from __future__ import annotations

import functools
from typing import Any

MAX_RECIPE_BYTES = 1 << 20
"""Largest recipe read (1 MiB, as a job file): a recipe is a few kilobytes."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists (a recipe nests 2 or 3 deep)."""


class RecipeYamlError(ValueError):
    """A recipe refused while it is read: one line, with its line number when known."""


def load_recipe_yaml(path: str) -> Any:
    """The YAML document in the file at `path` (safe loader, bounded as above);
    `OSError` when it cannot be read, `RecipeYamlError` when it is refused or not YAML."""
    import yaml

    with open(path, "rb") as stream:
        raw = stream.read(MAX_RECIPE_BYTES + 1)
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeYamlError(f"larger than {MAX_RECIPE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeYamlError(f"not valid UTF-8 (byte {exc.start})") from None
    loader = _loader()(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise RecipeYamlError(f"not valid YAML{line}: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:
        raise RecipeYamlError("nested too deeply") from None
    finally:
        loader.dispose()


@functools.cache
def _loader() -> Any:
    """PyYAML's safe loader, refusing aliases and nesting deeper than `MAX_DEPTH` while the
    file is composed (before anything is built)."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, "YAML aliases (*name) are not allowed", mark
                )
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise yaml.composer.ComposerError(
                        None, None, f"nested deeper than {MAX_DEPTH} levels", mark
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return RecipeLoader
