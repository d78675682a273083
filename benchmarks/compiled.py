"""Cost of ti-core's observer inside ``torch.compile(fullgraph=True)`` (CPU, inductor).

One process per (workload, configuration): it builds the bare model and the observed model,
compiles both with ``torch.compile(fullgraph=True)`` (inductor), then alternates short timed
blocks of bare steps and observed steps (order flipped every pair) and reports the median of
the per-pair ratios: both see the same machine state (separate processes on a shared machine
drift by more than the 5% being judged). A step is forward + ``.sum().backward()``. Wall clock
and process CPU time are both reported (CPU time includes the emission worker's reductions).

Each model gets its own copy of its ``forward`` code object, so Dynamo keeps a separate cache
per model and the bare model never walks the observed model's cache entries. Every compile is
cold (a fresh inductor cache directory per process, on-disk caches off).

    python benchmarks/compiled.py                                   # everything
    python benchmarks/compiled.py --workloads mlp --configs compile-first --pairs 15

Configurations: ``aa`` times a second bare copy against the first (the noise floor of the
ratios); ``compile-first`` observes the ``OptimizedModule``; ``inject-first`` compiles the
observed module; both sample forward 0 only (in the warmup), so every timed step is unsampled;
``every`` (compile-first) samples every forward; ``sentinel`` (compile-first, unsampled) adds
the flight recorder's dense mode (``Sentinel(mode="dense")``), its non-finite check in every
forward's graph; ``sentinel-outputs`` checks the outputs only
(``Sentinel(signals=("output",), mode="dense")``), which separates the two checks' costs;
``replay`` is the default sentinel (replay mode: checks at the root, nothing in the graph).
Every other configuration runs without the sentinel (``sentinel=False``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

CONFIGS = (
    "aa",
    "compile-first",
    "inject-first",
    "every",
    "sentinel",
    "sentinel-outputs",
    "replay",
)
WORKLOADS = ("mlp", "block")
DESCRIPTIONS = {
    "mlp": "8 x (Linear(128,128) + in-place ReLU) + Linear(128,16), input (64,128), 17 leaves",
    "block": "pre-norm transformer block d=128, 4 heads, MLP 256, input (4,32,128), 7 leaves",
}


def _build(name: str) -> tuple[Any, tuple[int, ...]]:
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812  (the usual alias)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(
                *[nn.Sequential(nn.Linear(128, 128), nn.ReLU(inplace=True)) for _ in range(8)]
            )
            self.head = nn.Linear(128, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            b, t, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, d)), None

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(128)
            self.attn = Attention(128, 4)
            self.ln2 = nn.LayerNorm(128)
            self.mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))[0]
            return x + self.mlp(self.ln2(x))

    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), (64, 128)
    if name == "block":
        return Block(), (4, 32, 128)
    raise ValueError(f"unknown workload {name!r}; use one of {WORKLOADS}")


def _own_code(model: Any, tag: str) -> Any:
    """Give ``model`` a class whose ``forward`` has its own code object (own Dynamo cache)."""
    cls = type(model)
    forward = cls.forward
    code = forward.__code__.replace(co_name=f"forward_{tag.replace('-', '_')}")
    clone = types.FunctionType(
        code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__
    )
    model.__class__ = type(f"{cls.__name__}_{tag}", (cls,), {"forward": clone})
    return model


def _block(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """Per-step (wall, process CPU) seconds of ``steps`` steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def one(workload: str, config: str, pairs: int, steps: int) -> dict[str, Any]:
    """Measure one configuration of one workload in this process."""
    import copy

    import torch
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    import ti_core
    from ti_core import AlwaysSampler, EveryNForwardsSampler, MemorySink

    torch.set_num_threads(1)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Every compile cold: the unsampled variant of an observed model is the bare graph, which
    # the on-disk caches would otherwise serve.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    warm = torch.randn(3, requires_grad=True)  # inductor's one-time start, before any timing
    torch.compile(lambda t: (t * 2).sum(), fullgraph=True)(warm).backward()
    base, shape = _build(workload)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    bare = torch.compile(_own_code(copy.deepcopy(base), "bare"), fullgraph=True)
    model = _own_code(copy.deepcopy(base), config)
    sampler = AlwaysSampler() if config == "every" else EveryNForwardsSampler(10**9)
    sink = MemorySink()
    options: dict[str, Any] = {"output_dir": None, "sink": sink, "sampler": sampler}
    options["sentinel"] = {
        "sentinel": ti_core.Sentinel(mode="dense"),
        "sentinel-outputs": ti_core.Sentinel(signals=("output",), mode="dense"),
        "replay": True,
    }.get(config, False)
    if config == "aa":
        target = observed = torch.compile(model, fullgraph=True)
    elif config == "inject-first":
        ti_core.inject_observer(model, **options)
        target, observed = torch.compile(model, fullgraph=True), model
    else:
        target = observed = torch.compile(model, fullgraph=True)
        ti_core.inject_observer(target, **options)

    def bare_step() -> None:
        bare(x).sum().backward()

    def observed_step() -> None:
        target(x).sum().backward()

    result: dict[str, Any] = {"workload": workload, "config": config}
    for name, step in (("bare", bare_step), ("observed", observed_step)):
        before = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        start = time.perf_counter()
        step()
        step()  # unsampled configurations: forward 1 compiles the unsampled variant
        result[f"{name}_first_two_steps_s"] = round(time.perf_counter() - start, 2)
        for _ in range(3):
            step()
        result[f"{name}_graphs"] = counters["stats"]["unique_graphs"] - before
        result[f"{name}_graph_breaks"] = sum(counters["graph_break"].values()) - breaks
    graphs_before = counters["stats"]["unique_graphs"]
    bare_t: list[tuple[float, float]] = []
    obs_t: list[tuple[float, float]] = []
    for i in range(pairs):
        order = [(bare_step, bare_t), (observed_step, obs_t)]
        if i % 2:
            order.reverse()
        for step, times in order:
            times.append(_block(step, steps))
    result["recompiles_while_timed"] = counters["stats"]["unique_graphs"] - graphs_before
    for k, clock in enumerate(("wall", "cpu")):
        ratios = [o[k] / b[k] for b, o in zip(bare_t, obs_t, strict=True)]
        result[f"{clock}_bare_step_us"] = round(statistics.median(b[k] for b in bare_t) * 1e6, 1)
        result[f"{clock}_observed_step_us"] = round(statistics.median(o[k] for o in obs_t) * 1e6, 1)
        result[f"{clock}_ratio_median"] = round(statistics.median(ratios), 4)
        q = statistics.quantiles(ratios, n=4)
        result[f"{clock}_ratio_q1_q3"] = [round(q[0], 4), round(q[2], 4)]
    if config != "aa":
        ti_core.remove_observer(observed)
        result["rows"] = sink.table().num_rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0, help="steps per block (0: per workload)")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        workload, config = args.one
        steps = args.steps or {"mlp": 50, "block": 20}[workload]
        if config == "every":
            steps = max(5, steps // 5)
        print(json.dumps(one(workload, config, args.pairs, steps)), flush=True)
        return
    for workload in args.workloads.split(","):
        for config in args.configs.split(","):
            env = dict(os.environ)
            with tempfile.TemporaryDirectory() as cache:
                env["TORCHINDUCTOR_CACHE_DIR"] = cache  # nothing from earlier runs either
                cmd = [sys.executable, __file__, "--one", workload, config]
                cmd += ["--pairs", str(args.pairs), "--steps", str(args.steps)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not lines:
                print(f"{workload} {config}: failed\n{out.stderr[-3000:]}", flush=True)
                continue
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
