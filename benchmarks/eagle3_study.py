#!/usr/bin/env python
"""The EAGLE-3 drafter against the paper's heads on one model: accepted blocks, speed and what a drafting step
costs.

- Blocks: mean accepted block at each k of each drafter's chain, decoding held-out standard-library windows and
  unseen third-party code (`paper_table.py`'s prompts and settings: fp32, exact, no EOS), with each depth's
  chance to stand given the one before, the share of windows whose greedy text loops, and the eagle3 chain's
  output checked against transformers' greedy; again over the first `--short-tokens`, before most loops.
- Speed: tokens/s of transformers' greedy, the heads' chain, the eagle3 chain, the default (heads and n-gram
  lookup, ranked) and eagle3 with n-gram lookup ranked the same way, in the dtype `auto` picks for this CPU; with
  `--dtypes bf16,fp32`, each dtype in turns on the same prompts, the ratios comparing the best dtype of each.
- Cost: one drafting step (a pass of the drafter's layer and its draft vocabulary) against a one-token call of
  the base and a verify call of k tokens, over a cached context.
- Training: the held-out top-1 accuracy of each draft step over the run (`--run`, its metrics.jsonl).

    python benchmarks/eagle3_study.py --corpus runs/e3/corpus --run runs/e3/eagle3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, heading, title
from lookup_study import LOOPS, loops
from paper_table import THIRD_PARTY, heldout_prompts, third_party_prompts
from transformers import AutoTokenizer, DynamicCache

from blockdecode import DEFAULT_MODEL
from blockdecode.core.hf import DTYPE_CHOICES, cache_argument, dtype_for, dtype_name, layer_inputs
from blockdecode.core.io import read_jsonl, save_figure, write_json
from blockdecode.decoding.loop import decode_prompts
from blockdecode.decoding.reference import first_divergence, greedy_generate
from blockdecode.drafters.eagle3.drafting import Eagle3Drafter
from blockdecode.model import BlockwiseLM, load

DRAFTERS = ("heads", "eagle3")
MIN_PROBS = (0.02, 0.1, 0.5)  # where else a chain might stop drafting (the drafter's default: 0.3)


def depth_rates(blocks: list[int], k: int) -> list[float]:
    """Each depth's chance to stand given the one before: of the calls whose first d-1 guesses stood, the share
    whose d-th did too (d = 1..k-1)."""
    rates = []
    for d in range(1, k):
        reached = sum(b >= d for b in blocks)
        rates.append(sum(b >= d + 1 for b in blocks) / reached if reached else 0.0)
    return rates


def blocks(
    model: BlockwiseLM, prompt_sets: dict, ks: list[int], new_tokens: int, drafters: tuple[str, ...] = DRAFTERS
) -> dict:
    """Each drafter's chain on each prompt set at each k (fp32, exact); the heads' no deeper than they were
    trained (`model.k`)."""
    found = {}
    for name, prompts in prompt_sets.items():
        refs = [greedy_generate(model.base, ids, new_tokens, []) for ids in prompts]
        looping = [loops(r[0, ids.shape[1] :].tolist(), ids[0].tolist()) > LOOPS for r, ids in zip(refs, prompts)]
        entry = found[name] = {"windows": len(prompts), "looping": sum(looping), "drafters": {}}
        for drafter in drafters:
            for k in [k for k in ks if drafter != "heads" or k <= model.k]:
                outs, stats = decode_prompts(
                    model.base, prompts, new_tokens, model.plan(drafter, k, tree=None, eos_token_id=[])
                )
                per = [o.stats.mean_block_size for o in outs]
                row = entry["drafters"].setdefault(drafter, {})[str(k)] = {
                    "mean_block_size": stats.mean_block_size,
                    "median_block_size": float(np.median(per)),
                    "not_looping_mean_block_size": float(
                        np.mean([p for p, loop in zip(per, looping) if not loop] or [0.0])
                    ),
                    "depth_rates": depth_rates(stats.block_sizes, k),
                }
                if k == max(ks) or (drafter == "heads" and k == min(model.k, max(ks))):
                    row["identical_to_greedy"] = all(
                        first_divergence(model.base, r, o.sequences) is None for r, o in zip(refs, outs)
                    )
                print(f"{name:16} {drafter:7} k={k}: block {stats.mean_block_size:.2f}", flush=True)
    return found


def speed(folder: str, prompts: list[torch.LongTensor], new_tokens: int, k: int, dtypes: list[torch.dtype]) -> dict:
    """tokens/s of each method and dtype (by name), the methods in turns on every prompt (after one warm-up each)."""
    models = {dtype_name(d): load(folder, d)[0] for d in dtypes}  # with the prompts its default plan measures
    dtypes = list(models)
    plans = {
        d: {
            "heads chain": m.plan("heads", k, tree=None, eos_token_id=[]),
            "eagle3 chain": m.plan("eagle3", k, tree=None, eos_token_id=[]),
            **{
                f"eagle3 chain, min_prob {p}": m.plan(
                    Eagle3Drafter(m.eagle3, m.base.get_input_embeddings(), min_prob=p), k, tree=None, eos_token_id=[]
                )
                for p in MIN_PROBS
            },
            "default": m.plan(eos_token_id=[]),
            "eagle3+ngram ranked": m.plan("eagle3+ngram", k, eos_token_id=[]),
        }
        for d, m in models.items()
    }

    def greedy(m: BlockwiseLM, ids: torch.LongTensor) -> None:
        with torch.inference_mode():
            m.base.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def run(d: str, method: str, ids: torch.LongTensor) -> float:
        start = time.perf_counter()
        if method == "greedy":
            greedy(models[d], ids)
        else:
            decode_prompts(models[d].base, [ids], new_tokens, plans[d][method])
        return time.perf_counter() - start

    methods = ["greedy", *plans[dtypes[0]]]
    for d in dtypes:
        for method in methods:
            run(d, method, prompts[0])
    seconds = {(d, m): [] for d in dtypes for m in methods}
    for ids in prompts:
        for d in dtypes:
            for method in methods:
                seconds[d, method].append(run(d, method, ids))
    rates = {d: {m: new_tokens * len(prompts) / sum(seconds[d, m]) for m in methods} for d in dtypes}
    best = {m: max(dtypes, key=lambda d: rates[d][m]) for m in methods}
    return {
        "tokens_per_s": rates,
        "best_dtype": best,
        "against_greedy": {m: rates[best[m]][m] / rates[best["greedy"]]["greedy"] for m in methods},
        "eagle3_against_heads_chain": {
            m: rates[best[m]][m] / rates[best["heads chain"]]["heads chain"] for m in methods if m.startswith("eagle3")
        },
    }


@torch.inference_mode()
def step_cost(folder: str, context: torch.LongTensor, k: int, dtype: torch.dtype, reps: int = 50) -> dict:
    """Median ms of one drafting step, of a one-token base call and of a k-token verify call over `context`."""
    model = BlockwiseLM.from_pretrained(folder, dtype=dtype).eval()
    drafter = model.eagle3_drafter()
    drafter.min_prob = 0.0
    tokens = context[:, :-1]
    with layer_inputs(model.base, drafter.layers) as aux:
        model.base(tokens[:, :-1])
    drafter.start([tokens[0].tolist()])
    drafter.see(0, aux[0][0])
    drafter._beam(0, tokens, 1, 1)  # the context read into the drafter's cache once

    def timed(fn) -> float:
        samples = []
        for _ in range(reps + 2):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[2:]) * 1e3

    one, deep = timed(lambda: drafter._beam(0, tokens, 1, 1)), timed(lambda: drafter._beam(0, tokens, k - 1, 1))
    cache = DynamicCache(config=model.base.config)
    name = cache_argument(model.base)  # transformers 5.x renamed past_key_values
    model.base(tokens, **{name: cache})

    def call(n: int):
        def forward() -> None:
            model.base(context[:, -1:].expand(1, n), **{name: cache})
            cache.crop(-n)  # transformers 5: a negative count removes that many

        return forward

    step = (deep - one) / max(1, k - 2)
    base_one, base_k = timed(call(1)), timed(call(k))
    return {
        "dtype": dtype_name(dtype),
        "draft_step_ms": step,
        "first_guess_ms": one,
        "base_call_ms": base_one,
        "verify_call_ms": base_k,
        "step_against_base_call": step / base_one,
        "step_against_verify_call": step / base_k,
    }


def training_curve(run: Path) -> list[dict]:
    return [
        {"step": r["step"], "eval_head_acc": r["eval_head_acc"], "block": r["eval_mean_block_size"]}
        for r in read_jsonl(run / "metrics.jsonl")
        if "eval_loss" in r
    ]


def plot_blocks(axes, blocks: dict, fontsize: str = "small") -> None:
    """Two panels of `blocks`' chains: the mean accepted block by k, and each depth's chance at the largest k."""
    ax = axes[0]
    for name, entry in blocks.items():
        for drafter, by_k in entry["drafters"].items():
            ks = sorted(map(int, by_k))
            ax.plot(ks, [by_k[str(k)]["mean_block_size"] for k in ks], "o-", label=f"{drafter}, {name}")
    ax.set(xlabel="k", ylabel="mean accepted block", title="chains, exact, fp32")
    ax.legend(fontsize=fontsize)
    ax = axes[1]
    for name, entry in blocks.items():
        for drafter, by_k in entry["drafters"].items():
            rates = by_k[str(max(map(int, by_k)))]["depth_rates"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", label=f"{drafter}, {name}")
    ax.set(xlabel="depth", ylabel="stands, given the depth before", title="each depth's chance", ylim=(0, 1))
    ax.legend(fontsize=fontsize)


def plot(report: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.4))
    plot_blocks(axes, report["blocks"])
    ax = axes[2]
    curve = report.get("training", [])
    if curve:
        for d in range(len(curve[0]["eval_head_acc"])):
            ax.plot([r["step"] for r in curve], [r["eval_head_acc"][d] for r in curve], label=f"step {d + 1}")
        ax.legend(fontsize="small", ncol=2)
    ax.set(xlabel="training step", ylabel="held-out top-1 accuracy", title="eagle3 training: each draft step")
    ax = axes[3]
    ratios = report["speed"]["against_greedy"]
    ax.barh(list(ratios), list(ratios.values()))
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="× transformers' greedy (each at its best dtype)", title="speed")
    ax.tick_params(axis="y", labelsize="small")
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    save_figure(fig, png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a saved BlockwiseLM with heads and an eagle3 drafter")
    p.add_argument("--corpus", required=True, help="the folder `blockdecode pretrain` prepared (its heldout.npy)")
    p.add_argument("--run", default=None, help="the eagle3 training run, for its curve")
    p.add_argument("--ks", default="2,4,6,8")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--short-tokens", type=int, default=32, help="the blocks at k=max again over this many new tokens")
    p.add_argument("--speed-prompts", type=int, default=8, help="of each set, timed")
    p.add_argument("--dtypes", default="auto", help=f"comma-separated, of {', '.join(DTYPE_CHOICES)}: each timed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "eagle3_study.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ks, dtypes = [int(k) for k in args.ks.split(",")], [dtype_for(d) for d in args.dtypes.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_sets = {
        "stdlib held-out": heldout_prompts(Path(args.corpus), args.prompts, args.prompt_len),
        "third-party": third_party_prompts(tokenizer, THIRD_PARTY, args.prompts, args.prompt_len),
    }
    model = BlockwiseLM.from_pretrained(args.model, dtype=torch.float32).eval()
    report = {
        **heading(
            "built-in code model" if args.model == DEFAULT_MODEL else Path(args.model).name,
            dtypes,
            threads=args.threads,
            torch=torch.__version__,
        ),
        "settings": vars(args),
        "eagle3": {
            "aux_layers": list(model.eagle3.config.aux_layers),
            "parameters": model.eagle3.config.parameters(),
            "draft_vocab": model.eagle3.config.draft_vocab_size,
        },
        "blocks": blocks(model, prompt_sets, ks, args.new_tokens),
        # the built-in base's greedy text loops within 128 tokens: before it has, fewer windows do
        "blocks_short": blocks(model, prompt_sets, [max(ks)], args.short_tokens),
    }
    timed = [p for prompts in prompt_sets.values() for p in prompts[:: max(1, len(prompts) // args.speed_prompts)]]
    report["speed"] = speed(args.model, timed, args.new_tokens, max(ks), dtypes)
    print(report["speed"], flush=True)
    context = torch.cat([p for p in prompt_sets["stdlib held-out"][:5]], dim=1)
    report["cost"] = {dtype_name(d): step_cost(args.model, context, max(ks), d) for d in dtypes}
    print(report["cost"], flush=True)
    if args.run:
        report["training"] = training_curve(Path(args.run))
    out = Path(args.out)
    write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
