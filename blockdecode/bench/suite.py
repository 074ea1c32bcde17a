"""`blockdecode bench` and its presets: what to run, on which model, and in what order.

- default: the built-in (or a given) model against transformers' greedy, prompt lookup and
  assisted generation, heads and n-gram at each k, plus the scripted-drafter study below;
- `quick`: the same in about two minutes;
- `core`: only the scripted-drafter study, a GPT-2-small-sized random model whose drafter is
  right with a chosen probability, with the dynamic and the static cache: what the decode loop
  turns a given block size into, whatever the heads' quality.

Beside the speedups: t(q), the cost of one forward of q tokens over a cached context, and the
ceiling it sets, k̂ · t(1) / t(k); efficiency = speedup / ceiling is what the loop leaves of it."""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from blockdecode.bench.batches import batch_rows, padded_batch
from blockdecode.bench.methods import (
    Method,
    Run,
    add_ceilings,
    add_quality,
    blockwise_run,
    measure,
    transformers_run,
)
from blockdecode.bench.report import environment, write_report
from blockdecode.builtin import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from blockdecode.core.hf import CACHE_IMPLEMENTATIONS, DTYPES, at_least, dtype_for, dtype_name, is_seq2seq, vocab_size
from blockdecode.core.io import check_writable, read_prompts
from blockdecode.core.toy import toy_model
from blockdecode.decoding.acceptance import parse_acceptance
from blockdecode.decoding.calibrate import calibrate
from blockdecode.decoding.loop import decode
from blockdecode.decoding.plan import DecodePlan, make_plan
from blockdecode.decoding.sampling import Sampling, sampling_settings
from blockdecode.decoding.timing import forward_cost
from blockdecode.drafters.base import ScriptedDrafter
from blockdecode.drafters.registry import CHOICES
from blockdecode.drafters.sources import SuffixArray, corpus_index
from blockdecode.drafters.suffix import SuffixDrafter
from blockdecode.loading import load_base
from blockdecode.model import BlockwiseLM, load
from blockdecode.pretraining.bible import HELD_OUT_VERSES


@dataclass
class BenchConfig:
    """One benchmark run."""

    model: str | None = None  # a saved BlockwiseLM or transformers folder; None: the built-in model
    draft: str | None = None  # a small causal LM with the same tokenizer, for assisted generation
    prompts: str | None = None  # a JSON list of prompt texts; None: the model's held-out prompts
    ks: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 10])
    dtype: str = "auto"  # bf16 where the device computes it natively, else fp32
    new_tokens: int = 128
    n_prompts: int = 12
    repeats: int = 2
    max_q: int = 32
    fwd_reps: int = 7
    acceptance: list[str] = field(default_factory=list)  # relaxed rules to measure beside exact
    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])  # sampling, against transformers'
    batches: list[int] = field(default_factory=lambda: [1, 4, 8])  # batch sizes, against transformers' batched greedy
    batch_k: int = 4  # a batch scores rows x k tokens a call: a short chain keeps that cheap
    trees: list[int | str] = field(default_factory=lambda: ["auto"])  # budgets or "auto", at the largest k
    drafters: list[str] = field(default_factory=lambda: list(CHOICES))  # each alone: a chain at every k; all: trees
    corpus: tuple[str, ...] = ()  # files and folders suffix lookup also drafts from
    static_cache: bool = False  # also greedy and the chains at the largest k with transformers' StaticCache
    methods: bool = True  # the model's own methods; False: the scripted-drafter study alone
    system: bool = True  # the GPT-2-small-sized study with a scripted drafter
    system_accuracies: list[float] = field(default_factory=lambda: [0.5, 0.8, 0.95, 1.0])
    system_model: dict = field(default_factory=lambda: dict(vocab=50257, width=768, layers=12, heads=12))
    system_dtype: str = "fp32"
    system_caches: list[str] = field(default_factory=lambda: ["dynamic"])
    out: str = "benchmarks/results/bench"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this torch has no CUDA device")
        for name in ("dtype", "system_dtype"):  # "auto" recorded as what it stands for here
            setattr(self, name, dtype_name(dtype_for(getattr(self, name), self.device)))
        if not self.ks:
            raise ValueError("ks must be block sizes >= 1, got none")
        self.ks = [at_least(k, 1, "ks must be block sizes >= 1") for k in self.ks]
        self.trees = [
            t if t in ("auto", "expected") else at_least(t, 1, "trees must be node budgets >= 1, 'auto' or 'expected'")
            for t in self.trees
        ]
        self.batches = [at_least(b, 1, "batches must be batch sizes >= 1") for b in self.batches]
        for name in ("new_tokens", "n_prompts", "repeats", "max_q", "fwd_reps", "batch_k"):
            setattr(self, name, at_least(getattr(self, name), 1, f"{name} must be a positive integer"))
        # a bad rule fails before anything runs; exact is measured anyway, so it is no relaxed rule to add
        self.acceptance = [spec for spec in self.acceptance if parse_acceptance(spec).rule != "exact"]
        for t in self.temperatures:
            Sampling(temperature=t)  # so does a bad temperature
        self.drafters = [bench_drafter(spec) for spec in self.drafters]
        self.corpus = tuple(str(path) for path in self.corpus)  # recorded in bench.json as given
        self._check_corpus()
        unknown = set(self.system_caches) - set(CACHE_IMPLEMENTATIONS)
        if unknown or not self.system_caches:
            raise ValueError(f"system_caches must name some of {', '.join(CACHE_IMPLEMENTATIONS)}, got {unknown}")
        if not (self.methods or self.system):
            raise ValueError("nothing to measure: enable methods or the scripted-drafter study")

    def _check_corpus(self) -> None:
        """A corpus no measured method reads is refused, as generate refuses it (it would be ignored), and so
        is a path that is not there: both before any model loads."""
        if not self.corpus:
            return
        if not self.methods:
            raise ValueError("corpus is read by suffix lookup, and this run measures none of a model's methods")
        if not any(reads_corpus(spec, self.trees) for spec in self.drafters):
            measured = f"drafters {', '.join(self.drafters) or 'none'}; trees {','.join(map(str, self.trees)) or 'off'}"
            raise ValueError(
                f"corpus is read by suffix lookup, and no method measured here uses it ({measured}): add suffix "
                "to the drafters (--drafters heads,ngram,suffix)"
            )
        for path in self.corpus:
            if not Path(path).exists():
                raise ValueError(f"corpus: {path} does not exist")

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        """About two minutes on 2 cores: fewer prompts, k and q, no GPT-2-sized study."""
        base = dict(
            ks=[2, 4, 8],
            new_tokens=64,
            n_prompts=4,
            repeats=1,
            max_q=16,
            fwd_reps=3,
            system=False,
            temperatures=[0.7],
            batches=[4],
        )
        return cls(**{**base, **overrides, "out": overrides.get("out", "benchmarks/results/bench_quick")})

    @classmethod
    def core(cls, **overrides) -> BenchConfig:
        """The decode loop alone: scripted drafters on a GPT-2-small-sized model, both caches, k=8."""
        base = dict(ks=[8], methods=False, n_prompts=4, system_caches=list(CACHE_IMPLEMENTATIONS), batches=[])
        return cls(**{**base, **overrides, "out": overrides.get("out", "benchmarks/results/core")})


BATCH_DRAFTERS = ["auto", "heads", "ngram"]  # auto: the chain the calibration predicts fastest
LOOKUPS = ("heads", "ngram", "suffix")  # what `drafters` names, alone or joined by + to share a tree
ROW_NAMES = {"ngram": "n-gram"}  # a chain's row is named "<drafter> k=<k>"


def bench_drafter(spec: str) -> str:
    """One of `drafters`: a drafter the bench knows (heads-rescored has a row of its own), or several joined."""
    names = spec.split("+")
    if not set(names) <= set(LOOKUPS) or len(set(names)) != len(names):
        raise ValueError(f"drafters takes {', '.join(LOOKUPS)} or several joined by + (a tree), got {spec!r}")
    return spec


def reads_corpus(spec: str, trees: list[int | str]) -> bool:
    """Whether a drafter of `drafters` gets a row that reads the corpus: suffix lookup's chain, or a
    tree holding it (drafters joined by + have trees alone; the "expected" tree is heads+ngram's)."""
    names = spec.split("+")
    return "suffix" in names and (len(names) == 1 or any(t != "expected" for t in trees))


def sourced(lm: BlockwiseLM, plan: DecodePlan, corpus: SuffixArray | None) -> DecodePlan:
    """`plan` with its suffix lookup reading `corpus` and no earlier output: the bench times each prompt
    alone, so what one decode wrote must not help the next."""
    if not any(isinstance(d, SuffixDrafter) for d in plan.drafters):
        return plan
    return lm.with_sources(plan, remember=False, corpus=corpus)


PRESETS = {"default": BenchConfig, "quick": BenchConfig.quick, "core": BenchConfig.core}


def default_prompts(model_dir: Path, n: int, translate: bool = False) -> list[str]:
    """The held-out prompts shipped beside a model (prompts.json), else a few code openings (held-out
    Bible verses for a translation model)."""
    path = model_dir / "prompts.json"
    if path.is_file():
        prompts, source = read_prompts(path), str(path)
    elif translate:
        prompts, source = list(HELD_OUT_VERSES), "the built-in held-out verses"
    else:
        prompts = ["def main():\n", "class Parser:\n    def __init__(self, text):\n", "import os\nimport sys\n\n"]
        source = "the built-in code openings"
    if n > len(prompts):  # a prompt measured twice adds time, not evidence
        warnings.warn(f"{n} prompts asked for; {source} holds {len(prompts)}: each is measured once", stacklevel=2)
    return prompts[:n]


def methods_for(
    cfg: BenchConfig, lm: BlockwiseLM, draft, prompts: list[torch.LongTensor], corpus: SuffixArray | None = None
) -> list[Method]:
    """Every method to measure; a tree of "auto" nodes is calibrated here on the first prompts (suffix
    lookup's without `corpus`, the index of cfg.corpus), and named by the budget it chose. A translation (an
    encoder-decoder's output) ends at its EOS for every method alike; a code continuation runs the whole budget."""
    n, eos = cfg.new_tokens, is_seq2seq(lm.base)

    def transformers(ids: torch.LongTensor, **kwargs) -> Run:
        return transformers_run(lm.base, ids, n, stop_at_eos=eos, **kwargs)

    def planned(plan):
        """A method's run: every prompt decoded through one plan."""
        plan = sourced(lm, plan, corpus)
        return lambda ids: blockwise_run(lm.base, ids, n, plan)

    def blockwise(drafter, k: int, **settings):
        return planned(make_plan(lm.base, drafter, k, eos_token_id=None if eos else [], lm=lm, **settings))

    ms = [
        Method("greedy", "greedy", transformers),
        Method("prompt lookup", "prompt_lookup", lambda x: transformers(x, prompt_lookup_num_tokens=10)),
    ]
    if draft is not None:
        ms.append(Method("assisted", "assisted", lambda ids: transformers(ids, assistant_model=draft)))
    chains = [spec for spec in cfg.drafters if "+" not in spec]
    for k in cfg.ks:
        for name in chains:
            if name == "heads" and k > lm.k:
                continue
            ms.append(Method(f"{ROW_NAMES.get(name, name)} k={k}", name, blockwise(name, k), k=k))
        for spec in cfg.acceptance:
            if k > lm.k or (spec.startswith("min-block") and parse_acceptance(spec).min_block > k):
                continue
            ms.append(
                Method(
                    f"heads k={k} {spec}",
                    "heads",
                    blockwise("heads", k, acceptance=spec),
                    k=k,
                    acceptance=spec,
                )
            )
    top = max(cfg.ks)
    if top > lm.k:
        beyond = ", ".join(str(k) for k in cfg.ks if k > lm.k)
        fits = [k for k in cfg.ks if k <= lm.k]
        kept = f"at k={max(fits)} (the largest k that fits)" if fits else "nowhere: no k given fits them"
        warnings.warn(
            f"--k {beyond}: the heads propose at most k={lm.k}, so k={beyond} gets {lookup_rows(chains)}; the rescored "
            f"lattice and the static cache's heads, measured at the largest k only, are dropped; the trees and "
            f"sampling's heads rows are measured {kept}",
            stacklevel=2,
        )
    if top <= lm.k:  # Kim et al.'s rescoring of the heads' lattice by an n-gram model of the context
        ms.append(Method(f"heads-rescored k={top}", "heads", blockwise("heads-rescored", top), k=top))
    if cfg.static_cache:  # the same calls with a preallocated cache, against the same greedy baseline
        static = dict(cache_implementation="static")
        ms.append(Method("greedy static", "greedy", lambda ids: transformers(ids, **static)))
        if top <= lm.k:
            ms.append(Method(f"heads k={top} static", "heads", blockwise("heads", top, **static), k=top))
        ms.append(Method(f"n-gram k={top} static", "ngram", blockwise("ngram", top, **static), k=top))
    k = max((k for k in cfg.ks if k <= lm.k), default=None)
    for budget in cfg.trees if k else []:
        if budget == "expected":  # one ranked tree of every drafter, its size chosen each call
            plan = lm.plan("heads+ngram", k, "expected", eos_token_id=None if eos else [], prompts=prompts[:1])
            ms.append(Method(f"expected tree k={k}", "expected tree", planned(plan), k=k))
            continue
        for family in cfg.drafters:
            nodes, name = budget, f"{family} tree {budget} k={k}"
            if budget == "auto":
                nodes = calibrate(lm, prompts[:2], family, k).budget
                name = f"{family} tree auto ({nodes or 'chain'}) k={k}"
            ms.append(Method(name, f"{family} tree", blockwise(family, k, tree=nodes or None), k=k))
    return ms


def lookup_rows(chains: list[str]) -> str:
    """What a k beyond the heads' is measured with: the chains of the drafters other than the heads."""
    names = [ROW_NAMES.get(name, name) for name in chains if name != "heads"]
    return f"{' and '.join(names)} rows alone" if names else "no chain rows"


def model_methods(cfg: BenchConfig, show: bool) -> dict:
    """Every method on the model: speed, blocks, quality against greedy, and its t(q) curve."""
    dtype = DTYPES[cfg.dtype]
    model_dir = Path(cfg.model or DEFAULT_MODEL)
    given = read_prompts(cfg.prompts)[: cfg.n_prompts] if cfg.prompts else None  # checked before the models load
    lm, tokenizer = load(model_dir, dtype)
    lm.to(cfg.device)
    seq2seq = is_seq2seq(lm.base)
    draft_dir = cfg.draft or (DEFAULT_DRAFT_MODEL if cfg.model is None else None)
    draft = load_base(draft_dir, dtype).to(cfg.device).eval() if draft_dir else None
    if draft is not None and vocab_size(draft) != lm.config.vocab_size:
        raise ValueError(f"the draft model {draft_dir} has another vocabulary than {model_dir}")
    texts = given or default_prompts(model_dir, cfg.n_prompts, translate=seq2seq)
    prompts = [tokenizer(t, return_tensors="pt").input_ids.to(cfg.device) for t in texts]
    corpus = corpus_index(tokenizer, list(cfg.corpus), progress=show) if cfg.corpus else None  # before any timing

    results = measure(methods_for(cfg, lm, draft, prompts, corpus), prompts, cfg.repeats, show)
    add_quality(results, tokenizer, lm.base, prompts)
    sampled = {f"{t:g}": sampling_methods(cfg, lm, prompts, t, show) for t in cfg.temperatures}
    batched = [
        row
        for size in cfg.batches
        for row in batch_rows(
            lm,
            *padded_batch(tokenizer, [texts[i % len(texts)] for i in range(size)], seq2seq, cfg.device),
            cfg.new_tokens,
            BATCH_DRAFTERS + (["expected"] if "expected" in cfg.trees else []),
            cfg.batch_k,
            cfg.repeats * 2,
            show,
        )
    ]
    greedy_text = results["greedy"]["outputs"][0][: cfg.new_tokens // 2]
    # t(q) over a prompt and half a continuation (an encoder-decoder: its source, as decoder context too)
    context = torch.tensor([prompts[0][0].tolist() + ([] if seq2seq else greedy_text)], device=cfg.device)
    cost = forward_cost(lm.base, context, max(cfg.max_q, *cfg.ks), cfg.fwd_reps)
    add_ceilings(results, cost)
    return {
        "model": str(model_dir),
        "task": "translation" if seq2seq else "code",
        "draft_model": str(draft_dir) if draft_dir else None,
        "prompts": texts,
        "corpus_tokens": corpus.size if corpus is not None else 0,
        "cost": {
            "context_tokens": context.shape[1],
            "seconds": cost,
            "relative": {q: t / cost[1] for q, t in cost.items()},
        },
        "methods": results,
        "sampling": sampled,
        "batches": batched,
    }


def sampling_methods(
    cfg: BenchConfig, lm: BlockwiseLM, prompts: list[torch.LongTensor], temperature: float, show: bool
):
    """Sampling at `temperature` (the model's other generation settings, as transformers takes them):
    transformers' own sampling, the baseline, against the heads' and n-gram lookup's chains at the
    largest k and the chain the calibration picks ("auto", what `generate(do_sample=True)` decodes
    with), verified by speculative sampling (trees are for greedy). Each run draws other tokens, so
    these rows compare speed and tokens per call, not outputs."""
    n, eos = cfg.new_tokens, is_seq2seq(lm.base)
    sampling = sampling_settings(lm.base, True, temperature=temperature)
    settings = dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)

    def run(plan):
        return lambda ids: blockwise_run(lm.base, ids, n, plan)

    def blockwise(drafter: str, k: int):
        return run(make_plan(lm.base, drafter, k, eos_token_id=None if eos else [], lm=lm, sampling=sampling))

    ms = [
        Method(
            f"sampling t={temperature:g}", "sampling", lambda ids: transformers_run(lm.base, ids, n, eos, **settings)
        )
    ]
    k = max((k for k in cfg.ks if k <= lm.k), default=None)
    if k:
        ms.append(Method(f"heads k={k} sampling", "heads", blockwise("heads", k), k=k, acceptance=sampling.spec))
        chosen = lm.plan("auto", k, "auto", prompts=prompts[:2], **settings).drafter_name
        name = f"auto ({chosen}) k={k} sampling"
        ms.append(Method(name, chosen, blockwise(chosen, k), k=k, acceptance=sampling.spec))
        if "expected" in cfg.trees:  # each call's chain n-gram lookup's or the heads', its length chosen
            ranked = lm.plan("auto", k, "expected", eos_token_id=None if eos else [], prompts=prompts[:1], **settings)
            ms.append(Method(f"ranked chain k={k} sampling", "heads", run(ranked), k=k, acceptance=sampling.spec))
    top = max(cfg.ks)
    ms.append(Method(f"n-gram k={top} sampling", "ngram", blockwise("ngram", top), k=top, acceptance=sampling.spec))
    results = measure(ms, prompts, cfg.repeats, show)
    for r in results.values():  # sampled outputs are compared with nothing
        for name in ("outputs", "identical_to_greedy", "token_agreement", "prefix_agreement"):
            r.pop(name)
    return {"settings": sampling.spec, "methods": results}


def system_ceiling(cfg: BenchConfig, show: bool) -> dict:
    """Head quality aside: a GPT-2-small-sized random model with a drafter that is right with a
    chosen probability, at the largest k, with each cache implementation asked for.

    fp32 by default: a random-weight model's bf16 logits are full of near-ties, and each wrong
    proposal changes the verified blocks, their rounding and so the path. The drafter is scripted
    from blockwise decoding's own fixed point (what a perfect drafter would propose to it), so a
    near-tie cannot derail it."""
    dtype = DTYPES[cfg.system_dtype]
    size = cfg.system_model
    model = toy_model("gpt2", seed=cfg.seed, std=0.15, context=1024, **size).to(cfg.device, dtype)
    vocab, k, n = size["vocab"], max(cfg.ks), cfg.new_tokens
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, vocab, (1, 32), generator=gen).to(cfg.device) for _ in range(min(4, cfg.n_prompts))]

    def script(ids: torch.LongTensor) -> torch.LongTensor:
        seq = torch.tensor([ids[0].tolist() + transformers_run(model, ids, n).sequence], device=ids.device)
        for _ in range(3):
            out = decode(model, ids, n, make_plan(model, ScriptedDrafter(seq, vocab), k, eos_token_id=[]))
            if torch.equal(out.sequences, seq):
                break
            seq = out.sequences
        return seq

    scripts = {tuple(p[0].tolist()): script(p) for p in prompts}

    def scripted(acc: float, impl: str):
        def run(ids: torch.LongTensor) -> Run:
            drafter = ScriptedDrafter(scripts[tuple(ids[0].tolist())], vocab, accuracy=acc, seed=cfg.seed)
            plan = make_plan(model, drafter, k, eos_token_id=[], cache_implementation=impl)
            return blockwise_run(model, ids, n, plan)

        return run

    methods = [Method("greedy", "greedy", lambda ids: transformers_run(model, ids, n))]
    cache_of = {}  # method name -> its cache implementation
    for impl in cfg.system_caches:
        for acc in cfg.system_accuracies:
            name = f"scripted p={acc:g}" + ("" if impl == "dynamic" else f" {impl}")
            methods.append(Method(name, "system", scripted(acc, impl), k=k))
            cache_of[name] = impl
    results = measure(methods, prompts, cfg.repeats if not cfg.methods else 1, show)
    context = prompts[0].repeat(1, 4)
    cost = {impl: forward_cost(model, context, k, cfg.fwd_reps, impl) for impl in cfg.system_caches}
    for impl in cfg.system_caches:
        add_ceilings({name: results[name] for name, i in cache_of.items() if i == impl}, cost[impl])
    for r in results.values():
        r.pop("outputs")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    name = f"GPT-2 architecture, random weights, {params:.0f}M"
    return {
        "model": name,
        "dtype": cfg.system_dtype,
        "k": k,
        "new_tokens": n,
        "environment": environment(cfg.system_dtype, cfg.device),
        "cost": cost,
        "methods": results,
    }


def measure_bench(cfg: BenchConfig, show: bool = True) -> dict:
    """Measure what cfg asks for and return the report, once cfg.out is known to be writable: a run
    of minutes is not lost to a folder it could never have written."""
    check_writable(Path(cfg.out))
    start = time.perf_counter()
    report: dict = {"config": asdict(cfg), "environment": environment(cfg.dtype, cfg.device), "methods": {}}
    if cfg.methods:
        report.update(model_methods(cfg, show))
    if cfg.system:
        report["system_ceiling"] = system_ceiling(cfg, show)
    report["seconds"] = time.perf_counter() - start
    return report


def run_bench(cfg: BenchConfig, show: bool = True) -> dict:
    """Measure what cfg asks for; write bench.json, the plots and table.md to cfg.out; return the report."""
    report = measure_bench(cfg, show)
    write_report(report, Path(cfg.out))
    return report
