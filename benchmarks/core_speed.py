#!/usr/bin/env python
"""Core speed benchmark: does blockwise decoding turn its block size into wall-clock speed?

One process, one random-weight GPT-2-small-sized model per dtype, the same seeded prompts for
every method. For each dtype it measures

1. t(q): one forward pass of q new tokens over a fixed context already in the KV cache
   (q = 1..max_q, dynamic and static cache, median of several reps after a warm-up; the cache is
   cropped back after every pass so the context never grows), and the prefill of a prompt;
2. the reference: transformers' greedy `generate` (EOS cleared, so it always makes --new-tokens);
3. `blockwise_generate` with a perfect ScriptedDrafter built from the reference, at block size k,
   with the dynamic and the static cache; every (prompt, repeat) runs all methods back to back in
   a rotated order, so machine drift hits both sides of each pair; speedup = median over pairs of
   t_greedy / t_blockwise. In low precision a k-token pass can break a near tie differently from
   generate()'s 1-token pass; the drafter is then off-track and the mean block shows it (reported
   as is). For such a cache a '+self' method is added: the drafter scripted from blockwise's own
   fixed-point output, i.e. a perfect drafter for the blockwise decoder, to measure the loop at
   full blocks in that dtype too;
4. the target: predicted = mean_block_size * t(1) / t(k); efficiency = speedup / predicted >= 0.9.
   pred*/effic* repeat it with the pass-by-pass model (prefill + sum of t(q) of the passes made).

It also splits one run per method into forward time (timed inside the run) and loop overhead.
On a CPU shared with other jobs, each timed run records how much CPU other processes used; groups
that overlapped foreign work are re-run (bounded by --retries/--quiet-budget) and flagged.

    .venv/bin/python benchmarks/core_speed.py            # full run (GPT-2 small, fp32 + bf16), ~4 min on 2 cores
    .venv/bin/python benchmarks/core_speed.py --quick    # tiny model, a few s: checks the plumbing
    .venv/bin/python benchmarks/core_speed.py --device cuda --dtypes fp32,bf16,fp16
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from blockdecode import ScriptedDrafter, blockwise_generate
from blockdecode.bench import cpu_name
from blockdecode.toy import toy_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHES_ALL = ("dynamic", "static")
CACHES = CACHES_ALL  # narrowed in main() to what this transformers supports


def croppable_caches() -> tuple[str, ...]:
    """The cache implementations this transformers can roll back (StaticLayer.crop is recent in 5.x)."""
    from transformers import cache_utils

    static_layer = getattr(cache_utils, "StaticLayer", None)
    return CACHES_ALL if static_layer is not None and hasattr(static_layer, "crop") else ("dynamic",)


TARGET_EFFICIENCY = 0.9
QUICK = dict(
    layers=2, width=128, heads=4, vocab=2048, new_tokens=32, prompts=2, repeats=2, fwd_reps=3, context=64, max_q=8
)


# ----------------------------------------------------------------------------- plumbing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens: a plumbing check (~10 s)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default 2 on cpu)")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, from {','.join(DTYPES)}")
    p.add_argument("--k", type=int, default=8, help="block size (head 1 included)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default 128)")
    p.add_argument("--prompts", type=int, default=None, help="number of random prompts (default 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats over all prompts (default 2)")
    p.add_argument("--context", type=int, default=None, help="tokens in the cache when timing t(q) (default 200)")
    p.add_argument("--max-q", type=int, default=None, help="largest q timed for t(q) (default 16, at least k)")
    p.add_argument("--fwd-reps", type=int, default=None, help="timed reps per q for t(q) (default 7)")
    p.add_argument("--layers", type=int, default=None, help="model depth (default 12)")
    p.add_argument("--width", type=int, default=None, help="model width (default 768)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 12)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 50257)")
    p.add_argument("--positions", type=int, default=1024, help="n_positions of the model")
    p.add_argument("--std", type=float, default=0.15, help="std of the random 2-D weights (varied greedy text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--noise-cores",
        type=float,
        default=None,
        help="a run is 'contended' if other processes used more cores than this on average\n"
        "(default: the cores our threads leave free + 0.1)",
    )
    p.add_argument(
        "--self-drafter",
        choices=("auto", "always", "never"),
        default="auto",
        help="also time a drafter scripted from blockwise's own fixed-point output\n"
        "(auto: for a cache whose output differed from generate()'s)",
    )
    p.add_argument("--self-iters", type=int, default=40, help="max rounds to find that fixed point")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each measurement wait up to this many s for other processes to go quiet (default 20 on cpu)",
    )
    p.add_argument("--quiet-budget", type=float, default=180, help="total quiet-waiting allowed per dtype, s")
    p.add_argument("--retries", type=int, default=None, help="re-runs of contended measurements per dtype (default 8)")
    p.add_argument("--profile", action="store_true", help="also cProfile one blockwise run per dtype and cache")
    p.add_argument("--out", default=None, help="JSON results path (default benchmarks/results/core_speed[_quick].json)")
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm bars")
    args = p.parse_args(argv)

    defaults = dict(
        layers=12, width=768, heads=12, vocab=50257, new_tokens=128, prompts=4, repeats=2, fwd_reps=7, context=200
    )
    if args.quick:
        defaults.update(QUICK)
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.max_q is None:
        args.max_q = defaults.get("max_q", 16)
    args.max_q = max(args.max_q, args.k)
    if args.out is None:
        args.out = f"benchmarks/results/core_speed{'_quick' if args.quick else ''}.json"
    args.dtype_names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtype_names if d not in DTYPES]
    if unknown:
        p.error(f"unknown dtype(s) {unknown}; choose from {list(DTYPES)}")
    if args.k < 1 or args.new_tokens < 2 or args.prompts < 1 or args.repeats < 1:
        p.error("need k >= 1, new-tokens >= 2, prompts >= 1, repeats >= 1")
    if args.width % args.heads:
        p.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.prompt_len + args.new_tokens > args.positions or args.context + args.max_q > args.positions:
        p.error("prompt-len + new-tokens and context + max-q must fit in --positions")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    """(fn(), wall seconds), with the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """How much CPU *other* processes burnt while we timed something: on a machine shared with
    other jobs (and with our threads pinned to every core, OpenMP barriers stall badly when a core
    is taken), a run that overlapped foreign work is not a clean measurement."""

    def __enter__(self):
        self.busy, self.own, self.wall = busy_cpu_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy = busy_cpu_seconds()
        wall = time.perf_counter() - self.wall
        own = time.process_time() - self.own
        self.seconds = None if busy is None or self.busy is None else max(0.0, busy - self.busy - own)
        self.cores = None if self.seconds is None else self.seconds / wall  # foreign cores busy on average
        self.wall = wall
        return False

    def contended(self, cores: float) -> bool:
        # /proc/stat counts in jiffies (~10 ms): allow a few of them of slack on short intervals.
        return self.seconds is not None and self.seconds - 0.03 > cores * self.wall


class Quiet:
    """On a machine shared with other jobs: before a measurement, wait (a bounded time) for the other
    processes to go quiet, and say whether a retry of a contended measurement is still affordable."""

    def __init__(self, args):
        self.args, self.waited, self.retried = args, 0.0, 0

    def wait(self) -> None:
        budget = min(self.args.quiet_wait, self.args.quiet_budget - self.waited)
        start = time.perf_counter()
        while time.perf_counter() - start < budget:
            with ForeignLoad() as load:
                time.sleep(0.5)
            if not load.contended(self.args.noise_cores):
                break
        self.waited += time.perf_counter() - start

    def retry(self) -> bool:
        if self.retried >= self.args.retries or self.waited >= self.args.quiet_budget:
            return False
        self.retried += 1
        return True


def write_json(path: Path, data: dict) -> None:
    """Atomic: a temp file in the same directory, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def text_quality(new_tokens: list[int]) -> dict:
    """Is a greedy continuation varied, or a degenerate repeat?"""
    longest = run = 1
    for a, b in zip(new_tokens, new_tokens[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    tail = new_tokens[-min(32, len(new_tokens)) :]
    period = next(
        (p for p in range(1, 9) if len(tail) >= 2 * p and all(tail[i] == tail[i + p] for i in range(len(tail) - p))),
        None,
    )
    distinct = len(set(new_tokens)) / len(new_tokens)
    return {
        "distinct_fraction": round(distinct, 3),
        "longest_run": longest,
        "tail_period": period,
        "degenerate": bool(distinct < 0.25 or period is not None),
    }


# ----------------------------------------------------------------------------- measurements


def make_cache(model, impl: str, max_len: int):
    if impl == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=max_len)


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x: the name this model's forward takes
    (a wrong name would be swallowed by **kwargs and every pass would run without its context)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def forward_costs(model, args, device, bar) -> dict:
    """t(q) for q = 1..max_q over `context` cached tokens, per cache type; and the prefill cost."""
    name = cache_kwarg(model)
    g = torch.Generator().manual_seed(args.seed + 12345)
    ctx = torch.randint(0, args.vocab, (1, args.context), generator=g).to(device)
    new = torch.randint(0, args.vocab, (1, args.max_q), generator=g).to(device)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=g).to(device)
    qs = list(range(1, args.max_q + 1))
    samples = {impl: {q: [] for q in qs} for impl in CACHES}
    prefill = {impl: [] for impl in CACHES}
    caches = {}
    for impl in CACHES:
        cache = make_cache(model, impl, args.context + args.max_q)
        model(input_ids=ctx, use_cache=True, logits_to_keep=1, **{name: cache})
        caches[impl] = cache
    # Reps outermost and q, cache interleaved inside: slow drift of the machine hits every q alike.
    for rep in range(-1, args.fwd_reps):  # rep -1 is the warm-up
        for impl in CACHES:
            cache = caches[impl]
            for q in qs:
                # logits_to_keep=0: all q logits, as the blockwise verify pass computes them.
                _, dt = timed(lambda: model(input_ids=new[:, :q], use_cache=True, **{name: cache}), device)  # noqa: B023
                cache.crop(-q)
                if rep >= 0:
                    samples[impl][q].append(dt)
                bar.update(1)
            fresh = make_cache(model, impl, args.prompt_len + args.new_tokens)
            _, dt = timed(lambda: model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{name: fresh}), device)  # noqa: B023
            if rep >= 0:
                prefill[impl].append(dt)
    for impl in CACHES:
        length = int(caches[impl].get_seq_length())
        assert length == args.context, f"{impl} cache drifted to {length} tokens"
    out = {}
    for impl in CACHES:
        t1 = median(samples[impl][1])
        out[impl] = {
            "q": qs,
            "ms": [1000 * median(samples[impl][q]) for q in qs],
            "ratio": [median(samples[impl][q]) / t1 for q in qs],
            "ms_min": [1000 * min(samples[impl][q]) for q in qs],
            "ms_all": [[round(1000 * s, 3) for s in samples[impl][q]] for q in qs],
            "prefill_ms": 1000 * median(prefill[impl]),
        }
    return out


def greedy(model, ids, args):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1, max_new_tokens=args.new_tokens
    )


def blockwise(model, ids, reference, impl, args):
    drafter = ScriptedDrafter(reference.cpu(), accuracy=1.0, vocab_size=args.vocab)
    return blockwise_generate(model, ids, args.new_tokens, drafter, args.k, eos_token_id=[], cache_implementation=impl)


def split_method(method: str) -> tuple[str, str]:
    """'static+self' -> ('static', 'self'); 'dynamic' -> ('dynamic', 'greedy')."""
    impl, _, source = method.partition("+")
    return impl, source or "greedy"


def pass_sizes(args, block_sizes: list[int]) -> list[int]:
    """q of every verify pass the loop made (1 newest token + n proposals), from its block sizes."""
    total = args.prompt_len + args.new_tokens
    length = args.prompt_len + 1  # after the prefill
    sizes = []
    for gained in block_sizes:
        sizes.append(1 + min(args.k - 1, total - length - 1))
        length += gained
    return sizes


def first_divergence(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> int | None:
    a, b = a.reshape(-1).tolist(), b.reshape(-1).tolist()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i - prompt_len
    return None if len(a) == len(b) else min(len(a), len(b)) - prompt_len


def self_reference(model, ids, first: torch.Tensor, impl: str, args) -> tuple[torch.Tensor, int, bool]:
    """A continuation that blockwise decoding reproduces exactly when the drafter proposes it.

    In low precision a k-token pass can pick another argmax than the 1-token pass generate() made
    (a near tie), and a drafter built from generate()'s text is useless after that point. Feeding
    blockwise its own output back as the script moves the first disagreement strictly later each
    round (the passes before it are the same, so the same numbers come out), until a fixed point:
    a perfect drafter for *this* decoder, to measure the loop at full blocks in any dtype."""
    ref = first
    for rounds in range(1, args.self_iters + 1):
        out = blockwise(model, ids, ref, impl, args).sequences
        if torch.equal(out.cpu(), ref.cpu()):
            return ref, rounds, True
        ref = out
    return ref, args.self_iters, False


class ForwardTimer:
    """Time every forward call of `model` inside a run (device drained at both ends of each), so a
    run's wall time splits into model forwards and everything else, measured in the same run."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.seconds, self.calls, self._t0 = 0.0, 0, 0.0

    def _pre(self, *_):
        sync(self.device)
        self._t0 = time.perf_counter()

    def _post(self, *_):
        sync(self.device)
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def __enter__(self):
        self.handles = [self.model.register_forward_pre_hook(self._pre), self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def profile_blockwise(model, ids, reference, impl, args, top: int = 22) -> str:
    prof = cProfile.Profile()
    prof.enable()
    blockwise(model, ids, reference, impl, args)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def run_method(model, method, ids, p, refs, args, device):
    """One timed run of `method` on prompt p: (sequences, stats or None, seconds)."""
    if method == "greedy":
        with torch.inference_mode():
            out, dt = timed(lambda: greedy(model, ids, args), device)
        return out, None, dt
    impl, source = split_method(method)
    out, dt = timed(lambda: blockwise(model, ids, refs[source][impl][p], impl, args), device)
    return out.sequences, out.stats, dt


def bench_dtype(name: str, args, device: torch.device, prompts: list[torch.Tensor], progress: bool) -> dict:
    dtype = DTYPES[name]
    model = toy_model(
        "gpt2",
        seed=args.seed,
        std=args.std,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        vocab=args.vocab,
        context=args.positions,
    ).to(device=device, dtype=dtype)
    # No EOS anywhere: generate fills unset values from the model's generation config, so clear it there.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    n = len(prompts)
    bar = tqdm(
        total=(args.fwd_reps + 1) * 2 * args.max_q + 4 * n + (args.repeats * n + 1) * 3,  # grows with '+self'
        desc=name,
        disable=not progress,
        leave=False,
        file=sys.stderr,
    )
    load_start = loadavg()

    # Warm-up + references: greedy on every prompt (untimed), then blockwise on every prompt and cache.
    greedy_refs, quality = [], []
    with torch.inference_mode():
        for ids in prompts:
            ref = greedy(model, ids, args)
            assert ref.shape[1] == args.prompt_len + args.new_tokens, f"generate stopped early: {tuple(ref.shape)}"
            greedy_refs.append(ref)
            quality.append(text_quality(ref[0, args.prompt_len :].tolist()))
            bar.update(1)
    refs = {"greedy": {impl: greedy_refs for impl in CACHES}, "self": {}}
    warm = {impl: [] for impl in CACHES}
    for impl in CACHES:
        for p, ids in enumerate(prompts):
            warm[impl].append(blockwise(model, ids, greedy_refs[p], impl, args).sequences)
            bar.update(1)
    methods = ["greedy", *CACHES]
    self_info = {}
    for impl in CACHES:
        needed = any(not torch.equal(w.cpu(), r.cpu()) for w, r in zip(warm[impl], greedy_refs))
        if args.self_drafter == "always" or (args.self_drafter == "auto" and needed):
            found = [self_reference(model, ids, warm[impl][p], impl, args) for p, ids in enumerate(prompts)]
            refs["self"][impl] = [f[0] for f in found]
            self_info[impl] = {"rounds": [f[1] for f in found], "converged": [f[2] for f in found]}
            methods.append(f"{impl}+self")
    bar.total += (args.repeats * n + 1) * (len(methods) - 3)
    bar.update(n)

    quiet = Quiet(args)
    while True:
        quiet.wait()
        with ForeignLoad() as load:
            costs = forward_costs(model, args, device, bar)
        if not (load.contended(args.noise_cores) and quiet.retry()):
            break
    costs["foreign_cores"] = load.cores

    # One instrumented run per method (prompt 0): forward time measured inside the run itself.
    split = {}
    for method in methods:
        while True:
            quiet.wait()
            with ForeignLoad() as load, ForwardTimer(model, device) as fwd:
                seq, stats, dt = run_method(model, method, prompts[0], 0, refs, args, device)
            if not (load.contended(args.noise_cores) and quiet.retry()):
                break
        split[method] = {
            "contended": load.contended(args.noise_cores),
            "wall_ms": 1000 * dt,
            "forward_ms": 1000 * fwd.seconds,
            "forward_calls": fwd.calls,
            "overhead_ms": 1000 * (dt - fwd.seconds),
            "overhead_ms_per_call": 1000 * (dt - fwd.seconds) / fwd.calls,
        }
    bar.update(len(methods))

    def run_group(rep: int, p: int, ids: torch.Tensor) -> list[dict]:
        """Every method once on prompt p, in an order rotated by (rep + p): no method always runs first."""
        shift = (rep + p) % len(methods)
        group = []
        for method in methods[shift:] + methods[:shift]:
            with ForeignLoad() as load:
                seq, stats, dt = run_method(model, method, ids, p, refs, args, device)
            div = first_divergence(seq.cpu(), greedy_refs[p].cpu(), args.prompt_len)
            run = {
                "repeat": rep,
                "prompt": p,
                "method": method,
                "seconds": dt,
                "new_tokens": seq.shape[1] - args.prompt_len,
                "tokens_per_second": (seq.shape[1] - args.prompt_len) / dt,
                "identical": div is None,
                "first_divergence": div,
                "foreign_cores": load.cores,
                "contended": load.contended(args.noise_cores),
            }
            if stats is not None:
                impl, _ = split_method(method)
                sizes = pass_sizes(args, stats.block_sizes)
                run.update(
                    calls=stats.calls,
                    mean_block_size=stats.mean_block_size,
                    block_sizes=stats.block_sizes,
                    internal_seconds=stats.seconds,
                    model_ms=costs[impl]["prefill_ms"] + sum(costs[impl]["ms"][q - 1] for q in sizes),
                )
            else:
                run.update(
                    calls=args.new_tokens,
                    mean_block_size=1.0,
                    model_ms=costs["dynamic"]["prefill_ms"] + (args.new_tokens - 1) * costs["dynamic"]["ms"][0],
                )
            run["overhead_ms"] = 1000 * dt - run["model_ms"]
            group.append(run)
            bar.update(1)
        return group

    runs, discarded = [], []
    for rep in range(args.repeats):
        for p, ids in enumerate(prompts):
            while True:
                quiet.wait()
                group = run_group(rep, p, ids)
                if not (any(r["contended"] for r in group) and quiet.retry()):
                    break
                discarded.extend(group)  # other processes took cores during this group: run it again
            base = next(r for r in group if r["method"] == "greedy")
            for r in group:
                if r is not base:
                    r["speedup"] = base["seconds"] / r["seconds"]
                    r["clean_pair"] = not (r["contended"] or base["contended"])
            runs.extend(group)
    bar.close()

    profiles = {}
    if args.profile:
        for method in methods[1:]:
            impl, source = split_method(method)
            profiles[method] = profile_blockwise(model, prompts[0], refs[source][impl][0], impl, args)

    return {
        "dtype": name,
        "methods": methods,
        "load_avg_start": load_start,
        "load_avg_end": loadavg(),
        "reference_quality": quality,
        "self_reference": self_info,
        "forward_costs": costs,
        "split": split,
        "runs": runs,
        "discarded_contended_runs": discarded,
        "quiet_waited_s": quiet.waited,
        "summary": summarize(args, costs, runs, methods),
        "profiles": profiles,
    }


def summarize(args, costs: dict, runs: list[dict], methods: list[str]) -> dict:
    k = args.k
    t1 = costs["dynamic"]["ms"][0]  # greedy generate runs on a dynamic cache
    greedy_runs = [r for r in runs if r["method"] == "greedy"]
    greedy_model = {(g["repeat"], g["prompt"]): g["model_ms"] for g in greedy_runs}
    out = {
        "greedy": {
            "tokens_per_second": median([r["tokens_per_second"] for r in greedy_runs]),
            "seconds": median([r["seconds"] for r in greedy_runs]),
            "calls": args.new_tokens,
            "model_ms": median([r["model_ms"] for r in greedy_runs]),
            "overhead_ms": median([r["overhead_ms"] for r in greedy_runs]),
            "identical": all(r["identical"] for r in greedy_runs),
            "contended_runs": sum(r["contended"] for r in greedy_runs),
        }
    }
    for method in methods[1:]:
        impl, _ = split_method(method)
        rs = [r for r in runs if r["method"] == method]
        clean = [r for r in rs if r["clean_pair"]]
        tk = costs[impl]["ms"][k - 1]
        mean_block = statistics.fmean(r["mean_block_size"] for r in rs)
        speedup = median([r["speedup"] for r in rs])
        predicted = mean_block * t1 / tk
        # Refined: the same pass-by-pass model, prefill and the short last pass included, on both sides.
        refined = median([greedy_model[r["repeat"], r["prompt"]] / r["model_ms"] for r in rs])
        out[method] = {
            "t1_ms": costs[impl]["ms"][0],
            "tk_ms": tk,
            "tk_over_t1": tk / t1,
            "tokens_per_second": median([r["tokens_per_second"] for r in rs]),
            "seconds": median([r["seconds"] for r in rs]),
            "calls": median([r["calls"] for r in rs]),
            "mean_block_size": mean_block,
            "speedup": speedup,
            "predicted": predicted,
            "efficiency": speedup / predicted,
            "meets_target": speedup / predicted >= TARGET_EFFICIENCY,
            "predicted_refined": refined,
            "efficiency_refined": speedup / refined,
            "model_ms": median([r["model_ms"] for r in rs]),
            "overhead_ms": median([r["overhead_ms"] for r in rs]),
            "clean_pairs": f"{len(clean)}/{len(rs)}",
            "speedup_clean": median([r["speedup"] for r in clean]),
            "efficiency_clean": median([r["speedup"] for r in clean]) / predicted,
            "identical": all(r["identical"] for r in rs),
            "identical_runs": f"{sum(r['identical'] for r in rs)}/{len(rs)}",
            "first_divergences": sorted({r["first_divergence"] for r in rs if r["first_divergence"] is not None}),
        }
    return out


# ----------------------------------------------------------------------------- report


def print_tables(args, results: list[dict]) -> None:
    k = args.k
    print(f"\n== t(q): one forward of q new tokens over {args.context} cached tokens (median ms; ratio to q=1) ==")
    print(f"{'q':>3}" + "".join(f"  {r['dtype'] + '/' + impl:>22}" for r in results for impl in CACHES))
    for i in range(args.max_q):
        row = f"{i + 1:>3}"
        for r in results:
            for impl in CACHES:
                c = r["forward_costs"][impl]
                row += f"  {c['ms'][i]:>11.2f} ms ×{c['ratio'][i]:>6.2f}"
        print(row)
    row = "pre"
    for r in results:
        for impl in CACHES:
            row += f"  {r['forward_costs'][impl]['prefill_ms']:>11.2f} ms {'':>7}"
    print(row + f"   (prefill of a {args.prompt_len}-token prompt)")

    print(f"\n== speed: k={k}, {args.new_tokens} new tokens, {args.prompts} prompts × {args.repeats} repeats ==")
    cols = (
        f"{'dtype':<5} {'method':<12} {'t(1)ms':>7} {'t(k)/t(1)':>9} {'greedy/s':>9} {'block/s':>8} {'mean blk':>8} "
        f"{'speedup':>7} {'predict':>7} {'effic':>6} {'target':>6} {'pred*':>6} {'effic*':>6} {'identical':>9}"
    )
    print(cols)
    print("-" * len(cols))
    for r in results:
        s = r["summary"]
        for method in r["methods"][1:]:
            x = s[method]
            print(
                f"{r['dtype']:<5} {method:<12} {s['dynamic']['t1_ms']:>7.2f} {x['tk_over_t1']:>9.3f} "
                f"{s['greedy']['tokens_per_second']:>9.1f} {x['tokens_per_second']:>8.1f} {x['mean_block_size']:>8.3f} "
                f"{x['speedup']:>7.3f} {x['predicted']:>7.3f} {x['efficiency']:>6.3f} "
                f"{'PASS' if x['meets_target'] else 'FAIL':>6} {x['predicted_refined']:>6.3f} "
                f"{x['efficiency_refined']:>6.3f} {x['identical_runs']:>9}"
            )
    print(
        "method: cache implementation; '+self' = drafter scripted from blockwise's own fixed-point output instead of\n"
        "generate()'s (only run when low-precision near-ties made the outputs differ).\n"
        "t(1) = dynamic-cache 1-token pass (what greedy generate runs); t(k) = that row's cache.\n"
        f"predict = mean blk × t(1)/t(k); effic = speedup/predict (target >= {TARGET_EFFICIENCY}); speedup = median "
        "over (prompt, repeat) pairs of t_greedy/t_blockwise.\n"
        "pred*/effic* = the same from the pass-by-pass model (prefill + Σ t(q_i) of the passes made) on both sides.\n"
        "identical = runs whose tokens equal generate()'s."
    )

    print("\n== where the time goes: one instrumented run per method (prompt 0), forwards timed inside the run ==")
    cols = (
        f"{'dtype':<5} {'method':<12} {'wall ms':>9} {'fwd ms':>9} {'Σt(q) ms':>9} {'overhead':>9} {'calls':>6} "
        f"{'ovh/call':>9} {'ovh %':>6}"
    )
    print(cols)
    print("-" * len(cols))
    for r in results:
        model_ms = {m: median([x["model_ms"] for x in r["runs"] if x["method"] == m]) for m in r["methods"]}
        for method in r["methods"]:
            x = r["split"][method]
            print(
                f"{r['dtype']:<5} {method:<12} {x['wall_ms']:>9.1f} {x['forward_ms']:>9.1f} {model_ms[method]:>9.1f} "
                f"{x['overhead_ms']:>9.1f} {x['forward_calls']:>6d} {x['overhead_ms_per_call']:>9.3f} "
                f"{100 * x['overhead_ms'] / x['wall_ms']:>6.1f}" + ("  contended" if x["contended"] else "")
            )
    print(
        "fwd ms = Σ of the model's forward calls in that run (device synced around each); overhead = wall − fwd:\n"
        "the decode loop's own cost (generate's loop for greedy). Σt(q) = prefill + the t(q) table's cost of the\n"
        "passes made (median over the timed runs): it differs from fwd ms as the context differs from the table's."
    )

    print(f"\n== noise: timed runs during which other processes used > {args.noise_cores:.1f} cores are 'contended' ==")
    for r in results:
        s = r["summary"]
        fc = r["forward_costs"]["foreign_cores"]
        line = f"{r['dtype']}: t(q) phase foreign load {fc if fc is None else round(fc, 2)} cores; "
        line += f"contended greedy runs {s['greedy']['contended_runs']}/{args.prompts * args.repeats}"
        for method in r["methods"][1:]:
            x = s[method]
            line += (
                f"; {method}: clean pairs {x['clean_pairs']}, speedup {x['speedup_clean']:.3f}, "
                f"effic {x['efficiency_clean']:.3f}"
            )
        print(line)
    print()
    for r in results:
        bad = [i for i, q in enumerate(r["reference_quality"]) if q["degenerate"]]
        distinct = [q["distinct_fraction"] for q in r["reference_quality"]]
        print(
            f"{r['dtype']}: greedy text distinct-token fraction per prompt {distinct}"
            + (f"  WARNING degenerate prompts {bad}" if bad else "")
        )
        for method in r["methods"][1:]:
            x = r["summary"][method]
            if not x["identical"]:
                print(
                    f"{r['dtype']}/{method}: {x['identical_runs']} runs identical to generate(); first divergence at "
                    f"new-token index {x['first_divergences']} (near-tie argmax flips between the 1-token and the "
                    "k-token pass)"
                )
        for impl, info in r["self_reference"].items():
            print(f"{r['dtype']}/{impl}+self: fixed point after {info['rounds']} rounds, converged {info['converged']}")
        for method, text in r["profiles"].items():
            print(f"\n-- cProfile, {r['dtype']}/{method}, one blockwise run (prompt 0) --\n{text}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    if args.threads is None and device.type == "cpu":
        args.threads = 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shared_cpu = device.type == "cpu" and not args.quick  # --quick checks the plumbing: no waiting
    if args.quiet_wait is None:
        args.quiet_wait = 20.0 if shared_cpu else 0.0
    if args.retries is None:
        args.retries = 8 if shared_cpu else 0
    if args.noise_cores is None:
        busy_threads = torch.get_num_threads() if device.type == "cpu" else 1
        args.noise_cores = max(0, (os.cpu_count() or 1) - busy_threads) + 0.1
    global CACHES
    CACHES = croppable_caches()
    out_path = Path(args.out)

    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, args.vocab, (1, args.prompt_len), generator=g).to(device) for _ in range(args.prompts)]

    meta = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if k != "dtype_names"},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_name": device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "model": {
            "arch": "gpt2",
            "layers": args.layers,
            "width": args.width,
            "heads": args.heads,
            "vocab": args.vocab,
            "positions": args.positions,
            "std": args.std,
            "attn_implementation": "sdpa",
        },
        "caches": list(CACHES),
        "target_efficiency": TARGET_EFFICIENCY,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(
        f"core_speed: {meta['device_name']} ({device}), threads={meta['threads']}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; gpt2 {args.layers}L×{args.width} vocab {args.vocab}; "
        f"k={args.k}, {args.new_tokens} tokens, {args.prompts} prompts × {args.repeats} repeats; load {loadavg()}",
        flush=True,
    )
    if CACHES != CACHES_ALL:
        print(f"transformers {transformers.__version__} cannot crop a StaticCache: timing the dynamic cache only")
    results = []
    start = time.perf_counter()
    for name in args.dtype_names:
        results.append(bench_dtype(name, args, device, prompts, progress=not args.no_progress))
        gc.collect()  # the previous dtype's model is unreferenced now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        meta["seconds"] = time.perf_counter() - start
        write_json(out_path, {"meta": meta, "results": results})  # partial results survive a later failure
    print_tables(args, results)
    print(f"\nwrote {out_path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
