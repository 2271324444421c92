"""What the scheduler and the training entrypoint (train_grpo.py) agree on, in a package of
its own so that neither imports the other (`scheduler/` never imports `training/`):

- `exits`: train_grpo.py's exit codes, which the scheduler reads to decide on a retry;
- `schema`: the fields of TRL's configuration classes, shipped as `trl_schema.json`;
- `values`: a TRL field's value from the command line or a recipe, checked and converted;
- `flags`: train_grpo.py's own flags (`ScriptArguments`) and TRL's names for them;
- `recipe`: a recipe's keys checked against both (`recipe_values`) and turned back into
  train_grpo.py's command line (`recipe_argv`): the training reads `--config` with it, the
  scheduler checks a job's recipe with it at submit time.

Standard library only (and `rewards` for the built-in reward names in `--help`): trl,
transformers and torch are imported only by `schema.live_schema`, when it runs.
"""
