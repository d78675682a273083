"""One observer inside a trainer: the options checked once, attached at the trainer's start
event with the trainer's own rank and directory, detached exactly once.

Shared by the Lightning and Hugging Face callbacks; imports neither library. The options are
those of ``ti_core.inject_observer`` (``ti_core.options.Options``); the callbacks only fill
in what the trainer knows: where to write by default, and which rank this process is. With a
loss trigger (``loss_trigger=``, :class:`ti_trainers.LossSpike`), the losses the callback reads
are tested here and an alarming one becomes ``ti_core.trigger_capture(kind="loss")``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, get_args

from torch import nn

from ti_core import (
    Event,
    has_observer,
    inject_observer,
    observer_of,
    remove_observer,
    trigger_capture,
)
from ti_core import options as options_module
from ti_core.sink import Sink
from ti_io import DirectorySink
from ti_schema.layout import rank_dir_name
from ti_schema.ranks import RankSelection
from ti_trainers.loss_spike import LossSpike, resolve_loss_trigger

RankPolicyName = Literal["rank0", "all"]
"""The named rank policies a callback resolves from the trainer's own rank."""
RANK_POLICY_NAMES: Final[tuple[RankPolicyName, ...]] = get_args(RankPolicyName)
OPTION_NAMES: Final[tuple[str, ...]] = options_module.OPTION_NAMES
"""The keyword arguments of ``ti_core.inject_observer`` (and so of every callback): the fields
of ``ti_core.options.Options``."""


class NothingObservedWarning(UserWarning):
    """The observed module was never called during training, so nothing was recorded."""


class TrainerRanks:
    """A rank policy (``ti_schema.RankPolicy``) decided from the rank the trainer reports.

    ``"rank0"``: global rank 0 observes, writing into the output directory itself; every other
    rank attaches nothing. ``"all"``: every rank observes, each into its ``rank-NNN``
    subdirectory (``ti_schema.layout.rank_dir_name``). The same decisions as ti-dist's
    ``Rank0Only`` and ``AllRanks``, from the trainer's ``global_rank`` / ``world_size``
    (Lightning's strategy) or ``process_index`` / ``world_size`` (Hugging Face's
    ``TrainingArguments``) instead of the environment, so no ti-dist is needed and the rank is
    the one the trainer uses.
    """

    def __init__(self, name: RankPolicyName, rank: int, world_size: int) -> None:
        if name not in RANK_POLICY_NAMES:
            raise ValueError(f"rank_policy={name!r} is not known; use one of {RANK_POLICY_NAMES}")
        for what, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{what} must be an int, got {value!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1, got rank {rank} of {world_size}")
        self.name: RankPolicyName = name
        self.rank = rank
        self.world_size = world_size

    def select(self) -> RankSelection:
        """Observe on rank 0 (``rank0``) or on every rank in its own directory (``all``)."""
        if self.name == "all":
            return RankSelection(
                rank=self.rank,
                world_size=self.world_size,
                observe=True,
                subdir=rank_dir_name(self.rank),
            )
        return RankSelection(
            rank=self.rank, world_size=self.world_size, observe=self.rank == 0, subdir=None
        )

    def __repr__(self) -> str:
        return f"TrainerRanks({self.name!r}, rank={self.rank}, world_size={self.world_size})"


def check_options(options: Mapping[str, object], owner: str) -> dict[str, Any]:
    """The options of a callback, checked when it is made: unknown names, the rank policy, the
    output directory, and every other value as ``inject_observer`` checks it
    (``ti_core.options.Options``). What needs the model (its modules, a compiled graph) and the
    sinks are checked when the trainer starts, before the model is touched."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(unknown)}; it takes the "
            f"keyword arguments of ti_core.inject_observer: {', '.join(OPTION_NAMES)}"
        )
    policy = options.get("rank_policy", "rank0")
    if isinstance(policy, str):
        if policy not in RANK_POLICY_NAMES:
            raise ValueError(
                f"{owner}(rank_policy={policy!r}): use 'rank0' or 'all' (decided from the "
                "trainer's rank), or pass a RankPolicy object such as ti_dist.Ranks([0, 3])"
            )
    elif isinstance(policy, type) or not callable(getattr(policy, "select", None)):
        raise TypeError(
            f"{owner}(rank_policy=...) must be 'rank0', 'all' or an object with "
            f"select() -> RankSelection, got {policy!r}"
        )
    output_dir = options.get("output_dir")
    if "output_dir" in options and output_dir is not None:
        if not isinstance(output_dir, str | os.PathLike):
            raise TypeError(
                f"{owner}(output_dir=...) must be a path (str or os.PathLike) or None, got "
                f"{output_dir!r}"
            )
        if isinstance(output_dir, str) and not output_dir:
            raise ValueError(f"{owner}(output_dir='') is empty; pass a directory, or None")
    options_module.Options.of(options, owner)
    return dict(options)


def _written_to(sinks: Sequence[Sink]) -> Path | str | None:
    """Where the run's directory sink writes, resolved at open (its rank folder included): a
    ``Path`` on local disk, the URI on an object store; None without a directory sink."""
    directory = next((s for s in sinks if isinstance(s, DirectorySink)), None)
    if directory is None:
        return None
    location = directory.location
    return location.local_path if location.local_path is not None else location.uri


def _sinks(sink: object) -> list[Sink]:
    if sink is None:
        return []
    if isinstance(sink, Sequence) and not isinstance(sink, str | bytes):
        return list(sink)
    return [sink]  # type: ignore[list-item]  # inject_observer checks it is a Sink


class Attachment:
    """The observer of one training run: attached by :meth:`attach`, removed by
    :meth:`detach` (idempotent). A callback owns one and calls them from the trainer's events."""

    def __init__(
        self,
        options: Mapping[str, object],
        owner: str,
        *,
        hint: str = "",
        loss_trigger: object = None,
    ) -> None:
        self._owner = owner
        self._hint = hint
        self._options = check_options(options, owner)
        self.loss_spike: LossSpike | None = resolve_loss_trigger(loss_trigger, owner)
        """The test of :meth:`report_loss` (``loss_trigger=``); None: losses are not read."""
        self._model: nn.Module | None = None
        self._remove_counter: Callable[[], None] | None = None
        self._forwards = 0
        self.output_dir: Path | str | None = None
        """Where this process writes its directory artifacts (its ``rank-NNN`` folder under
        ``rank_policy="all"``): a ``Path`` on local disk, the URI (``s3://bucket/run/rank-001``)
        on an object store; None before attaching, when it writes no directory, or when this
        rank does not observe."""

    @property
    def attached(self) -> bool:
        """Whether an observer of this attachment is on the model now."""
        return self._model is not None

    def attach(
        self,
        model: nn.Module,
        *,
        default_dir: Path,
        rank: int,
        world_size: int,
        extra_sinks: Sequence[Sink] = (),
    ) -> None:
        """Attach an observer to ``model`` (``inject_observer`` with this attachment's options).

        ``default_dir``: ``output_dir`` unless the options give one (or a ``DirectorySink`` in
        ``sink=``). ``rank``/``world_size``: the trainer's; a named ``rank_policy`` becomes
        :class:`TrainerRanks`. ``extra_sinks`` are added to ``sink=``. Raises what
        ``inject_observer`` raises, before the model is touched; RuntimeError when attached.
        """
        if self._model is not None:
            raise RuntimeError(
                f"{self._owner} is already observing a model; one callback observes one "
                "training run at a time"
            )
        options = dict(self._options)
        sinks = _sinks(options.get("sink"))
        own_directory = next((s for s in sinks if isinstance(s, DirectorySink)), None)
        if "output_dir" not in options and own_directory is None:
            options["output_dir"] = default_dir
        policy = options.get("rank_policy", "rank0")
        if isinstance(policy, str):
            options["rank_policy"] = TrainerRanks(policy, rank, world_size)  # type: ignore[arg-type]
        if extra_sinks:
            options["sink"] = [*sinks, *extra_sinks]
        self.output_dir = None
        inject_observer(model, **options)
        if not has_observer(model):
            return  # this rank does not observe: nothing attached, nothing to remove
        if self.loss_spike is not None:
            self.loss_spike.reset()  # a new run: no history from an earlier one
        self._model = model
        self._forwards = 0
        self._remove_counter = model.register_forward_pre_hook(self._count).remove
        observer = observer_of(model)
        if observer is not None:
            self.output_dir = _written_to(observer.sinks.sinks)

    def report_loss(self, loss: float) -> Event | None:
        """Test a loss the trainer logged (:attr:`loss_spike`); when it fires, record a
        ``loss`` event with the reason and capture the next root forwards densely
        (``ti_core.trigger_capture``: the sentinel's ``dense_forwards``, else 4). Returns the
        event; None when nothing fired, without a loss trigger, or when nothing is attached."""
        detector, model = self.loss_spike, self._model
        if detector is None or model is None:
            return None
        reason = detector.check(loss)
        if reason is None:
            return None
        return trigger_capture(model, kind="loss", value=float(loss), reason=reason)

    def _count(self, module: nn.Module, args: object) -> None:
        self._forwards += 1

    def detach(self) -> None:
        """Remove the observer (finalizing its artifacts) and this attachment's hook; a no-op
        when nothing is attached. Warns when the model was never called while attached."""
        model, self._model = self._model, None
        if model is None:
            return
        remover, self._remove_counter = self._remove_counter, None
        try:
            if remover is not None:
                remover()
        finally:
            remove_observer(model)
        if self._forwards == 0:
            warnings.warn(
                f"{self._owner}: {type(model).__name__} was never called while it was observed, "
                "so nothing was recorded: the observer samples calls of the observed module "
                f"itself (root forwards). {self._hint}".rstrip(),
                NothingObservedWarning,
                stacklevel=2,
            )
