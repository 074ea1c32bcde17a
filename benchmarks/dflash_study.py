#!/usr/bin/env python
"""The DFlash block drafter against EAGLE-3, the paper's heads and the default on one model: accepted blocks, what
a drafting pass costs beside a bare forward, and tokens a second, windows that loop and windows that do not apart.

- Blocks: mean accepted block of each drafter's chain at each k (`eagle3_study.blocks`: held-out standard-library
  windows and unseen third-party code, fp32, exact, no EOS), each depth's chance to stand given the one before,
  and the chain's output checked against transformers' greedy; the windows whose greedy text loops counted apart.
  `--variant NAME=FOLDER` adds the chain of another DFlash drafter (a run of other layers, block or gamma).
- Cost: one DFlash pass (the whole block guessed) against a bare base forward of the same block and of one token
  over a cached context; EAGLE-3's one drafting step beside it.
- Speed: tokens/s of transformers' greedy, each drafter's chain, the default and DFlash ranked with n-gram lookup,
  each method in turns on the same windows, in the dtype `auto` picks for this CPU (`--dtype`); the median over
  windows of each method's speed against greedy's, over the windows that loop and those that do not.

    python benchmarks/dflash_study.py --corpus runs/e3/corpus --dflash runs/dflash/dflash --run runs/dflash
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, dtype_flag, heading, title
from eagle3_study import blocks, plot_blocks, step_cost
from lookup_study import LOOPS, loops
from paper_table import THIRD_PARTY, heldout_prompts, third_party_prompts
from transformers import AutoTokenizer, DynamicCache

from blockdecode import DEFAULT_MODEL
from blockdecode.bench.report import write_results
from blockdecode.core.hf import cache_argument, dtype_for, dtype_name, layer_inputs
from blockdecode.core.io import read_jsonl, save_figure
from blockdecode.decoding.loop import decode_prompts
from blockdecode.model import BlockwiseLM


def with_dflash(model: str, dflash: str, dtype: torch.dtype) -> BlockwiseLM:
    """The model (its heads and EAGLE-3 drafter) with the DFlash drafter in `dflash` attached."""
    lm = BlockwiseLM.from_pretrained(model, dtype=dtype).eval()
    lm.attach_dflash(dflash)
    return lm


@torch.inference_mode()
def pass_cost(lm: BlockwiseLM, context: torch.LongTensor, reps: int = 50) -> dict:
    """Median ms of one DFlash pass over a cached context (the block's b positions), of a bare base forward of b
    tokens and of 1 over the same context."""
    drafter = lm.dflash_drafter()
    b = lm.dflash.config.block_size
    tokens = context[:, :-1]
    with layer_inputs(lm.base, drafter.layers) as aux:
        lm.base(tokens[:, :-1])
    drafter.start([tokens[0].tolist()])
    drafter.see(0, aux[0][0])
    drafter._logits(0, tokens)  # the context read into the drafter's entries once, as a decode does as it goes

    def timed(fn) -> float:
        samples = []
        for _ in range(reps + 2):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[2:]) * 1e3

    cache = DynamicCache(config=lm.base.config)
    name = cache_argument(lm.base)  # transformers 5.x renamed past_key_values
    lm.base(tokens, **{name: cache})

    def call(n: int):
        def forward() -> None:
            lm.base(context[:, -1:].expand(1, n), **{name: cache})
            cache.crop(-n)  # transformers 5: a negative count removes that many

        return forward

    drafting, block, one = timed(lambda: drafter._logits(0, tokens)), timed(call(b)), timed(call(1))
    return {
        "block_size": b,
        "pass_ms": drafting,
        "base_block_call_ms": block,
        "base_one_token_call_ms": one,
        "pass_against_block_call": drafting / block,
        "pass_against_one_token_call": drafting / one,
    }


def speed(lm: BlockwiseLM, prompts: list[torch.LongTensor], new_tokens: int, looping: list[bool]) -> dict:
    """tokens/s of each method, the methods in turns on every window (after one warm-up each), and the median over
    windows of each one's speed against greedy's, on the windows that loop and on those that do not."""
    b = lm.dflash.config.block_size
    plans = {
        "heads chain": lm.plan("heads", lm.k, tree=None, eos_token_id=[]),
        "eagle3 chain": lm.plan("eagle3", 8, tree=None, eos_token_id=[]),
        f"dflash chain, block {b}": lm.plan("dflash", b, tree=None, eos_token_id=[]),
        "dflash chain, k 8": lm.plan("dflash", 8, tree=None, eos_token_id=[]),
        "default": lm.plan(eos_token_id=[]),
        "dflash+ngram ranked": lm.plan("ngram+dflash", b, eos_token_id=[]),
        "dflash+heads+ngram ranked": lm.plan("ngram+heads+dflash", lm.k, eos_token_id=[]),
    }

    def run(method: str, ids: torch.LongTensor) -> float:
        start = time.perf_counter()
        if method == "greedy":
            with torch.inference_mode():
                lm.base.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        else:
            decode_prompts(lm.base, [ids], new_tokens, plans[method])
        return time.perf_counter() - start

    methods = ["greedy", *plans]
    for method in methods:
        run(method, prompts[0])
    seconds = {m: [] for m in methods}
    for ids in prompts:
        for method in methods:
            seconds[method].append(run(method, ids))
    ratios = {m: [g / s for g, s in zip(seconds["greedy"], seconds[m])] for m in methods}

    def median(m: str, loop: bool) -> float | None:
        chosen = [r for r, flag in zip(ratios[m], looping) if flag == loop]
        return float(np.median(chosen)) if chosen else None

    return {
        "tokens_per_s": {m: new_tokens * len(prompts) / sum(seconds[m]) for m in methods},
        "median_against_greedy": {m: float(np.median(ratios[m])) for m in methods},
        "median_against_greedy_looping": {m: median(m, True) for m in methods},
        "median_against_greedy_not_looping": {m: median(m, False) for m in methods},
        "windows": len(prompts),
        "looping": sum(looping),
    }


def training_curve(run: Path) -> list[dict]:
    return [
        {"step": r["step"], "block": r["eval_mean_block_size"], "acc": r.get("eval_head_acc")}
        for r in read_jsonl(run / "metrics.jsonl")
        if "eval_mean_block_size" in r
    ]


def plot(report: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.6))
    plot_blocks(axes, report["blocks"], "x-small")
    ax = axes[2]
    curve = report.get("training", [])
    if curve:
        ax.plot([r["step"] for r in curve], [r["block"] for r in curve], "o-", label="this run")
    for name, points in report.get("variant_curves", {}).items():
        ax.plot([r["step"] for r in points], [r["block"] for r in points], "o--", label=name)
    ax.set(xlabel="training step", ylabel="held-out mean accepted block", title="DFlash training")
    if curve or report.get("variant_curves"):
        ax.legend(fontsize="x-small")
    ax = axes[3]
    speed = report["speed"]
    names = list(speed["median_against_greedy"])
    y = np.arange(len(names))
    for offset, key, label in ((-0.2, "median_against_greedy_not_looping", "windows that do not loop"),
                               (0.2, "median_against_greedy_looping", "windows that loop")):  # fmt: skip
        ax.barh(y + offset, [speed[key][n] or 0 for n in names], height=0.4, label=label)
    ax.set_yticks(y, names, fontsize="small")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set(xlabel=f"median × transformers' greedy ({speed['dtype']})", title="speed")
    ax.legend(fontsize="x-small")
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a saved BlockwiseLM with heads and an eagle3 drafter")
    p.add_argument("--dflash", default=None, help="the DFlash drafter's folder (default: the model's own)")
    p.add_argument("--variant", action="append", default=[], help="NAME=FOLDER: another DFlash drafter's chain")
    p.add_argument("--corpus", required=True, help="the folder `blockdecode pretrain` prepared (its heldout.npy)")
    p.add_argument("--run", default=None, help="the DFlash training run, for its curve")
    p.add_argument("--ks", default="4,8,16")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--speed-prompts", type=int, default=6, help="of each set, timed")
    dtype_flag(p, "the dtype timed (blocks are measured in fp32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "dflash_study.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ks, dtype = [int(k) for k in args.ks.split(",")], dtype_for(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_sets = {
        "stdlib held-out": heldout_prompts(Path(args.corpus), args.prompts, args.prompt_len),
        "third-party": third_party_prompts(tokenizer, THIRD_PARTY, args.prompts, args.prompt_len),
    }
    dflash = args.dflash or str(Path(args.model) / "dflash")
    model = with_dflash(args.model, dflash, torch.float32)
    cfg = model.dflash.config
    report = {
        **heading(
            "built-in code model" if args.model == DEFAULT_MODEL else Path(args.model).name,
            dtype,
            threads=args.threads,
            torch=torch.__version__,
        ),
        "settings": vars(args),
        "dflash": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "layers": cfg.num_hidden_layers,
            "block_size": cfg.block_size,
            "draft_vocab": cfg.draft_vocab_size,
            "parameters": sum(t.numel() for t in model.dflash.parameters()),
        },  # fmt: skip
        "blocks": blocks(model, prompt_sets, ks, args.new_tokens, ("heads", "eagle3", "dflash")),
    }
    for spec in args.variant:
        name, folder = spec.split("=", 1)
        variant = with_dflash(args.model, folder, torch.float32)
        found = blocks(variant, prompt_sets, [variant.dflash.config.block_size], args.new_tokens, ("dflash",))
        report.setdefault("variants", {})[name] = {
            "layers": variant.dflash.config.num_hidden_layers,
            "block_size": variant.dflash.config.block_size,
            "blocks": {n: e["drafters"]["dflash"] for n, e in found.items()},
        }
        run = Path(folder).parent / "metrics.jsonl"
        if run.is_file():
            report.setdefault("variant_curves", {})[name] = training_curve(run.parent)
    timed_model = with_dflash(args.model, dflash, dtype)
    context = torch.cat(prompt_sets["stdlib held-out"][:5], dim=1)
    report["cost"] = {
        "dflash": pass_cost(timed_model, context),
        "eagle3": step_cost(args.model, context, 8, dtype),
    }
    report["cost"]["dtype"] = dtype_name(dtype)
    print(report["cost"], flush=True)
    timed = [p for prompts in prompt_sets.values() for p in prompts[:: max(1, len(prompts) // args.speed_prompts)]]
    refs = [timed_model.base.generate(ids, max_new_tokens=args.new_tokens, do_sample=False) for ids in timed]
    looping = [loops(r[0, ids.shape[1] :].tolist(), ids[0].tolist()) > LOOPS for r, ids in zip(refs, timed)]
    report["speed"] = speed(timed_model, timed, args.new_tokens, looping) | {"dtype": dtype_name(dtype)}
    print(report["speed"], flush=True)
    if args.run:
        report["training"] = training_curve(Path(args.run))
    out = Path(args.out)
    write_results(report, out, plot)
    return report


if __name__ == "__main__":
    main()
