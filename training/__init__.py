"""GRPO training for rlfleet jobs: `train_grpo.py` and its data, model and progress helpers.

Runs on a VM by itself; it never imports the scheduler.
"""
