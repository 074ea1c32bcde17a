"""`blockdecode bench`: blockwise decoding against the decoders a user would otherwise pick,
on one model, one set of prompts, one dtype and thread count, in one process.

Every (prompt, repeat) round runs every method once, in an order rotated from round to round,
so machine drift hits all of them alike; a method's speedup is the median over rounds of
t(greedy) / t(method) within the round. Beside it: the cost of verifying a block, t(q) for
q = 1..max_q, and the ceiling it sets, k̂ · t(1) / t(k); efficiency = speedup / ceiling shows
how much the decode loop itself costs."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from blockdecode.acceptance import parse_acceptance
from blockdecode.decode import cache_argument
from blockdecode.drafters import NgramDrafter, ScriptedDrafter
from blockdecode.model import DTYPES, BlockwiseLM, atomic_write
from blockdecode.reference import plain_generation_config


@dataclass
class BenchConfig:
    """One benchmark run."""

    model: str | None = None  # a saved BlockwiseLM; None: the built-in model
    draft: str | None = None  # a small causal LM with the same tokenizer, for assisted generation
    prompts: str | None = None  # a JSON list of prompt texts; None: the model's held-out prompts
    ks: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 10])
    dtype: str = "bf16"
    new_tokens: int = 128
    n_prompts: int = 12
    repeats: int = 2
    max_q: int = 32
    fwd_reps: int = 7
    acceptance: list[str] = field(default_factory=list)  # relaxed rules to measure beside exact
    system: bool = True  # the GPT-2-small-sized ceiling with a scripted drafter
    system_accuracies: list[float] = field(default_factory=lambda: [0.5, 0.8, 0.95, 1.0])
    system_model: dict = field(default_factory=lambda: dict(vocab=50257, width=768, layers=12, heads=12))
    out: str = "benchmarks/results/bench"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose {', '.join(DTYPES)}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks must be block sizes >= 1, got {self.ks}")
        for name in ("new_tokens", "n_prompts", "repeats", "max_q", "fwd_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for spec in self.acceptance:
            parse_acceptance(spec)  # a bad rule fails before anything runs

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        """About two minutes on 2 cores: fewer prompts, k and q, no GPT-2-sized ceiling."""
        base = dict(ks=[2, 4, 8], new_tokens=64, n_prompts=4, repeats=1, max_q=16, fwd_reps=3, system=False)
        return cls(**{**base, **overrides, "out": overrides.get("out", "benchmarks/results/bench_quick")})


@dataclass
class Run:
    """One method on one prompt: its output, wall time and model calls."""

    sequence: list[int]
    seconds: float
    calls: int
    draft_calls: int = 0
    block_sizes: list[int] = field(default_factory=list)


@contextmanager
def counting_calls(*models: torch.nn.Module):
    """Count forward calls of each model (a list, in order), however generate drives them."""
    counts = [0] * len(models)
    handles = []
    for i, m in enumerate(models):

        def hook(_module, _args, _kwargs, i=i) -> None:
            counts[i] += 1

        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, ids: torch.LongTensor, new_tokens: int, **kwargs) -> Run:
    """transformers' generate, greedy, EOS off (every method makes the same number of tokens)."""
    assistant = kwargs.get("assistant_model")
    with plain_generation_config(model), counting_calls(model, *([assistant] if assistant else [])) as counts:
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
        _sync(ids.device)
        seconds = time.perf_counter() - start
    return Run(out[0, ids.shape[1] :].tolist(), seconds, counts[0], counts[1] if assistant else 0)


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall time is the work's time; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def blockwise_run(lm: BlockwiseLM, ids: torch.LongTensor, new_tokens: int, k: int, **kwargs) -> Run:
    """blockdecode timed and counted from outside, exactly as `hf_generate` is."""
    with counting_calls(lm.base) as counts:
        start = time.perf_counter()
        out = lm.generate(ids, new_tokens, eos_token_id=[], k=k, **kwargs)
        _sync(ids.device)
        seconds = time.perf_counter() - start
    return Run(out.sequences[0, ids.shape[1] :].tolist(), seconds, counts[0], block_sizes=out.stats.block_sizes)


@torch.inference_mode()
def forward_cost(model: PreTrainedModel, context: torch.LongTensor, max_q: int, reps: int) -> dict[int, float]:
    """t(q): median seconds of one forward pass of q new tokens over `context` already cached,
    the cache cropped back after each pass so every pass sees the same context."""
    cache = DynamicCache(config=model.config)
    arg = {cache_argument(model): cache, "use_cache": True}
    model(input_ids=context, **arg)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    times: dict[int, float] = {}
    for q in range(1, max_q + 1):
        ids = torch.randint(0, vocab, (1, q), generator=gen).to(context.device)
        samples = []
        for rep in range(reps + 1):  # the first pass of each q warms up
            start = time.perf_counter()
            model(input_ids=ids, **arg)
            _sync(ids.device)
            elapsed = time.perf_counter() - start
            cache.crop(-q)
            if rep:
                samples.append(elapsed)
        times[q] = statistics.median(samples)
    return times


def block_stats(runs: list[Run], k: int) -> dict:
    """Mean accepted block, its histogram, and per head the share of calls that reached it."""
    blocks = [b for r in runs for b in r.block_sizes]
    hist = [blocks.count(b) for b in range(1, k + 1)]
    reached = [sum(1 for b in blocks if b >= i) / max(1, len(blocks)) for i in range(2, k + 1)]
    # Head i's own rate: accepted when heads 2..i-1 were.
    own = [reached[i] / reached[i - 1] if i and reached[i - 1] else reached[i] for i in range(len(reached))]
    return {
        "mean_block_size": statistics.mean(blocks) if blocks else 0.0,
        "block_histogram": hist,
        "head_reached": reached,
        "head_acceptance": own,
    }


def default_prompts(model_dir: Path, n: int) -> list[str]:
    """The held-out prompts shipped beside a model (prompts.json), else a few code openings."""
    path = model_dir / "prompts.json"
    if path.is_file():
        prompts = json.loads(path.read_text())
    else:
        prompts = ["def main():\n", "class Parser:\n    def __init__(self, text):\n", "import os\nimport sys\n\n"]
    return [prompts[i % len(prompts)] for i in range(n)]


@dataclass
class Method:
    name: str
    family: str  # greedy | prompt_lookup | assisted | heads | ngram | system
    run: Callable[[torch.LongTensor], Run]
    k: int | None = None
    acceptance: str = "exact"

    @property
    def exact(self) -> bool:
        return self.acceptance == "exact"


def methods_for(cfg: BenchConfig, lm: BlockwiseLM, draft: PreTrainedModel | None) -> list[Method]:
    base, n = lm.base, cfg.new_tokens
    ms = [
        Method("greedy", "greedy", lambda ids: hf_generate(base, ids, n)),
        Method("prompt lookup", "prompt_lookup", lambda ids: hf_generate(base, ids, n, prompt_lookup_num_tokens=10)),
    ]
    if draft is not None:
        ms.append(Method("assisted", "assisted", lambda ids: hf_generate(base, ids, n, assistant_model=draft)))
    ngram = NgramDrafter()  # stateless: one serves every k
    for k in cfg.ks:
        if k <= lm.k:
            ms.append(Method(f"heads k={k}", "heads", lambda ids, k=k: blockwise_run(lm, ids, n, k), k=k))
        ms.append(Method(f"n-gram k={k}", "ngram", lambda ids, k=k: blockwise_run(lm, ids, n, k, drafter=ngram), k=k))
        for spec in cfg.acceptance:
            if k > lm.k or (spec.startswith("min-block") and parse_acceptance(spec).min_block > k):
                continue
            ms.append(
                Method(
                    f"heads k={k} {spec}",
                    "heads",
                    lambda ids, k=k, spec=spec: blockwise_run(lm, ids, n, k, acceptance=spec),
                    k=k,
                    acceptance=spec,
                )
            )
    return ms


def measure(methods: list[Method], prompts: list[torch.LongTensor], repeats: int, show: bool) -> dict[str, dict]:
    """Warm every method up, then run rounds of all methods in rotated order."""
    for m in methods:
        m.run(prompts[0])
    runs: dict[str, list[Run]] = {m.name: [] for m in methods}
    ratios: dict[str, list[float]] = {m.name: [] for m in methods}
    rounds = [(p, r) for r in range(repeats) for p in range(len(prompts))]
    for i, (p, _) in enumerate(tqdm(rounds, desc="bench rounds", disable=not show)):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        times = {}
        for m in order:
            run = m.run(prompts[p])
            runs[m.name].append(run)
            times[m.name] = run.seconds
        for m in methods:
            ratios[m.name].append(times["greedy"] / times[m.name])
    greedy_out = {p: runs["greedy"][p].sequence for p in range(len(prompts))}
    results = {}
    for m in methods:
        rs = runs[m.name]
        tokens = sum(len(r.sequence) for r in rs)
        calls = sum(r.calls for r in rs)
        outputs = rs[: len(prompts)]
        agreement = [_agreement(r.sequence, greedy_out[p]) for p, r in enumerate(outputs)]
        prefix = [_prefix_agreement(r.sequence, greedy_out[p]) for p, r in enumerate(outputs)]
        results[m.name] = {
            "family": m.family,
            "k": m.k,
            "acceptance": m.acceptance,
            "exact_method": m.exact,
            "tokens_per_s": statistics.median(len(r.sequence) / r.seconds for r in rs),
            "speedup": statistics.median(ratios[m.name]),
            "speedup_per_round": ratios[m.name],
            "calls_per_token": calls / tokens,
            "tokens_per_call": tokens / calls,
            "draft_calls_per_token": sum(r.draft_calls for r in rs) / tokens,
            "identical_to_greedy": all(a == 1.0 for a in prefix),
            "token_agreement": statistics.mean(agreement),
            "prefix_agreement": statistics.mean(prefix),
            "outputs": [r.sequence for r in outputs],
        }
        if m.family in ("heads", "ngram", "system"):
            results[m.name].update(block_stats(rs, m.k))
    return results


def _agreement(ours: list[int], greedy: list[int]) -> float:
    """Share of positions holding greedy's token."""
    return sum(a == b for a, b in zip(ours, greedy)) / max(1, len(greedy))


def _prefix_agreement(ours: list[int], greedy: list[int]) -> float:
    """Share of greedy's tokens reproduced before the first difference (1.0: identical)."""
    if len(ours) == len(greedy) and ours == greedy:
        return 1.0
    same = next((i for i, (a, b) in enumerate(zip(ours, greedy)) if a != b), min(len(ours), len(greedy)))
    return same / max(1, len(greedy))


@torch.inference_mode()
def continuation_loss(base: PreTrainedModel, prompt: torch.LongTensor, tokens: list[int]) -> float:
    """The base model's mean cross-entropy (nats/token) of a generated continuation."""
    ids = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], dim=1)
    logits = base(input_ids=ids, use_cache=False).logits[0, prompt.shape[1] - 1 : -1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, prompt.shape[1] :]))


def add_quality(results: dict[str, dict], tokenizer, base: PreTrainedModel, prompts: list[torch.LongTensor]) -> None:
    """chrF of each method's text against greedy's (sacrebleu) and the base model's loss on it."""
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    refs = [tokenizer.decode(t) for t in results["greedy"]["outputs"]]
    for r in results.values():
        hyps = [tokenizer.decode(t) for t in r["outputs"]]
        r["chrf"] = chrf.corpus_score(hyps, [refs]).score
        r["loss"] = statistics.mean(continuation_loss(base, p, t) for p, t in zip(prompts, r["outputs"]))


def add_ceilings(results: dict[str, dict], cost: dict[int, float]) -> None:
    """Each blockwise row's ceiling k̂ · t(1) / t(k) and its efficiency, measured / ceiling."""
    for r in results.values():
        if r.get("k") and r["k"] in cost and "mean_block_size" in r:
            r["ceiling"] = r["mean_block_size"] * cost[1] / cost[r["k"]]
            r["efficiency"] = r["speedup"] / r["ceiling"]


def system_ceiling(cfg: BenchConfig, show: bool) -> dict:
    """Head quality aside: a GPT-2-small-sized random model with a drafter that is right with a
    chosen probability, at the largest k. Always fp32: a random-weight model's bf16 logits are full
    of near-ties, and each wrong proposal changes the verified blocks, their rounding and so the
    path, which derails any scripted drafter after the first flip."""
    from blockdecode.decode import blockwise_generate
    from blockdecode.toy import toy_model

    dtype = torch.float32
    size = cfg.system_model
    model = toy_model("gpt2", seed=cfg.seed, std=0.15, context=1024, **size).to(cfg.device, dtype)
    vocab = size["vocab"]
    k, n = max(cfg.ks), cfg.new_tokens
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, vocab, (1, 32), generator=gen).to(cfg.device) for _ in range(min(4, cfg.n_prompts))]
    lm = BlockwiseLM.from_base(model, k=2)  # its heads stay unused: the scripted drafter proposes

    def script(ids: torch.LongTensor) -> torch.LongTensor:
        ref = hf_generate(model, ids, n)
        seq = torch.tensor([ids[0].tolist() + ref.sequence], device=ids.device)
        for _ in range(3):  # blockwise's own fixed point: what a perfect drafter would propose
            out = blockwise_generate(model, ids, n, ScriptedDrafter(seq, vocab), k, eos_token_id=[])
            if torch.equal(out.sequences, seq):
                break
            seq = out.sequences
        return seq

    scripts = {tuple(p[0].tolist()): script(p) for p in prompts}
    methods = [Method("greedy", "greedy", lambda ids: hf_generate(model, ids, n))]
    for acc in cfg.system_accuracies:

        def run(ids: torch.LongTensor, acc: float = acc) -> Run:
            seq = scripts[tuple(ids[0].tolist())]
            return blockwise_run(lm, ids, n, k, drafter=ScriptedDrafter(seq, vocab, accuracy=acc, seed=cfg.seed))

        methods.append(Method(f"scripted p={acc:g}", "system", run, k=k))
    results = measure(methods, prompts, 1, show)
    cost = forward_cost(model, prompts[0].repeat(1, 4), k, cfg.fwd_reps)
    add_ceilings(results, cost)
    for r in results.values():
        r.pop("outputs")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    model_name = f"GPT-2 architecture, random weights, {params:.0f}M"
    return {"model": model_name, "dtype": "fp32", "k": k, "cost": cost, "methods": results}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version() -> str:
    try:
        return version("blockdecode")
    except PackageNotFoundError:  # run from a source tree, not installed
        return "source tree"


def environment(cfg: BenchConfig) -> dict:
    import transformers

    return {
        "dtype": cfg.dtype,
        "device": torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blockdecode": package_version(),
    }


def run_bench(cfg: BenchConfig, show: bool = True) -> dict:
    """Measure every method; write bench.json, the plots and table.md to cfg.out; return the results."""
    from blockdecode import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

    dtype = DTYPES[cfg.dtype]
    model_dir = Path(cfg.model or DEFAULT_MODEL)
    lm = BlockwiseLM.from_pretrained(model_dir, dtype=dtype).to(cfg.device, dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    draft_dir = cfg.draft or (DEFAULT_DRAFT_MODEL if cfg.model is None else None)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(cfg.device).eval() if draft_dir else None
    if draft is not None and draft.get_output_embeddings().weight.shape[0] != lm.config.vocab_size:
        raise ValueError(f"the draft model {draft_dir} has another vocabulary than {model_dir}")
    texts = json.loads(Path(cfg.prompts).read_text()) if cfg.prompts else default_prompts(model_dir, cfg.n_prompts)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{cfg.prompts}: prompts must be a JSON list of non-empty strings")
    texts = texts[: cfg.n_prompts]
    prompts = [tokenizer(t, return_tensors="pt").input_ids.to(cfg.device) for t in texts]

    start = time.perf_counter()
    results = measure(methods_for(cfg, lm, draft), prompts, cfg.repeats, show)
    add_quality(results, tokenizer, lm.base, prompts)
    context = torch.tensor(
        [prompts[0][0].tolist() + results["greedy"]["outputs"][0][: cfg.new_tokens // 2]], device=cfg.device
    )
    cost = forward_cost(lm.base, context, max(cfg.max_q, *cfg.ks), cfg.fwd_reps)
    add_ceilings(results, cost)
    report = {
        "config": asdict(cfg),
        "environment": environment(cfg),
        "model": str(model_dir),
        "draft_model": str(draft_dir) if draft_dir else None,
        "prompts": texts,
        "cost": {
            "context_tokens": context.shape[1],
            "seconds": cost,
            "relative": {q: t / cost[1] for q, t in cost.items()},
        },
        "methods": results,
    }
    if cfg.system:
        report["system_ceiling"] = system_ceiling(cfg, show)
    report["seconds"] = time.perf_counter() - start
    out = Path(cfg.out)
    atomic_write(out / "bench.json", lambda p: Path(p).write_text(json.dumps(report, indent=1) + "\n"))
    plot(report, out)
    tables = f"{markdown(report)}\n\n{acceptance_markdown(report)}\n"
    atomic_write(out / "table.md", lambda p: Path(p).write_text(tables))
    return report


def update_readme(readme: Path, name: str, text: str) -> None:
    """Replace what lies between `<!-- {name}:start -->` and `<!-- {name}:end -->` in the README:
    its tables are generated from results, never typed."""
    start_mark, end_mark = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    old = readme.read_text()
    if start_mark not in old or end_mark not in old:
        raise ValueError(f"{readme} has no {start_mark} ... {end_mark} section")
    head, rest = old.split(start_mark, 1)
    new = f"{head}{start_mark}\n{text}\n{end_mark}{rest.split(end_mark, 1)[1]}"
    atomic_write(readme, lambda p: Path(p).write_text(new))


def best(report: dict, family: str) -> dict | None:
    """The fastest exact row of a family."""
    rows = [r for r in report["methods"].values() if r["family"] == family and r["exact_method"]]
    return max(rows, key=lambda r: r["speedup"], default=None)


def markdown(report: dict) -> str:
    """The README's table: one row per method, exact rows first, then the approximate ones."""
    env = report["environment"]
    lines = [
        f"{env['dtype']}, {env.get('device', 'cpu')}, {env['threads']} threads, {env['cpu']}; torch {env['torch']}, "
        f"transformers {env['transformers']}; {len(report['prompts'])} prompts x {report['config']['repeats']} "
        f"repeats, {report['config']['new_tokens']} new tokens each.",
        "",
        "| method | tokens/s | speedup | calls/token | mean block | ceiling | efficiency | identical | chrF | loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(report["methods"].items(), key=lambda kv: not kv[1]["exact_method"])
    for name, r in rows:
        block = f"{r['mean_block_size']:.2f}" if "mean_block_size" in r else "-"
        ceiling = f"{r['ceiling']:.2f}x" if "ceiling" in r else "-"
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        same = "yes" if r["identical_to_greedy"] else ("no (approximate)" if not r["exact_method"] else "NO")
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['calls_per_token']:.3f} | {block} | "
            f"{ceiling} | {eff} | {same} | {r['chrf']:.1f} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def acceptance_markdown(report: dict) -> str:
    """Exact and each relaxed rule at each k: how much faster, and what it costs in quality
    against exact greedy (the paper's Top-2 / Top-3 rows)."""
    rows = [r for r in report["methods"].values() if r["family"] == "heads"]
    if not any(not r["exact_method"] for r in rows):
        return "(no approximate rule was measured: run `blockdecode bench --acceptance topk:2,...`)"
    greedy = report["methods"]["greedy"]
    lines = [
        f"Greedy's own text has loss {greedy['loss']:.3f} nats/token under the base model.",
        "",
        "| acceptance | k | mean block | speedup | token agreement | chrF | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["acceptance"] != "exact", r["acceptance"], r["k"])):
        lines.append(
            f"| {r['acceptance']} | {r['k']} | {r['mean_block_size']:.2f} | {r['speedup']:.2f}x | "
            f"{r['token_agreement']:.3f} | {r['chrf']:.1f} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def plot(report: dict, out: Path) -> None:
    """speedup.png (speedup against k per method), blocks.png (block-size histograms at the best
    k) and cost.png (t(q) / t(1), the price of verifying a block)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        atomic_write(out / name, lambda p: fig.savefig(p, format="png", dpi=100))
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family, label in (("heads", "blockdecode, heads"), ("ngram", "blockdecode, n-gram")):
        rows = sorted(
            (r for r in methods.values() if r["family"] == family and r["exact_method"]), key=lambda r: r["k"]
        )
        ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], "o-", label=label)
        if family == "heads":
            ax.plot(
                [r["k"] for r in rows if "ceiling" in r],
                [r["ceiling"] for r in rows if "ceiling" in r],
                "x:",
                label="heads' ceiling k̂·t(1)/t(k)",
            )
    for spec in report["config"]["acceptance"]:
        rows = sorted((r for r in methods.values() if r["acceptance"] == spec), key=lambda r: r["k"])
        ax.plot(
            [r["k"] for r in rows], [r["speedup"] for r in rows], "s--", alpha=0.7, label=f"heads, {spec} (approx.)"
        )
    for name in ("prompt lookup", "assisted"):
        if name in methods:
            ax.axhline(
                methods[name]["speedup"],
                linestyle="--",
                color="grey" if name == "assisted" else "tan",
                label=f"transformers {name}",
            )
    ax.axhline(1.0, color="black", linewidth=0.8, label="transformers greedy")
    ax.set_xlabel("k (block size)")
    ax.set_ylabel("speedup over greedy generate")
    ax.legend(fontsize="small")
    save(fig, "speedup.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for family in ("heads", "ngram"):
        top = best(report, family)
        if top:
            ax.bar(
                [b + (0.2 if family == "ngram" else -0.2) for b in range(1, top["k"] + 1)],
                top["block_histogram"],
                width=0.4,
                label=f"{family}, k={top['k']}",
            )
    ax.set_xlabel("accepted block size (tokens per call)")
    ax.set_ylabel("calls")
    ax.legend()
    save(fig, "blocks.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    rel = report["cost"]["relative"]
    qs = sorted(int(q) for q in rel)
    ax.plot(qs, [rel[q] if q in rel else rel[str(q)] for q in qs], "o-", label="built-in model")
    if "system_ceiling" in report:
        cost = report["system_ceiling"]["cost"]
        sq = sorted(int(q) for q in cost)
        ax.plot(
            sq,
            [cost[q] / cost[1] if q in cost else cost[str(q)] / cost["1"] for q in sq],
            "o-",
            label="GPT-2-small size (fp32)",
        )
    ax.set_xlabel("q (tokens in one forward pass)")
    ax.set_ylabel("t(q) / t(1)")
    ax.legend()
    save(fig, "cost.png")
