"""Per-slot values of one layer step, held as a Python list and made a tensor only when asked.

A decode step (one token, ``top_k`` routed slots) is planned in plain Python end to end: plan
widths and roles, serving, grouping and order (``serving.plan_served_step``). Its results
(``ServedSlots``, ``StepPlan``) expose tensors, which tests, the CPU placement's worker and
prefill steps read, but the executor's decode path needs none of them, and one
``torch.tensor(list)`` costs ~5.6 us on the project's 2-core VM (one thread, quiet), five of them
per step were ~30 us of the planner's 100 us budget. :class:`SlotValues` holds either form and
builds the other once, on first use (then keeps it: the attribute returns the same tensor on every
read, as the dataclass field it replaces did).
"""

from __future__ import annotations

import torch


class SlotValues:
    """A flat Python list of ints/bools or a tensor of ``shape`` and ``dtype``; each form on demand.

    Built from a list, :meth:`tensor` is ``torch.tensor(values, dtype=dtype).reshape(shape)``;
    built from a tensor, :meth:`values` is its flattened ``tolist()``. Nothing here copies a
    tensor given to it (the serving policy's fast path hands the plan's widths tensor through).
    """

    __slots__ = ("_values", "_tensor", "_shape", "_dtype")

    def __init__(self, values: list | torch.Tensor, shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype = torch.int64) -> None:
        if isinstance(values, torch.Tensor):
            self._tensor, self._values = values, None
        else:
            self._values, self._tensor = values, None
        self._shape = shape
        self._dtype = dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape given, else the tensor's (a list given without a shape is 1-D)."""
        if self._shape is not None:
            return tuple(self._shape)
        return tuple(self._tensor.shape) if self._tensor is not None else (len(self._values),)

    def tensor(self) -> torch.Tensor:
        """The values as a tensor (built once)."""
        t = self._tensor
        if t is None:
            t = torch.tensor(self._values, dtype=self._dtype)
            if self._shape is not None and tuple(t.shape) != tuple(self._shape):
                t = t.reshape(self._shape)
            self._tensor = t
        return t

    def values(self) -> list:
        """The values as a flat Python list (built once; do not modify it)."""
        v = self._values
        if v is None:
            v = self._values = self._tensor.reshape(-1).tolist()
        return v

    def __repr__(self) -> str:
        return repr(self._tensor if self._tensor is not None else self._values)
