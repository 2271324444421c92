"""VM names: what `vm add` accepts, the whole name checked (a final newline included)."""

from __future__ import annotations

import pytest

from scheduler.errors import BadInput
from scheduler.fleet import VMSpec


@pytest.mark.parametrize("name", ["gpu-1", "a", "node_7.lab", "A" * 128])
def test_a_vm_name_of_letters_digits_dots_dashes_is_accepted(name: str) -> None:
    VMSpec(name=name, host="h").validate()


@pytest.mark.parametrize("name", ["gpu-1\n", "-a", "a b", "A" * 129, "a/b"])
def test_a_vm_name_with_anything_else_is_refused(name: str) -> None:
    with pytest.raises(BadInput):
        VMSpec(name=name, host="h").validate()
