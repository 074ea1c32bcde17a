"""What the scripts here share: the dtype `auto` picks on this machine, the heading that names the machine and
the dtype in every report, table and plot, and llama.cpp's greedy on a GGUF. A speed means little without the
machine and the dtype: bf16 runs at about half fp32's speed on a CPU that emulates it, where `auto` picks fp32."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch

from blockdecode.bench.methods import Run
from blockdecode.bench.report import cpu_name
from blockdecode.core.hf import DTYPE_CHOICES, dtype_name
from blockdecode.core.io import save_figure

RESULTS = Path(__file__).parent / "results"


def dtype_flag(p: argparse.ArgumentParser, what: str = "the dtype timed") -> None:
    """`--dtype`, defaulting to what the package picks here (`blockdecode.core.hf.dtype_for` reads it)."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=f"{what}; auto: bf16 where native, else fp32")


def machine(device: str = "cpu") -> str:
    """The CPU's model name and torch's kernels on it (AVX2 has no native bf16; AVX512 may), or the GPU's name."""
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)} (host {cpu_name()})"
    return f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})"


def heading(model: str, dtype: torch.dtype | Sequence[torch.dtype], device: str = "cpu", **settings) -> dict:
    """What every report opens with: the model, the machine, the dtype (or dtypes) it ran in, then the study's own
    `settings` (threads among them where one count is used)."""
    dtypes = [dtype] if isinstance(dtype, torch.dtype) else list(dtype)
    return {"model": model, "machine": machine(device), "dtype": "/".join(map(dtype_name, dtypes)), **settings}


def title(report: dict, threads: int | str | None = None) -> str:
    """One line naming a `heading`'s conditions, for a plot or a table: model, dtype, threads and machine."""
    threads = threads or report.get("threads")
    count = f", {threads} thread{'s' * (int(threads) != 1)}" if isinstance(threads, int | str) else ""
    return f"{report['model']}, {report['dtype']}{count}; {report['machine']}"


def plot_bars(report: dict, groups: list[str], bars: dict[str, list[float]], ylabel: str, what: str, png: Path,
              size: tuple[float, float] = (8, 4), **ticks) -> None:  # fmt: skip
    """A study's grouped bars: for each label of `bars`, a bar in every group, a line at 1.0; titled with `what`
    and the report's `title`. `ticks`: how the groups' names are set (matplotlib's text options)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    width = 0.8 / len(bars)
    for j, (label, values) in enumerate(bars.items()):
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(groups))], groups, **ticks)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{what}\n{title(report)}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def llama_cpp_run(path: Path, threads: int, context: int, lookup: bool = False) -> Callable[..., Run]:
    """llama.cpp's greedy continuation (temperature 0) of token ids on the GGUF itself, `run(ids, new_tokens,
    stop=())`, ending after a token of `stop` (the model's EOS ids) if one comes; `lookup`: with llama-cpp-python's
    prompt-lookup draft of 10 tokens, verified by the engine in one batch. Each run starts from an empty cache, so
    that its prefill is timed as every other engine's is (llama-cpp-python would keep the prefix it saw last)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    llm = Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False,
                draft_model=draft, logits_all=lookup)  # fmt: skip

    def run(ids: torch.LongTensor, new_tokens: int, stop: Collection[int] = ()) -> Run:
        start = time.perf_counter()
        llm.reset()
        out = []
        for token in llm.generate(ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out.append(token)
            if len(out) == new_tokens or token in stop:
                break
        return Run(out, time.perf_counter() - start, calls=len(out))

    return run


def llama_cpp_call_cost(path: Path, threads: int, context: int, prompt: list[int], qs: Collection[int],
                        reps: int = 5) -> dict[int, float]:  # fmt: skip
    """t(q): seconds of one llama.cpp call of q new tokens over `prompt` already in its cache, with the logits of
    all q (what verifying q tokens needs), the median of `reps`, the q's taken in turn each round after a warm-up
    round; as `decoding.timing.forward_cost` times `transformers`' forward."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False,
                logits_all=True)  # fmt: skip
    samples: dict[int, list[float]] = {q: [] for q in qs}
    for rep in range(reps + 1):
        for q in qs:
            llm.reset()
            llm.eval(prompt)
            start = time.perf_counter()
            llm.eval((prompt * q)[:q])  # any q tokens: a call costs the same whatever they are
            if rep:
                samples[q].append(time.perf_counter() - start)
    return {q: statistics.median(samples[q]) for q in qs}
