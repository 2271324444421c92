"""The web dashboard (`rlfleet web`): the queue, a job with its curves and log, the fleet
with its GPU timelines, and a JSON API under /api/ that mirrors the CLI's `--json`.

Starlette, Jinja2 and uvicorn are imported only here, never by the CLI's start-up.
"""
