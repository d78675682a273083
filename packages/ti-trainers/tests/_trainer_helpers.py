"""Shared by the ti-trainers tests: what "a clean model" means, and reading a run back."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from torch import nn

from ti_core import has_observer

HookCounts = dict[str, tuple[int, int, int, int, bool]]


def hook_counts(model: nn.Module) -> HookCounts:
    """Per module: forward pre-hooks, forward hooks, backward hooks, backward pre-hooks, and
    whether it has an instance ``forward``. Compared before and after training."""
    return {
        name: (
            len(module._forward_pre_hooks),
            len(module._forward_hooks),
            len(module._backward_hooks),
            len(module._backward_pre_hooks),
            "forward" in module.__dict__,
        )
        for name, module in model.named_modules()
    }


def assert_clean(model: nn.Module, before: HookCounts) -> None:
    """No observer and exactly the hooks the model had before it was observed."""
    assert not has_observer(model)
    after = hook_counts(model)
    changed = {
        n: (before.get(n), after.get(n)) for n in {*before, *after} if before.get(n) != after.get(n)
    }
    assert not changed, f"hooks differ (before, after): {changed}"
    assert not any("_ti_observer" in m.__dict__ for m in model.modules())


def history(run_dir: Path) -> pl.DataFrame:
    return pl.read_parquet(run_dir / "history.parquet")
