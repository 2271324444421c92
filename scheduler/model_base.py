"""The declarative base every model derives from (`scheduler.models`, and the models kept
in modules of their own, such as `scheduler.store_records`), with stable constraint
names so that migrations diff cleanly. A module of its own, so that a model outside
`models.py` needs no import of it (no import cycle). Whatever compares the schema with
the models (migrations/env.py, the migration test) imports every module of models."""

from __future__ import annotations

from sqlalchemy import DateTime, MetaData
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base with stable constraint names, so migrations diff cleanly."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def timestamp() -> DateTime:
    """The type of every time column: a timestamp with its time zone."""
    return DateTime(timezone=True)
