"""ZeRO-1/2's model weights held once on XLA: each parameter owns its buffer, and the flat buffer of its group exists
only while the optimizer step (or a load's ``update_lp_params``) writes it.

Upstream keeps a group's weights in one flat buffer and makes each parameter a view of it. XLA has no buffer views:
a view that lives across a step is a buffer of its own, and torch's functionalization keeps the flat buffer's
storage besides. ZeRO-1 in fp32 at world 1 read five weight-sized buffers a step where the floor reads three, and
its flat copy was never donated (docs/performance.md, 'What the TPU compiler says'). Here the parameters keep their
own buffers, updated in place at the step's end (so donated to the step graph); the flat buffer is concatenated from
them where DeepSpeed asks for it inside a step, and XLA drops that concatenation, which the update overwrites whole.
The values are upstream's: the same partitions, all-gathered the same way, copied into the same parameters.
``deepspeed_xla.patches.__init__`` applies these to ``DeepSpeedZeroOptimizer`` itself, not to its subclasses.
"""
import collections.abc
import contextlib
import functools
import weakref
from typing import Callable, Iterator, List, Optional

_FLATS = "_dsx_step_flats"  # on an optimizer whose parameters own their buffers: its StepFlats


class StepFlats:
    """A ZeRO-1/2 optimizer's flat bit16 buffers and their partitions, made from the parameters when asked for; kept
    only inside ``scope()`` (a step), so that the writes of one step land in one buffer, which is then dropped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.numels = [flat.numel() for flat in optimizer.bit16_groups_flat]
        self._scopes = 0
        self._flats: List[Optional[object]] = [None] * len(self.numels)
        self._partitions: List[Optional[list]] = [None] * len(self.numels)

    def flat(self, group: int):
        """Group ``group``'s flat buffer, as upstream flattens it (its order, per-parameter padding and alignment)."""
        return self._kept(self._flats, group, self._flatten)

    def partitions(self, group: int) -> list:
        return self._kept(self._partitions, group,
                          lambda group: self.optimizer.get_data_parallel_partitions(self.flat(group), group))

    def _kept(self, store: list, group: int, make: Callable[[int], object]):
        """``make(group)``, or what it made earlier in this scope: kept only while a scope is open."""
        if store[group] is None:
            if not self._scopes:
                return make(group)
            store[group] = make(group)
        return store[group]

    def _flatten(self, group: int):
        from deepspeed import comm as dist
        optimizer = self.optimizer
        alignment = optimizer.nccl_start_alignment_factor * dist.get_world_size(
            group=optimizer.real_dp_process_group[group])
        flat = optimizer.flatten_dense_tensors_aligned(optimizer.round_robin_bit16_groups[group], alignment,
                                                       param_padding=optimizer.round_robin_bit16_padding[group])
        if flat.numel() != self.numels[group]:
            raise RuntimeError(f"ZeRO parameter group {group} now flattens to {flat.numel()} elements, not the "
                               f"{self.numels[group]} it was partitioned for: a parameter of the model changed shape "
                               "after deepspeed.initialize. Change shapes before initialize.")
        return flat.detach()

    def to_params(self, group: int) -> None:
        """The flat buffer's values into the parameters' own buffers, in place."""
        import torch
        optimizer, flat = self.optimizer, self.flat(group)
        views = [flat.narrow(0, offset, meta.numel()).view(meta.shape)
                 for meta, offset in zip(optimizer.round_robin_bit16_meta[group],
                                         optimizer.round_robin_bit16_offsets[group])]
        torch._foreach_copy_([param.data for param in optimizer.round_robin_bit16_groups[group]], views)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._scopes += 1
        try:
            yield
        finally:
            self._scopes -= 1
            if not self._scopes:
                self._flats = [None] * len(self.numels)
                self._partitions = [None] * len(self.numels)


class PerGroup(collections.abc.Sequence):
    """What DeepSpeed indexes by parameter group (``bit16_groups_flat``, ``parallel_partitioned_bit16_groups``),
    made on each access."""

    def __init__(self, count: int, make: Callable[[int], object]):
        self._count, self._make = count, make

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[group] for group in range(self._count)[index]]
        if not -self._count <= index < self._count:
            raise IndexError(index)
        return self._make(index % self._count)


def _fragments_from_params(optimizer) -> None:
    """Each parameter's ``_hp_mapping.lp_fragment`` read from the parameter when used, not kept: a kept view of the
    flat buffer would keep that buffer (and, on XLA, a copy of its own) alive."""
    from deepspeed.utils.tensor_fragment import tensor_fragment
    fragment_class = _fragment_class(tensor_fragment)
    for group in optimizer.bit16_groups:
        for param in group:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None and not isinstance(mapping, fragment_class):
                mapping.__dict__.pop("lp_fragment", None)
                mapping._dsx_param = weakref.ref(param)
                mapping.__class__ = fragment_class


@functools.lru_cache(maxsize=None)
def _fragment_class(tensor_fragment: type) -> type:
    def lp_fragment(self):
        address = self.lp_fragment_address
        return self._dsx_param().data.flatten().narrow(0, address.start, address.numel)

    return type("ParamTensorFragment", (tensor_fragment, ), {"lp_fragment": property(lp_fragment)})


def _own_buffers(optimizer) -> None:
    """Give each parameter its own buffer and drop the flat buffers (the layout this module keeps)."""
    flats = StepFlats(optimizer)
    for group in optimizer.round_robin_bit16_groups:
        for param in group:
            param.data = param.data.clone()
    optimizer.bit16_groups_flat = PerGroup(len(flats.numels), flats.flat)
    optimizer.parallel_partitioned_bit16_groups = PerGroup(len(flats.numels), flats.partitions)
    setattr(optimizer, _FLATS, flats)
    _fragments_from_params(optimizer)


def _owns(optimizer) -> bool:
    return _FLATS in optimizer.__dict__


def params_own_their_buffers(original):
    """``DeepSpeedZeroOptimizer.__init__``: then the parameters own their buffers, on XLA."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        if type(self) is DeepSpeedZeroOptimizer and self.bit16_groups_flat \
                and all(flat.device.type == "xla" for flat in self.bit16_groups_flat):
            _own_buffers(self)

    return __init__


def bit16_weights_in_place(original):
    """``_update_model_bit16_weights``: the flat buffer's values copied into the parameters."""

    @functools.wraps(original)
    def _update_model_bit16_weights(self, group_index):
        if not _owns(self):
            return original(self, group_index)
        getattr(self, _FLATS).to_params(group_index)

    return _update_model_bit16_weights


def in_one_flat_buffer(original):
    """``step``: every access to a group's flat buffer inside it is one buffer, dropped at its end."""

    @functools.wraps(original)
    def step(self, *args, **kwargs):
        if not _owns(self):
            return original(self, *args, **kwargs)
        with getattr(self, _FLATS).scope():
            return original(self, *args, **kwargs)

    return step


def lp_params_into_params(original):
    """``update_lp_params`` (after a universal checkpoint's load) writes the flat buffers, which upstream's
    parameters view; here the written values are copied into the parameters."""

    @functools.wraps(original)
    def update_lp_params(self):
        if not _owns(self):
            return original(self)
        flats = getattr(self, _FLATS)
        with flats.scope():
            original(self)
            for group in range(len(flats.numels)):
                flats.to_params(group)

    return update_lp_params


def fragments_after_linking(original):
    """``_link_all_hp_params`` (called again by ``reload_states``): the new mappings read their parameters too."""

    @functools.wraps(original)
    def _link_all_hp_params(self):
        original(self)
        if _owns(self):
            _fragments_from_params(self)

    return _link_all_hp_params
