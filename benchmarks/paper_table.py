"""The paper's Table 1 on the built-in model: mean accepted block size for heads trained frozen /
fine-tuned / distilled / fine-tuned+distilled, at each k, beside the held-out loss of the base each
was verified against (the analogue of the paper's BLEU column) and the paper's own figures.

Two prompt sets: held-out standard-library files, and Python files of installed third-party
packages the model never saw (`--third-party`); per set the mean and the median over prompts of
each prompt's mean block, since a prompt whose greedy text loops inflates the mean.

Every run's heads were trained at the largest k; a smaller k decodes with heads 2..k of them.
Decoding is exact, in fp32 so that no near-tie blurs the comparison; the largest k is also
checked token for token against transformers' greedy generate.

    python benchmarks/paper_table.py --runs runs/heads-frozen runs/heads-finetune ... --corpus runs/corpus

Also (`paper_tradeoff.png`/`.json`) the speed/quality curve over each run's training evaluations;
`--curves DIR ...` draws it alone, for runs finished or not; and (`--widths DIR ...`,
`paper_widths.png`/`.json`) runs of other head widths compared at equal training time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, heading
from results_doc import DOC, update_section
from ship import install
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from blockdecode.core.hf import cache_argument
from blockdecode.core.io import read_jsonl, save_figure, saving_folder, write_json
from blockdecode.decoding.loop import decode_prompts
from blockdecode.decoding.reference import first_divergence, greedy_generate
from blockdecode.loading import load_base
from blockdecode.model import BlockwiseLM
from blockdecode.pretraining.pretrain import PretrainConfig, heldout_batches, heldout_loss

PAPER = {"frozen": {8: 1.76}, "distill": {8: 1.91}, "finetune+distill": {8: 4.69, 10: 4.95}}
"""Stern et al. (2018), Table 1, WMT En-De: k̂ of Regular, Distillation and Both, as cited here."""
THIRD_PARTY = ("accelerate", "tqdm", "sacrebleu", "packaging")


def third_party_prompts(tokenizer, packages: tuple[str, ...], n: int, length: int) -> list[torch.LongTensor]:
    """n prompts of `length` tokens, one per file, from files spread evenly over the installed
    packages' Python sources, each taken a third of the way into its file (past the headers)."""
    import importlib.util

    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"--third-party: package {name} is not installed")
        files += sorted(p for root in spec.submodule_search_locations for p in Path(root).rglob("*.py"))
    prompts = []
    for path in files[:: max(1, len(files) // (2 * n))]:
        ids = tokenizer(path.read_text(errors="replace")).input_ids
        if len(ids) >= 3 * length:
            start = len(ids) // 3
            prompts.append(torch.tensor([ids[start : start + length]]))
    if len(prompts) < n:
        raise ValueError(f"--third-party: only {len(prompts)} files of {packages} are long enough for {n} prompts")
    return [prompts[round(i * (len(prompts) - 1) / max(1, n - 1))] for i in range(n)]


def heldout_prompts(corpus: Path, n: int, length: int, split: str = "heldout") -> list[torch.LongTensor]:
    """n prompts of `length` tokens spread evenly over a held-out split's token stream."""
    tokens = np.load(corpus / f"{split}.npy", mmap_mode="r")
    starts = np.linspace(0, len(tokens) - length - 1, n).astype(np.int64)
    return [torch.from_numpy(tokens[s : s + length].astype(np.int64)).unsqueeze(0) for s in starts]


def measure(
    run: Path,
    corpus: Path,
    ks: list[int],
    prompt_sets: dict[str, list[torch.LongTensor]],
    new_tokens: int,
    device: str = "cpu",
) -> dict:
    """Block sizes at each k on each prompt set, the base's held-out loss, and exactness at the largest k."""
    model = BlockwiseLM.from_pretrained(run, dtype=torch.float32).to(device).eval()
    meta = json.loads((run / "train_config.json").read_text()) if (run / "train_config.json").is_file() else {}
    windows = heldout_batches(np.load(corpus / "heldout.npy", mmap_mode="r"), PretrainConfig(corpus="", out=""))
    row = {
        "run": str(run),
        "mode": meta.get("mode", run.name),
        "label": label(meta, run.name),
        "trained_k": model.k,
        "heldout_loss": heldout_loss(model.base, windows),
        "training": json.loads((run / "blockdecode.json").read_text()).get("training"),
        "proposal_cost": proposal_cost(run, min(8, model.k)),
        "base_training": base_training(meta),
        "sets": {},
    }
    for name, prompts in prompt_sets.items():
        prompts = [p.to(device) for p in prompts]
        by_k = row["sets"].setdefault(name, {})
        for k in tqdm([k for k in ks if k <= model.k], desc=f"{run.name} / {name}", leave=False):
            plan = model.plan("heads", k, tree=None, eos_token_id=[])
            outs, stats = decode_prompts(model.base, prompts, new_tokens, plan)
            per_prompt = [o.stats.mean_block_size for o in outs]
            blocks = stats.block_sizes  # tokens gained per call after the prefill
            entry = {
                "mean_block_size": stats.mean_block_size,
                "median_block_size": float(np.median(per_prompt)),
                "per_prompt": per_prompt,
                "calls": len(blocks),
                "block_histogram": [blocks.count(b) for b in range(1, k + 1)],
            }
            if k == max(ks):
                refs = [greedy_generate(model.base, ids, new_tokens, []) for ids in prompts]
                entry["identical_to_greedy"] = all(
                    first_divergence(model.base, r, o.sequences) is None for r, o in zip(refs, outs)
                )
            by_k[str(k)] = entry
    return row


def base_training(meta: dict) -> dict | None:
    """How the run's base was pretrained, if that is known: `blockdecode pretrain`'s pretrain.json beside
    its model, or, for heads retrained on a shipped model, what that model's blockdecode.json carries:
    steps, tokens, and its held-out loss per token and per byte."""
    if not meta.get("base"):
        return None
    base = Path(meta["base"])
    if (base.parent / "pretrain.json").is_file():
        return json.loads((base.parent / "pretrain.json").read_text())
    shipped = base / "blockdecode.json"
    if not shipped.is_file():
        return None
    return (json.loads(shipped.read_text()).get("training") or {}).get("base_pretraining")


def label(meta: dict, fallback: str) -> str:
    """A row's name: its mode, and what runs of one mode differ by: the head type, soft targets, a
    draft vocabulary, and where the base was trained its learning rate and base-loss weight."""
    mode = meta.get("mode", fallback)
    parts = [mode]
    if meta.get("head_type", "paper") != "paper":
        parts.append(f"{meta['head_type']} heads")
    if meta.get("targets", "hard") != "hard":
        parts.append(f"{meta['targets']} targets")
    if meta.get("draft_vocab"):
        parts.append(f"draft vocabulary {meta['draft_vocab']}")
    if mode.startswith("finetune") and "base_lr" in meta:
        parts.append(f"base lr {meta['base_lr']:g}")
    if mode.startswith("finetune") and "base_loss_weight" in meta:
        parts.append(f"base-loss weight {meta['base_loss_weight']:g}")
    return ", ".join(parts)


def proposal_cost(run: Path, k: int, context: int = 300, reps: int = 30) -> dict:
    """Milliseconds of one chain proposal of k-1 tokens against one forward of the base for one token
    at a `context`-token cache, medians of `reps`, in fp32 and bf16: what the heads add to each call."""
    costs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        costs[name] = call_costs(BlockwiseLM.from_pretrained(run, dtype=dtype).eval(), k, context, reps)
    return costs


def call_costs(model: BlockwiseLM, k: int, context: int, reps: int) -> dict:
    from transformers import DynamicCache

    drafter = model.drafter()  # made outside inference mode, as a plan makes it
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = {cache_argument(model.base): DynamicCache(config=model.base.config)}
    with torch.inference_mode():
        out = model.base(ids, use_cache=True, output_hidden_states=True, **cache)
    hidden, newest = out.hidden_states[-1][0, -1:], out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = torch.cat([ids, newest], 1)

    @torch.inference_mode()
    def forward() -> None:
        model.base(newest, use_cache=True, **cache)
        next(iter(cache.values())).crop(-1)  # the token just scored

    @torch.inference_mode()
    def propose() -> None:
        drafter.propose(tokens, hidden, k - 1)

    cost = {"forward_ms": 1e3 * median_seconds(forward, reps), "proposal_ms": 1e3 * median_seconds(propose, reps)}
    return {**cost, "ratio": cost["proposal_ms"] / cost["forward_ms"]}


def median_seconds(fn, reps: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def markdown(rows: list[dict], ks: list[int], prompt_set: str) -> str:
    """The table as the paper lays it out: one row per training mode, one column per k, mean
    (median) accepted block on one prompt set, and the paper's figures beneath."""
    head = "| heads | steps | held-out loss (nats/token) | " + " | ".join(f"k={k}" for k in ks)
    head += " | proposal / forward, fp32 | bf16 |"
    lines = [head, "|" + "---|" * (len(ks) + 5)]
    for r in rows:
        by_k = r["sets"][prompt_set]
        cells = [
            f"{by_k[str(k)]['mean_block_size']:.2f} ({by_k[str(k)]['median_block_size']:.2f})" if str(k) in by_k else ""
            for k in ks
        ]
        cost = r.get("proposal_cost", {})
        cells += [
            f"{c['proposal_ms']:.2f} / {c['forward_ms']:.2f} ms ({c['ratio']:.0%})" if (c := cost.get(d)) else ""
            for d in ("float32", "bfloat16")
        ]
        steps = (r["training"] or {}).get("steps", "")
        lines.append(f"| {r['label']} | {steps} | {r['heldout_loss']:.3f} | " + " | ".join(cells) + " |")
    for mode, figures in PAPER.items():
        cells = [f"{figures[k]:.2f}" if k in figures else "" for k in ks] + ["", ""]
        lines.append(f"| paper, {mode} (WMT En-De) | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_result(path: Path, data: dict, fig) -> None:
    """`data` as the JSON file `path` and `fig` as the PNG beside it, replacing the earlier pair as one
    (`io.saving_folder`): a run stopped between the two leaves the old pair, never one of each."""
    with saving_folder(path.parent, path.name) as staging:
        save_figure(fig, staging / path.with_suffix(".png").name)
        write_json(staging / path.name, data)


def plot(rows: list[dict], ks: list[int]):
    """Mean accepted block against k, one panel per prompt set: the figure, for `write_result`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(rows[0]["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        for r in rows:
            by_k = r["sets"][name]
            xs = [k for k in ks if str(k) in by_k]
            ax.plot(xs, [by_k[str(k)]["mean_block_size"] for k in xs], "o-", label=r["label"])
        ax.plot(ks, ks, ":", color="grey", label="ceiling (k)")
        ax.set_xlabel("k (block size)")
        ax.set_ylabel("mean accepted block size")
        ax.set_title(f"{name}, exact greedy")
        ax.legend()
    return fig


def curve(records: list[dict]) -> list[dict]:
    """A run's speed against its quality at each held-out evaluation: the mean accepted block and
    the base's held-out loss relative to the first evaluation's (the base before training)."""
    evals = [r for r in records if "eval_base_loss" in r]
    return [
        {
            "step": r["step"],
            "mean_block_size": r["eval_mean_block_size"],
            "relative_loss": r["eval_base_loss"] / evals[0]["eval_base_loss"] - 1,
        }
        for r in evals
    ]


def tradeoff(run_dirs: list[Path], png: Path) -> dict:
    """Each run's held-out evaluations during training: the base's held-out loss relative to the
    run's first evaluation (the original base) against the mean accepted block measured by
    decoding held-out prompts at the trained k; finished or not. The curve users pick a point on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {run.name: points for run in run_dirs if (points := curve(read_jsonl(run / "metrics.jsonl")))}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        ax.plot([100 * p["relative_loss"] for p in points], [p["mean_block_size"] for p in points], "o-", label=name)
        for p in points[1:]:
            ax.annotate(str(p["step"]), (100 * p["relative_loss"], p["mean_block_size"]), fontsize=7)
    ax.axvline(2.0, color="grey", linestyle=":", label="shipping limit (+2 %)")
    ax.set_xlabel("held-out loss of the base vs the original (%)")
    ax.set_ylabel("mean accepted block (held-out, trained k)")
    ax.set_title("speed against quality over training (labels: step)")
    ax.legend(fontsize="small")
    write_result(png.with_suffix(".json"), curves, fig)
    return curves


def widths(run_dirs: list[Path], png: Path) -> dict:
    """Runs that differ in head width, compared at equal training time: each run's held-out mean
    block against its steps scaled by its median training speed to the fastest run's (the runs
    see the same batches, so speed alone turns steps into time; a speed measured while other work
    shared the cores is only as fair as that sharing). The better width has the longer block where
    the shorter run ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for run in run_dirs:
        records = read_jsonl(run / "metrics.jsonl")
        evals = [r for r in records if "eval_mean_block_size" in r]
        speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        if not speeds or not evals:
            raise ValueError(f"--widths: {run} has no training speed or no evaluation logged yet")
        runs[run.name] = {
            "head_hidden_size": json.loads((run / "train_config.json").read_text())["head_hidden_size"],
            "tokens_per_s": float(np.median(speeds)),
            "steps": [r["step"] for r in evals],
            "mean_block_size": [r["eval_mean_block_size"] for r in evals],
        }
    fastest = max(r["tokens_per_s"] for r in runs.values())
    for r in runs.values():
        r["time"] = [step * fastest / r["tokens_per_s"] for step in r["steps"]]
    until = min(r["time"][-1] for r in runs.values())
    for r in runs.values():
        r["mean_block_at_equal_time"] = float(np.interp(until, r["time"], r["mean_block_size"]))
    best = max(runs, key=lambda name: runs[name]["mean_block_at_equal_time"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        ax.plot(r["time"], r["mean_block_size"], "o-", label=f"{name} (width {r['head_hidden_size']})")
    ax.axvline(until, color="grey", linestyle=":", label="compared here")
    ax.set_xlabel("training time, in steps of the fastest run")
    ax.set_ylabel("mean accepted block (held-out, trained k)")
    ax.set_title("head width at equal training time")
    ax.legend(fontsize="small")
    result = {"compared_at_time": until, "better": best, "runs": runs}
    write_result(png.with_suffix(".json"), result, fig)
    return result


def kept_rows(path: Path, ks: list[int], prompt_sets: list[str], args: argparse.Namespace) -> list[dict]:
    """The rows of an earlier result, refused unless it measured the same prompts the same way, so that
    runs trained in other sittings stand in one table without being measured again."""
    earlier = json.loads(path.read_text())
    same = {"prompt_sets": prompt_sets, "prompts": args.prompts, "prompt_len": args.prompt_len}
    same |= {"new_tokens": args.new_tokens, "ks": ks}
    differ = [f"{key} {earlier.get(key)!r} (now {value!r})" for key, value in same.items() if earlier.get(key) != value]
    if differ:
        raise SystemExit(f"error: --keep {path} measured other prompts: {', '.join(differ)}")
    return [{**row, "kept_from": row.get("kept_from", str(path))} for row in earlier["rows"]]


def shipped_prompts(corpus: Path, n: int, length: int) -> list[torch.LongTensor]:
    """The prompts shipped with the model (prompts.json, which calibration and `bench` read first): held-out
    windows of every source it learnt from, alternating stdlib and package files where the corpus has both,
    so that the first few already show both kinds of code."""
    stdlib = heldout_prompts(corpus, n, length)
    if not (corpus / "heldout_packages.npy").is_file():
        return stdlib
    packages = heldout_prompts(corpus, n, length, "heldout_packages")
    return [p for pair in zip(packages, stdlib) for p in pair][:n]


def ship(
    rows: list[dict],
    directory: Path,
    prompts: list[torch.LongTensor],
    original_loss: float,
    prompt_set: str,
    k: int = 8,
    max_loss_increase: float = 0.02,
) -> dict:
    """Save the run with the largest mean accepted block at k on `prompt_set` (base included,
    bf16, with its tokenizer and the held-out prompts as text) as the built-in model, replacing
    what was there only once the copy is whole. A run whose fine-tuned base's held-out loss is
    more than `max_loss_increase` (relative) above the original base's is passed over: a faster
    but worse model is not the better default (the paper accepted 1 % of BLEU)."""
    k = k if all(str(k) in r["sets"][prompt_set] for r in rows) else min(r["trained_k"] for r in rows)
    good = [r for r in rows if r["heldout_loss"] <= original_loss * (1 + max_loss_increase)]
    if not good:
        raise ValueError(f"no run keeps its held-out loss within {max_loss_increase:.0%} of the original's")
    best = max(good, key=lambda r: r["sets"][prompt_set][str(k)]["mean_block_size"])
    training = {
        **(best["training"] or {}),
        "measured_in": "float32",
        **({"base_pretraining": best["base_training"]} if best.get("base_training") else {}),
        "original_base_stdlib_heldout_loss": original_loss,
        "base_stdlib_heldout_loss": best["heldout_loss"],
        "mean_block_size": {
            name: {kk: v["mean_block_size"] for kk, v in by_k.items()} for name, by_k in best["sets"].items()
        },
    }
    tokenizer = AutoTokenizer.from_pretrained(best["run"])
    install(best["run"], directory, training, [tokenizer.decode(p[0]) for p in prompts])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", default=[], help="saved BlockwiseLM folders, one per training mode")
    parser.add_argument("--corpus", required=True, help="the folder `blockdecode pretrain` prepared")
    parser.add_argument(
        "--curves",
        nargs="*",
        default=None,
        help="training folders (finished or not) to plot as the speed/quality curve",
    )
    parser.add_argument("--widths", nargs="*", default=None, help="training folders differing in head width")
    parser.add_argument("--original", default=None, help="the base the runs started from (default: the least loss)")
    parser.add_argument("--ks", default="2,4,6,8,10")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--third-party", action="store_true", help=f"also measure on {', '.join(THIRD_PARTY)}")
    parser.add_argument("--out", default=str(RESULTS / "paper_table.json"))
    parser.add_argument(
        "--doc", nargs="?", const=str(DOC), default=None, help="write the table into this file (docs/results.md)"
    )
    parser.add_argument("--device", default="cpu", help="where to decode: cpu (default) or cuda")
    parser.add_argument("--ship", default=None, help="save the best run (mean block at k=8) here, in bf16")
    parser.add_argument(
        "--keep", default=None, help="an earlier result of this script whose rows join the table (never shipped)"
    )
    args = parser.parse_args()
    curves = tradeoff([Path(r) for r in args.curves or args.runs], Path(args.out).with_name("paper_tradeoff.png"))
    for name, points in curves.items():
        print(name + ": " + ", ".join(f"{p['step']}: {p['mean_block_size']:.2f} ({100 * p['relative_loss']:+.1f} %)"
                                      for p in points))  # fmt: skip
    if args.widths:
        compared = widths([Path(r) for r in args.widths], Path(args.out).with_name("paper_widths.png"))
        for name, r in compared["runs"].items():
            print(f"{name}: width {r['head_hidden_size']}, {r['tokens_per_s']:.0f} tokens/s, mean block "
                  f"{r['mean_block_at_equal_time']:.2f} at equal time")  # fmt: skip
        print(f"better: {compared['better']}")
    if not args.runs:  # the curves alone
        return
    torch.set_num_threads(2)
    ks = [int(k) for k in args.ks.split(",")]
    corpus = Path(args.corpus)
    prompt_sets = {"stdlib held-out": heldout_prompts(corpus, args.prompts, args.prompt_len)}
    if args.third_party:
        tokenizer = AutoTokenizer.from_pretrained(args.runs[0])
        prompt_sets["third-party"] = third_party_prompts(tokenizer, THIRD_PARTY, args.prompts, args.prompt_len)
    start = time.perf_counter()
    runs = tqdm(args.runs, desc="runs")
    rows = [measure(Path(run), corpus, ks, prompt_sets, args.new_tokens, args.device) for run in runs]
    kept = kept_rows(Path(args.keep), ks, list(prompt_sets), args) if args.keep else []
    windows = heldout_batches(np.load(corpus / "heldout.npy", mmap_mode="r"), PretrainConfig(corpus="", out=""))
    original = (
        heldout_loss(load_base(args.original, torch.float32).to(args.device).eval(), windows)
        if args.original
        else min(r["heldout_loss"] for r in rows)
    )
    result = {
        **heading(", ".join(Path(run).name for run in args.runs), torch.float32, args.device),
        "what": "mean accepted block size (tokens per base-model call), exact greedy, fp32",
        "prompt_sets": list(prompt_sets),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "ks": ks,
        "original_heldout_loss": original,
        "paper": PAPER,
        "rows": kept + rows,
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
    }
    conditions = f"exact greedy in {result['dtype']}; {result['machine']}"
    figure = plot(kept + rows, ks)
    figure.suptitle(conditions, fontsize=9)
    write_result(Path(args.out), result, figure)
    tables = [f"{name}: mean (median) accepted block, {conditions}\n\n{markdown(kept + rows, ks, name)}"
              for name in prompt_sets]  # fmt: skip
    print("\n\n".join(tables))
    if args.doc:
        update_section(Path(args.doc), "paper-table", "\n\n".join(tables))
    if args.ship:
        chosen = "third-party" if "third-party" in prompt_sets else "stdlib held-out"
        prompts = shipped_prompts(corpus, args.prompts, args.prompt_len)
        best = ship(rows, Path(args.ship), prompts, original, chosen)
        print(f"shipped {best['run']} ({best['mode']}) to {args.ship}")


if __name__ == "__main__":
    main()
