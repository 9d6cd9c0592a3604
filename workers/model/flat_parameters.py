"""A model's trainable parameters and their gradients as views into one flat buffer."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FlatParameters:
    """A model's trainable parameters and their gradients, each as views into one flat buffer.

    ``values`` holds the parameters back to back, in parameter order; ``buffer`` holds
    ``[extra | gradients]`` in the same order, ``grads`` being its gradient part. Backward
    accumulates into ``param.grad`` in place, so the buffer always holds the sum of every
    shard's gradient since the last ``zero()``, ready to all-reduce without copies (DDP's
    ``gradient_as_bucket_view`` trick), and one optimizer call steps ``values`` from ``grads``.
    The ``extra`` slots in front let per-step bookkeeping (shard census, loss, sample count)
    ride along in the bucket that holds the first parameters, which is reduced last.
    Parameters without ``requires_grad`` are left out.

    With sharded state (``keep_gradient_slice``) the buffer holds ``[extra | one slice]``
    instead: backward accumulates into gradients of the parameters' own (autograd's), which
    the reducer takes bucket by bucket (``take_gradients``) and frees, keeping only the reduced
    entries of the slice (docs/architecture.md, "Sharded optimizer state").
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        extra: int = 0,
        *,
        device: torch.device | None = None,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Move ``params`` into ``values`` on ``device`` (default: the first one's), one at a
        time, each parameter's own storage freed as it moves (where nothing else holds it): the
        device never holds them twice, nor a model moved there whole. Then lay out the gradient
        (``hold_gradients(extra, span)``): the whole of it by default. Raises ValueError for no
        trainable parameter or mixed dtypes."""
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"mixed parameter dtypes are not supported: {sorted(map(str, dtypes))}")
        self.numel = sum(p.numel() for p in self.params)
        first = self.params[0]
        self.values = torch.empty(self.numel, dtype=first.dtype, device=first.device if device is None else device)
        #: ``[start, end)`` of each parameter in ``values``, in parameter order.
        self._offsets: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                end = offset + p.numel()
                self.values[offset:end].copy_(p.reshape(-1))  # blocking: the source may be freed next
                p.data = self.values[offset:end].view_as(p)
                self._offsets.append((offset, end))
                offset = end
        self.hold_gradients(extra, span)

    def hold_gradients(self, extra: int, span: tuple[int, int] | None = None) -> None:
        """Lay the gradient buffer out anew as ``[extra | gradients]``, zeroed: the whole
        gradient (``span`` None), the parameters' ``.grad`` views into it, or only entries
        ``span = (lo, hi)`` of it, the parameters' gradients their own (``keep_gradient_slice``).
        Allocates only that much: a sharded rank never holds a whole gradient. A worker that
        learns its extra slots only once its parameters are on the device (``TrainWorker``:
        a probe forward) builds with ``span=(0, 0)`` and calls this then. Raises ValueError
        for a span outside the parameters."""
        lo, hi = (0, self.numel) if span is None else span
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"a gradient slice [{lo}, {hi}) outside the {self.numel} parameters")
        self._drop_gradients()  # views of the old buffer, or an aborted step's not taken
        self.buffer = torch.zeros(extra + hi - lo, dtype=self.values.dtype, device=self.values.device)
        self.extra = self.buffer[:extra]
        self.grads = self.buffer[extra:]
        #: The gradient entries ``grads`` holds, ``[lo, hi)`` of the whole vector.
        self.span = (lo, hi)
        #: Whether ``grads`` holds one slice and the parameters' gradients are their own.
        self.sliced = span is not None
        #: ``(start, end)`` of each parameter's gradient in ``buffer`` were it whole, in parameter order.
        self.ranges = [(extra + start, extra + end) for start, end in self._offsets]
        self._views: list[torch.Tensor] = []
        if not self.sliced:
            for p, (start, end) in zip(self.params, self._offsets):
                p.grad = self.grads[start:end].view_as(p)
                self._views.append(p.grad)

    def no_decay_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` in ``values`` of the parameters with fewer than 2 dimensions
        (biases, norm weights): those GPT-style recipes exempt from weight decay."""
        return [offsets for p, offsets in zip(self.params, self._offsets) if p.dim() < 2]

    def keep_gradient_slice(self, lo: int, hi: int) -> None:
        """From now on hold only gradient entries ``[lo, hi)`` (zeroed), the extra slots kept:
        the parameters' gradients become their own, taken by ``take_gradients``. Re-made at
        every join (the slice moves with the group); the same span is left as it is (its
        leftover gradients freed). Raises ValueError for a slice outside the parameters."""
        if self.sliced and self.span == (lo, hi):
            self._drop_gradients()  # an aborted step's, not taken
            return
        self.hold_gradients(self.extra.numel(), (lo, hi))

    def _drop_gradients(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_slice(self, lo: int, hi: int) -> torch.Tensor:
        """Gradient entries ``[lo, hi)`` of the whole vector, a view of ``grads``. Raises
        ValueError outside the span held."""
        if not self.span[0] <= lo <= hi <= self.span[1]:
            raise ValueError(f"gradient entries [{lo}, {hi}) are not held here (only {list(self.span)})")
        return self.grads[lo - self.span[0] : hi - self.span[0]]

    def take_gradients(self, indices: Iterable[int]) -> torch.Tensor:
        """With a slice kept: the gradients of parameters ``indices`` (contiguous, any order)
        back to back in parameter order, a new tensor on this thread's current stream (zeros
        for a parameter backward did not reach; a sparse gradient made dense), and the
        parameters' own gradients freed. On a GPU the caller first orders the current stream
        after the streams that wrote them."""
        parts = []
        for index in sorted(indices):
            param = self.params[index]
            grad = param.grad
            if grad is None:
                parts.append(torch.zeros(param.numel(), dtype=param.dtype, device=param.device))
                continue
            if grad.is_cuda:  # made on another stream maybe: not reused there before this one's copy
                grad.record_stream(torch.cuda.current_stream(grad.device))
            parts.append((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
            param.grad = None
        return torch.cat(parts)

    def accumulated(self) -> list[torch.Tensor | None]:
        """A copy of the gradient accumulated so far, for ``restore_accumulated``."""
        if not self.sliced:
            return [self.grads.clone()]
        return [None if p.grad is None else p.grad.clone() for p in self.params]

    def restore_accumulated(self, copy: list[torch.Tensor | None]) -> None:
        """Put back the gradient ``accumulated`` copied (a lost backup's pass undone)."""
        if not self.sliced:
            self.grads.copy_(copy[0])  # type: ignore[arg-type]
            return
        for p, grad in zip(self.params, copy):
            p.grad = grad

    def zero(self) -> None:
        """Zero the buffer (and free the parameters' own gradients, a slice kept); raises if
        something replaced a ``.grad`` view (e.g. ``set_to_none``)."""
        for p, view in zip(self.params, self._views):
            if p.grad is not view:
                raise RuntimeError("a parameter's .grad no longer views the flat gradient buffer")
        if self.sliced:
            self._drop_gradients()
        self.buffer.zero_()


def flatten_onto(model: torch.nn.Module, device: torch.device) -> FlatParameters:
    """Put ``model`` (built on the host, as a job's factory builds it) on ``device``, its
    trainable parameters moved one by one into the returned ``FlatParameters``' values (each
    host copy freed as it goes, never the whole model on the device beside them), the rest
    (buffers, frozen parameters) by ``model.to``. No gradient is laid out yet (``span (0, 0)``,
    no extra slots): ``hold_gradients`` does that once the extra slots are known. Raises
    RuntimeError where ``model.to`` replaced a parameter that had moved (a module's own
    ``_apply``, or torch's ``overwrite_module_params_on_conversion``): its gradient would
    never reach the flat buffer."""
    flat = FlatParameters(model.parameters(), device=device, span=(0, 0))
    model.to(device)  # what is on the device already is left as it is: the flat values' views
    moved = [p for p in model.parameters() if p.requires_grad]
    if len(moved) != len(flat.params) or any(p is not q for p, q in zip(moved, flat.params)):
        raise RuntimeError(
            f"field 'model.factory': moving the model to {device} replaced its parameters; ringleader trains the "
            "parameters it moved into one flat buffer, so keep them the same objects when the model moves "
            "(torch.__future__.set_overwrite_module_params_on_conversion(False), no _apply that re-creates them)"
        )
    return flat
